"""The rows ``pdgate prove`` gives for a family of variants (one run per test module)."""
from __future__ import annotations

import json
from typing import Iterable

from model.cli import main


def prove_rows(folder, variants: Iterable[str]) -> list[dict]:
    """``pdgate prove --variant V ...`` into ``folder`` (its JSON and traces); the run
    must exit 0, else the rows that are not as expected are the message."""
    argv = ["prove", "--json", str(folder / "r.json"), "--traces", str(folder / "traces")]
    for name in variants:
        argv += ["--variant", name]
    code = main(argv)
    got = json.loads((folder / "r.json").read_text())
    assert code == 0, [r for r in got if r["result"] != r["expected"]]
    return got
