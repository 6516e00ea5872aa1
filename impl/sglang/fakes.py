"""Small fakes for what SGLang's transfer queue touches outside the modules it is checked
with: the scheduler, the tree cache, ``Req``, the KV receiver and its ``kv_mgr``, the
server args and the parallel context. Each answers the attributes the released code reads
with plain values; any other attribute is a recorded stub (``stubs.Recorder``), so a new
release's needs show up in the list of reads instead of as an AttributeError.
"""
from __future__ import annotations

from typing import Any

from impl.sglang.stubs import Recorder, Stub, make_stub
from model.spec.kvpoll import KVPoll

WAITING, SUCCESS, FAILED = int(KVPoll.WaitingForInput), int(KVPoll.Success), int(KVPoll.Failed)


class _Recording:
    """Unknown attributes: a falsy stub, recorded as ``fake <Class>.<attr>``."""
    _recorder: Recorder = Recorder()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        qual = f"fake {type(self).__name__}.{name}"
        self._recorder.note(qual)
        return make_stub(qual, self._recorder)()


class FinishAbort(Exception):
    """``sglang.srt.managers.schedule_batch.FINISH_ABORT``: the abort reason, kept readable
    (the decisions are read back from these messages)."""

    def __init__(self, message: str = "", status_code: Any = None, err_type: Any = None):
        super().__init__(message)
        self.message, self.status_code = message, status_code


class TimeStats(_Recording):
    def set_wait_queue_entry_time(self) -> None:
        pass


class Req(_Recording):
    """The fields of SGLang's ``Req`` that the transfer queue reads and writes."""

    def __init__(self, rid: str, bootstrap_room: int | None, bootstrap_host: str | None = "10.0.0.1"):
        self.rid, self.bootstrap_room, self.bootstrap_host = rid, bootstrap_room, bootstrap_host
        self.finished_reason: Any = None
        self.to_finish: Any = None
        self.output_ids: list[int] = []
        self.return_logprob = False
        self.return_sampling_mask = False
        self.time_stats = TimeStats()
        self.pd_rebootstrap_forced_output_id = None
        self.expected_kv_checksum = 0


class KvManager(_Recording):
    """``kv_mgr``: deferred-release bookkeeping (SGLang #35049). ``fenced`` rooms are
    those whose prefill acknowledged the abort (the trace's ``fence`` events)."""

    def __init__(self, deferred: bool):
        self.enable_deferred_decode_kv_release = deferred
        self.fenced: set[int] = set()

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        return room in self.fenced

    def clear_deferred_abort_state(self, room: int) -> None:
        self.fenced.discard(room)


class KvReceiver(_Recording):
    """A KV receiver whose poll the trace sets; latched once Success or Failed."""

    def __init__(self, kv_mgr: KvManager):
        self.state = WAITING
        self.kv_mgr = kv_mgr
        self.require_staging = False
        self.abort_notified = False
        self.bootstrap_infos = [None]
        self.polled: list[int] | None = None      # the runner collects each step's polls
        self.landed: set[str] = set()              # metadata fields written so far
        self.fenced = False                         # prefill acknowledged the abort

    def poll(self) -> int:
        if self.polled is not None:
            self.polled.append(self.state)
        return self.state

    def failure_exception(self) -> None:
        if self.state == FAILED:
            raise RuntimeError("transfer failed (trace fail event)")

    def clear(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        self.abort_notified = True

    def is_abort_release_safe(self) -> bool:
        return self.fenced

    def writes_fenced(self) -> bool:
        """No write can still land in this request's slot (pdgate's receiver protocol,
        read by the strict patch only)."""
        return self.fenced or self.landed >= {"room", "payload"}


class ServerArgs(_Recording):
    def __init__(self) -> None:
        self.disaggregation_transfer_backend = "mooncake"
        self.disaggregation_decode_host_receive_threshold = 1.0
        self.disaggregation_enable_kv_checksum = False
        self.disaggregation_decode_enable_radix_cache = False


class SpecAlgorithm(_Recording):
    def is_none(self) -> bool:
        return True


class Streamer(_Recording):
    def stream_output(self, reqs: Any, return_logprob: Any = None, *args: Any, **kw: Any) -> None:
        pass


class PreallocQueue(_Recording):
    kv_checksum_signature = 0

    def note_destinations_queued(self, n: int) -> None:
        pass


class Metrics(_Recording):
    enable_metrics = False


class BatchResultProcessor(_Recording):
    def _maybe_update_reasoning_tokens(self, req: Any, token: int) -> None:
        pass


class Scheduler(_Recording):
    def __init__(self, server_args: ServerArgs):
        self.server_args = server_args
        self.spec_algorithm = SpecAlgorithm()
        self.enable_decode_hicache = False
        self.enable_hisparse = False
        self.enable_metrics = False
        self.metrics_reporter = Metrics()
        self.output_streamer = Streamer()
        self.disagg_decode_prealloc_queue = PreallocQueue()
        self.kv_checksum_computer = None
        self.batch_result_processor = BatchResultProcessor()
        self.random_seed = 0

    def stream_output(self, reqs: Any, return_logprob: Any = None, *args: Any, **kw: Any) -> None:
        pass                                     # 0.5.12's spelling


class TreeCache(_Recording):
    pass


class _Group:
    def __init__(self, cpu_group: Any):
        self.cpu_group = cpu_group


class Parallel(_Recording):
    """``runtime_context.get_parallel()`` (0.5.22+): where the queue finds its gloo group."""

    def __init__(self, cpu_group: Any, tp_rank: int, tp_size: int):
        self.attn_tp_group = _Group(cpu_group)
        self.tp_rank = self.attn_tp_rank = tp_rank
        self.tp_size = self.attn_tp_size = tp_size
        self.dp_rank = 0


def provided(server_args: ServerArgs, parallel: Any) -> dict[str, dict[str, Any]]:
    """The stub attributes replaced by fakes (``stubs.install``'s ``provided``)."""
    return {"sglang.srt.managers.schedule_batch": {"FINISH_ABORT": FinishAbort},
            "sglang.srt.runtime_context": {"get_disagg": lambda: server_args,
                                           "get_parallel": lambda: parallel[0],
                                           "get_spec": lambda: SpecAlgorithm()},
            "sglang.srt.server_args": {"get_global_server_args": lambda: server_args}}


__all__ = ["FinishAbort", "KvManager", "KvReceiver", "Parallel", "Req", "Scheduler",
           "ServerArgs", "Stub", "TreeCache", "provided"]
