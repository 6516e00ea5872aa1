"""Scenario scripts: a small command language over the spec, for golden-file tests.

A script is a list of blocks separated by blank lines; each block is optional ``#``
comment lines, one command, ``----``, and the command's expected output (raft's
datadriven style, ../shared/reference/style.md point 5). ``run_script`` executes the
commands and returns the script with every output replaced by what the spec gives,
so a test compares that with the file and a rewrite flag stores it.

Commands (requests are named ``r<id>``; ranks are 0-based):
  variant NAME | ranks N | slots N | timeout N     set-up, before the first event
  enqueue rID room=R payload=P                      on every rank
  kv-done RANK rID | fail RANK rID | fence RANK rID
  land RANK rID room|payload
  step                                              one protocol step on all ranks
  state                                             per-rank queue, rows, slots, outcomes
  check                                             the invariant report
An event the spec does not enable prints ``not enabled: <why>`` (that is an outcome);
a malformed command raises ScenarioError naming the line.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from model.spec.events import FIELDS, Enqueue, Event, Fail, Fence, KvDone, Land, Step
from model.spec.invariants import INVARIANTS, check_invariants
from model.spec.kernel import Decision
from model.spec.kvpoll import KVPoll
from model.spec.machine import EventNotEnabled, StepRecord, apply
from model.spec.state import SystemState, initial_state
from model.spec.variants import VARIANTS, get_variant

SEPARATOR = "----"


class ScenarioError(ValueError):
    """A malformed script; ``str()`` is one line naming the script line."""

    def __init__(self, line: int, message: str):
        self.line = line
        super().__init__(f"line {line}: {message}")


@dataclass
class Block:
    comments: list[str]
    command: str
    line: int
    output: list[str] = field(default_factory=list)


def parse_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        comments = []
        while i < len(lines) and (not lines[i].strip() or lines[i].startswith("#")):
            if lines[i].startswith("#"):
                comments.append(lines[i])
            i += 1
        if i >= len(lines):
            break
        block = Block(comments, lines[i].strip(), i + 1)
        i += 1
        if i < len(lines) and lines[i].strip() == SEPARATOR:
            i += 1
            while i < len(lines) and lines[i].strip():
                block.output.append(lines[i])
                i += 1
        blocks.append(block)
    return blocks


def _poll(p: int) -> str:
    return KVPoll(p).name


def _req(token: str, line: int) -> int:
    if not token.startswith("r") or not token[1:].isdigit():
        raise ScenarioError(line, f"request must be named r<id> (e.g. r1), got {token!r}")
    return int(token[1:])


def _int(token: str, line: int, what: str, lo: int = 0) -> int:
    try:
        value = int(token)
    except ValueError:
        raise ScenarioError(line, f"{what} must be an integer, got {token!r}") from None
    if value < lo:
        raise ScenarioError(line, f"{what} must be >= {lo}, got {value}")
    return value


def _names(reqs) -> str:
    return "[" + " ".join(f"r{r}" for r in reqs) + "]"


def format_step(rec: StepRecord) -> list[str]:
    out = [f"step {rec.step}"]
    if rec.hang is not None:
        out.append(f"hang: collective mismatch, queue lengths {list(rec.hang)}")
    for rs in rec.ranks:
        popped = ", ".join(
            f"r{q} commit payload={p}" if d == Decision.COMMIT else f"r{q} {Decision(d).name.lower()}"
            for q, d, p in rs.popped) or "-"
        out.append(f"rank {rs.rank}: queue {_names(rs.queue)} "
                   f"local [{' '.join(map(_poll, rs.local))}] "
                   f"gated [{' '.join(map(_poll, rs.gated))}] "
                   f"min [{' '.join(map(_poll, rs.reduced))}] popped {popped}")
    return out


def format_state(s: SystemState) -> list[str]:
    out = []
    for k, rs in enumerate(s.ranks):
        polls = " ".join(f"r{r}={_poll(rs.recv[r])}/age{rs.age[r]}" for r in rs.queue)
        out.append(f"rank {k}: queue {_names(rs.queue)} {polls}".rstrip())
        rows = " ".join(f"{i}=({rs.room_at[i]},{rs.payload_at[i]})" for i in range(s.n_slots))
        owners = " ".join(f"r{r}@{slot}" for r, slot in sorted(rs.slot_of.items()))
        out.append(f"  rows (room,payload) {rows}; slots {owners or '-'}; free {rs.free}"
                   + (f"; quarantined {_names(sorted(rs.quarantined))}" if rs.quarantined else ""))
        if rs.outcomes:
            done = ", ".join(f"r{r} commit payload={v}" if kind == "commit"
                             else f"r{r} {Decision(v).name.lower()}"
                             for r, (kind, v) in sorted(rs.outcomes.items()))
            out.append(f"  left: {done}")
    return out


def format_check(s: SystemState) -> list[str]:
    found = {name: check_invariants(s, [name]) for name in INVARIANTS}
    return [f"{name}: " + ("ok" if not vs else "VIOLATED " + "; ".join(v.detail for v in vs))
            for name, vs in found.items()]


class Scenario:
    """Runs commands one by one; the state is built on the first event command."""

    def __init__(self) -> None:
        self.variant, self.ranks, self.slots, self.timeout = "gate", 2, 2, None
        self.state: SystemState | None = None

    def _setup(self, cmd: str, args: list[str], line: int) -> list[str]:
        if self.state is not None:
            raise ScenarioError(line, f"{cmd} must come before the first event")
        if len(args) != 1:
            raise ScenarioError(line, f"{cmd} takes one argument")
        if cmd == "variant":
            if args[0] not in VARIANTS:
                raise ScenarioError(line, f"unknown variant {args[0]!r} (known: {', '.join(VARIANTS)})")
            self.variant = args[0]
        else:
            setattr(self, cmd, _int(args[0], line, cmd, lo=1))
        return ["ok"]

    def _ensure_state(self, line: int) -> SystemState:
        if self.state is None:
            try:
                v = get_variant(self.variant, self.timeout)
            except ValueError as exc:
                raise ScenarioError(line, str(exc)) from None
            self.state = initial_state(v, self.ranks, self.slots)
        return self.state

    def _event(self, cmd: str, args: list[str], line: int) -> Event:
        if cmd == "enqueue":
            if len(args) != 3:
                raise ScenarioError(line, "usage: enqueue rID room=R payload=P")
            opts = dict(a.split("=", 1) for a in args[1:] if "=" in a)
            if set(opts) != {"room", "payload"}:
                raise ScenarioError(line, "usage: enqueue rID room=R payload=P")
            return Enqueue(_req(args[0], line), _int(opts["room"], line, "room"),
                           _int(opts["payload"], line, "payload", lo=-2**31))
        want = 3 if cmd == "land" else 2
        if len(args) != want:
            raise ScenarioError(line, f"usage: {cmd} RANK rID" + (" room|payload" if want == 3 else ""))
        rank, req = _int(args[0], line, "rank"), _req(args[1], line)
        if rank >= self.ranks:
            raise ScenarioError(line, f"rank {rank} out of range 0..{self.ranks - 1}")
        if cmd == "land":
            if args[2] not in FIELDS:
                raise ScenarioError(line, f"land field must be room or payload, got {args[2]!r}")
            return Land(rank, req, args[2])
        return {"kv-done": KvDone, "fail": Fail, "fence": Fence}[cmd](rank, req)

    def run(self, command: str, line: int) -> list[str]:
        words = command.split()
        cmd, args = words[0], words[1:]
        if cmd in ("variant", "ranks", "slots", "timeout"):
            return self._setup(cmd, args, line)
        if cmd in ("step", "state", "check") and args:
            raise ScenarioError(line, f"{cmd} takes no arguments")
        if cmd not in ("step", "state", "check", "enqueue", "kv-done", "fail", "fence", "land"):
            raise ScenarioError(line, f"unknown command {cmd!r}")
        state = self._ensure_state(line)
        if cmd == "state":
            return format_state(state)
        if cmd == "check":
            return format_check(state)
        event = Step() if cmd == "step" else self._event(cmd, args, line)
        try:
            rec = apply(state, event)
        except EventNotEnabled as exc:
            return [f"not enabled: {exc}"]
        return format_step(rec) if rec is not None else ["ok"]


def run_script(text: str) -> str:
    """The script with every block's output replaced by the spec's."""
    scenario = Scenario()
    parts = []
    for block in parse_blocks(text):
        output = scenario.run(block.command, block.line)
        parts.append("\n".join([*block.comments, block.command, SEPARATOR, *output]))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m model.spec.scenario FILE``: print the script with the spec's output."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m model.spec.scenario FILE", file=sys.stderr)
        return 2
    try:
        with open(argv[0], encoding="utf-8") as fp:
            sys.stdout.write(run_script(fp.read()))
    except OSError as exc:
        print(f"scenario: cannot read {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 2
    except ScenarioError as exc:
        print(f"scenario: {argv[0]}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
