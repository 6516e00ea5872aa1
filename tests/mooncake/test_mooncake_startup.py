"""``pdgate e2e``'s start-up waits follow ``--timeout-s`` (impl/mooncake/cluster.py,
``Cluster.left``): a prefill or a decode rank that never answers (stopped with SIGSTOP
the moment it is started) ends the run in about ``--timeout-s`` with one error line
naming it, and the JSON is still written. The waits were fixed, 60 s for the prefill's
endpoint line and 90 s for each rank's ready line, whatever bound the run was given."""
from __future__ import annotations

import json
import re
import signal
import time

import pytest

from impl.mooncake.cluster import Cluster
from model.cli import main


@pytest.mark.parametrize("stopped, timeout_s, said", [
    ("prefill0", 4.0, "prefill0: no endpoint line within"),
    ("rank0", 20.0, "rank0: no ready line within"),    # the ready lines are read rank 0 first
], ids=["prefill", "rank"])
def test_a_child_that_never_answers_ends_the_run_at_its_timeout(stopped, timeout_s, said, tmp_path,
                                                                 capsys, monkeypatch):
    started = Cluster._child

    def child(self, name, argv):
        c = started(self, name, argv)
        if name == stopped:
            c.signal(signal.SIGSTOP)        # alive, holding its pipes, never answering
        return c
    monkeypatch.setattr(Cluster, "_child", child)
    work = tmp_path / "w"
    t0 = time.monotonic()
    rc = main(["e2e", "--requests", "2", "--page-bytes", "4096", "--min-pages", "1", "--max-pages", "1",
               "--timeout-s", f"{timeout_s:g}", "--work-dir", str(work)])
    waited = time.monotonic() - t0
    out, err = capsys.readouterr()
    errors = [ln for ln in err.splitlines() if ln.startswith("pdgate e2e: ") and "namespace" not in ln]
    assert rc == 1 and len(errors) == 1 and said in errors[0], (err, out[-300:])
    assert 0 < float(re.search(r"within ([0-9.]+) s", errors[0]).group(1)) <= timeout_s, errors
    assert timeout_s - 0.5 <= waited < timeout_s + 20, waited   # not 60 s, not 90 s
    figs = json.loads((work / "e2e.json").read_text())
    assert figs["error"] == errors[0][len("pdgate e2e: "):] and figs["committed"] is None
