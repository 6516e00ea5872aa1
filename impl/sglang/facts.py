"""``pdgate conform --facts``: every source reader on each release, against the variants
that model it: the decode iteration's points and its offload manager
(impl/sglang/iteration_facts.py), prefill's queues (same), pipeline parallel
(impl/sglang/pp_facts.py) and the wall-clock timeouts (impl/sglang/clock_facts.py).
A reading of the code with ``ast``, not a run of it (``--points`` and ``--pp`` run it).
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from impl.sglang import clock_facts, iteration_facts as it, pp_facts

# family -> (the variant(s) modelling a release, what its source does that they do not)
FAMILIES: dict[str, tuple[Callable[[str], str], Callable[..., list[str]]]] = {
    "decode": (lambda v: it.MODELLED_BY[v], it.release_mismatches),
    "offload": (lambda v: it.MODELLED_BY[v], it.offload_mismatches),
    "prefill": (lambda v: it.PREFILL_MODELLED_BY[v], it.prefill_mismatches),
    "pp": (lambda v: "/".join(pp_facts.MODELLED_BY[v]), pp_facts.release_mismatches),
    "clocks": (lambda v: clock_facts.MODELLED_BY[v], clock_facts.release_mismatches),
}
_NOT_WITH_FACTS = ("points", "pp", "swap", "patch", "deferred", "emit_diff", "local_release",
                   "reorder_rooms", "reads", "variant", "seed", "random", "trace")


def check(versions: list[str], source: str | None = None) -> list[dict]:
    """One row per (release, family): ``matches`` or ``differs`` with the facts that do."""
    rows = []
    for version in versions:
        for family, (variant, mismatches) in FAMILIES.items():
            found = mismatches(version, source)
            rows.append({"release": version, "family": family, "variant": variant(version),
                         "verdict": "differs" if found else "matches", "mismatches": found})
    return rows


def _args(args: Any) -> list[str]:
    """The releases ``args`` ask for; ValueError (one line) otherwise."""
    from impl.sglang.conform import _versions
    given = [f"--{n.replace('_', '-')}" for n in _NOT_WITH_FACTS if getattr(args, n, None)]
    if given:
        raise ValueError(f"--facts does not combine with {', '.join(given)}")
    versions = _versions(args.sglang)
    unknown = [v for v in versions if any(v not in m for m in (it.MODELLED_BY, it.PREFILL_MODELLED_BY,
                                                                 pp_facts.MODELLED_BY, clock_facts.MODELLED_BY))]
    if unknown:
        raise ValueError(f"--facts: no variants model {', '.join(unknown)} (modelled: {', '.join(it.MODELLED_BY)})")
    if args.source is not None and len(versions) != 1:
        raise ValueError("--source names one release's source: give one --sglang release")
    return versions


def run_facts(args: Any) -> int:
    """The table; exit 1 where a release's source does what its variant does not model,
    2 on bad input."""
    from pathlib import Path
    from impl.sglang.points import report
    from impl.sglang.wheels import MissingRelease
    try:
        versions = _args(args)
        if args.source is not None and not Path(args.source).is_dir():
            raise ValueError(f"--source: {args.source} is not a directory")
        if args.json:
            Path(args.json).open("a", encoding="utf-8").close()      # writable before any work
        rows = check(versions, args.source)
    except (ValueError, MissingRelease, OSError, SyntaxError) as exc:
        msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        print(f"pdgate conform: {msg}", file=sys.stderr)
        return 2
    lines = [f"{r['release']:<8} {r['family']:<8} {r['variant']:<28} "
             + ("matches" if not r["mismatches"] else "differs: " + "; ".join(r["mismatches"])) for r in rows]
    return report(rows, lines, args.json)
