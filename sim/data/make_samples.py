"""Regenerate the small sample inputs shipped in sim/data (seeded, deterministic):

    python -m sim.data.make_samples

- mooncake_sample.jsonl: 200 requests over ~60 s in Mooncake's trace format
  (timestamp ms, input_length, output_length, hash_ids of 512-token blocks);
- azure_sample.csv: 200 requests in Azure's LLM inference trace format
  (TIMESTAMP date-time, ContextTokens, GeneratedTokens);
- lag_sample.txt: 500 metadata lags (ms) for ``empirical:``, a TCP-like mix: mostly
  ~0.1-0.5 ms, a few retransmission-sized tails.
Synthetic, not real traces: nothing is downloaded.
"""
from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
N = 200


def main() -> None:
    rng = np.random.default_rng(20240601)
    gaps = rng.gamma(0.5, 300.0 / 0.5, N)       # bursty, mean 300 ms
    t = np.cumsum(gaps) - gaps[0]
    inp = np.maximum(16, rng.lognormal(8.0, 0.9, N)).astype(int)
    out = np.maximum(1, rng.lognormal(5.0, 0.7, N)).astype(int)
    with open(HERE / "mooncake_sample.jsonl", "w", encoding="utf-8") as fp:
        for i in range(N):
            blocks = list(range(i * 7, i * 7 + int(inp[i]) // 512 + 1))
            fp.write(json.dumps({"timestamp": int(t[i]), "input_length": int(inp[i]),
                                 "output_length": int(out[i]), "hash_ids": blocks}) + "\n")
    start = datetime(2023, 11, 16, 18, 0, 0)
    gaps = rng.exponential(250.0, N)
    t = np.cumsum(gaps) - gaps[0]
    ctx = np.maximum(8, rng.lognormal(7.2, 1.0, N)).astype(int)
    gen = np.maximum(1, rng.lognormal(5.3, 0.8, N)).astype(int)
    with open(HERE / "azure_sample.csv", "w", encoding="utf-8") as fp:
        fp.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for i in range(N):
            stamp = start + timedelta(milliseconds=float(t[i]))
            fp.write(f"{stamp.strftime('%Y-%m-%d %H:%M:%S.%f')}0,{ctx[i]},{gen[i]}\n")
    lags = np.where(rng.random(500) < 0.97, rng.lognormal(np.log(0.2), 0.5, 500),
                    rng.uniform(5.0, 40.0, 500))
    with open(HERE / "lag_sample.txt", "w", encoding="utf-8") as fp:
        fp.write("# metadata lag after KV completion, ms (synthetic TCP-like sample)\n")
        fp.writelines(f"{x:.4f}\n" for x in lags)


if __name__ == "__main__":
    main()
