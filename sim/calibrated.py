"""A calibration (``pdgate calibrate``'s CONFIG, sim/fit.py) as the simulator's model:
``pdgate simulate --calibration CONFIG``.

The run reproduces an e2e's setup: a closed loop (every request is there at t=0 and
is admitted as the transfer queue, ``--inflight`` long, frees room), no prefill compute
(the e2e's prefill only writes), no decode after commit (the e2e pops and checks), the
measured step trace and all-reduce cost, and one of three transfer models:
- ``writer`` (default): the prefill's single writer as a FIFO server whose KV writes
  take the fitted correlated draws, so the queueing that makes up most of a transfer
  follows the load (ranks, inflight, delays);
- ``correlated``: enqueue -> Success drawn per request and rank from the fitted common
  factor and per-rank noise (measured under the calibration run's load only);
- ``replay``: the calibration run's measured per-request, per-rank times.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from typing import Any

import numpy as np

from sim.config import SimConfig, TransferFit, WriterFit
from sim.dists import Dist
from sim.errors import SimInputError
from sim.options import positive_int
from sim.workload import Workload

MODELS = ("writer", "correlated", "replay")
MAX_CONFIG_BYTES = 64 << 20
_cache: dict[str, dict[str, Any]] = {}


def load(path: str) -> dict[str, Any]:
    """A calibration file, checked; SimInputError naming it and what is wrong."""
    if path in _cache:
        return _cache[path]
    try:
        with open(path, encoding="utf-8") as fp:
            text = fp.read(MAX_CONFIG_BYTES + 1)
        cal = json.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise SimInputError(f"--calibration: cannot read {path}: "
                            f"{getattr(exc, 'strerror', None) or 'not UTF-8 text'}") from None
    except (json.JSONDecodeError, RecursionError):
        raise SimInputError(f"--calibration: {path} is not JSON") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise SimInputError(f"--calibration: {path} is larger than {MAX_CONFIG_BYTES} bytes")
    _check(cal, path)
    _cache[path] = cal
    return cal


def _values(x: Any, what: str, path: str, lo: float = -math.inf) -> list[float]:
    ok = isinstance(x, list) and x and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= 1e7
        for v in x)
    if not ok:
        raise SimInputError(f"--calibration: {path}: {what} must be a non-empty list of finite "
                            f"numbers in {lo:g}..1e7")
    return [float(v) for v in x]


def _check(cal: Any, path: str) -> None:
    if not isinstance(cal, dict) or cal.get("version") != 1:
        raise SimInputError(f"--calibration: {path} is not a pdgate calibration (version 1)")
    try:
        a, s, t, w = cal["allreduce"], cal["setup"], cal["transfer"], cal["writer"]
        _values([a["alpha_ms"], a["beta_ms"]], "allreduce", path, 0)
        _values(a["residual_ms"], "allreduce.residual_ms", path, -1e7)
        _values([cal["step_growth_per_rank_doubling"]], "step_growth_per_rank_doubling", path, -1)
        _values(cal["step_rest_ms"], "step_rest_ms", path, 0)
        _values(cal["lag_ms"], "lag_ms", path, 0)
        if cal.get("delayed_wait_ms"):
            _values(cal["delayed_wait_ms"], "delayed_wait_ms", path, 0)
        for name, part in (("transfer", t), ("writer", w)):
            _values([part["base_ms"], part["per_page_ms"]], f"{name} base", path, 0)
            _values(part["common"], f"{name}.common", path, -50)
            _values(part["noise"], f"{name}.noise", path, -50)
        _values([w["xfer_delay_ms"], w["room_ms"], w["push_ms"]], "writer delays", path, 0)
        if not isinstance(t["replay_ms"], list) or not t["replay_ms"]:
            raise KeyError("replay_ms")
        width = len(t["replay_ms"][0]) if isinstance(t["replay_ms"][0], list) else 0
        for row in t["replay_ms"]:
            if len(_values(row, "transfer.replay_ms rows", path, 0)) != width:
                raise SimInputError(f"--calibration: {path}: transfer.replay_ms rows differ in length")
        for key in ("ranks", "requests", "inflight", "slots", "pages", "min_pages", "max_pages"):
            if not isinstance(s[key], int) or not 1 <= s[key] <= 1 << 20:
                raise SimInputError(f"--calibration: {path}: setup.{key} must be an integer in 1..2^20")
        if not s["min_pages"] <= s["max_pages"] <= s["pages"]:
            raise SimInputError(f"--calibration: {path}: need setup.min_pages <= max_pages <= pages")
    except (KeyError, TypeError, IndexError) as exc:
        raise SimInputError(f"--calibration: {path}: missing or malformed {exc}") from None


def _fit(part: dict[str, Any], replay: bool) -> TransferFit:
    return TransferFit(part["base_ms"], part["per_page_ms"], tuple(part["common"]),
                       tuple(part["noise"]),
                       tuple(tuple(r) for r in part["replay_ms"]) if replay else ())


def configure(cfg: SimConfig, cal: dict[str, Any], model: str, delays: dict[int, float],
              inflight: int | None) -> SimConfig:
    """``cfg`` (from the usual flags: variant, ranks, seed, faults) with the calibrated
    timing; ``delays``: rank -> ms, the e2e's --metadata-delay."""
    if model not in MODELS:
        raise SimInputError(f"--transfer-model: one of {', '.join(MODELS)}, got {model!r}")
    T, a, s = cfg.ranks, cal["allreduce"], cal["setup"]
    for r in delays:
        if not 0 <= r < T:
            raise SimInputError(f"--metadata-delay: rank {r} out of range 0..{T - 1}")
    # steps scale with the ranks as fitted (sim/fit.py; 0 from one rank count)
    scale = max(0.1, 1 + cal["step_growth_per_rank_doubling"] * math.log2(T / s["ranks"]))
    step = Dist("trace", (), tuple(v * scale for v in cal["step_rest_ms"]), "trace:calibration")
    extra = Dist("trace", (), tuple(v * scale for v in a["residual_ms"]), "trace:calibration")
    lag, waits = tuple(cal["lag_ms"]), tuple(cal.get("delayed_wait_ms") or ())
    room = cal["writer"]["room_ms"]
    measured = bool(waits) and model == "writer"
    # a delayed rank's lag: its delay and the measured waits behind the prefill's queue
    # (the writer adds the delay itself), else the row's two writes
    lags = tuple(Dist("empirical", (), (waits if measured else
                                        tuple(v + delays[r] for v in waits) if waits else
                                        tuple(v + delays[r] + 2 * room for v in lag))
                      if r in delays else lag, "empirical:calibration") for r in range(T))
    pool = inflight if inflight is not None else s["inflight"]
    out = replace(cfg, request_pool=pool, slots=max(s["slots"], pool), forward=step, idle_step=step,
                  allreduce_alpha_ms=a["alpha_ms"] * scale, allreduce_beta_ms=a["beta_ms"] * scale,
                  allreduce_extra=extra, prefill_base_ms=0.0, prefill_ms_per_token=0.0,
                  page_tokens=1, metadata_lag=lags, lag_skew=None, page_pool=s["pages"])
    if model == "writer":
        w = cal["writer"]
        return replace(out, transfer=_fit(w, False), writer=WriterFit(
            w["xfer_delay_ms"], w["room_ms"], w["push_ms"],
            tuple(float(delays.get(r, 0.0)) for r in range(T)), not measured)).validate()
    return replace(out, transfer=_fit(cal["transfer"], model == "replay")).validate()


def workload(cal: dict[str, Any], n: int, rng: np.random.Generator) -> Workload:
    """The e2e's closed loop: ``n`` requests all there at t=0, page counts uniform in
    the run's range (as its seeded workload draws them), nothing to decode after commit."""
    s = cal["setup"]
    pages = rng.integers(s["min_pages"], s["max_pages"] + 1, n).astype(np.int64)
    return Workload(np.zeros(n), pages, np.zeros(n, dtype=np.int64),
                    f"closed loop of {n} requests (calibrated e2e)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("calibrated (pdgate calibrate)")
    c.add_argument("--calibration", metavar="CONFIG",
                   help="time everything as fitted to a real e2e run (pdgate calibrate): "
                        "closed-loop requests, measured steps, all-reduce, transfers and lags")
    c.add_argument("--transfer-model", choices=MODELS, default=None,
                   help="--calibration: how transfers are timed (default writer)")
    c.add_argument("--metadata-delay", action="append", default=[], metavar="RANK:MS",
                   help="--calibration: as pdgate e2e's: RANK's Success first, its row MS later")
    c.add_argument("--inflight", type=positive_int, default=None, metavar="N",
                   help="--calibration: the transfer queue's bound (default: the e2e run's)")


def parse_delays(items: list[str]) -> dict[int, float]:
    out: dict[int, float] = {}
    for text in items:
        rank, sep, ms = text.partition(":")
        try:
            r, v = int(rank), float(ms)
        except ValueError:
            r, v = -1, math.nan
        if not sep or r < 0 or not math.isfinite(v) or not 0 <= v <= 1e7:
            raise SimInputError(f"--metadata-delay: {text!r} must be RANK:MS, MS in 0..1e7")
        out[r] = v
    return out


def check_flags(args: argparse.Namespace) -> None:
    """Calibration-only flags without --calibration are refused, never ignored; and a
    calibrated run takes its timing from the file, not from timing flags."""
    if getattr(args, "calibration", None):
        if getattr(args, "trace_in", None):
            raise SimInputError("--trace-in: a calibrated run is the e2e's closed loop, not a replay")
        if args.inflight is not None and args.inflight > 1 << 20:
            raise SimInputError(f"--inflight: must be in 1..2^20, got {args.inflight}")
        return
    for flag, given in (("--transfer-model", getattr(args, "transfer_model", None) is not None),
                        ("--metadata-delay", bool(getattr(args, "metadata_delay", None))),
                        ("--inflight", getattr(args, "inflight", None) is not None)):
        if given:
            raise SimInputError(f"{flag}: applies only with --calibration")
