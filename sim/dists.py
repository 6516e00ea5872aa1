"""Distribution strings (the grammar is in docs/SIMULATOR.md), all in milliseconds.

``const:2``, ``exp:1.5`` (mean), ``uniform:lo,hi``, ``lognormal:mu,sigma`` (of ln ms),
``pareto:alpha,scale`` (scale = the minimum), ``gamma:shape,mean``, ``empirical:FILE``
(one non-negative number per line, ``#`` comments, drawn with replacement), ``trace:FILE``
(the same file read in order: each block of draws is a run of consecutive values from a
random start, so a measured trace keeps its slow and fast stretches).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from model.spec.trace import open_input
from sim.errors import SimInputError

# kind -> (number of parameters, description for error messages)
_KINDS = {"const": (1, "const:VALUE"), "exp": (1, "exp:MEAN"), "uniform": (2, "uniform:LO,HI"),
          "lognormal": (2, "lognormal:MU,SIGMA"), "pareto": (2, "pareto:ALPHA,SCALE"),
          "gamma": (2, "gamma:SHAPE,MEAN"), "empirical": (0, "empirical:FILE"),
          "trace": (0, "trace:FILE")}


@dataclass(frozen=True)
class Dist:
    kind: str
    params: tuple[float, ...] = ()
    sample: tuple[float, ...] = ()     # empirical values
    text: str = ""

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` independent draws (always consumes the generator the same way per kind)."""
        p = self.params
        if self.kind == "const":
            return np.full(n, p[0])
        if self.kind == "exp":
            return rng.exponential(p[0], n)
        if self.kind == "uniform":
            return rng.uniform(p[0], p[1], n)
        if self.kind == "lognormal":
            return rng.lognormal(p[0], p[1], n)
        if self.kind == "pareto":
            return (rng.pareto(p[0], n) + 1.0) * p[1]
        if self.kind == "gamma":
            return rng.gamma(p[0], p[1] / p[0], n)
        if self.kind == "trace":
            start = int(rng.integers(0, len(self.sample)))
            return np.asarray(self.sample)[(start + np.arange(n)) % len(self.sample)]
        return np.asarray(self.sample)[rng.integers(0, len(self.sample), n)]

    @property
    def mean(self) -> float:
        p = self.params
        return {"const": lambda: p[0], "exp": lambda: p[0], "uniform": lambda: (p[0] + p[1]) / 2,
                "lognormal": lambda: math.exp(p[0] + p[1] ** 2 / 2),
                "pareto": lambda: math.inf if p[0] <= 1 else p[0] * p[1] / (p[0] - 1),
                "gamma": lambda: p[1],
                "empirical": lambda: float(np.mean(self.sample)),
                "trace": lambda: float(np.mean(self.sample))}[self.kind]()

    def __str__(self) -> str:
        return self.text


MAX_EMPIRICAL_BYTES = 64 << 20


def load_empirical(path: str, flag: str) -> tuple[float, ...]:
    try:
        with open_input(path, "utf-8-sig") as fp:      # a BOM dropped; a FIFO never waited on
            text = fp.read(MAX_EMPIRICAL_BYTES + 1)     # bounded: /dev/zero is a file too
    except (OSError, UnicodeDecodeError) as exc:
        raise SimInputError(f"{flag}: cannot read empirical file {path}: "
                            f"{getattr(exc, 'strerror', None) or 'not UTF-8 text'}") from None
    if len(text) > MAX_EMPIRICAL_BYTES:
        raise SimInputError(f"{flag}: empirical file {path} is larger than {MAX_EMPIRICAL_BYTES} bytes")
    lines = text.splitlines()
    values = []
    for n, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            val = float(text)
        except ValueError:
            raise SimInputError(f"{flag}: {path} line {n}: {text!r} is not a number") from None
        if not math.isfinite(val) or val < 0:
            raise SimInputError(f"{flag}: {path} line {n}: {text!r} must be a finite number >= 0")
        values.append(val)
    if not values:
        raise SimInputError(f"{flag}: empirical file {path} holds no values")
    return tuple(values)


def parse_dist(text: str, flag: str) -> Dist:
    """Parse one distribution string; SimInputError names ``flag`` on any problem."""
    kind, sep, rest = str(text).partition(":")
    kind = kind.strip().lower()
    if not sep or kind not in _KINDS:
        raise SimInputError(f"{flag}: invalid distribution {text!r} "
                            f"(use one of {', '.join(d for _, d in _KINDS.values())})")
    arity, usage = _KINDS[kind]
    if kind in ("empirical", "trace"):
        if not rest.strip():
            raise SimInputError(f"{flag}: {text!r} needs a file ({usage})")
        return Dist(kind, (), load_empirical(rest.strip(), flag), text)
    try:
        params = tuple(float(x) for x in rest.split(","))
    except ValueError:
        raise SimInputError(f"{flag}: invalid distribution {text!r}: parameters must be numbers "
                            f"({usage})") from None
    if len(params) != arity:
        raise SimInputError(f"{flag}: {text!r} takes {arity} parameter(s) ({usage})")
    if not all(math.isfinite(x) for x in params):
        raise SimInputError(f"{flag}: {text!r}: parameters must be finite")
    bad = {"const": params[0] < 0, "exp": params[0] <= 0,
           "uniform": len(params) == 2 and not 0 <= params[0] <= params[1],
           "lognormal": len(params) == 2 and params[1] < 0,
           "pareto": len(params) == 2 and (params[0] <= 0 or params[1] <= 0),
           "gamma": len(params) == 2 and (params[0] <= 0 or params[1] <= 0)}[kind]
    if bad:
        raise SimInputError(f"{flag}: {text!r}: parameters out of range ({usage}; times >= 0, "
                            f"means, shapes and scales > 0)")
    return Dist(kind, params, (), text)


def parse_rank_dists(values: list[str], ranks: int, flag: str) -> list[Dist]:
    """A default DIST plus optional ``RANK=DIST`` overrides -> one Dist per rank."""
    default, overrides = None, {}
    for text in values:
        head, eq, tail = text.partition("=")
        if eq and head.strip().isdigit():
            rank = int(head)
            if rank >= ranks:
                raise SimInputError(f"{flag}: rank {rank} out of range 0..{ranks - 1} in {text!r}")
            overrides[rank] = parse_dist(tail, flag)
        else:
            default = parse_dist(text, flag)
    if default is None and len(overrides) < ranks:
        raise SimInputError(f"{flag}: give a default distribution for the ranks without RANK=DIST")
    return [overrides.get(k, default) for k in range(ranks)]


def parse_skew(text: str | None, ranks: int, flag: str = "--lag-skew") -> list[float]:
    """Per-rank multipliers: ``S`` (a ramp 1 .. 1+S over the ranks) or ``m0,m1,...``."""
    if text is None:
        return [1.0] * ranks
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        raise SimInputError(f"{flag}: {text!r} must be a number or a comma list of numbers") from None
    if len(vals) == 1:
        s = vals[0]
        vals = [1.0 + s * k / max(ranks - 1, 1) for k in range(ranks)]
    if len(vals) != ranks:
        raise SimInputError(f"{flag}: {len(vals)} multipliers for {ranks} ranks")
    if any(not math.isfinite(v) or v < 0 for v in vals):
        raise SimInputError(f"{flag}: multipliers must be finite and >= 0 in {text!r}")
    return vals
