"""The variants: named configurations of one step function, never copies of it.

Each field is one design decision from SGLang's history (see docs/ARCHITECTURE.md and
../shared/reference/protocol.md). ``strict`` is this project's proposal.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum


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
        return ", ".join(parts)


DEFAULT_TIMEOUT_STEPS = 4

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
    )
}


# strict minus one mechanism each: the proofs show every mechanism is needed, and
# their counterexample traces name these variants so that validate can replay them.
ABLATIONS: dict[str, Variant] = {
    name: replace(VARIANTS["strict"], name=name, **change)
    for name, change in (("strict-no-fence", {"fence_before_reuse": False}),
                         ("strict-no-room-order", {"room_after_payload": False}),
                         ("strict-no-timeout", {"timeout_steps": None}))
}


def get_variant(name: str, timeout_steps: int | None = None) -> Variant:
    """Look a variant (or an ablation) up by name; ``timeout_steps`` overrides strict's bound."""
    variant = VARIANTS.get(name) or ABLATIONS.get(name)
    if variant is None:
        raise ValueError(f"unknown variant {name!r} (known: {', '.join([*VARIANTS, *ABLATIONS])})")
    if timeout_steps is not None:
        if variant.timeout_steps is None:
            raise ValueError(f"variant {name!r} has no timeout to override")
        if timeout_steps < 1:
            raise ValueError(f"timeout_steps must be >= 1, got {timeout_steps}")
        variant = replace(variant, timeout_steps=timeout_steps)
    return variant
