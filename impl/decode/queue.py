"""The decode transfer queue: add, then once per scheduler step ``pop_transferred``
(poll -> gate -> MIN -> pop -> clear -> free), as a thin driver around the spec's kernel.

A step is split into ``begin_step`` (local: polls and gate, no state change),
the collective, and ``finish_step`` (apply the MIN), so that tests can run several
ranks in one process and the real path runs them over gloo; see docs/IMPL.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from impl.decode.buffers import MetadataBuffers, SlotAllocator
from impl.decode.collective import AdaptiveMessage, DEFAULT_TIMEOUT_S, GlooExchange, digest
from impl.decode.errors import (CollectiveLengthMismatch, DecodeInputError, DuplicateRequest,
                                DuplicateRoom, PeerAbortedStep, RoomOutOfRange, SlotInUse,
                                SlotNotAllocated, ZeroRoom)
from impl.decode.gate import (FAKE_BOOTSTRAP_HOST, check_polls, decide_tensor, gate_array,
                              gate_tensor, may_pop, numpy_ops_knowing, poll_bytes,
                              resolve_variant)
from model.spec.timeouts import STEP_FLOOR_S, deployed_variant
from impl.decode.trace import StepTrace, Tracer
from model.spec.kernel import Decision
from model.spec.kvpoll import KVPoll
from model.spec.variants import Admission, Deferral, FreeOrder, Variant


@runtime_checkable
class KVReceiver(Protocol):
    """What the queue needs from a transfer receiver (SGLang's BaseKVReceiver subset).

    Optional: ``writes_fenced() -> bool``, True once no write for this request can still
    land in its metadata slot (all fields landed, or prefill acknowledged the abort).
    Variants that fence before reuse (strict) keep a popped request's slot out of the
    free list until it says True; a receiver without the method counts as fenced.
    Optional: ``abort_acknowledged() -> bool``, True once prefill acknowledged the abort
    of a failed request; the deferred variants (SGLang #35049) hold a failed request's
    slot until it says True or their release timeout passes; a receiver without it
    answers ``writes_fenced()``. Both must stay callable after ``clear()``.
    """

    def poll(self) -> int: ...

    def failure_exception(self) -> Exception | None: ...

    def clear(self) -> None: ...


@dataclass
class Req:
    rid: str
    bootstrap_room: int
    bootstrap_host: str = "127.0.0.1"


@dataclass
class DecodeRequest:
    req: Req
    kv_receiver: KVReceiver
    metadata_buffer_index: int

    @property
    def is_fake(self) -> bool:
        return self.req.bootstrap_host == FAKE_BOOTSTRAP_HOST


@dataclass(frozen=True)
class Committed:
    """All ranks agreed on Success and this rank's slot holds the request's own row."""
    decode_req: DecodeRequest
    slot: int
    first_token: int
    fields: dict[str, torch.Tensor] = field(repr=False)
    decision: Decision = Decision.COMMIT


@dataclass(frozen=True)
class Aborted:
    decode_req: DecodeRequest
    slot: int
    decision: Decision
    reason: str


def _writes_fenced(receiver: Any) -> bool:
    check = getattr(receiver, "writes_fenced", None)
    return True if check is None else bool(check())


def _abort_acknowledged(receiver: Any) -> bool:
    check = getattr(receiver, "abort_acknowledged", None)
    return _writes_fenced(receiver) if check is None else bool(check())


def _deployed_variant(variant: str | Variant, timeout_steps: int | None, timeout_s: float | None,
                      release_timeout_s: float | None, step_floor_s: float) -> Variant:
    """A variant by name gets its timeouts from seconds (model.spec.timeouts); a Variant
    object (a trace's own) is used as given."""
    if isinstance(variant, Variant):
        if timeout_s is not None or release_timeout_s is not None:
            raise ValueError("timeout_s / release_timeout_s apply to a variant given by name")
        return resolve_variant(variant)
    return deployed_variant(variant, timeout_steps, timeout_s, release_timeout_s, step_floor_s)


@dataclass
class StepPlan:
    """The local half of a step: nothing in the queue has changed yet. ``reqs`` is the
    queue's own list (valid until the next ``begin_step``); on cpu the per-request values
    are numpy arrays."""
    reqs: list[DecodeRequest]
    local: torch.Tensor | np.ndarray
    seen: torch.Tensor | np.ndarray
    gated: torch.Tensor | np.ndarray
    fingerprint: torch.Tensor
    error: DecodeInputError | None = None


_EMPTY_I64 = torch.empty(0, dtype=torch.int64)
AGES_FROM = int(KVPoll.Transferring)


class DecodeTransferQueue:
    def __init__(self, gloo_group: Any, metadata_buffers: MetadataBuffers,
                 allocator: SlotAllocator, variant: str | Variant = "strict",
                 timeout_steps: int | None = None,
                 collective_timeout_s: float = DEFAULT_TIMEOUT_S,
                 tracer: Tracer | None = None, exchange: GlooExchange | None = None,
                 *, timeout_s: float | None = None, release_timeout_s: float | None = None,
                 step_floor_s: float = STEP_FLOOR_S):
        self.variant = _deployed_variant(variant, timeout_steps, timeout_s, release_timeout_s,
                                         step_floor_s)
        if allocator.size != metadata_buffers.size:
            raise ValueError(f"allocator has {allocator.size} slots, buffers {metadata_buffers.size}")
        self.buffers, self.allocator, self.tracer = metadata_buffers, allocator, tracer
        self.exchange = exchange or GlooExchange(gloo_group, collective_timeout_s)
        dev = metadata_buffers.device
        # the queue is _reqs then _pending; adds join _reqs at the next step, so a step's
        # plan can hold _reqs itself (no copy) and the lists are replaced, never edited,
        # while it runs
        self._reqs: list[DecodeRequest] = []
        self._receivers: list[Any] = []                  # _reqs' receivers, polled per step
        self._pending: list[DecodeRequest] = []          # added, not yet in _reqs / tensors
        self._slots = _EMPTY_I64.to(dev)
        self._expected = _EMPTY_I64.to(dev)
        self._age = _EMPTY_I64.to(dev)
        self._real = torch.empty(0, dtype=torch.bool, device=dev)
        self._rooms: dict[int, str] = {}                 # queued real room -> rid
        self._holders: dict[int, str] = {}               # slot -> rid (queued or quarantined)
        self._rids: set[str] = set()                     # queued request ids
        self._fakes = 0                                  # queued fake transfers
        self._fingerprint: torch.Tensor | None = None    # digest of the queue, cached
        self._message = AdaptiveMessage()                # the step's collective buffer
        # reduced values after which nothing can leave, as bytes: "can anything pop?"
        # is then one C-level bytes.translate on the reduced polls
        self._stay = bytes(np.flatnonzero(~may_pop(self.variant)).tolist())
        # on cpu the step runs on numpy views of the per-request tensors (one numpy op
        # costs a fraction of a torch op at these sizes); refreshed when they change
        self._on_cpu = dev.type == "cpu"
        self._room_np = metadata_buffers.room_column.numpy() if self._on_cpu else None
        self._views: tuple = ()
        self._refresh_views()
        self._quarantine: list[DecodeRequest] = []
        self._held: list[list[Any]] = []                 # [request, steps held]: deferred slots
        self._seq: dict[str, int] = {}                   # rid -> enqueue order, while it holds a slot
        self._added = 0
        self.steps = 0

    # -- queue contents -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._reqs) + len(self._pending)

    @property
    def queue(self) -> list[DecodeRequest]:
        return self._reqs + self._pending

    @property
    def quarantined(self) -> list[DecodeRequest]:
        return list(self._quarantine)

    @property
    def held(self) -> list[DecodeRequest]:
        """Failed requests whose slots a deferred variant still holds (SGLang #35049)."""
        return [d for d, _ in self._held]

    # -- admission ------------------------------------------------------------------
    def capacity(self) -> int:
        """Requests this rank could take now: its free metadata slots (quarantined and
        held slots are not free; slots whose writes got fenced are released first)."""
        self.release_fenced()
        return self.allocator.available_size()

    def admissible(self, wanted: int) -> int:
        """How many of the caller's next ``wanted`` requests to take. Agreed admission
        (every deployable variant): the MIN over ranks of what each can take, one
        all-reduce, so every rank of the group must call it in the same step with the
        same ``wanted``. Local admission (SGLang's, the deferred variants): this rank's
        own capacity, no collective (the spec shows the queues can then diverge); the
        agreed deferral (0.5.23) first releases what every rank can release, one MIN
        while slots are held, so its ranks too must all call it."""
        if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 0:
            raise ValueError(f"wanted must be an integer >= 0, got {wanted!r}")
        if self._held and self.variant.defer_failed is Deferral.AGREED:
            # 0.5.23 resolves its holds before each admission: what every rank can release
            # now (acknowledged, or timed out at an earlier step), one MIN over the held
            # slots, which agree on every rank (machine._fence releases at that point)
            self._release_held(self.exchange.all_reduce_min(torch.from_numpy(self._due_now())).numpy())
        n = min(wanted, self.capacity())
        if self.variant.admission is Admission.AGREED:
            n = int(self.exchange.all_reduce_min(torch.tensor([n], dtype=torch.int64))[0])
        return n

    def admit(self, candidates: Sequence[tuple[Req, KVReceiver]]) -> list[DecodeRequest]:
        """The admit step: enqueue the first ``admissible(len(candidates))`` candidates,
        in order, on this rank (every rank with the same candidates); the rest stay
        with the caller (its prealloc queue) for a later step."""
        n = self.admissible(len(candidates))
        return [self.enqueue(req, receiver) for req, receiver in candidates[:n]]

    def add(self, decode_req: DecodeRequest) -> None:
        """Queue a request whose slot the caller allocated; refuses bad input untouched."""
        req, idx = decode_req.req, decode_req.metadata_buffer_index
        if req.rid in self._rids:
            raise DuplicateRequest(req.rid)
        self.buffers.check_index(idx, req.rid)
        if idx in self._holders:
            raise SlotInUse(idx, self._holders[idx], req.rid)
        if not self.allocator.is_allocated(idx):
            raise SlotNotAllocated(idx)
        room = req.bootstrap_room
        if decode_req.is_fake:
            self._fakes += 1
        else:
            if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**64:
                raise RoomOutOfRange(req.rid, room)
            if room == 0:
                raise ZeroRoom(req.rid)
            if room in self._rooms:
                raise DuplicateRoom(room, self._rooms[room], req.rid)
            self._rooms[room] = req.rid
        self._holders[idx] = req.rid
        self._rids.add(req.rid)
        self._seq[req.rid] = self._added
        self._added += 1
        self._pending.append(decode_req)

    def enqueue(self, req: Req, receiver: KVReceiver) -> DecodeRequest:
        """Allocate a slot and add; on refusal the slot goes back and nothing changed."""
        self.release_fenced()                  # slots whose writes got fenced since the step
        idx = self.allocator.alloc()
        decode_req = DecodeRequest(req, receiver, idx)
        try:
            self.add(decode_req)
        except Exception:
            self.allocator.undo_alloc(idx)
            raise
        return decode_req

    def _sync(self) -> None:
        """Move pending adds into the queue and its per-request tensors (once per step)."""
        if not self._pending:
            return
        new, dev = self._pending, self.buffers.device
        slots = torch.tensor([d.metadata_buffer_index for d in new], dtype=torch.int64, device=dev)
        rooms = torch.tensor([0 if d.is_fake else d.req.bootstrap_room for d in new],
                             dtype=torch.uint64, device=dev).view(torch.int64)
        real = torch.tensor([not d.is_fake for d in new], dtype=torch.bool, device=dev)
        self._slots = torch.cat([self._slots, slots])
        self._expected = torch.cat([self._expected, rooms])
        self._real = torch.cat([self._real, real])
        self._age = torch.cat([self._age, torch.zeros(len(new), dtype=torch.int64, device=dev)])
        self._reqs = self._reqs + new
        self._receivers = self._receivers + [d.kv_receiver for d in new]
        self._pending = []
        self._fingerprint = None
        self._refresh_views()

    def _refresh_views(self) -> None:
        if self._on_cpu:
            expected = self._expected.numpy()
            self._views = (self._slots.numpy(), expected, self._age.numpy(), self._real.numpy())
            self._ops = numpy_ops_knowing(expected, 0)    # "expected room is 0", once per change

    # -- one protocol step ----------------------------------------------------------
    def pop_transferred(self) -> list[Committed | Aborted]:
        """One scheduler step on this rank; every rank of the group must call it."""
        self.release_fenced()
        plan = self.begin_step()
        values = plan.gated.cpu() if isinstance(plan.gated, torch.Tensor) else plan.gated
        try:
            reduced = self._message.reduce(self.exchange, values, len(values), plan.fingerprint,
                                           plan.error is None)
        except PeerAbortedStep:
            if plan.error is not None:
                raise plan.error from None
            raise
        except CollectiveLengthMismatch as exc:
            self._trace(plan, (), (), hang=exc.lengths, error=str(exc))
            raise
        due = self.release_due() if self._held else None
        if due is not None and self.variant.defer_failed is Deferral.AGREED:
            # MIN of "can release" over ranks: the held lists agree (holds follow the
            # agreed MIN), so every rank sends one flag per held slot in the same order
            due = self.exchange.all_reduce_min(torch.from_numpy(due)).numpy()
        return self.finish_step(plan, reduced, due)

    def release_due(self) -> np.ndarray:
        """Count this step for every held slot; 1 where this rank could release it now
        (prefill acknowledged the abort, or it was held the release timeout's steps)."""
        for h in self._held:
            h[1] += 1
        return self._due_now()

    def _due_now(self) -> np.ndarray:
        """1 per held slot this rank could release (machine._releasable): prefill
        acknowledged the abort, or it was held the release timeout's steps."""
        limit = self.variant.release_timeout_steps
        return np.array([_abort_acknowledged(d.kv_receiver) or (limit is not None and n >= limit)
                         for d, n in self._held], dtype=np.uint8)

    def _release_held(self, due: np.ndarray) -> None:
        """Free the held slots that are due (in enqueue order, as machine._release_held)."""
        if len(due) != len(self._held):
            raise ValueError(f"{len(due)} release flags for {len(self._held)} held slots")
        out = [d for (d, _), ok in zip(self._held, due) if ok]
        self._held = [h for h, ok in zip(self._held, due) if not ok]
        for d in sorted(out, key=lambda d: self._seq[d.req.rid]):
            self._free(d.metadata_buffer_index, d)

    def begin_step(self) -> StepPlan:
        """Poll every receiver and gate locally. Changes nothing; a bad poll is kept in
        ``plan.error`` so the rank can still tell its peers before raising."""
        self._sync()
        reqs = self._reqs
        polls = [r.poll() for r in self._receivers]
        if self._fingerprint is None:                 # recomputed only when the queue changed
            self._fingerprint = digest(self._expected)
        fp = self._fingerprint
        try:
            raw = poll_bytes(polls, lambda i: reqs[i].req.rid)
        except DecodeInputError as exc:
            empty = np.empty(0, dtype=np.uint8)
            return StepPlan(reqs, empty, empty, empty, fp, exc)
        if self._on_cpu:
            slots, expected, age, real = self._views
            local = np.frombuffer(raw, dtype=np.uint8)
            seen = self._room_np[slots]                                   # the one gather
            gated = gate_array(self.variant, local, seen, expected, self._age_input(age),
                               real if self._fakes else None,  # skip the mask when all are real
                               self._ops)
            return StepPlan(reqs, local, seen, gated, fp)
        local = check_polls(raw).to(self.buffers.device)
        seen = self.buffers.room_column.index_select(0, self._slots)     # the one gather
        real = self._real if self._fakes else None
        gated = gate_tensor(self.variant, local, seen, self._expected, self._age, real)
        return StepPlan(reqs, local, seen, gated, fp)

    def _age_input(self, age: np.ndarray) -> np.ndarray | int:
        """The ages, or 0 when that gives the kernel the same answers: it reads an age only
        as ``age >= timeout_steps`` (model.spec.kernel, as its gate_table), so when the
        oldest is below the timeout every request's answer is 0's and the rule folds away."""
        timeout = self.variant.timeout_steps
        return age if timeout is not None and age.size and int(age.max()) >= timeout else 0

    def finish_step(self, plan: StepPlan, reduced: torch.Tensor | np.ndarray,
                    release_due: np.ndarray | None = None) -> list[Committed | Aborted]:
        """Apply the agreed MIN: release held slots that are due (``release_due``, agreed
        by ``pop_transferred``; None: this rank's own ``release_due()``), then pop, read
        committed rows, clear and free (or fence, or hold) slots."""
        if plan.error is not None:
            raise plan.error
        if self._held:
            self._release_held(self.release_due() if release_due is None else release_due)
        reduced = reduced.numpy() if isinstance(reduced, torch.Tensor) else reduced
        if not reduced.tobytes().translate(None, self._stay):   # no MIN value can pop anything
            return self._keep_all(plan, reduced)
        reduced = torch.from_numpy(reduced).to(self.buffers.device)
        decisions = decide_tensor(self.variant, reduced, torch.as_tensor(plan.seen),
                                  self._expected, self._real)
        leave = decisions != int(Decision.KEEP)
        if not bool(leave.any()):
            return self._keep_all(plan, reduced)
        results = self._pop(plan.reqs, leave, decisions)
        keep = ~leave
        self._fingerprint = None
        self._slots, self._expected = self._slots[keep], self._expected[keep]
        self._real, self._age = self._real[keep], (self._age + self._ages_by(reduced))[keep]
        self._refresh_views()
        keep_list = keep.tolist()
        self._reqs = [d for d, k in zip(plan.reqs, keep_list) if k]
        self._receivers = [r for r, k in zip(self._receivers, keep_list) if k]
        self._trace(plan, reduced, [(r.decode_req.req.rid, int(r.decision),
                                     r.first_token if isinstance(r, Committed) else 0)
                                    for r in results])
        self.steps += 1
        return results

    def _ages_by(self, reduced: torch.Tensor) -> torch.Tensor:
        """1 where a kept request ages: after a MIN of Transferring or Success (every
        rank latched Success and a gate held it; as machine._pop), else 0."""
        red = torch.as_tensor(reduced, device=self._age.device)
        return (red >= AGES_FROM).to(torch.int64)

    def _keep_all(self, plan: StepPlan, reduced: Any) -> list[Committed | Aborted]:
        if self._on_cpu:
            age = self._views[2]              # the age tensor, through its numpy view
            red = reduced.numpy() if isinstance(reduced, torch.Tensor) else np.asarray(reduced)
            age += red >= AGES_FROM
        else:
            self._age += self._ages_by(reduced)
        self._trace(plan, reduced, ())
        self.steps += 1
        return []

    def _pop(self, reqs: list[DecodeRequest], leave: torch.Tensor,
             decisions: torch.Tensor) -> list[Committed | Aborted]:
        positions = leave.nonzero().flatten()
        kinds = decisions.index_select(0, positions).tolist()
        slots = self._slots.index_select(0, positions)
        commit = decisions.index_select(0, positions) == int(Decision.COMMIT)
        rows = self._read_rows(slots[commit]) if bool(commit.any()) else []
        results: list[Committed | Aborted] = []
        row_iter = iter(rows)
        for pos, kind, slot in zip(positions.tolist(), kinds, slots.tolist()):
            d = reqs[pos]
            if kind == int(Decision.COMMIT):
                first, fields = next(row_iter)
                results.append(Committed(d, slot, first, fields))
            else:
                results.append(Aborted(d, slot, Decision(kind), self._reason(d, Decision(kind), slot)))
        order: Sequence[int] = range(len(results))
        if self.variant.free_order is FreeOrder.SET and len(results) > 1:
            # SGLang frees in the iteration order of a set of queue positions
            at = {pos: i for i, pos in enumerate(positions.tolist())}
            order = [at[pos] for pos in set(at)]
        for i in order:
            self._release(results[i].decode_req, results[i].decision)
        return results

    def _read_rows(self, slots: torch.Tensor) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """Every field's rows for the committed slots: one index_select per field."""
        firsts = self.buffers.output_ids.index_select(0, slots)[:, 0].tolist()
        per_field = {name: t.index_select(0, slots).unbind(0)
                     for name, t in self.buffers.fields.items()}
        return [(firsts[i], {name: rows[i] for name, rows in per_field.items()})
                for i in range(len(firsts))]

    def _reason(self, d: DecodeRequest, kind: Decision, slot: int) -> str:
        if kind is Decision.ABORT_FAILED:
            exc = d.kv_receiver.failure_exception()
            return f"transfer failed on this or another rank{': ' + str(exc) if exc else ''}"
        seen = self.buffers.read_room(slot)
        if kind is Decision.ABORT_ROOM_ZERO:
            return "all ranks reported Success but this slot's bootstrap_room reads 0"
        return (f"slot {slot} holds bootstrap_room {seen}, expected {d.req.bootstrap_room} "
                "(another request's metadata)")

    def _release(self, d: DecodeRequest, decision: Decision = Decision.COMMIT) -> None:
        self._rids.discard(d.req.rid)
        if d.is_fake:
            self._fakes -= 1
        else:
            self._rooms.pop(d.req.bootstrap_room, None)
        d.kv_receiver.clear()
        if decision is Decision.ABORT_FAILED and self.variant.defer_failed is not Deferral.NONE:
            self._held.append([d, 0])
        elif self.variant.fence_before_reuse and not _writes_fenced(d.kv_receiver):
            self._quarantine.append(d)
        else:
            self._free(d.metadata_buffer_index, d)

    def _free(self, slot: int, d: DecodeRequest) -> None:
        if self.variant.clear_on_free:
            self.buffers.clear_slot(slot)
        del self._holders[slot]
        self._seq.pop(d.req.rid, None)
        self.allocator.free(slot)

    def release_fenced(self) -> list[int]:
        """Free quarantined slots whose writes are fenced now, in quarantine order, and
        (local deferral) held slots whose abort prefill acknowledged."""
        freed, still = [], []
        for d in self._quarantine:
            if _writes_fenced(d.kv_receiver):
                self._free(d.metadata_buffer_index, d)
                freed.append(d.metadata_buffer_index)
            else:
                still.append(d)
        self._quarantine = still
        if self._held and self.variant.defer_failed is Deferral.LOCAL:
            kept = []
            for h in self._held:
                if _abort_acknowledged(h[0].kv_receiver):
                    self._free(h[0].metadata_buffer_index, h[0])
                    freed.append(h[0].metadata_buffer_index)
                else:
                    kept.append(h)
            self._held = kept
        return freed

    def _trace(self, plan: StepPlan, reduced: Any, popped: Sequence[tuple[str, int, int]],
               hang: tuple[int, ...] | None = None, error: str | None = None) -> None:
        if self.tracer is None:
            return
        as_list = (lambda t: tuple(t.tolist()) if hasattr(t, "tolist") else tuple(t))
        self.tracer.record(StepTrace(self.steps, tuple(d.req.rid for d in plan.reqs),
                                     as_list(plan.local), as_list(plan.gated), as_list(reduced),
                                     tuple(tuple(p) for p in popped), hang, error))

    # -- for tests and debugging ----------------------------------------------------
    def snapshot(self) -> tuple:
        """Everything that defines this rank's state, comparable with ``==``."""
        self._sync()
        return (tuple(d.req.rid for d in self._reqs), tuple(self._slots.tolist()),
                tuple(self._expected.tolist()), tuple(self._age.tolist()),
                tuple(self._real.tolist()), tuple(sorted(self._rooms.items())),
                tuple(sorted(self._holders.items())),
                tuple(d.req.rid for d in self._quarantine), self.steps,
                tuple(self.allocator.free_list()), tuple((d.req.rid, n) for d, n in self._held))
