"""Generators of hostile input, by class: traces (for validate and replay) and flags
(for every subcommand). Each case is data; the tests decide how to run it.

Trace classes: non-object JSON lines, wrong types in every field, numbers past the
digit limit, deep nesting, bare records, huge ranks/slots, special files, NaN/inf,
records after the end, no end, trailing garbage, events for unknown requests.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass

from model.spec.events import PAYLOAD, ROOM, Enqueue, KvDone, Land, Step
from model.spec.machine import apply
from model.spec.state import initial_state
from model.spec.trace import TraceWriter
from model.spec.variants import VARIANTS

EVENTS = [Enqueue(0, 77, 5), KvDone(0, 0), KvDone(1, 0), Land(0, 0, PAYLOAD), Land(0, 0, ROOM),
          Land(1, 0, PAYLOAD), Land(1, 0, ROOM), Step()]


def good_trace(variant: str = "gate", ranks: int = 2, slots: int = 2) -> list[str]:
    """A short trace the spec allows: one request, committed on both ranks."""
    fp = io.StringIO()
    writer = TraceWriter(fp, variant, ranks, slots, "hostile")
    state = initial_state(VARIANTS[variant], ranks, slots)
    for ev in EVENTS:
        rec = apply(state, ev)
        writer.event(ev) if rec is None else writer.step(rec)
    writer.end(state.steps)
    return fp.getvalue().splitlines()


FIFO = "{fifo}"     # a TraceCase path: the test makes a FIFO there (tests.hostile.test_hostile)


@dataclass(frozen=True)
class TraceCase:
    name: str
    content: bytes | None = None       # None: ``path`` names a special file instead
    path: str | None = None

    def __str__(self) -> str:
        return self.name


def _text(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def _with(lines: list[str], index: int, obj) -> list[str]:
    return lines[:index] + [obj if isinstance(obj, str) else json.dumps(obj)] + lines[index + 1:]


WRONG_VALUES = {"list": [1], "dict": {"a": 1}, "string": "7", "float": 1.5, "null": None,
                "bool": True, "huge": 10 ** 30, "negative": -3}


def _wrong_types(good: list[str]) -> list[TraceCase]:
    """Every field of every record (and of a step's per-rank entry) set to every wrong
    kind of value: scalars where lists belong and the other way round."""
    out = []
    for i, text in enumerate(good):
        obj = json.loads(text)
        kind = obj["kind"]
        for key in [k for k in obj if k not in ("t", "source", "format")]:
            for vname, value in WRONG_VALUES.items():
                out.append(TraceCase(f"{kind}.{key}={vname}", _text(_with(good, i, {**obj, key: value}))))
        if kind == "step":
            entry = obj["ranks"][0]
            for key in entry:
                for vname in ("dict", "string", "null", "huge"):
                    bad = json.loads(text)
                    bad["ranks"][0][key] = WRONG_VALUES[vname]
                    out.append(TraceCase(f"step.ranks[0].{key}={vname}", _text(_with(good, i, bad))))
            for bad_pop in ([["0", "commit", 5]], [[0, "explode", 5]], [[0, "commit"]], [5],
                            [[0, ["commit"], 5]], [[0, {"commit": 1}, 5]]):
                bad = json.loads(text)
                bad["ranks"][0]["popped"] = bad_pop
                out.append(TraceCase(f"step.popped={json.dumps(bad_pop)}", _text(_with(good, i, bad))))
    return out


def _diverged() -> list[str]:
    """docs/trace-format.md's ungated example: a step, then its queues_identical claim."""
    from model.spec.invariants import check_invariants
    fp = io.StringIO()
    writer = TraceWriter(fp, "ungated", 2, 2, "hostile")
    state = initial_state(VARIANTS["ungated"], 2, 2)
    for ev in [Enqueue(0, 77, 5), KvDone(0, 0), KvDone(1, 0), Land(0, 0, PAYLOAD), Land(0, 0, ROOM), Step()]:
        rec = apply(state, ev)
        writer.event(ev) if rec is None else writer.step(rec)
    writer.violation(check_invariants(state, ["queues_identical"])[0], 0)
    writer.end(state.steps)
    return fp.getvalue().splitlines()


def trace_cases() -> list[TraceCase]:
    good = good_trace()
    header = json.loads(good[0])
    enqueue_at = next(i for i, t in enumerate(good) if '"enqueue"' in t)
    cases = [TraceCase(f"non-object {v} at line {n + 1}", _text(_with(good, n, v)))
             for v in ("[1]", '"x"', "3", "null", "true") for n in (0, enqueue_at)]
    cases += _wrong_types(good)
    digits = "9" * 5000
    cases += [
        TraceCase("4300+ digit req", _text(_with(good, enqueue_at, good[enqueue_at].replace('"req":0', f'"req":{digits}')))),
        TraceCase("4300+ digit ranks", _text(_with(good, 0, good[0].replace('"ranks":2', f'"ranks":{digits}')))),
        TraceCase("1e400 room (inf as float)", _text(_with(good, enqueue_at, good[enqueue_at].replace('"room":77', '"room":1e400')))),
        TraceCase("t is 1e400", _text(_with(good, 1, good[1][:-1] + ',"t":1e400}'))),
        TraceCase("NaN payload", _text(_with(good, enqueue_at, good[enqueue_at].replace('"payload":5', '"payload":NaN')))),
        TraceCase("Infinity t", _text(_with(good, 1, good[1][:-1] + ',"t":Infinity}'))),
        TraceCase("-Infinity rank", _text(_with(good, 2, good[2].replace('"rank":0', '"rank":-Infinity')))),
        TraceCase("deep nesting in a field", _text(_with(good, enqueue_at, '{"kind":"enqueue","req":' + "[" * 100000 + "]" * 100000 + "}"))),
        *[TraceCase(f"enqueue slots {v}", _text(_with(good, enqueue_at, good[enqueue_at][:-1] + f',"slots":{v}}}')))
          for v in ('"0,1"', "[0]", "[0,1,1]", "[0,true]", "[0,-1]", f"[0,{header['slots']}]", "[0,1e400]")],
        TraceCase("a line of brackets", _text([good[0], "[" * 1_000_000])),
        TraceCase("bare step first (no header)", _text(['{"kind":"step"}', *good[1:]])),
        TraceCase("ranks 1e9", _text(_with(good, 0, {**header, "ranks": 10 ** 9}))),
        TraceCase("slots 1e9", _text(_with(good, 0, {**header, "slots": 10 ** 9}))),
        TraceCase("ranks x slots too many", _text(_with(good, 0, {**header, "ranks": 4096, "slots": 4096}))),
        TraceCase("ranks 0", _text(_with(good, 0, {**header, "ranks": 0}))),
        TraceCase("version 2", _text(_with(good, 0, {**header, "version": 2}))),
        TraceCase("unknown variant", _text(_with(good, 0, {**header, "variant": "yolo"}))),
        TraceCase("two headers", _text([good[0], *good])),
        TraceCase("unknown kind", _text(_with(good, 1, {"kind": "teleport"}))),
        TraceCase("records after end", _text([*good, '{"kind":"step"}'])),
        TraceCase("trailing garbage", _text([*good, "}{"])),
        TraceCase("garbage mid-trace", _text([*good[:2], "not json at all", *good[2:]])),
        TraceCase("event for an unknown request", _text([*good[:2], '{"kind":"kv_done","rank":0,"req":777}', *good[2:]])),
        TraceCase("land of an unknown field", _text(_with(good, 4, good[4].replace('"payload"', '"both"')))),
        TraceCase("rank out of range", _text(_with(good, 2, good[2].replace('"rank":0', '"rank":9')))),
        TraceCase("poll value 7", _text([good[0], good[1], '{"kind":"step","step":0,"hang":null,"ranks":['
                                        '{"rank":0,"queue":[0],"local":[7],"gated":[7],"reduced":[7],"popped":[]},'
                                        '{"rank":1,"queue":[0],"local":[7],"gated":[7],"reduced":[7],"popped":[]}]}'])),
        TraceCase("1001 violation claims", _text([*_diverged()[:-1]] + [_diverged()[-2]] * 1000
                                                 + [_diverged()[-1]])),
        TraceCase("empty file", b""),
        TraceCase("blank lines only", b"\n\n  \n"),
        TraceCase("not UTF-8", b"\xff\xfe\x00garbage\n"),
        TraceCase("a 17 MiB line", _text([good[0], '{"kind":"step","x":"' + "a" * (17 << 20) + '"}'])),
        TraceCase("/dev/zero", path="/dev/zero"),
        TraceCase("a directory", path="/"),
        TraceCase("a missing file", path="/nonexistent/trace.jsonl"),
        TraceCase("a FIFO nobody writes to", path=FIFO),
        TraceCase("land field a list", _text(_with(good, 4, good[4].replace('"field":"payload"', '"field":["payload"]')))),
    ]
    return cases


def verdict_traces() -> dict[str, bytes]:
    """Well-formed traces that are not malformed input: a correct verdict is expected."""
    good = good_trace()
    bare = [good[0], good[1], '{"kind":"step"}', '{"kind":"step"}', '{"kind":"end","steps":2}']
    return {
        "no end": _text(good[:-1]),                            # validate: 1 (cut short)
        "bare steps": _text(bare),                             # validate: 0
        "SlotsExhausted": _text([json.dumps({**json.loads(good[0]), "slots": 1}),
                                 '{"kind":"enqueue","req":0,"room":77,"payload":5}',
                                 '{"kind":"enqueue","req":1,"room":78,"payload":6}',
                                 '{"kind":"end","steps":0}']),  # validate: 1, replay: 1
    }


# -- flags, for every subcommand -----------------------------------------------------
# Each: argv after "pdgate". Every one must be refused before any work (exit 2, one
# line). {trace} is a good trace file, {dir} a writable folder.
NUMBERS = ("nan", "inf", "-inf", "-1", "1e400")
FLAG_CASES: list[list[str]] = [
    *[["prove", "--timeout", v] for v in NUMBERS],
    ["prove", "--jobs", "0"], ["prove", "--variant", "bogus"], ["prove", "--only", "no-such-obligation"],
    ["prove", "--json", "/proc/x.json"], ["prove", "--traces", "/proc/x"], ["prove", "--json", "/"],
    ["validate"], ["validate", "{trace}", "--variant", "bogus"], ["validate", "{trace}", "extra"],
    *[["simulate", "--requests", "10", flag, v] for flag in ("--rate", "--burstiness", "--allreduce-beta",
                                                             "--prefill-base", "--bandwidth", "--fail-prob")
      for v in ("nan", "inf", "-1")],
    ["simulate", "--requests", "1e12"], ["simulate", "--requests", "0"], ["simulate", "--ranks", "0"],
    ["simulate", "--seed", "-1"], ["simulate", "--variant", "bogus"], ["simulate", "--compare", "gate,bogus"],
    ["simulate", "--metadata-lag", "const:nan"], ["simulate", "--metadata-lag", "nosuch:1"],
    ["simulate", "--forward", "const:-5"], ["simulate", "--trace-in", "/dev/zero"],
    ["simulate", "--trace-in", "/nonexistent.jsonl"],
    *[["simulate", "--requests", "10", flag, path] for flag in ("--json", "--trace", "--perfetto")
      for path in ("/proc/x", "/", "/nonexistent/dir/x")],
    ["simulate", "--requests", "10", "--plot", "/proc/x"], ["simulate", "--requests", "10", "--plot", "/etc/hostname"],
    *[["sweep", "--rate", v] for v in ("nan", "1,inf", "-1", "x")],
    ["sweep", "--ranks", "0"], ["sweep", "--ranks", "2,x"], ["sweep", "--jobs", "0"],
    *[["sweep", "--cell-timeout", v] for v in ("nan", "inf", "-1", "0")],
    ["sweep", "--out", "/proc/x.csv"], ["sweep", "--out", "/"], ["sweep", "--capacity", "--ttft-p99-target", "inf"],
    *[["replay", "{trace}", "--ranks", v] for v in ("0", "1e9", "nan", "100", "-2")],
    *[["replay", "{trace}", "--collective-timeout", v] for v in NUMBERS + ("0",)],
    *[["replay", "{trace}", "--deadline", v] for v in ("nan", "0", "-5", "1e400")],
    ["replay", "{trace}", "--out", "{trace}"], ["replay", "{trace}", "--out", "/proc/x"],
    ["replay", "{trace}", "--out", "{dir}"], ["replay", "/nonexistent.jsonl"],
    *[["e2e", flag, v] for flag in ("--heartbeat-ms", "--fence-grace-s", "--step-ms", "--timeout-s",
                                    "--collective-timeout-s", "--connect-timeout-s")
      for v in ("nan", "inf", "-1")],
    ["e2e", "--heartbeat-ms", "0"], ["e2e", "--heartbeat-misses", "0"], ["e2e", "--step-ms", "0"],
    ["e2e", "--ranks", "17"], ["e2e", "--ranks", "1e9"], ["e2e", "--requests", "1e12"],
    ["e2e", "--requests", "0"], ["e2e", "--slots", "0"], ["e2e", "--pages", "1e9"],
    ["e2e", "--page-bytes", "100000000000"], ["e2e", "--seed", "-1"], ["e2e", "--timeout-steps", "0"],
    ["e2e", "--metadata-delay", "0:nan"], ["e2e", "--metadata-delay", "0:1e308"],
    ["e2e", "--metadata-delay", "5:10"], ["e2e", "--metadata-delay", "x"], ["e2e", "--device", "tpu"], ["e2e", "--netns", "bogus"],
    ["e2e", "--variant", "ungated"], ["e2e", "--host", "no such host"], ["e2e", "--json", "/proc/x"], ["e2e", "--trace", "/"],
    ["e2e", "--requests", "100000", "--max-pages", "1000", "--pages", "1000"],
    ["live", "--late-room", "1:nan"], ["live", "--late-room", "1:-5"], ["live", "--late-room", "9:1"],
    ["live", "--late-room", "x"], ["live", "--patch", "loose"], ["live", "--requests", "1e9"],
    ["live", "--fail-send", "-1"], ["live", "--kill-prefill-s", "1e400"],
    ["live", "--json", "/proc/x"], ["live", "--trace", "/"], ["live", "--work-dir", "/proc/x"],
    ["live", "--late-write", "1:nan"], ["live", "--late-write", "2:5"], ["live", "--late-write", "1:never"],
    ["live", "--second-wave-s", "nan"], ["live", "--release-timeout-s", "inf"], ["live", "--max-running", "65"], ["live", "--max-running", "2.5"],
    ["bench", "nosuchbench"], ["bench", "--json", "/proc/x"],
    ["nosuchcommand"], ["--bogus-flag"],
]

# Unwritable outputs: a full device, a read-only file (even for root), a folder (or, for
# a folder flag, a file), /proc, a missing parent folder, a FIFO nobody reads; for a
# folder flag also an existing folder nothing can be created in, even by root (/proc/sys).
BAD_OUTPUT_FILES = ("/dev/full", "/proc/version", "{dir}", "/proc/x", "{dir}/missing/x", FIFO)
BAD_OUTPUT_DIRS = ("/dev/full", "/proc/version", "{trace}", "/proc/x", FIFO, "/proc/sys")
REQUIRED_ARGS = {"replay": ["{trace}"], "conform": ["--sglang", "pinned"]}


def output_path_cases() -> list[list[str]]:
    """Every output flag of every subcommand (model.cli's OUTPUT_FILES and OUTPUT_DIRS)
    given each unwritable path; sweep's resumable --out must also be a regular file."""
    from model.cli import OUTPUT_DIRS, OUTPUT_FILES
    out = []
    for table, bad in ((OUTPUT_FILES, BAD_OUTPUT_FILES), (OUTPUT_DIRS, BAD_OUTPUT_DIRS)):
        for name, dests in table.items():
            for dest in dests:
                flag = "--" + dest.replace("_", "-")
                out += [[name, *REQUIRED_ARGS.get(name, []), flag, path] for path in bad]
    return out + [["sweep", "--out", "/dev/null"], ["sweep", "--out", "/dev/zero"],
                  ["simulate", "--json", "{dir}/x", "--perfetto", "{dir}/x"],
                  ["e2e", "--json", "{dir}/x", "--trace", "{dir}/./x"],
                  ["sweep", "--trace-in", "{trace}", "--out", "{trace}"],
                  *[["simulate", "--compare", "gate,strict", "--requests", "5", "--trace", p]
                    for p in ("/dev/full", "{dir}/missing/x")]]


# Inputs that cannot be read, for every input flag: refused in one line.
INPUT_CASES = [
    *[["simulate", "--requests", "5", *flag.split("=")[:1], flag.split("=")[1] + path]
      for flag in ("--trace-in=", "--forward=empirical:")
      for path in ("/dev/full", "/proc/self/mem", "{dir}", FIFO, "/nonexistent.csv")],
    *[["validate", path] for path in ("/proc/self/mem", "{dir}", FIFO)],
    *[["replay", path] for path in ("/proc/self/mem", "{dir}", FIFO)],
]


def typed_flag_cases() -> list[list[str]]:
    """For every subcommand (present and future) and each of its flags that converts
    its value: NaN, inf and a value past any limit, plus an unknown flag. Positional
    traces get the good trace ({trace})."""
    from model.cli import SUBCOMMANDS, subcommand_parser
    out = []
    for name in SUBCOMMANDS:
        parser = subcommand_parser(name)
        positionals = ["{trace}" for a in parser._actions if not a.option_strings and a.nargs is None]
        out.append([name, *positionals, "--definitely-not-a-flag"])
        for action in parser._actions:
            if action.option_strings and action.type is not None:
                flag = max(action.option_strings, key=len)
                out += [[name, *positionals, flag, v] for v in ("nan", "inf", "-1e400")]
    return out


# Simulator runs that would never end or exhaust memory: refused before any work (2)
# or stopped by the run's own bounds (1), in bounded time either way.
SIM_BOUND_CASES = [
    ["simulate", "--ranks", "8193"], ["simulate", "--ranks", "1000000000"],
    ["simulate", "--requests", "1000000000000"], ["simulate", "--metadata-lag", "const:1e308"],
    ["simulate", "--metadata-lag", "lognormal:1e6,1"], ["simulate", "--metadata-lag", "pareto:0.01,1"],
    ["simulate", "--stall", "0:0:1e300"], ["simulate", "--kv-bytes-per-token", "10" + "0" * 22],
    ["simulate", "--allreduce-alpha", "1e308"], ["simulate", "--slots", "1000000000"],
    ["simulate", "--request-pool", "1000000000"], ["simulate", "--input-len", "const:1e15"],
    ["sweep", "--ranks", "100000", "--rate", "1", "--out", "{dir}/s.csv"],
    ["sweep", "--metadata-lag", "const:1e308", "--cell-timeout", "2", "--jobs", "1",
     "--out", "{dir}/s.csv"],
]
