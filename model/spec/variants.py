"""The variants: named configurations of one step function, never copies of it.

Each field is one design decision from SGLang's history (see docs/ARCHITECTURE.md and
../shared/reference/protocol.md). ``strict`` is this project's proposal.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Iterable


class Admission(Enum):
    """How the ranks decide to take the next request into the transfer queue."""
    AGREED = "agreed"      # the MIN over ranks of the free slots: all take it, or none does
    LOCAL = "local"        # each rank on its own free slots (SGLang's prealloc queue)


class FreeOrder(Enum):
    """The order in which one step's popped requests give their slots back (the FIFO free
    list then hands them out in that order)."""
    QUEUE = "queue"        # queue order (pdgate's impl)
    SET = "set"            # iteration order of a Python set of queue positions (SGLang's
    # ``indices_to_remove``): ascending only while the positions stay below the set's
    # table size (8 slots, then 32, ...), e.g. list({9, 2}) == [9, 2]


class Deferral(Enum):
    """What happens to a request's slot after the MIN aborts it as Failed (SGLang #35049).
    Commits and room aborts free at once in every variant."""
    NONE = "none"          # freed at once (strict's fence quarantine is separate)
    LOCAL = "local"        # held per rank until that rank's Fence or the release timeout
    AGREED = "agreed"      # held until every rank can release (MAX to hold, MIN to release)


class GateRule(Enum):
    NONE = "none"          # no gate: local Success goes straight into the MIN
    NONZERO = "nonzero"    # hold Success while the local room reads 0 (SGLang 0.5.13)
    MATCH = "match"        # hold Success until the local room equals the expected room


@dataclass(frozen=True)
class Variant:
    name: str
    gate: GateRule
    # After a MIN Success, a rank that reads room 0: True -> keep it locally and retry
    # next step (SGLang <= 0.5.12, the divergence of #23252/#26394); False -> abort.
    keep_on_room_zero: bool
    # Zero the room field when a slot is freed (#27374, 0.5.23 clear_slot).
    clear_on_free: bool
    # A slot goes back to the free list only once no write to it is in flight (#35049).
    fence_before_reuse: bool
    # The prefill writes the room as a separate write issued after the payload write
    # completed. Assumption A1 (docs/ARCHITECTURE.md): a write that completed at the
    # sender is visible at the receiver before any write issued after that completion.
    room_after_payload: bool
    # A request whose metadata has not matched within this many protocol steps is
    # reported Failed locally, so the MIN aborts it on every rank in the same step.
    timeout_steps: int | None
    # An expected room of 0 cannot be told apart from a cleared slot: fail it locally.
    fail_zero_room: bool
    admission: Admission = Admission.AGREED
    free_order: FreeOrder = FreeOrder.QUEUE
    defer_failed: Deferral = Deferral.NONE
    # A held (deferred) slot is released after this many protocol steps even without a
    # Fence (SGLang: 30 s); None: only a Fence releases it.
    release_timeout_steps: int | None = None

    def describe(self) -> str:
        parts = [f"gate={self.gate.value}"]
        parts.append("keep-on-room-0" if self.keep_on_room_zero else "abort-on-room-0")
        parts.append("clear-on-free" if self.clear_on_free else "no-clear")
        if self.fence_before_reuse:
            parts.append("fence-before-reuse")
        if self.room_after_payload:
            parts.append("room-after-payload")
        if self.timeout_steps is not None:
            parts.append(f"timeout={self.timeout_steps}")
        if self.fail_zero_room:
            parts.append("fail-room-0")
        parts.append(f"admission={self.admission.value}")
        if self.free_order is not FreeOrder.QUEUE:
            parts.append(f"free-order={self.free_order.value}")
        if self.defer_failed is not Deferral.NONE:
            release = (f", release-timeout={self.release_timeout_steps}"
                       if self.release_timeout_steps is not None else "")
            parts.append(f"defer-failed={self.defer_failed.value}{release}")
        return ", ".join(parts)


# The proofs' small bounds (what `pdgate prove` and the explorer use). Deployments
# configure seconds and convert them (impl.decode.timeouts); these are not deployable.
DEFAULT_TIMEOUT_STEPS = 4
DEFAULT_RELEASE_STEPS = 1

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("ungated", GateRule.NONE, keep_on_room_zero=True, clear_on_free=False,
                fence_before_reuse=False, room_after_payload=False, timeout_steps=None,
                fail_zero_room=False),
        Variant("gate-noclear", GateRule.NONZERO, keep_on_room_zero=False, clear_on_free=False,
                fence_before_reuse=False, room_after_payload=False, timeout_steps=None,
                fail_zero_room=False),
        Variant("gate", GateRule.NONZERO, keep_on_room_zero=False, clear_on_free=True,
                fence_before_reuse=False, room_after_payload=False, timeout_steps=None,
                fail_zero_room=False),
        Variant("strict", GateRule.MATCH, keep_on_room_zero=False, clear_on_free=True,
                fence_before_reuse=True, room_after_payload=True,
                timeout_steps=DEFAULT_TIMEOUT_STEPS, fail_zero_room=True),
        # SGLang 0.5.21 and 0.5.22 with deferred release on (#35049; 0.5.19 and 0.5.20
        # hold only a decode-initiated abort's slot): a failed request's slot is held per
        # rank until that rank's Fence or a per-rank release timeout; admission reads the
        # rank's own free slots.
        Variant("deferred-local", GateRule.NONZERO, keep_on_room_zero=False, clear_on_free=True,
                fence_before_reuse=False, room_after_payload=False, timeout_steps=None,
                fail_zero_room=False, admission=Admission.LOCAL, free_order=FreeOrder.SET,
                defer_failed=Deferral.LOCAL, release_timeout_steps=DEFAULT_RELEASE_STEPS),
        # SGLang 0.5.23: holds and releases agreed across ranks (all_reduce_flags MAX, then
        # MIN: "Releasing only on some ranks would diverge admission").
        Variant("deferred", GateRule.NONZERO, keep_on_room_zero=False, clear_on_free=True,
                fence_before_reuse=False, room_after_payload=False, timeout_steps=None,
                fail_zero_room=False, admission=Admission.LOCAL, free_order=FreeOrder.SET,
                defer_failed=Deferral.AGREED, release_timeout_steps=DEFAULT_RELEASE_STEPS),
    )
}


# strict minus one mechanism each: the proofs show every mechanism is needed, and
# their counterexample traces name these variants so that validate can replay them.
ABLATIONS: dict[str, Variant] = {
    name: replace(VARIANTS["strict"], name=name, **change)
    for name, change in (("strict-no-fence", {"fence_before_reuse": False}),
                         ("strict-no-room-order", {"room_after_payload": False}),
                         ("strict-no-timeout", {"timeout_steps": None}),
                         # agreed admission is what keeps strict's per-rank quarantine
                         # from diverging the queues
                         ("strict-local-admission", {"admission": Admission.LOCAL}),
                         # the proofs do not depend on the free order
                         ("strict-set-order", {"free_order": FreeOrder.SET}))
}


def get_variant(name: str, timeout_steps: int | None = None,
                release_timeout_steps: int | None = None) -> Variant:
    """Look a variant (or an ablation) up by name; ``timeout_steps`` overrides strict's
    bound, ``release_timeout_steps`` the deferred variants' release timeout."""
    variant = VARIANTS.get(name) or ABLATIONS.get(name)
    if variant is None:
        raise ValueError(f"unknown variant {name!r} (known: {', '.join([*VARIANTS, *ABLATIONS])})")
    for field_name, what, value in (("timeout_steps", "timeout", timeout_steps),
                                    ("release_timeout_steps", "release timeout",
                                     release_timeout_steps)):
        if value is None:
            continue
        if getattr(variant, field_name) is None:
            raise ValueError(f"variant {name!r} has no {what} to override")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field_name} must be an integer >= 1, got {value!r}")
        variant = replace(variant, **{field_name: value})
    return variant


FAMILIES = ("iter-", "prefill-", "pp-", "clocks-")


def brief(names: Iterable[str]) -> str:
    """Variant names for a one-line error: the transfer queue's by name, the families of
    the iteration, pipeline and clock variants as ``iter-* (6)`` (``pdgate prove --list``
    lists them all)."""
    names = list(names)
    plain = [n for n in names if not n.startswith(FAMILIES)]
    counts = {f: sum(n.startswith(f) for n in names) for f in FAMILIES}
    return ", ".join([*plain, *(f"{f}* ({c})" for f, c in counts.items() if c)])
