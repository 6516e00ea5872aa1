"""Simulator speed and memory (issue: SimPy reference simulator).

Figures:
- protocol steps (the spec's Step, all ranks polling a non-empty queue) and rank-steps
  (steps x ranks) per wall second of a whole loaded 8-rank simulation, environment
  events included; scheduler steps/s counts every decode loop iteration;
- the wall time of a one-hour, ~12 k request workload at 8 ranks and the ratio of
  simulated to wall time;
- bytes per request in flight: tracemalloc's peak during a run with thousands of
  requests in flight, over the peak number in flight (spec state, SimPy events and
  the simulator's own bookkeeping; the up-front per-request draws are excluded);
- the spec's apply(Step) alone at 8 ranks and 4 queued requests;
- requests per wall second at 8 ranks (gate) replaying the Mooncake conversation sample
  (sim/data, 1,000 real requests) and on generated Poisson load (4 req/s, default
  lengths), by the fast schedule and, in the same run, by the eager one (a SimPy event
  per delivery batch and per scheduler action, the schedule before the fast one; both
  run on the spec's packed state); with ``PDGATE_BENCH_BEFORE=DIR`` (a checkout of an
  older pdgate, e.g. ``git archive b44bea5 | tar -x -C DIR``), also that tree's simulator on
  the same loads, interleaved with this one's in the same run (each tree's runs in
  fresh subprocesses): requests per CPU second ``*_before`` and this tree's ratio to
  it; where the simulator is compiled (``simulator_compiled``, setup.py), also this
  tree's source (PDGATE_PURE=1) in the same way: ``*_source`` and the compiled build's
  ratio to it. Recorded before issue 11 item 5 (b44bea5, this 2-core machine): ~6,100
  (Mooncake) and ~6,200 (Poisson) requests per wall second; before the packed state
  (ef1485a): ~11,000 and ~12,000; from source at 2b48376: 16,500-22,000 and
  17,800-23,700; compiled: 24,700-38,600 and 25,500-42,500; the goal is 20,000;
- the trace reader: rows per second and peak traced memory streaming a generated
  Azure-2024-format CSV (the memory must not grow with the file).
"""
from __future__ import annotations

import gc
import time
import tracemalloc

from model import _native
from model.spec import Enqueue, Step, apply, get_variant, initial_state
from sim.config import SimConfig
from sim.dists import parse_dist
from sim.draws import draw, stream
from sim.engine import Simulation
from sim.workload import synthetic

TARGETS = {
    "mooncake_requests_per_s_8_ranks": (">=", 20_000),
    "poisson_requests_per_s_8_ranks": (">=", 20_000),
    "trace_read_peak_mb": ("<=", 8),
    "rank_steps_per_s": (">=", 150_000),
    "steps_per_s_8_ranks": (">=", 20_000),
    "hour_trace_wall_s": ("<=", 10.0),
    "bytes_per_inflight_request": ("<=", 1024),
}


def _workload(n: int, rate: float, seed: int = 0, inp: str = "lognormal:7,0.8",
              out: str = "lognormal:5,0.8"):
    return synthetic(stream(seed, "workload"), n, rate, 1.0, parse_dist(inp, "--input-len"),
                     parse_dist(out, "--output-len"))


def _timed(cfg: SimConfig, wl) -> tuple:
    """(run data, wall seconds, CPU seconds): CPU time shows the cost on a shared machine."""
    sim = Simulation(cfg, wl)
    t0, c0 = time.perf_counter(), time.process_time()
    data = sim.run()
    return data, time.perf_counter() - t0, time.process_time() - c0


def _loaded(quick: bool) -> dict:
    """8 ranks, a busy worker: short forward passes, requests arriving all the time."""
    cfg = SimConfig(variant="gate", ranks=8, forward=parse_dist("const:5", "--forward"))
    data, wall, cpu = _timed(cfg, _workload(2000 if quick else 10_000, 40.0))
    return {"steps_per_s_8_ranks": round(data.protocol_steps / wall),
            "rank_steps_per_s": round(data.protocol_steps * 8 / wall),
            "steps_per_cpu_s_8_ranks": round(data.protocol_steps / cpu),
            "scheduler_steps_per_s_8_ranks": round(data.decode_steps / wall),
            "loaded_protocol_steps": data.protocol_steps}


def _hour(quick: bool) -> dict:
    """~12 k requests over one simulated hour at 8 ranks (Mooncake conversation size)."""
    n = 1200 if quick else 12_000
    cfg = SimConfig(variant="gate", ranks=8)
    wl = _workload(n, 12_000 / 3600.0, inp="lognormal:8,0.9")
    data, wall, cpu = _timed(cfg, wl)
    scale = 12_000 / n
    return {"hour_trace_requests": n, "hour_trace_sim_s": round(data.sim_ms / 1000, 1),
            "hour_trace_wall_s": round(wall * scale, 3),
            "hour_trace_cpu_s": round(cpu * scale, 3),
            "sim_to_wall_ratio": round(data.sim_ms / 1000 / wall),
            "hour_trace_diverged": data.divergence is not None}


def _traced_peak(cfg: SimConfig, wl) -> tuple:
    draws = draw(cfg, wl)          # the per-request draws (a few chunks kept) are not in flight
    gc.collect()
    tracemalloc.start()
    sim = Simulation(cfg, wl, draws=draws)
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    data = sim.run()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return data, peak - base


def _memory(quick: bool) -> dict:
    """A flood of long-running requests (most decoding, some transferring at 8 ranks);
    and the worst case: every request held in the 8 ranks' transfer queues by a long lag
    (there the spec's per-rank bookkeeping is the cost)."""
    n = 6000 if quick else 20_000
    cfg = SimConfig(variant="gate", ranks=8, request_pool=n, prefill_servers=4096,
                    forward=parse_dist("const:25", "--forward"))
    data, peak = _traced_peak(cfg, _workload(n, 2000.0, out="const:2000"))
    n_q = 3000
    cfg_q = SimConfig(variant="gate", ranks=8, request_pool=n_q, slots=n_q,
                      idle_step=parse_dist("const:25", "--idle-step"),
                      metadata_lag=(parse_dist("const:3000", "--metadata-lag"),) * 8)
    data_q, peak_q = _traced_peak(cfg_q, _workload(n_q, 10_000.0, inp="const:100"))
    return {"peak_in_flight": data.peak_in_flight,
            "bytes_per_inflight_request": round(peak / data.peak_in_flight),
            "peak_queued_8_ranks": data_q.peak_in_flight,
            "bytes_per_queued_request_8_ranks": round(peak_q / data_q.peak_in_flight)}


# Simulations of one of ``_throughput``'s loads by a checkout's own code, in a fresh
# subprocess (PDGATE_BENCH_BEFORE's, and this tree's alike, so that neither side runs in
# a process with other runs in it): prints the least CPU seconds of three runs (the first
# run of a process pays the interpreter's warm-up, most of a 1,000-request replay).
_ONE_RUN = """
import sys, time
from sim.config import SimConfig
from sim.engine import Simulation
from sim.workload import load_trace
from bench.bench_sim import _workload
name, n, sample = sys.argv[1], int(sys.argv[2]), sys.argv[3]
wl = load_trace(sample) if name == "mooncake" else _workload(n, 4.0)
best = float("inf")
for _ in range(3):
    sim = Simulation(SimConfig(variant="gate", ranks=8), wl)
    c0 = time.process_time()
    sim.run()
    best = min(best, time.process_time() - c0)
print(best)
"""


TREE_RUN_TIMEOUT_S = 600      # three runs of one load: seconds each on any tree so far


def _before_tree() -> str | None:
    """PDGATE_BENCH_BEFORE, checked before any run: a pdgate checkout, or unset."""
    import os
    from bench.cli import BenchInputError
    tree = os.environ.get("PDGATE_BENCH_BEFORE")
    if tree is None:
        return None
    if not tree or not os.path.isfile(os.path.join(tree, "sim", "engine.py")):
        raise BenchInputError(f"PDGATE_BENCH_BEFORE: {tree!r} is not a pdgate checkout "
                              f"(no sim/engine.py there)")
    return os.path.abspath(tree)      # its subprocesses run from there


def _tree_cpu(tree: str, name: str, n: int, sample: str, source: bool = False) -> float:
    """CPU seconds of ``tree``'s simulator on load ``name`` (its code, the same load; with
    ``source``, its modules' source even where they are compiled: PDGATE_PURE=1); a
    tree whose runs fail or take over TREE_RUN_TIMEOUT_S is a BenchInputError."""
    import os
    import subprocess
    import sys
    from bench.cli import BenchInputError
    env = {**os.environ, "PYTHONPATH": tree, "PDGATE_PURE": "1" if source else ""}
    try:
        done = subprocess.run([sys.executable, "-c", _ONE_RUN, name, str(n), sample], cwd=tree,
                              env=env, capture_output=True, text=True, timeout=TREE_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise BenchInputError(f"{tree}: the {name} runs took over {TREE_RUN_TIMEOUT_S} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise BenchInputError(f"{tree}: its simulator failed on the {name} load: {last}")
    return float(done.stdout.split()[-1])


def _throughput(quick: bool) -> dict:
    """Requests per wall second (best of 5, or 2 with --quick: a Mooncake run takes ~0.1
    s, and single runs on a shared machine vary by up to 2x), fast vs eager schedule (and
    PDGATE_BENCH_BEFORE's tree, see the module doc) interleaved in the same run, so load
    changes hit all; the ratios from CPU time (less noisy when shared)."""
    from pathlib import Path
    from sim.workload import load_trace
    here = str(Path(__file__).resolve().parents[1])      # this tree, for its own subprocesses
    sample = str(Path(here) / "sim" / "data" / "mooncake_conversation_head1000.jsonl")
    n_poisson = 2000 if quick else 10_000
    loads = {"mooncake": load_trace(sample), "poisson": _workload(n_poisson, 4.0)}
    before = _before_tree()
    compiled = _native.compiled()
    out: dict = {"simulator_compiled": compiled}
    cfg = SimConfig(variant="gate", ranks=8)
    for name, wl in loads.items():
        walls: dict[bool, list[float]] = {False: [], True: []}
        cpus: dict[bool, list[float]] = {False: [], True: []}
        before_cpus: list[float] = []
        after_cpus: list[float] = []          # this tree, in subprocesses like the before tree's
        source_cpus: list[float] = []         # this tree's source, where it is compiled
        for _ in range(2 if quick else 5):
            for eager in (False, True):
                sim = Simulation(cfg, wl, eager=eager)
                t0, c0 = time.perf_counter(), time.process_time()
                sim.run()
                walls[eager].append(time.perf_counter() - t0)
                cpus[eager].append(time.process_time() - c0)
            if before or compiled:
                after_cpus.append(_tree_cpu(here, name, n_poisson, sample))
            if before:
                before_cpus.append(_tree_cpu(before, name, n_poisson, sample))
            if compiled:
                source_cpus.append(_tree_cpu(here, name, n_poisson, sample, source=True))
        out[f"{name}_requests_per_s_8_ranks"] = round(len(wl) / min(walls[False]))
        out[f"{name}_requests_per_s_8_ranks_eager"] = round(len(wl) / min(walls[True]))
        out[f"{name}_requests_per_cpu_s_8_ranks"] = round(len(wl) / min(cpus[False]))
        out[f"{name}_speedup_vs_eager_cpu"] = round(min(cpus[True]) / min(cpus[False]), 2)
        if before_cpus:
            out[f"{name}_requests_per_cpu_s_8_ranks_before"] = round(len(wl) / min(before_cpus))
            out[f"{name}_speedup_vs_before_cpu"] = round(min(before_cpus) / min(after_cpus), 2)
        if source_cpus:
            out[f"{name}_requests_per_cpu_s_8_ranks_source"] = round(len(wl) / min(source_cpus))
            out[f"{name}_speedup_compiled_vs_source_cpu"] = round(min(source_cpus) / min(after_cpus), 2)
    return out


def _trace_reader(quick: bool) -> dict:
    """Stream a generated Azure 2024 CSV, keeping only its last second of requests."""
    import os
    import tempfile
    from sim.traces import read_trace
    rows = 50_000 if quick else 500_000
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "azure2024.csv")
        with open(path, "w") as fp:
            fp.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
            for i in range(rows):
                fp.write(f"2024-05-10 {i // 3_600_000:02d}:{i // 60000 % 60:02d}:{i // 1000 % 60:02d}"
                         f".{i % 1000:03d}000+00:00,{100 + i % 900},{1 + i % 300}\n")
        t0 = time.perf_counter()
        read_trace(path, window_s=(rows / 1000 - 1, rows / 1000))
        wall = time.perf_counter() - t0
        tracemalloc.start()
        read_trace(path, window_s=(rows / 1000 - 1, rows / 1000))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return {"trace_read_rows": rows, "trace_read_rows_per_s": round(rows / wall),
            "trace_read_peak_mb": round(peak / 2**20, 2)}


def _spec_step() -> dict:
    s = initial_state(get_variant("gate"), 8, 64)
    for i in range(4):
        apply(s, Enqueue(i, 100 + i, 7))
    step, n = Step(), 20_000
    t0 = time.perf_counter()
    for _ in range(n):
        apply(s, step)
    wall = time.perf_counter() - t0
    return {"spec_apply_step_us_8_ranks_4_queued": round(wall / n * 1e6, 2)}


def run(quick: bool) -> dict:
    _before_tree()           # a wrong PDGATE_BENCH_BEFORE is refused before minutes of runs
    out: dict = {}
    for part in (_loaded, _hour, _memory, _throughput, _trace_reader):
        out.update(part(quick))
    out.update(_spec_step())
    return out
