"""Divergence detection after every protocol step, cheaply: the spec's own incremental
check (``model.spec.invariants.step_violations``), re-exported where the simulator
has always imported it."""
from __future__ import annotations

from model.spec.invariants import step_violations

__all__ = ["step_violations"]
