"""``pdgate simulate``: one variant, or ``--compare`` several on common random numbers."""
from __future__ import annotations

import argparse
import os
from typing import Any

from dataclasses import replace

from model.spec.variants import VARIANTS
from sim import calibrated
from sim.compare import cost_line, ttft_cost
from sim.config import SimConfig
from sim.dists import parse_dist
from sim.engine import Simulation, trace_writer, traced_variant
from sim.rundata import RunData
from sim.hazard import HAZARD_COLUMNS, hazard_line, summarize_hazard
from sim.errors import SimCutShort, SimInputError, check_writable, run_reporting
from sim.options import add_model_arguments, build_config, build_workload, nonneg_int, positive_int
from sim.results import divergence_line, dumps, step_note, summarize, table
from sim.workload import Workload

PROG = "pdgate simulate"
IDEAL = "ideal"   # --compare's extra reference run (ideal_config)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", default="gate", help=f"one of {', '.join(VARIANTS)}")
    p.add_argument("--compare", metavar="V1,V2,..",
                   help="run these variants on identical draws; the first is the baseline")
    p.add_argument("--ranks", type=positive_int, default=8, help="TP ranks of the decode worker")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--replications", type=positive_int, default=5,
                   help="--compare / --hazard: seeds seed..seed+R-1, for the confidence interval")
    p.add_argument("--hazard", action="store_true",
                   help="run each variant (--compare's, default all) until its first invariant "
                        "break, --replications times: requests and seconds until the break")
    add_model_arguments(p)
    calibrated.add_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    o.add_argument("--trace", metavar="PATH",
                   help="write the run in the spec's trace format (--compare: PATH.VARIANT)")
    o.add_argument("--perfetto", metavar="PATH", help="Chrome/Perfetto trace JSON, a track per rank")
    o.add_argument("--plot", metavar="DIR", help="PNG CDFs of TTFT and gate delay")
    o.add_argument("--no-wall-clock", action="store_true",
                   help="write wall_seconds as null, so same-seed outputs are byte-identical")


def _trace_path(path: str, variant: str, several: bool) -> str:
    if not several:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.{variant}{ext or '.ndjson'}"


def ideal_config(cfg: SimConfig) -> SimConfig:
    """The reference for the gate's cost: ungated with every metadata row visible the
    moment its KV lands (so it cannot diverge), on the same draws otherwise."""
    zero = parse_dist("const:0", "--metadata-lag")
    return replace(cfg, variant="ungated", timeout_steps=None, gate_timeout_s=None,
                   release_timeout_s=None, no_clear=False,
                   metadata_lag=(zero,) * cfg.ranks, lost_metadata_prob=0.0, late_write=None)


def simulate_one(args: argparse.Namespace, variant: str, seed: int, trace_path: str | None,
                 record: bool, several: bool = False, workload: Workload | None = None) -> RunData:
    """One run with the flags' model (variant "ideal": see ideal_config); ``trace_path``
    gets the spec trace."""
    cfg = build_config(args, "ungated" if variant == IDEAL else variant, args.ranks,
                       args.metadata_lag, seed, several)
    if variant == IDEAL:
        cfg = ideal_config(cfg)
    if workload is None:
        workload = build_workload(args, args.rate, seed)
    if trace_path is None:
        return Simulation(cfg, workload, record_spans=record).run()
    traced_variant(cfg)             # refused before the file is created
    try:
        fp = open(trace_path, "w", encoding="utf-8")
    except OSError as exc:
        raise SimInputError(f"--trace: cannot write {trace_path}: {exc.strerror}") from None
    with fp:
        writer = trace_writer(fp, cfg, f"pdgate simulate seed={seed}", workload=workload.source)
        return Simulation(cfg, workload, trace=writer, record_spans=record).run()


def check_outputs(args: argparse.Namespace, names: list[str]) -> None:
    """Every output path is checked before any work (not after a long run)."""
    several = args.compare is not None
    for n in names + ([IDEAL] if several else []):
        if args.trace:
            check_writable(_trace_path(args.trace, n, several), "--trace")
    check_writable(args.json, "--json")
    check_writable(args.perfetto, "--perfetto")
    check_writable(args.plot, "--plot", directory=True)


def _variants(args: argparse.Namespace) -> list[str]:
    names = [n.strip() for n in (args.compare or args.variant).split(",") if n.strip()]
    flag = "--compare" if args.compare else "--variant"
    if not names:
        raise SimInputError(f"{flag}: name at least one variant")
    for n in names:
        if n not in VARIANTS:
            raise SimInputError(f"{flag}: unknown variant {n!r} (known: {', '.join(VARIANTS)})")
    if len(set(names)) != len(names):
        raise SimInputError(f"{flag}: a variant is named twice")
    return names


def _write(path: str, text: str, flag: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as fp:
            fp.write(text)
    except OSError as exc:
        raise SimInputError(f"{flag}: cannot write {path}: {exc.strerror}") from None


def _hazard(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """--hazard: each variant's first break over --replications independent seeds."""
    runs: dict[str, list[RunData]] = {n: [] for n in names}
    workload = None
    for rep in range(args.replications):
        if rep == 0 or not args.trace_in:
            workload = build_workload(args, args.rate, args.seed + rep)
        for n in names:
            runs[n].append(simulate_one(args, n, args.seed + rep, None, False, True, workload))
    rows = [row for n in names for row in summarize_hazard(n, runs[n])]
    print(table(rows, HAZARD_COLUMNS))
    for row in rows:
        print(hazard_line(row, len(workload)))
    print(step_note(runs[names[0]][0]))
    if args.plot:
        from sim.outputs import write_hazard_plot
        print(f"wrote {write_hazard_plot(args.plot, runs, len(workload))}")
    out = {"hazard": rows, "requests": len(workload), "workload": workload.source}
    if args.json:
        _write(args.json, dumps(out), "--json")
    return out


MAX_REPLICATIONS = 10_000


def execute(args: argparse.Namespace) -> dict[str, Any]:
    if args.replications > MAX_REPLICATIONS:
        raise SimInputError(f"--replications: at most {MAX_REPLICATIONS}, got {args.replications}")
    if args.hazard and not args.compare:
        args.compare = ",".join(VARIANTS)
    names = _variants(args)
    calibrated.check_flags(args)
    several = args.compare is not None
    reps = args.replications if several else 1
    record = bool(args.perfetto)
    check_outputs(args, names)
    for n in names:     # bad flags are refused before any trace is read or run started
        build_config(args, n, args.ranks, args.metadata_lag, args.seed, several)
    if args.hazard:
        if args.trace or args.perfetto:
            raise SimInputError("--hazard: writes no --trace or --perfetto (run one variant for those)")
        return _hazard(args, names)
    runs: dict[str, list[RunData]] = {n: [] for n in names + ([IDEAL] if several else [])}
    for rep in range(reps):
        # a replay is read once (it does not depend on the seed); synthetic load per seed
        if rep == 0 or not args.trace_in:
            workload = build_workload(args, args.rate, args.seed + rep)
        for n in runs:
            path = _trace_path(args.trace, n, several) if args.trace and rep == 0 else None
            runs[n].append(simulate_one(args, n, args.seed + rep, path, record and rep == 0,
                                        several, workload))
    wall = not args.no_wall_clock
    summaries = [summarize(runs[n][0], wall) for n in names]
    print(table(summaries))
    info = workload.info
    if info:
        print(f"replay: {info['requests']} requests of {info['format']} trace {args.trace_in}"
              + (f" (--requests truncates: the trace has more rows)" if info["truncated_by_requests"] else "")
              + (f", window {info['window_s'][0]:g}-{info['window_s'][1]:g} s" if info["window_s"] else "")
              + (f", time scale {info['time_scale']:g}" if info["time_scale"] != 1 else "")
              + f", {info['failed_rows']} failed rows (0 output tokens) replayed as failed transfers"
              + f", prefix-cache hit rate {info['prefix_hit_rate']:.1%} of prompt tokens")
    print(step_note(runs[names[0]][0]))
    for s in summaries:
        line = divergence_line(s)
        if line:
            print(line)
        if s["stuck"]:
            print(f"{s['variant']}: {s['stuck']} request(s) can never leave (bounded_wait: "
                  f"no timeout frees them); the run stopped at t={s['sim_seconds']:.3f} s")
    out: dict[str, Any] = summaries[0] if not several else {"compare": summaries}
    if several:
        base = names[0]
        if any(r.divergence for r in runs[base]):
            print(f"note: {base} diverged, so only its requests committed before that pair up; "
                  f"the ideal reference below is the gate's full price")
        costs = []
        for n in names[1:]:
            cost = ttft_cost(runs[n], runs[base])
            costs.append({"variant": n, "baseline": base, **cost})
            print(cost_line(n, base, cost))
        ideal = runs[IDEAL][0]
        if any(r.divergence for r in runs[IDEAL]):
            print("note: the ideal reference diverged too (failures with no metadata on a rank)")
        for n in names:
            if n == "ungated":
                continue
            cost = ttft_cost(runs[n], runs[IDEAL])
            costs.append({"variant": n, "baseline": "ideal", **cost})
            print(cost_line(n, "ideal (ungated, metadata visible with its KV)", cost))
        out["ttft_cost"] = costs
        out["ideal_reference"] = summarize(ideal, wall)
    firsts = [runs[n][0] for n in names]
    if args.perfetto:
        from sim.outputs import write_perfetto
        write_perfetto(args.perfetto, firsts)
    if args.plot:
        from sim.outputs import write_plots
        for path in write_plots(args.plot, firsts, runs[IDEAL][0] if several else None):
            print(f"wrote {path}")
    if args.json:
        _write(args.json, dumps(out), "--json")
    cut = [f"{s['variant']}: {s['cut_short']}" for s in summaries if s["cut_short"]]
    if cut:
        raise SimCutShort("; ".join(cut))
    return out


def run(args: argparse.Namespace) -> int:
    return run_reporting(PROG, execute, args)
