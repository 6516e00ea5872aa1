"""A fake gloo group for T ranks run as T threads of one process: every collective a
rank issues is recorded as (op, shape) and really reduced (MIN, MAX, SUM) once every
rank has issued it, with a timeout.

A rank that waits in a collective its peer never issues is the hang of a real gloo
group: here it is reported, not hung. The wait ends as soon as the peer has finished
its code without issuing it (``Hang``), or, if the peer is still busy, after the
timeout (``Hang`` too); collectives whose (op, shape) differ are gloo's "collective
mismatch" (``Mismatch``). Either is raised in the ranks involved, so the code under
test sees what a failing collective raises, and the caller reads the records.

``FakeDist`` stands in for ``torch.distributed`` in a release's modules: the
collectives go to the hub of the group they name, everything else is the real module.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

Record = tuple[str, tuple[int, ...]]          # (op, tensor shape)


class CollectiveError(RuntimeError):
    """A collective that would hang or mix vectors on a real gloo group."""


class Hang(CollectiveError):
    pass


class Mismatch(CollectiveError):
    pass


def _op_name(op: Any) -> str:
    for name in ("MIN", "MAX", "SUM"):
        if op == getattr(dist.ReduceOp, name):
            return name.lower()
    raise ValueError(f"unsupported reduce op {op!r}")


_REDUCE: dict[str, Callable[[list[torch.Tensor]], torch.Tensor]] = {
    "min": lambda ts: torch.stack(ts).min(dim=0).values,
    "max": lambda ts: torch.stack(ts).max(dim=0).values,
    "sum": lambda ts: torch.stack(ts).sum(dim=0),
}


@dataclass
class Hub:
    """The T ranks' shared state: what each issued, and each pending collective's inputs."""
    ranks: int
    timeout_s: float = 2.0
    records: list[list[Record]] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    _inputs: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    _results: dict[int, torch.Tensor | CollectiveError] = field(default_factory=dict)
    _cv: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.records = [[] for _ in range(self.ranks)]
        self.done = [False] * self.ranks
        self.errors = [None] * self.ranks

    def _show(self, k: int, i: int) -> str:
        if i < len(self.records[k]):
            op, shape = self.records[k][i]
            return f"{op.upper()} shape {list(shape)}"
        return "nothing (its code returned)" if self.done[k] else "nothing yet"

    def all_reduce(self, rank: int, tensor: torch.Tensor, op: str) -> None:
        with self._cv:
            i = len(self.records[rank])
            self.records[rank].append((op, tuple(tensor.shape)))
            self._inputs.setdefault(i, {})[rank] = tensor.clone()
            self._cv.notify_all()
            end = time.monotonic() + self.timeout_s
            while i not in self._results:
                inputs = self._inputs[i]
                if len(inputs) == self.ranks:
                    self._results[i] = self._reduce(i, inputs)
                    self._cv.notify_all()
                    break
                gone = [k for k in range(self.ranks) if k not in inputs and self.done[k]]
                left = end - time.monotonic()
                if gone or left <= 0:
                    k = (gone or [k for k in range(self.ranks) if k not in inputs])[0]
                    self._results[i] = Hang(f"collective {i}: rank {rank} waits in "
                                            f"{self._show(rank, i)}, rank {k} issues "
                                            f"{self._show(k, i)}")
                    self._cv.notify_all()
                    break
                self._cv.wait(min(left, 0.05))
            out = self._results[i]
        if isinstance(out, CollectiveError):
            raise out
        tensor.copy_(out)

    def _reduce(self, i: int, inputs: dict[int, torch.Tensor]) -> torch.Tensor | CollectiveError:
        shapes = {k: self.records[k][i] for k in inputs}
        if len(set(shapes.values())) > 1:
            return Mismatch(f"collective {i}: " + ", ".join(
                f"rank {k} issues {self._show(k, i)}" for k in sorted(shapes)))
        op = self.records[0][i][0]
        return _REDUCE[op]([inputs[k] for k in range(self.ranks)])

    def finish(self, rank: int, error: str | None = None) -> None:
        with self._cv:
            self.done[rank], self.errors[rank] = True, error
            self._cv.notify_all()


@dataclass(frozen=True)
class Group:
    """A process group handle: this rank in the hub (``size`` 1: a trivial group)."""
    hub: Hub | None
    rank: int
    size: int


class FakeDist:
    """``torch.distributed`` as the release's modules see it."""

    ReduceOp = dist.ReduceOp

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def get_world_size(self, group: Any = None) -> int:
        return group.size if isinstance(group, Group) else 1

    def get_rank(self, group: Any = None) -> int:
        return group.rank if isinstance(group, Group) else 0

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> None:
        if not isinstance(group, Group):
            raise CollectiveError(f"all_reduce on a group pdgate did not make: {group!r:.60}")
        if group.size > 1:
            group.hub.all_reduce(group.rank, tensor, _op_name(op))


def run_threads(hub: Hub, bodies: Sequence[Callable[[], Any]], deadline_s: float = 30.0) -> list[Any]:
    """Run one body per rank, each on its own thread; returns each body's value (None
    where it raised: the error is in ``hub.errors``). A thread still running after the
    deadline is reported as an error and left (it is a daemon)."""
    values: list[Any] = [None] * len(bodies)

    def run(k: int) -> None:
        error = None
        try:
            values[k] = bodies[k]()
        except Exception as exc:          # the code under test failed: recorded, compared
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        hub.finish(k, error)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(bodies))]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline_s
    for k, t in enumerate(threads):
        t.join(max(0.0, end - time.monotonic()))
        if t.is_alive():
            hub.finish(k, f"rank {k} still running after {deadline_s:g} s")
    return values


def join_rows(bodies: Sequence[Callable[[], None]], timeout_s: float, ranks: int,
              errors: list) -> None:
    """Each (stage, rank) body in a daemon thread of its own (row s*ranks + k), all
    waited for at most 10 x ``timeout_s`` + 10 s in all; a row still running then is
    marked in ``errors`` (its thread is left: daemon, it cannot hold the process)."""
    threads = [threading.Thread(target=body, daemon=True) for body in bodies]
    for t in threads:
        t.start()
    end = time.monotonic() + 10 * timeout_s + 10
    for row, t in enumerate(threads):
        t.join(max(0.0, end - time.monotonic()))
        if t.is_alive():
            errors[row] = f"stage {row // ranks} rank {row % ranks} still running"
