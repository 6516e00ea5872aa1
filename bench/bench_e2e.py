"""End to end over real Mooncake (TCP on loopback): throughput against raw Mooncake
writes of the same bytes, and commit latency after the last byte lands.

One cluster (a prefill and T=2 decode ranks, strict) serves a warm-up phase (first
connections and handshakes; not counted), then K phases of N requests.
After each phase the prefill replays exactly the batches it wrote in that phase (KV
pages + payload rows, then rooms) with raw ``batch_transfer_sync_write``, one after
another, while the decode ranks idle: the ratio of the two times, phase by phase,
cancels most of the machine's load drift; the figure is the median over phases.

The e2e path writes with ``Engine.write`` (submit each range, wait without spinning),
whereas ``batch_transfer_sync_write`` busy-waits a core: on a 2-core host that alone is
worth a lot. So the replay is run a second time with Engine.write's own primitive, and
``throughput_ratio_same_primitive`` (e2e against that) is the protocol's own overhead.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from impl.mooncake.cluster import Cluster
from impl.mooncake.report import figures, load_log

TARGETS = {"throughput_ratio": (">=", 0.8), "commit_latency_max_steps": ("<=", 1)}
RANKS = 2


def run(quick: bool) -> dict:
    phases, n, warmup = (3, 16, 8) if quick else (5, 64, 8)
    workload = ["--seed", "11", "--page-bytes", str(64 * 1024), "--min-pages", "4",
                "--max-pages", "16"]
    rank_args = ["--variant", "strict", "--timeout-steps", "2000", "--slots", "64",
                 "--pages", "1024", "--inflight", "16", "--step-ms", "2"]
    ratios, same_ratios, e2e_rates, raw_rates = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="pdgate-bench-e2e-") as tmp:
        cluster = Cluster(RANKS, Path(tmp), workload, rank_args, timeout_s=600)
        try:
            prefill, endpoint = cluster.start_prefill(0, warmup + phases * n, ["--allow-baseline"])
            cluster.start_ranks()
            cluster.serve(endpoint, 0, warmup)
            cluster.wait_idle(120)
            prefill.send("baseline")
            prefill.read(120, "warm-up baseline")
            for k in range(phases):
                cluster.serve(endpoint, warmup + k * n, n)
                recs = [r for rank in cluster.wait_idle(120) for r in rank]
                if any(r["decision"] != "commit" or not r["kv_ok"] for r in recs):
                    raise RuntimeError(f"phase {k}: not every request committed byte-exact")
                e2e_s = max(r["t_pop"] for r in recs) - min(r["t_enq"] for r in recs)
                prefill.send("baseline")
                raw = prefill.read(120, "baseline")
                ratios.append(raw["seconds"] / e2e_s)
                same_ratios.append(raw["submit_seconds"] / e2e_s)
                e2e_rates.append(raw["bytes"] / e2e_s / 1e6)
                raw_rates.append(raw["bytes"] / raw["seconds"] / 1e6)
            results = cluster.finish()
            prefill.send("quit")
            prefill.close(30)
        finally:
            cluster.close()
        logs = [load_log(str(Path(tmp) / f"rank{r}.jsonl")) for r in range(RANKS)]
    figs = figures(results, logs, warmup + phases * n)
    return {
        "ranks": RANKS, "phases": phases, "requests_per_phase": n,
        "throughput_ratio": round(statistics.median(ratios), 3),
        "throughput_ratio_per_phase": [round(r, 3) for r in ratios],
        "throughput_ratio_same_primitive": round(statistics.median(same_ratios), 3),
        "e2e_mb_per_s": round(statistics.median(e2e_rates), 1),
        "raw_mb_per_s": round(statistics.median(raw_rates), 1),
        "commit_latency_max_steps": figs["commit_latency_max_steps"],
        "commit_latency_p50_ms": figs["commit_latency_p50_ms"],
        "commit_latency_p99_ms": figs["commit_latency_p99_ms"],
        "byte_exact": figs["byte_exact"],
    }
