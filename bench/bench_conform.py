"""``pdgate conform`` speed: one release (the newest pinned) over the default traces
(every trace ``pdgate prove`` exports plus the simulator runs), as shipped and with the
strict patch; goal under 60 s each. The T gloo processes are started once per rank count
and reused across traces; the prove run that writes the traces is not counted.
``quick`` restricts prove to the ungated and gate counterexamples."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time

TARGETS = {"conform_one_release_seconds": ("<=", 60.0),
           "conform_one_release_patch_seconds": ("<=", 60.0)}


def run(quick: bool) -> dict:
    from impl.sglang import conform
    from impl.sglang.wheels import PINNED
    release = PINNED[-1]
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "model.cli", "prove", "--traces", tmp]
        if quick:
            argv += ["--variant", "ungated", "--variant", "gate", "--only", "cex:"]
        subprocess.run(argv, check=True, capture_output=True, timeout=600)
        sources = conform.default_sources(tmp)
        figures: dict = {"release": release, "traces": len(sources)}
        for mode, key in (("own", "conform_one_release_seconds"),
                          ("patch", "conform_one_release_patch_seconds")):
            t0 = time.perf_counter()
            rows = conform.check([release], sources, mode=mode,
                                 patch="strict" if mode == "patch" else None)
            figures[key] = round(time.perf_counter() - t0, 2)
            figures[f"{mode}_differs"] = sum(r["verdict"] == "differs" for r in rows)
    return figures
