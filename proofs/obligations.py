"""The proof obligations of ``pdgate prove``: what is checked, per variant, and how.

Kinds (the ``obligation`` column):
  safety:INV        inductive invariant, Z3 over unbounded sorts (all T, N, slots)
  lemma:slots       the slot bookkeeping the encoding relies on (owner of a held slot)
  liveness:bounded_wait  strict: age <= T is inductive for a symbolic T >= 1 (unbounded);
                    others: a lasso (a reachable state whose step changes only ages)
  cex:INV           the smallest counterexample by bounded unrolling, exported as a trace
  nonvacuous:*      premises satisfiable; a commit is reachable; the gate can hold one
  bmc-crosscheck    proofs/explore.py's explicit-state search agrees (small sizes)
  induction:INV     unbounded, for each invariant the variant breaks: not inductive,
                    shown by a concrete counterexample to induction
  consistent:actions  unbounded: every action's guard and side axioms are satisfiable
  refines:spec      every small reachable spec state and every event: the symbolic
                    action (unbounded and finite readings) allows exactly the spec's
                    successor, or at least it where a named abstraction adds behaviour
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

import z3

from model.encoding.checks import (BmcResult, Goal, bmc, check_step, consistent, premises,
                                   prove_inductive, stutter_goal, violates)
from model.encoding.invariants import PREDICATES
from model.encoding.vocab import Sizes, Z3OPS
from model.spec.kernel import SUCCESS, TRANSFERRING, gated_poll
from model.spec.timeouts import (GATE_TIMEOUT_S, RELEASE_TIMEOUT_S, STEP_FLOOR_S, deployed_variant,
                                 steps_for)
from model.spec.variants import ABLATIONS, VARIANTS, Admission, Deferral, Variant
from proofs.export import ReplayMismatch, export_lasso, export_violation, export_witness

SAFETY_NAMES = ("queues_identical", "outcomes_agree", "no_corruption", "exactly_once")
SLOT_LEMMAS = ["fresh_is_blank", "slot_owner", "slot_held", "quarantine_decided"]
# Each safety property with the lemmas that make it inductive.
BUNDLES: dict[str, list[str]] = {
    "exactly_once": ["exactly_once", "fresh_is_blank"],
    "queues_identical": ["queues_identical"],
    "outcomes_agree": ["outcomes_agree", "queues_identical", "recv_range"],
    "no_corruption": ["no_corruption", "queues_identical", "recv_range", "exactly_once",
                      *SLOT_LEMMAS, "writes_to_held_slots", "free_rows_zero",
                      "room_is_own_or_zero", "room_after_payload", "payload_is_own"],
    "bounded_wait": ["bounded_wait", "ages_agree", "queues_identical", "recv_range"],
}
# With local admission, queues stay identical only while every rank's slots are held by
# the same requests (then their free-slot counts agree: the capacity argument).
LOCAL_ADMISSION_LEMMAS = ["occupancy_agrees", "no_quarantine", "quarantine_decided"]
# What holds where (verified by the solver; see docs/PROOFS.md for why).
PROVED: dict[str, tuple[str, ...]] = {
    "ungated": ("exactly_once",),
    "gate-noclear": ("queues_identical", "exactly_once"),
    "gate": ("queues_identical", "exactly_once"),
    "strict": SAFETY_NAMES,
    "deferred-local": ("exactly_once",),
    "deferred": ("queues_identical", "exactly_once"),
    "strict-set-order": SAFETY_NAMES,
    "strict-no-fence": ("outcomes_agree",),
}
RELATIONAL = ("queues_identical", "outcomes_agree")   # compare ranks: need T >= 2
ALL_VARIANTS: dict[str, Variant] = {**VARIANTS, **ABLATIONS}
MAX_RANKS, MAX_REQS, MAX_DEPTH = 2, 2, 9
# The deferred variants' counterexamples that go through a held slot come from the
# explicit-state search of the concrete spec at this size instead: breadth first, so the
# shortest there. A late write after a deferred slot's release takes 10 events, beyond
# MAX_DEPTH (the unrolling to depth 10 takes 15 s per variant, the search about 1 s);
# the admission divergence takes 5 (6 s by unrolling, well under 1 s by search).
EXPLORE_SIZE = dict(ranks=2, requests=2, steps=3, slots=1)


def bundle(variant: Variant, inv: str) -> list[str]:
    """The invariant with the lemmas that make it inductive for this variant."""
    names = list(BUNDLES[inv])
    if variant.admission is Admission.LOCAL and "queues_identical" in names:
        names += LOCAL_ADMISSION_LEMMAS
    return names


@dataclass
class Settings:
    traces: Path
    timeout_ms: int = 20_000
    facts_cpu_seconds: float = 0.0  # proofs/cli.py: facts the workers share that no row proves


@dataclass
class Outcome:
    result: str                 # "proved", "counterexample", or what went wrong
    detail: str = ""
    trace: str | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0    # this process's CPU time: what a loaded machine does not inflate


@dataclass(frozen=True)
class Obligation:
    obligation: str
    variant: str
    expected: str               # "proved" or "counterexample"
    unbounded: bool
    check: Callable[["Obligation", Settings], Outcome] = field(compare=False)
    arg: str = ""
    # slow: outside the default set (``pdgate prove --all``, or named by ``--only``), so
    # the default stays under 30 s wall on 2 cores
    slow: bool = field(default=False, compare=False)

    @property
    def key(self) -> str:
        return f"{self.obligation}@{self.variant}"


# -- checks -------------------------------------------------------------------------------
def symbolic_timeout(v: Variant) -> Variant:
    """``v`` with its timeout replaced by a Z3 constant T (the context assumes T >= 1):
    a proof about it holds for every bound the variant can be configured with."""
    return replace(v, timeout_steps=z3.Int("T"))


def _inductive(ob: Obligation, st: Settings) -> Outcome:
    v = ALL_VARIANTS[ob.variant]
    names = bundle(v, ob.arg) if ob.arg in BUNDLES else SLOT_LEMMAS
    symbolic = ob.arg == "bounded_wait" and v.timeout_steps is not None
    v = symbolic_timeout(v) if symbolic else v
    log = prove_inductive(v, names, st.timeout_ms)
    bad = log.failures("unsat")
    lemmas = ", ".join(n for n in names if n != ob.arg)
    if bad:
        return Outcome("not inductive", "; ".join(bad) + _cti_for(v, names, log, st))
    return Outcome("proved", f"init + {len(log.queries) - 1} actions unsat"
                   + (f"; with lemmas {lemmas}" if lemmas else "")
                   + ("; for every timeout T >= 1: age <= T, so a request leaves within T+1 steps"
                      if symbolic else ""))


FactKey = tuple[str, tuple[str, ...], int]      # (variant, bundle, timeout_ms)
# Bundles a worker of this same run found inductive or not (proofs/cli.py proves each
# once, most of them as their own lemma:/safety: rows, and hands the verdicts to every
# worker); never anything from an earlier run.
_SHARED_VERDICTS: dict[FactKey, bool] = {}


def share_facts(verdicts: dict[FactKey, bool]) -> None:
    _SHARED_VERDICTS.update(verdicts)


def fact_bundles(variant: str) -> list[tuple[str, ...]]:
    """The candidate facts of a variant: the slot lemmas, then each expected safety bundle."""
    v = ALL_VARIANTS[variant]
    return [tuple(SLOT_LEMMAS)] + [tuple(bundle(v, inv)) for inv in PROVED.get(variant, ())]


def bundle_inductive(key: FactKey) -> bool:
    """Initiation and consecution of the bundle all unsat (as its lemma:/safety: row)."""
    hit = _SHARED_VERDICTS.get(key)
    if hit is None:
        variant, names, timeout_ms = key
        hit = not prove_inductive(ALL_VARIANTS[variant], list(names), timeout_ms).failures("unsat")
    return hit


@lru_cache(maxsize=None)
def proved_facts(variant: str, timeout_ms: int = 20_000) -> tuple[str, ...]:
    """The facts this run proves for the variant (unbounded): every candidate bundle
    (fact_bundles) is checked and only those found inductive count. Assumed on every
    unrolled frame to prune the bounded search (sound: they hold in every reachable
    state); nothing is assumed that this run has not just proved (here, cached per
    process, or by the worker whose verdict share_facts took)."""
    facts: set[str] = set()
    for names in fact_bundles(variant):
        if bundle_inductive((variant, names, timeout_ms)):
            facts |= set(names)
    return tuple(sorted(facts))


def fact_key(ob: Obligation, timeout_ms: int) -> FactKey | None:
    """The candidate fact bundle this row proves, if it proves one: its result is then
    the bundle's verdict ("proved" exactly when every query came back unsat)."""
    if ob.check is not _inductive or ob.arg == "bounded_wait":
        return None
    names = tuple(bundle(ALL_VARIANTS[ob.variant], ob.arg) if ob.arg in BUNDLES else SLOT_LEMMAS)
    return (ob.variant, names, timeout_ms) if names in fact_bundles(ob.variant) else None


def minimal_bmc(variant: Variant, goal: Goal, timeout_ms: int, first_ranks: int = 1,
                facts: bool = True, largest: Sizes = Sizes(MAX_RANKS, MAX_REQS, MAX_REQS)
                ) -> BmcResult | None:
    """Fewest ranks, then requests, then slots, then transitions (within the bounds).
    ``first_ranks=2`` for invariants that compare ranks: one rank cannot break them.
    ``facts``: assume the variant's proved facts (they prune the search)."""
    assume = proved_facts(variant.name, timeout_ms) if facts else ()
    for ranks in range(first_ranks, largest.ranks + 1):
        for reqs in range(1, largest.reqs + 1):
            for slots in range(1, reqs + 1):
                res = bmc(variant, Sizes(ranks, reqs, slots), goal, MAX_DEPTH, timeout_ms, assume)
                if res.status != "unsat":
                    return res
    return None


def _trace_path(ob: Obligation, st: Settings) -> Path:
    name = ob.obligation.replace(":", "-").replace(" ", "_")
    return st.traces / f"{ob.variant}.{name}.jsonl"


def _found(ob: Obligation, st: Settings, goal: Goal, export: Callable[..., str | None],
           what: str, first_ranks: int = 1, facts: bool = True,
           largest: Sizes = Sizes(MAX_RANKS, MAX_REQS, MAX_REQS)) -> Outcome:
    v = ALL_VARIANTS[ob.variant]
    res = minimal_bmc(v, goal, st.timeout_ms, first_ranks, facts, largest)
    bound = f"T<={largest.ranks}, N<={largest.reqs}, {MAX_DEPTH} events"
    if res is None:
        return Outcome("none found", f"no {what} within {bound}")
    if res.status != "sat":
        return Outcome(res.status, f"solver gave up at {res.sizes}")
    path = _trace_path(ob, st)
    try:
        detail = export(v, res.sizes.ranks, res.sizes.slots, res.steps, path,
                        f"{ob.obligation}: {what}, minimal within {bound}")
    except ReplayMismatch as exc:
        return Outcome("replay mismatch", str(exc))
    result = "proved" if ob.expected == "proved" else "counterexample"
    size = f"{res.sizes}, {res.depth} events"
    return Outcome(result, f"{size}: {detail}" if detail else size, str(path))


def _counterexample(ob: Obligation, st: Settings) -> Outcome:
    inv = ob.arg
    return _found(ob, st, violates(inv),
                  lambda v, t, s, steps, path, note: export_violation(v, t, s, steps, inv, path, note),
                  f"violation of {inv}", 2 if inv in RELATIONAL else 1)


def _explored(ob: Obligation, st: Settings) -> Outcome:
    """A counterexample from proofs/explore.py (the shortest at EXPLORE_SIZE), exported
    through the same replay as the solver's."""
    from proofs.explore import explore
    v, inv = ALL_VARIANTS[ob.variant], ob.arg
    res = explore(v, invariants=[inv], check_liveness=False, **EXPLORE_SIZE)
    size = "T={ranks} N={requests} steps<={steps} S={slots}".format(**EXPLORE_SIZE)
    path = res.violations.get(inv)
    if path is None:
        return Outcome("none found", f"no violation of {inv} at {size} ({res.states} states)")
    out = _trace_path(ob, st)
    try:
        detail = export_violation(v, EXPLORE_SIZE["ranks"], EXPLORE_SIZE["slots"], path, inv, out,
                                  f"{ob.obligation}: shortest violation of {inv} by explicit-state "
                                  f"search at {size}")
    except ReplayMismatch as exc:
        return Outcome("replay mismatch", str(exc))
    return Outcome("counterexample", f"{size}, {len(path)} events (explicit-state search): {detail}",
                   str(out))


def _lasso(ob: Obligation, st: Settings) -> Outcome:
    if ob.arg == "room0":        # a genuine room 0, every field landed everywhere
        extra = lambda c, s, r: z3.And([z3.And(c.room(r) == 0, s.lr(k, r), s.lp(k, r))
                                        for k in c.elems["Rank"]])
    else:                        # a real room (the impl refuses room 0) that never lands
        extra = lambda c, s, r: c.room(r) != 0
    return _found(ob, st, stutter_goal(extra), export_lasso, "lasso")


def _commit_goal(c, s) -> z3.BoolRef:
    return z3.Or([z3.And(s.dec(k, r), s.commit(k, r)) for k in c.elems["Rank"] for r in c.elems["Req"]])


def _gate_holds_goal(c, s) -> z3.BoolRef:
    return z3.Or([z3.And(s.inq(k, r), s.recv(k, r) == SUCCESS,
                         gated_poll(c.variant, s.recv(k, r), s.seen(k, r), c.room(r), s.age(k, r),
                                    Z3OPS) == TRANSFERRING)
                  for k in c.elems["Rank"] for r in c.elems["Req"]])


class _BoundLowered:
    """A context whose variant's timeout is one less: bounded_wait read one step tighter."""
    def __init__(self, ctx) -> None:
        self._ctx = ctx
        self.variant = replace(ctx.variant, timeout_steps=ctx.variant.timeout_steps - 1)

    def __getattr__(self, name: str):
        return getattr(self._ctx, name)


def _bound_reached_goal(c, s) -> z3.BoolRef:
    """The encoded bounded_wait broken at T - 1: some request queued for T held steps."""
    return z3.Not(PREDICATES["bounded_wait"](_BoundLowered(c), s))


WITNESS_GOALS = {"commit": _commit_goal, "gate-holds": _gate_holds_goal}


def _witness(ob: Obligation, st: Settings) -> Outcome:
    """A reachable commit or held gate, replayed on the spec."""
    return _found(ob, st, WITNESS_GOALS[ob.arg], lambda *a: export_witness(*a) or "",
                  f"reachable {ob.arg}")


def _bound_reached(ob: Obligation, st: Settings) -> Outcome:
    """A request queued for exactly the liveness bound T, replayed on the spec: the bound
    the liveness row proves is tight (an encoding stating a looser bound than the proof's
    T finds no such run). One rank and request suffice (T + 2 events), so the search
    stays there and needs no proved facts: a second either way."""
    return _found(ob, st, _bound_reached_goal, lambda *a: export_witness(*a) or "",
                  "run keeping a request queued for T held steps", facts=False, largest=Sizes(1, 1, 1))


def _premises(ob: Obligation, st: Settings) -> Outcome:
    v = ALL_VARIANTS[ob.variant]
    bundles = [SLOT_LEMMAS] + [bundle(v, n) for n in PROVED.get(ob.variant, ())]
    if v.timeout_steps is not None:
        bundles.append(BUNDLES["bounded_wait"])
    bad = []
    for names in bundles:
        bad += [f"{names[0]} / {q}" for q in premises(v, names, timeout_ms=st.timeout_ms).failures("sat")]
    if bad:
        return Outcome("vacuous", "; ".join(bad))
    return Outcome("proved", f"{len(bundles)} invariants x 7 actions satisfiable at T=2 N=2 S=2")


CTI_SIZES = Sizes(2, 2, 2)     # the sorts' bound for the sat searches (Ctx.at_most)
# The exact universes a negative induction row tries before that bound (one rank
# first, skipped for the invariants that compare ranks).
CTI_UNIVERSES = (Sizes(1, 1, 1), Sizes(2, 1, 1), Sizes(2, 2, 1))


def _cti_for(v: Variant, names: list[str], log, st: Settings) -> str:
    """A failed proof, made concrete: the first failing action's CTI, searched with the
    sorts bounded (as the negative rows do), so a timeout still shows what breaks."""
    for label, r in log.queries:
        if r.status == "sat" or (r.status == "unknown" and label != "init"):
            found = check_step(v, names, st.timeout_ms, only=[label], at_most=CTI_SIZES, describe=True)
            for _, res in found.queries:
                if res.status == "sat":
                    return f"; {label}: {res.reason}"
    return ""


def _not_inductive(ob: Obligation, st: Settings) -> Outcome:
    """The broken invariant with every fact proved for the variant: some action takes a
    state satisfying them all to one that breaks them, shown as a concrete CTI."""
    facts = proved_facts(ob.variant, st.timeout_ms)
    # the liveness bundle's lemmas, where the variant has them (deferred-local's queues
    # may diverge: a CTI breaking queues_identical would say nothing about the wait)
    extra = [n for n in BUNDLES["bounded_wait"][1:] if n in facts or n == "recv_range"
             or "queues_identical" in facts] if ob.arg == "bounded_wait" else []
    names = [ob.arg] + [n for n in (*extra, *facts) if n != ob.arg]
    names = list(dict.fromkeys(names))
    v = ALL_VARIANTS[ob.variant]
    # Exact small universes first, smallest first (the quantifiers range over a few
    # named elements: a CTI in a fraction of a second, where the at-most query's
    # quantifier search over fresh elements takes seconds, its time varying several-fold
    # with the solver's state); then the at-most query, whose log decides the rest.
    searches = [dict(universe=u) for u in CTI_UNIVERSES[ob.arg in RELATIONAL:]]
    for search in [*searches, dict(at_most=CTI_SIZES)]:
        log = check_step(v, names, st.timeout_ms, describe=True, **search)
        found = [r for _, r in log.queries if r.status == "sat"]
        if found:
            return Outcome("not inductive", found[0].reason)
    unknown = log.failures("unsat")
    if unknown:
        return Outcome("unknown", "; ".join(unknown))
    return Outcome("inductive", f"every action unsat with {', '.join(names)}")


def _consistent(ob: Obligation, st: Settings) -> Outcome:
    names = list(proved_facts(ob.variant, st.timeout_ms))
    log = consistent(ALL_VARIANTS[ob.variant], names, CTI_SIZES, st.timeout_ms)
    bad = log.failures("sat")
    if bad:
        return Outcome("inconsistent", "; ".join(bad))
    return Outcome("proved", f"{len(log.queries)} actions: guard and side axioms satisfiable "
                   f"with the proved facts ({len(names)}), unbounded sorts")


def _refines(ob: Obligation, st: Settings) -> Outcome:
    from proofs.refinement import refinement
    ok, detail = refinement(ALL_VARIANTS[ob.variant])
    return Outcome("proved" if ok else "refinement mismatch", detail)


def _crosscheck(ob: Obligation, st: Settings) -> Outcome:
    from proofs.crosscheck import crosscheck
    return crosscheck(ob.variant, PROVED.get(ob.variant, ()))


# (seconds, step floor) pairs the deployed conversion is checked on: whole, fractional
# and sub-floor counts, a floor above the timeout, and the defaults' order of magnitude
DEPLOYED_CASES = ((30.0, 0.001), (0.0005, 0.001), (0.0025, 0.001), (1.0, 0.3), (7.0, 7.0),
                  (0.3, 0.1), (1e6, 1e-3))


def _deployed(ob: Obligation, st: Settings) -> Outcome:
    """The timeouts as deployed (model/spec/timeouts.py: seconds -> an agreed step count)
    are what the liveness rows assume, T >= 1, and the least count of steps of at least
    the floor that lasts the configured seconds (never early, one step late at most);
    bad settings are refused."""
    bad = []
    for seconds, floor in DEPLOYED_CASES:
        n = steps_for(seconds, floor)
        if n < 1 or n * floor < seconds * (1 - 1e-9) or (n > 1 and (n - 1) * floor >= seconds):
            bad.append(f"steps_for({seconds:g}, {floor:g}) = {n}")
    for args in ((0.0,), (-1.0,), (float("nan"),), (float("inf"),), (1.0, 0.0), (1e300, 1e-300)):
        try:
            bad.append(f"steps_for{args} = {steps_for(*args)} (not refused)")
        except ValueError:
            pass
        except (ArithmeticError, TypeError) as exc:      # refused, but not as a ValueError
            bad.append(f"steps_for{args} raised {type(exc).__name__}")
    v = deployed_variant(ob.variant)
    if v.timeout_steps is not None and v.timeout_steps != steps_for(GATE_TIMEOUT_S, STEP_FLOOR_S):
        bad.append(f"{ob.variant}'s deployed timeout is {v.timeout_steps} steps")
    if v.release_timeout_steps is not None and \
            v.release_timeout_steps != steps_for(RELEASE_TIMEOUT_S, STEP_FLOOR_S):
        bad.append(f"{ob.variant}'s deployed release timeout is {v.release_timeout_steps} steps")
    if bad:
        return Outcome("wrong conversion", "; ".join(bad))
    return Outcome("proved", f"{len(DEPLOYED_CASES)} conversions least and >= 1 step, bad settings "
                             f"refused, timeout {v.timeout_steps} release {v.release_timeout_steps}")


def needs_facts(ob: Obligation) -> bool:
    """The row reads proved_facts (assumes them or names them)."""
    return ob.check in (_counterexample, _lasso, _witness, _not_inductive, _consistent)


# -- the list -------------------------------------------------------------------------------
def obligations() -> list[Obligation]:
    out: list[Obligation] = []
    for name in VARIANTS:
        out.append(Obligation("lemma:slots", name, "proved", True, _inductive, "slots"))
        for inv in SAFETY_NAMES:
            if inv in PROVED[name]:
                out.append(Obligation(f"safety:{inv}", name, "proved", True, _inductive, inv))
            else:
                # the deferred variants' breaks that go through a held slot
                deep = (inv in RELATIONAL and VARIANTS[name].defer_failed is not Deferral.NONE)
                out.append(Obligation(f"cex:{inv}", name, "counterexample", False,
                                      _explored if deep else _counterexample, inv))
                out.append(Obligation(f"induction:{inv}", name, "not inductive", True, _not_inductive, inv))
        if VARIANTS[name].timeout_steps is not None:
            out.append(Obligation("liveness:bounded_wait", name, "proved", True, _inductive, "bounded_wait"))
        else:             # no timeout: a request the gate holds (or retries) forever
            out.append(Obligation("liveness:bounded_wait", name, "counterexample", False, _lasso,
                                  "never-lands"))
            out.append(Obligation("induction:bounded_wait", name, "not inductive", True,
                                  _not_inductive, "bounded_wait"))
        out.append(Obligation("nonvacuous:premises", name, "proved", False, _premises))
        out.append(Obligation("nonvacuous:commit", name, "proved", False, _witness, "commit"))
        if VARIANTS[name].gate.value != "none":
            out.append(Obligation("nonvacuous:gate-holds", name, "proved", False, _witness, "gate-holds"))
        out.append(Obligation("bmc-crosscheck", name, "proved", False, _crosscheck, slow=True))
    # what the liveness rows assume of the deployed timeouts, and that their bound is tight
    for name in ("strict", "deferred"):
        out.append(Obligation("deployed:timeouts", name, "proved", False, _deployed))
    out.append(Obligation("nonvacuous:bound-reached", "strict", "proved", False, _bound_reached))
    out.append(Obligation("liveness:bounded_wait room=0", "gate", "counterexample", False, _lasso, "room0"))
    # strict minus one mechanism: each one is needed.
    for ablation in ("strict-no-room-order", "strict-no-fence"):
        out.append(Obligation("cex:no_corruption", ablation, "counterexample", False,
                              _counterexample, "no_corruption"))
        out.append(Obligation("induction:no_corruption", ablation, "not inductive", True,
                              _not_inductive, "no_corruption"))
    out.append(Obligation("safety:outcomes_agree", "strict-no-fence", "proved", True, _inductive,
                          "outcomes_agree"))
    out.append(Obligation("liveness:bounded_wait", "strict-no-timeout", "counterexample", False,
                          _lasso, "never-lands"))
    out.append(Obligation("induction:bounded_wait", "strict-no-timeout", "not inductive", True,
                          _not_inductive, "bounded_wait"))
    # agreed admission is needed: strict's quarantine is per rank
    out.append(Obligation("cex:queues_identical", "strict-local-admission", "counterexample", False,
                          _counterexample, "queues_identical"))
    out.append(Obligation("induction:queues_identical", "strict-local-admission", "not inductive",
                          True, _not_inductive, "queues_identical"))
    # the free order is not needed: SGLang's set order proves the same (the unbounded
    # encoding takes any free slot, so no proof reads the order)
    for inv in SAFETY_NAMES:
        out.append(Obligation(f"safety:{inv}", "strict-set-order", "proved", True, _inductive, inv))
    out.append(Obligation("liveness:bounded_wait", "strict-set-order", "proved", True, _inductive,
                          "bounded_wait"))
    # The symbolic actions against the spec, on every small reachable state: a change
    # to a mechanism in model/spec flips this row without model/encoding being touched.
    for name in ALL_VARIANTS:
        out.append(Obligation("consistent:actions", name, "proved", True, _consistent))
        out.append(Obligation("refines:spec", name, "proved", False, _refines))
    from proofs.agreement import iteration_obligations     # the decode iteration's rows
    from proofs.pipeline import pipeline_obligations       # pipeline parallel's (pp-*)
    from proofs.clocks import clock_obligations             # per-rank clocks' rows
    return out + iteration_obligations() + pipeline_obligations() + clock_obligations()


def run_obligation(ob: Obligation, st: Settings) -> Outcome:
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        out = ob.check(ob, st)
    except z3.Z3Exception as exc:
        out = Outcome("solver error", str(exc))
    except Exception as exc:        # a bug in a check: one row says so, the run goes on
        out = Outcome("error", f"{type(exc).__name__}: {exc}")
    out.seconds, out.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return out
