"""SGLang's abort messages -> the spec's decisions: one table for ``pdgate conform`` (the
release runner) and ``pdgate live`` (its in-worker hooks). Standard library and the
spec only, so the live worker's venv can import it."""
from __future__ import annotations

from model.spec.kernel import Decision

# finished_reason messages, stable over 0.5.12..0.5.23 -> the spec's decision
REASONS = (("Decode transfer failed", Decision.ABORT_FAILED),
           ("not ready after readiness gate", Decision.ABORT_ROOM_ZERO),
           ("corruption", Decision.ABORT_ROOM_MISMATCH))


def decision_of(message: str) -> Decision | None:
    """The decision an abort message names, or None for a message no release writes."""
    return next((decision for text, decision in REASONS if text in message), None)
