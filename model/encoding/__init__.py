"""The Z3 encoding of the spec (docs/PROOFS.md): vocabulary, transition relation built
from the spec's own kernel, invariants and lemmas, and the checks (``check_init``,
``check_step``, ``premises``, ``bmc``). Imports z3; the spec itself never does."""
from model.encoding.checks import bmc, check_init, check_step, premises, prove_inductive
from model.encoding.vocab import Ctx, Sizes, State

__all__ = ["bmc", "check_init", "check_step", "premises", "prove_inductive", "Ctx", "Sizes", "State"]
