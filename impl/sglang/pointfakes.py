"""The environment of a release's own ``DecodePreallocQueue.pop_preallocated`` and
``PrefillBootstrapQueue.pop_bootstrapped``, driven by the spec's iteration inputs
(model/spec/iteration.py INPUTS) for one rank: receivers and senders whose polls the
inputs set, the prefill dp-rank lookup (``resolved``), a token pool whose budget admits
a request exactly where ``fits`` says (each rank's request length is short or too long),
and a metadata-buffer allocator with a number of free buffers.

The queues are the release's own classes, built without their ``__init__`` (which
needs GPUs, a KV manager and a model) from the attributes their methods read; an
attribute no fake sets reads as a recorded falsy stub (``fakes._Recording``), so a
release needing a new one shows in the stub reads, not as a crash.
"""
from __future__ import annotations

import ast
import functools
from collections import deque
from typing import Any, Mapping, Sequence

import torch

from impl.sglang import fakes
from impl.sglang.stubs import make_stub
from model.spec.kvpoll import KVPoll

BOOTSTRAPPING, FAILED = int(KVPoll.Bootstrapping), int(KVPoll.Failed)
BUDGET = 1000             # every rank's free KV tokens
SHORT, LONG = 1, 100_000  # a request's prompt length where it fits / does not fit
Inputs = Mapping[str, Sequence[Sequence[int]]]


class Receiver(fakes._Recording):
    """A decode KV receiver: this rank's ``handshake`` input, at most Bootstrapping until
    ``init`` (the dp rank resolved; a receiver can fail before, as CommonKVReceiver's
    constructor does when the bootstrap server is unreachable); a Failed handshake is its
    ``conclude_state``."""

    def __init__(self, handshake: int, mgr: Any = None, **_: Any):
        self.handshake, self.kv_mgr, self.initialised = handshake, mgr, False
        self.require_staging = self.supports_host_destination = False
        self.sent: list[int] = []

    @property
    def conclude_state(self) -> Any:
        return KVPoll.Failed if self.handshake == FAILED else None

    def init(self, prefill_dp_rank: int, *args: Any, **kw: Any) -> None:
        self.initialised = True

    def poll(self) -> int:
        return self.handshake if self.initialised else min(self.handshake, BOOTSTRAPPING)

    def failure_exception(self) -> None:
        raise RuntimeError("handshake failed (scenario input)")

    def send_metadata(self, *args: Any, **kw: Any) -> None:
        self.sent.append(1)

    def clear(self) -> None:
        pass

    def abort(self) -> None:
        pass


class Sender(fakes._Recording):
    """A prefill KV sender whose poll is this rank's ``bootstrap`` input."""

    def __init__(self, bootstrap: int):
        self.bootstrap = bootstrap

    def poll(self) -> int:
        return self.bootstrap

    def failure_exception(self) -> None:
        raise RuntimeError("bootstrap failed (scenario input)")

    def pop_decode_prefix_len(self) -> int:
        return 0

    def init(self, *args: Any, **kw: Any) -> None:
        pass

    def abort(self) -> None:
        pass


class PrefillInfo(fakes._Recording):
    """Two prefill dp ranks, not derived from the room: each request needs a query."""
    dp_size = 2
    follow_bootstrap_room = False


class KvArgs(fakes._Recording):
    state_types: list = []            # no Mamba / SWA / NSA state to send


class KvManager(fakes._Recording):
    def __init__(self) -> None:
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self.kv_args = KvArgs()

    def try_ensure_parallel_info(self, addr: str) -> bool:
        self.prefill_info_table[addr] = PrefillInfo()
        return True


def resolver(resolved: dict[str, set[int]]) -> type:
    """``CommonKVReceiver`` as decode.py uses it: the dp-rank query answers, per
    bootstrap address (one per rank), the rooms whose ``resolved`` input is 1."""
    class CommonKVReceiver(fakes._Recording):
        @staticmethod
        def query_prefill_dp_ranks(addr: str, rooms: list[int]) -> dict[str, int]:
            return {str(room): 0 for room in rooms if room in resolved.get(addr, set())}
    return CommonKVReceiver


class Allocator(fakes._Recording):
    """Metadata buffers (``ReqToMetadataIdxAllocator``) with ``free`` left."""

    def __init__(self, free: int):
        self.free, self.next = free, 0

    def available_size(self) -> int:
        return self.free

    def alloc(self) -> int | None:
        if self.free <= 0:
            return None
        self.free, self.next = self.free - 1, self.next + 1
        return self.next - 1


class TokenPool(fakes._Recording):
    """``req_to_token_pool``: rows for every request."""

    def __init__(self, rows: int):
        self.req_to_token = torch.zeros((rows, 8), dtype=torch.int32)
        self.rows = rows
        self.mamba_allocator = None           # no hybrid (Mamba) state pool

    def available_size(self) -> int:
        return self.rows

    def alloc(self, reqs: list) -> list[int]:
        return [0 for _ in reqs]


class KvAllocator(fakes._Recording):
    """``token_to_kv_pool_allocator``: ``BUDGET`` free tokens, page size 1; its fit test
    is the base allocator's (0.5.23 mem_cache/allocator/base.py ``prealloc_fits``)."""
    page_size = 1

    def available_size(self) -> int:
        return BUDGET

    def prealloc_fits_assumes_reclaim(self) -> bool:
        return False

    def prealloc_ceiling_fits(self, full_tokens: int, swa_tokens: int) -> None:
        return None                   # no pool ceiling of its own (base allocator)

    def prealloc_fits(self, tree_cache: Any, full_tokens: int, swa_tokens: int, *,
                      full_budget_tokens: int, swa_budget_tokens: int | None = None) -> bool:
        return full_tokens <= full_budget_tokens and (
            swa_budget_tokens is None or swa_tokens <= swa_budget_tokens)

    def translate_kv_indices_for_transfer(self, indices: Any) -> Any:
        return indices

    def get_kvcache(self) -> Any:
        return fakes._Recording()


class SamplingParams(fakes._Recording):
    max_new_tokens = 1


class KvState(fakes._Recording):
    """``req.kv`` (0.5.19+): the request's KV bookkeeping, holding nothing yet."""
    req_pool_idx = 0
    cache_protected_len = 0
    holds_kv = holds_mamba = False
    retraction_backup = None


class Req(fakes.Req):
    """A request on one rank; its prompt length is what ``fits`` decides."""

    def __init__(self, rid: str, room: int, host: str, length: int = SHORT):
        super().__init__(rid, room, host)
        self.bootstrap_port = 8998
        self.origin_input_ids = [1] * length
        self.sampling_params = SamplingParams()
        self.disagg_prefill_dp_rank = None
        self.is_retracted = False
        self.priority = None
        self.req_pool_idx = 0
        self.metadata_buffer_index = -1
        self.prefill_attempt_count = 0
        self.pending_bootstrap = True
        self.swa_branching_seqlen = None
        self.lora_id = None
        self.fill_ids = [1] * length
        self.kv = KvState()


class Batch(fakes._Recording):
    def __init__(self) -> None:
        self.reqs: list = []


class Scheduler(fakes.Scheduler):
    def __init__(self, server_args: fakes.ServerArgs, cp_group: Any, tp_group: Any):
        super().__init__(server_args)
        self.running_batch = Batch()
        self.waiting_queue: list = []
        self.last_batch = None
        self.enable_priority_scheduling = self.enable_lora = False
        self.enable_hicache_storage = False
        self.processed_tokens_counter = 0
        self.attn_cp_cpu_group, self.attn_tp_cpu_group = cp_group, tp_group
        self.failed: list = []

    def handle_bootstrap_failure(self, req: Any) -> None:
        self.failed.append(req)


def _fallback(self: Any, name: str) -> Any:
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    qual = f"fake {type(self).__name__}.{name}"
    fakes._Recording._recorder.note(qual)
    return make_stub(qual, fakes._Recording._recorder)()


_EMPTY = {"list": list, "dict": dict, "set": set, "deque": deque}


@functools.lru_cache(maxsize=16)
def _init_values(source: str, cls: str) -> tuple[tuple[str, Any], ...]:
    return tuple(_read_init(source, cls).items())


def init_defaults(source: str, cls: str) -> dict[str, Any]:
    """``_read_init``'s values, fresh containers each call (parsed once per release)."""
    return {k: (type(v)() if isinstance(v, (list, dict, set, deque)) else v)
            for k, v in _init_values(source, cls)}


def _read_init(source: str, cls: str) -> dict[str, Any]:
    """The plain values ``cls.__init__`` gives its attributes in a release's module
    source (constants and empty containers: counters, queues, tables), read with ``ast``
    since ``__init__`` itself cannot run here."""
    tree = ast.parse(source)
    init = next((f for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == cls
                 for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    out: dict[str, Any] = {}
    for node in ast.walk(init) if init is not None else ():
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) and node.value is not None else None
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                and target.value.id == "self"):
            continue
        value = node.value
        if isinstance(value, ast.Constant):
            out[target.attr] = value.value
        elif isinstance(value, (ast.List, ast.Dict, ast.Set, ast.Tuple)) and not ast.unparse(value).strip("[]{}()"):
            out[target.attr] = type(ast.literal_eval(value) if not isinstance(value, ast.Set) else set())()
        elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and \
                value.func.id in _EMPTY and not value.args:
            out[target.attr] = _EMPTY[value.func.id]()
    return out


def build(cls: type, attrs: dict[str, Any], source: str) -> Any:
    """An instance of the release's queue class without its ``__init__``: the plain
    values its ``__init__`` sets (``init_defaults``), then ``attrs``; attributes no fake
    sets read as recorded stubs (a subclass adds only that fallback)."""
    sub = type(cls.__name__, (cls,), {"__getattr__": _fallback})
    obj = object.__new__(sub)
    obj.__dict__.update({**init_defaults(source, cls.__name__), **attrs})
    return obj


def server_args() -> fakes.ServerArgs:
    args = fakes.ServerArgs()
    args.optimistic_prefill_attempts = 0           # no prefill before bootstrap
    args.disaggregation_decode_allocation_policy = "early"
    args.disaggregation_decode_host_receive_threshold = 1.0
    return args
