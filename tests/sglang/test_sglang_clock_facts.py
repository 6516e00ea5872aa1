"""The clock variants against the releases' own code (impl/sglang/clock_facts.py) and
``pdgate conform --facts`` (impl/sglang/facts.py): each release's source (0.5.12 to
0.5.23) places its timeout verdicts where its clocks-* variant does, and a source edited
at one mechanism is reported at that mechanism.

Expected table (read from the wheels):

| release | abort (SGLANG_REQ_WAITING_TIMEOUT) | receiver times out in | deferred release | freed on |
|---|---|---|---|---|
| 0.5.12 to 0.5.18 | each rank's own clock | WaitingForInput (#31800) | none | |
| 0.5.19 | each rank's own clock (#27221) | WaitingForInput | per rank | ack, deadline (#38961) |
| 0.5.20 to 0.5.22 | rank 0's, on the request broadcast | WaitingForInput | per rank (device slots) | ack, deadline |
| 0.5.23 | rank 0's, on the request broadcast | WaitingForInput (and Bootstrapping in the prefill wait, outside the model) | MIN | ack, deadline |
"""
import pytest

from impl.sglang import clock_facts as cf
from impl.sglang.facts import FAMILIES, check
from impl.sglang.wheels import PINNED, RELEASES, open_wheel
from model.cli import main
from model.spec.agreement import Op

L, B, W = Op.LOCAL, Op.BROADCAST, ("WaitingForInput",)
EXPECTED = {
    **{f"0.5.{n}": (L, W, None, ()) for n in range(12, 19)},
    "0.5.19": (L, W, L, ("ack", "deadline")), **{f"0.5.{n}": (B, W, L, ("ack", "deadline")) for n in range(20, 23)},
    "0.5.23": (B, W, Op.MIN, ("ack", "deadline")),
}
MODULES = (cf.SCHEDULER, cf.DECODE, cf.MOONCAKE, cf.COMMON)


def _read(version, module=None, old=None, new=None):
    """The release's facts, one module edited (``old`` must occur exactly once)."""
    w = open_wheel(version)
    texts = {m: w.source_of(m)[0] for m in MODULES}
    if module is not None:
        assert texts[module].count(old) == 1, old
        texts[module] = texts[module].replace(old, new)
    return cf.mechanisms_of(*(texts[m] for m in MODULES))


@pytest.mark.parametrize("version", RELEASES)
def test_each_release_reads_as_the_table_and_its_variant(version):
    got = _read(version)
    assert (got.abort, got.receiver_times, got.release, got.release_on) == EXPECTED[version]
    assert cf.release_mismatches(version) == []


def test_the_receiver_timeout_states_are_read_not_assumed():
    """0.5.23 also times out Bootstrapping (its prefill wait, before the transfer queue):
    read, and outside the states the model's transfer-queue poll takes."""
    for version, states in (("0.5.12", {"WaitingForInput"}), ("0.5.23", {"Bootstrapping", "WaitingForInput"})):
        w = open_wheel(version)
        assert cf.receiver_timeout_states(w.source_of(cf.MOONCAKE)[0], w.source_of(cf.COMMON)[0]) == states
    assert "Bootstrapping" not in cf.POLLED and "Transferring" in cf.POLLED


# a source edited at one mechanism: (release, module, old, new, the fact, what it reads, the line)
EDITS = [
    # the timeout aborts kept on rank 0 instead of riding the broadcast (#27221 again)
    ("0.5.23", cf.SCHEDULER, "recv_requests(local_reqs=local_reqs)", "recv_requests(local_reqs=[])",
     "abort", Op.LOCAL, "0.5.23 abort: source Op.LOCAL, clocks-0.5.23 Op.BROADCAST"),
    # Transferring timed out too (what #31800 asks for)
    ("0.5.23", cf.COMMON, "elif status == KVPoll.WaitingForInput:",
     "elif status in (KVPoll.WaitingForInput, KVPoll.Transferring):", "receiver_times",
     ("WaitingForInput", "Transferring"), "0.5.23 receiver_times: source ('WaitingForInput', 'Transferring'), "
     "clocks-0.5.23 ('WaitingForInput',)"),
    # the release's MIN over the drain acks only: the deadline decided per rank
    ("0.5.23", cf.DECODE, "flags=ready, group=self.gloo_group, op=torch.distributed.ReduceOp.MIN",
     "flags=drained, group=self.gloo_group, op=torch.distributed.ReduceOp.MIN", "release", Op.LOCAL,
     "0.5.23 release: source Op.LOCAL, clocks-0.5.23 Op.MIN"),
    # a held slot released on the ack only (no deadline)
    ("0.5.19", cf.DECODE, "if not drained and now < deadline:", "if not drained:", "release_on", ("ack",),
     "0.5.19 release_on: source ('ack',), clocks-0.5.19 ('ack', 'deadline')"),
]


@pytest.mark.parametrize("version, module, old, new, fact, value, line", EDITS)
def test_a_source_edited_at_one_mechanism_shows_there_and_only_there(tmp_path, version, module, old, new,
                                                                     fact, value, line):
    edited = _read(version, module, old, new)
    assert getattr(edited, fact) == value
    assert [f for f in cf.ClockMechanisms.__dataclass_fields__
            if getattr(edited, f) != getattr(_read(version), f)] == [fact]
    # the same edit as a source tree: the mismatch line, and conform --facts exit 1
    path = tmp_path / (module.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True)
    path.write_text(open_wheel(version).source_of(module)[0].replace(old, new), encoding="utf-8")
    assert cf.release_mismatches(version, str(tmp_path)) == [line]


def test_conform_facts_prints_every_family_and_exits_0_on_the_pinned_releases(tmp_path, capsys):
    out = tmp_path / "facts.json"
    assert main(["conform", "--facts", "--sglang", "pinned", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"{len(PINNED) * len(FAMILIES)} checks: {len(PINNED) * len(FAMILIES)} match, 0 reproduce, 0 differ"
    assert any(line.split()[:4] == ["0.5.21", "clocks", "clocks-0.5.21", "matches"] for line in lines)
    assert out.read_text().count('"family"') == len(PINNED) * len(FAMILIES)


def test_conform_facts_on_an_edited_source_differs_and_exits_1(tmp_path, capsys):
    version, module, old, new, *_, line = EDITS[0]
    path = tmp_path / (module.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True)
    path.write_text(open_wheel(version).source_of(module)[0].replace(old, new), encoding="utf-8")
    assert main(["conform", "--facts", "--sglang", version, "--source", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert f"differs: {line}" in text and "0.5.23   decode" in text
    rows = check([version], str(tmp_path))
    assert [r["family"] for r in rows if r["verdict"] == "differs"] == ["clocks"]


@pytest.mark.parametrize("args, needle", [
    (["--points"], "--facts does not combine with --points"),
    (["--sglang", "0.5.12,0.5.13", "--source", "/tmp"], "--source names one release's source"),
    (["--source", "/nonexistent/dir"], "--source: /nonexistent/dir is not a directory"),
    (["--sglang", "0.5.7"], "SGLang 0.5.7 is not in"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    argv = ["conform", "--facts", *(["--sglang", "0.5.23"] if "--sglang" not in args else []), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_a_source_without_a_function_the_readers_need_is_one_line_and_exit_2(tmp_path, capsys):
    """An edited --source whose decode.py lost ``pop_transferred``: named, not a KeyError."""
    path = tmp_path / "sglang/srt/disaggregation/decode.py"
    path.parent.mkdir(parents=True)
    path.write_text("x = 1\n", encoding="utf-8")
    assert main(["conform", "--facts", "--sglang", "0.5.23", "--source", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "pdgate conform: the source defines no function pop_transferred (a reader needs it)"
