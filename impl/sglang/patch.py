"""pdgate's functions inside SGLang's own transfer queue.

``swap_dropins(release)``: the release's ``poll_and_all_reduce`` /
``poll_and_all_reduce_with_staging`` replaced by pdgate's drop-ins (impl.decode.polling),
nothing else changed (``pdgate conform --swap``: the release must still match its spec
variant, now with a collective that cannot hang).

``install(release)`` / ``install_into(loaded)``: the strict patch. SGLang's own
``pop_transferred`` keeps its loop; what it calls gets strict's rules: the gate holds
Success until the slot's room *equals* the request's (not merely non-zero), a request
the gate held for ``timeout_steps`` steps (steps whose MIN was Transferring or Success)
is Failed before the MIN (so every rank aborts it in the same step), an expected room of 0 fails, a room mismatch
seen at commit time is agreed with one MAX all-reduce of the local flags before any rank
drops the request, and a popped request's slot is reused only once no write of it can
still land (``writes_fenced``: the receiver's own ``writes_fenced()`` where it has one;
for SGLang's receivers, a MIN of Success, which the prefill sends only after every write
returned, or the prefill's abort ack on the release's own channel; else never), and
0.5.19+'s deferred release of a failed request's slot waits for that ack without its
wall-clock timeout (``deferred_kv_release_timeout`` set to infinity: "released after
30 s regardless" is the late-write break of #35049).

``strict_diff(release, source)``: the same patch as a unified diff against a release's
decode module; the lines it adds call ``install_at_import``, i.e. ``install_into``.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from impl.decode import polling

_NAMES = ("poll_and_all_reduce", "poll_and_all_reduce_with_staging")
_AGES_FROM = 3      # KVPoll.Transferring: a kept request ages after a MIN of at least this


def _note(release: Any) -> Callable[[list], None] | None:
    observer = getattr(release, "observer", None)
    return None if observer is None else observer.note


def swap_dropins(release: Any) -> None:
    """Point the release's queue (and utils) at pdgate's drop-ins, gate rule ``gate``."""
    def bind(fn: Callable[..., list]) -> Callable[..., list]:
        def call(*args: Any, **kwargs: Any) -> list:
            return fn(*args, **kwargs, timeout_s=release.collective_timeout_s,
                      transfer_backend=release.server_args.disaggregation_transfer_backend,
                      trace=_note(release))
        call._pdgate_swapped = True           # type: ignore[attr-defined]
        return call

    for name in _NAMES:
        ours = bind(getattr(polling, name))
        for module in (release.decode, release.utils):
            if hasattr(module, name):
                setattr(module, name, ours)


# ---------------------------------------------------------------------------------------
# The strict patch: SGLang's own queue with strict's rules.

def abort_acked(recv: Any, room: int) -> bool:
    """The prefill acknowledged the abort of ``room`` on SGLang's own channel (0.5.19+'s
    deferred release: the ABORT_ACK its sender sends once the room's transfer drained,
    and never for a send it could not prove settled). False where the receiver has no
    such channel or never sent the abort."""
    safe = getattr(getattr(recv, "kv_mgr", None), "is_abort_release_safe", None)
    if safe is None or not getattr(recv, "abort_notified", False):
        return False
    try:
        return bool(safe(room, len(getattr(recv, "bootstrap_infos", None) or ())))
    except (TypeError, KeyError, AttributeError):
        return False


def writes_fenced(recv: Any, room: int, settled: bool) -> bool:
    """No write of this request can still land in its metadata slot: the receiver's own
    ``writes_fenced()`` where it has one (pdgate's receivers, conform's fakes); else
    ``settled`` (the MIN was Success: every rank's prefill reported Success, which it
    sends only after all its writes returned) or the prefill's abort ack. A receiver
    with neither is never fenced: its slot stays held (a lost slot, never a reuse)."""
    own = getattr(recv, "writes_fenced", None)
    if own is not None:
        return bool(own())
    return settled or abort_acked(recv, room)


class _Quarantine:
    """The queue's slot allocator as ``pop_transferred`` sees it under the patch: a slot
    whose request may still receive writes is held (strict's fence-before-reuse, SGLang
    #35049) until ``writes_fenced`` says none can land.

    ``agreed``: every popped slot is held and released only by ``release_agreed``, once
    every rank's receiver says fenced (a MIN all-reduce of the local flags over the held
    list, the same list on every rank: pops are agreed), so the ranks' free lists, and
    with them admission, never differ (what 0.5.23 does for its deferred releases); it
    runs at the end of each step and before admission. Not agreed: each rank frees a
    slot when its own writes are fenced (strict's spec rule)."""

    def __init__(self, real: Any, buffers: Any, agreed: bool):
        self.real, self.buffers, self.agreed = real, buffers, agreed
        self.receiver_of: dict[int, Any] = {}      # slot -> receiver, set before each step
        self.room_of: dict[int, int] = {}          # slot -> its request's room
        self.settled: set[int] = set()             # slots whose request's MIN was Success
        self.held: dict[int, tuple[Any, int, bool]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def _fenced(self, entry: tuple[Any, int, bool]) -> bool:
        return writes_fenced(*entry)

    def free(self, idx: int) -> None:
        entry = (self.receiver_of.get(idx), self.room_of.get(idx, 0), idx in self.settled)
        if self.agreed or not self._fenced(entry):
            self.held[idx] = entry
        else:
            self.real.free(idx)

    def _free_held(self, idx: int) -> None:
        del self.held[idx]
        self.buffers.bootstrap_room[idx] = 0          # a late write may have landed
        self.real.free(idx)

    def release_fenced(self) -> None:
        if self.agreed:
            return                                    # only at a step, on every rank
        for idx, entry in list(self.held.items()):
            if self._fenced(entry):
                self._free_held(idx)

    def release_agreed(self, wait: Callable[[str, Callable[[], Any]], None], dist: Any,
                       group: Any) -> None:
        if not self.agreed or not self.held:
            return
        import torch
        flags = torch.tensor([int(self._fenced(e)) for e in self.held.values()], dtype=torch.int32)
        wait("all_reduce(MIN) of fenced flags",
             lambda: dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group, async_op=True))
        for idx, ready in zip(list(self.held), flags.tolist()):
            if ready:
                self._free_held(idx)


def _strict_poll(release: Any, timeout_steps: int | None) -> tuple[Callable[..., list],
                                                                  Callable[..., list]]:
    """``poll_and_all_reduce`` and ``poll_and_all_reduce_with_staging`` with strict's
    rules, every release's shapes: the room-equality gate and timeout before the MIN
    (pdgate's drop-ins, variant strict, with the queue's ages), then one MAX all-reduce
    of the local room-mismatch flags of the entries the MIN lets commit, so a mismatch
    seen by any rank aborts the request on every rank (returned as Failed) instead of on
    that rank alone."""
    import torch
    from impl.decode.gate import is_fake_transfer, room_column_of
    from model.spec.variants import get_variant
    variants = {timeout_steps: get_variant("strict", timeout_steps)}
    success, failed = 4, 0

    def variant() -> Any:
        """strict with the release's current ``timeout_steps`` (conform sets it per trace
        on a release whose patched source installed the patch at import)."""
        steps = getattr(release, "timeout_steps", timeout_steps)
        if steps not in variants:
            variants[steps] = get_variant("strict", steps)
        return variants[steps]

    def context(decode_reqs: Any, metadata_buffers: Any) -> tuple:
        queue = release.current_queue
        if decode_reqs is None and queue is not None:      # 0.5.12 passes pollers only
            decode_reqs, metadata_buffers = queue.queue, queue.metadata_buffers
        ages = [queue._pdgate_ages.get(id(d), 0) for d in decode_reqs] \
            if decode_reqs is not None and queue is not None else None
        return decode_reqs, metadata_buffers, ages

    def options(ages: Any) -> dict:
        return {"variant": variant(), "ages": ages, "timeout_s": release.collective_timeout_s,
                "transfer_backend": release.server_args.disaggregation_transfer_backend,
                "trace": _note(release)}

    def note_reduced(decode_reqs: Any, reduced: list) -> None:
        """The MIN per request, for ageing after the step (strict's timeout counts only
        steps whose MIN was Transferring or Success: some gate held the request), and
        the slots whose request's MIN was Success (its writes settled) for the quarantine."""
        queue = release.current_queue
        if queue is not None and decode_reqs is not None:
            queue._pdgate_reduced = {id(d): r for d, r in zip(decode_reqs, reduced)}
            queue._pdgate_slots.settled.update(d.metadata_buffer_index for d, r
                                               in zip(decode_reqs, reduced) if r == success)

    def agree_mismatch(reduced: list, gloo_group: Any, decode_reqs: Any, metadata_buffers: Any,
                       server_args: Any) -> list:
        if decode_reqs is None or metadata_buffers is None:
            return reduced
        fake_none = polling.fake_backend(server_args,
                                         release.server_args.disaggregation_transfer_backend)
        commits = [i for i, r in enumerate(reduced) if r == success
                   and not is_fake_transfer(decode_reqs[i].req.bootstrap_host, fake_none)]
        if not commits:          # the same on every rank: they all reduced the same vector
            return reduced
        col = room_column_of(metadata_buffers)
        flags = torch.tensor([int(int(col[decode_reqs[i].metadata_buffer_index]) & (2**64 - 1)
                                  != (decode_reqs[i].req.bootstrap_room or 0))
                              for i in commits], dtype=torch.int32)
        polling._CACHE.exchange(gloo_group, release.collective_timeout_s)._wait(
            "all_reduce(MAX) of room-mismatch flags",
            lambda: release.dist.all_reduce(flags, op=release.dist.ReduceOp.MAX,
                                            group=gloo_group, async_op=True))
        for i, bad in zip(commits, flags.tolist()):
            if bad:
                reduced[i] = failed
        return reduced

    def poll(pollers: Any, gloo_group: Any, decode_reqs: Any = None, metadata_buffers: Any = None,
             server_args: Any = None, **_: Any) -> list:
        decode_reqs, metadata_buffers, ages = context(decode_reqs, metadata_buffers)
        reduced = polling.poll_and_all_reduce(pollers, gloo_group, decode_reqs, metadata_buffers,
                                              server_args, **options(ages))
        note_reduced(decode_reqs, reduced)
        return agree_mismatch(reduced, gloo_group, decode_reqs, metadata_buffers, server_args)

    def staged(decode_reqs: Any, staging_handler: Any, gloo_group: Any,
               metadata_buffers: Any = None, server_args: Any = None, pollers: Any = None,
               **_: Any) -> list:
        decode_reqs, metadata_buffers, ages = context(decode_reqs, metadata_buffers)
        reduced = polling.poll_and_all_reduce_with_staging(
            decode_reqs, staging_handler, gloo_group, metadata_buffers, server_args, pollers,
            **options(ages))
        note_reduced(decode_reqs, reduced)
        return agree_mismatch(reduced, gloo_group, decode_reqs, metadata_buffers, server_args)
    return poll, staged


def install_into(release: Any, timeout_steps: int | None = None,
                 agreed_release: bool = True) -> None:
    """Give a loaded release's ``DecodeTransferQueue`` strict's rules (see module doc).
    ``agreed_release``: slots of popped requests are released only when every rank's
    writes are fenced, agreed at the end of each step (``_Quarantine``)."""
    import torch.distributed as dist
    release.dist = dist
    release.current_queue = None
    release.timeout_steps, release.agreed_release = timeout_steps, agreed_release
    poll, staged = _strict_poll(release, timeout_steps)
    for module in (release.decode, release.utils):
        for name, fn in (("poll_and_all_reduce", poll),
                         ("poll_and_all_reduce_with_staging", staged)):
            if hasattr(module, name):
                setattr(module, name, fn)
    cls = release.decode.DecodeTransferQueue
    own_pop = cls.pop_transferred

    def pop_transferred(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(self, "_pdgate_ages"):
            self._pdgate_ages = {}
            self._pdgate_slots = _Quarantine(self.req_to_metadata_buffer_idx_allocator,
                                             self.metadata_buffers, release.agreed_release)
            if hasattr(self, "deferred_kv_release_timeout"):
                # 0.5.19+ holds a failed request's slot until the prefill's ack "or 30 s
                # regardless": strict keeps only the ack
                self.deferred_kv_release_timeout = math.inf
        slots = self._pdgate_slots
        slots.release_fenced()
        slots.receiver_of = {d.metadata_buffer_index: d.kv_receiver for d in self.queue}
        slots.room_of = {d.metadata_buffer_index: int(d.req.bootstrap_room or 0)
                         for d in self.queue}
        slots.settled = set()
        real, self.req_to_metadata_buffer_idx_allocator = \
            self.req_to_metadata_buffer_idx_allocator, slots
        release.current_queue = self
        try:
            out = own_pop(self, *args, **kwargs)
        finally:
            self.req_to_metadata_buffer_idx_allocator = real
            release.current_queue = None
        agree_releases(self)
        held = getattr(self, "_pdgate_reduced", {})
        self._pdgate_ages = {id(d): self._pdgate_ages.get(id(d), 0)
                             + (held.get(id(d), 0) >= _AGES_FROM) for d in self.queue}
        self._pdgate_reduced = {}
        return out

    def agree_releases(self: Any) -> None:
        """Agreed release of held slots whose writes every rank has fenced: at the end of
        each step and at the start of each scheduler iteration, before admission (a
        collective: every rank calls it at the same point)."""
        if hasattr(self, "_pdgate_slots"):
            exchange = polling._CACHE.exchange(self.gloo_group, release.collective_timeout_s)
            self._pdgate_slots.release_agreed(exchange._wait, release.dist, self.gloo_group)

    def release_fenced(self: Any) -> None:
        """Free held slots whose writes are fenced (call when a receiver reports it)."""
        if hasattr(self, "_pdgate_slots"):
            self._pdgate_slots.release_fenced()

    cls.pop_transferred = pop_transferred
    cls.release_fenced = release_fenced
    cls.agree_releases = agree_releases
    # the scheduler's iteration: held slots are released (agreed) before admission, as
    # 0.5.23 resolves its deferred releases first
    mixin = getattr(release.decode, "SchedulerDisaggregationDecodeMixin", None)
    own_iteration = getattr(mixin, "process_decode_queue", None)
    if own_iteration is not None and not getattr(own_iteration, "_pdgate_strict", False):
        def process_decode_queue(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.disagg_decode_transfer_queue.agree_releases()
            return own_iteration(self, *args, **kwargs)
        process_decode_queue._pdgate_strict = True      # type: ignore[attr-defined]
        mixin.process_decode_queue = process_decode_queue
    cls._pdgate_strict = True


def _live_release(decode: Any, utils: Any, transfer_backend: str,
                  collective_timeout_s: float) -> Any:
    """What ``install_into`` needs of a release installed in this process."""
    import types
    # the backend decides whether a request without bootstrap host is a fake transfer
    backend = types.SimpleNamespace(disaggregation_transfer_backend=transfer_backend)
    return types.SimpleNamespace(decode=decode, utils=utils, server_args=backend,
                                 collective_timeout_s=collective_timeout_s, observer=None)


def install(release: str, *, timeout_steps: int | None = None,
            collective_timeout_s: float = 30.0, agreed_release: bool = True,
            transfer_backend: str = "mooncake", observer: Any = None) -> None:
    """Apply the strict patch in a live SGLang decode worker, at start-up, before the
    scheduler builds its queues: ``impl.sglang.patch.install("0.5.23")``. Refuses a
    release other than the one installed (the patch is checked per release by ``pdgate
    conform --patch strict``). ``observer.note(gated)`` sees what each step hands to the
    MIN (``pdgate live``'s rank logs)."""
    import importlib
    sglang = importlib.import_module("sglang")
    installed = getattr(sglang, "__version__", None)
    if installed != release:
        raise RuntimeError(f"strict patch for SGLang {release}, but {installed} is installed")
    decode = importlib.import_module("sglang.srt.disaggregation.decode")
    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    target = _live_release(decode, utils, transfer_backend, collective_timeout_s)
    target.observer = observer
    install_into(target, timeout_steps, agreed_release)


# ---------------------------------------------------------------------------------------
# The strict patch as a unified diff against a release's source: the diff appends a call
# of ``install_at_import`` to the release's decode module, so the patched source runs
# this module's code, not a second copy of it.

DIFF_TARGET = "sglang/srt/disaggregation/decode.py"
DIFF_MARK = "# pdgate: the strict patch"


def strict_block(release: str) -> str:
    """The lines the strict diff appends to ``release``'s decode module."""
    return (f"\n\n{DIFF_MARK} (impl/sglang/patch.py, written by `pdgate conform --emit-diff`):\n"
            f"# this queue with strict's rules, installed as this module finishes importing.\n"
            f"import impl.sglang.patch as _pdgate_patch  # noqa: E402\n\n"
            f"_pdgate_strict = _pdgate_patch.install_at_import({release!r}, __name__)\n")


def strict_diff(release: str, original: str) -> str:
    """The strict patch for ``release`` as a unified diff (``patch -p1`` in the directory
    holding ``sglang/``) against ``original``, the text of its decode module."""
    import difflib
    if DIFF_MARK in original:
        raise ValueError(f"{DIFF_TARGET} of SGLang {release} already carries the strict patch")
    patched = original + ("" if original.endswith("\n") or not original else "\n") \
        + strict_block(release)
    lines = difflib.unified_diff(original.splitlines(keepends=True),
                                 patched.splitlines(keepends=True),
                                 f"a/{DIFF_TARGET}", f"b/{DIFF_TARGET}")
    # a last line without its newline: the marker patch(1) expects after it
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
                   for line in lines)


def install_at_import(release: str, module: str, *, timeout_steps: int | None = None,
                      collective_timeout_s: float = 30.0, agreed_release: bool = True,
                      transfer_backend: str = "mooncake") -> Any:
    """The strict patch installed by the patched source itself (the diff's call, at the
    end of ``module``, the decode module being imported); returns what ``install_into``
    patched (conform points its observer and timeouts there). Refuses a diff applied to
    another installed release."""
    import importlib
    import sys
    installed = getattr(sys.modules.get(module.split(".")[0]), "__version__", None)
    if isinstance(installed, str) and installed != release:
        raise RuntimeError(f"strict diff for SGLang {release} applied to {installed}")
    decode = sys.modules[module]
    utils = importlib.import_module(module.rsplit(".", 1)[0] + ".utils")
    target = _live_release(decode, utils, transfer_backend, collective_timeout_s)
    install_into(target, timeout_steps, agreed_release)
    return target
