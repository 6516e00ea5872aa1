"""Suite-wide settings.

Mooncake: quiet logs and short transfer timeouts so a frozen peer fails a test in
seconds, not the default 30 s of a spinning core.
Hypothesis: no per-example deadline (a loaded 2-core CI machine is slow, not wrong); under
CI=true examples are derandomized so a landing never depends on luck, while local runs
keep exploring new examples.
Compiled build (model/_native.py): a test that patches a compiled module's functions
(marked ``source_modules``) needs their source, since compiled calls do not look names
up; where this process runs the compiled build, such a test runs in a fresh process on
the source (PDGATE_PURE=1) and passes only if it passes there.
"""
import os
import re
import subprocess
import sys

import pytest
from hypothesis import settings

from model import _native

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "3")

settings.register_profile("local", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "local")


SOURCE_RUN_TIMEOUT_S = 280      # under pytest-timeout's 300 s for the test that waits


def pytest_configure(config):
    config.addinivalue_line("markers", "source_modules: patches functions of the compiled "
                            "modules, so runs on their source (see this file's doc)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("source_modules") is None or not _native.compiled():
        return None             # pytest calls the test here, as usual
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid],
        cwd=pyfuncitem.config.rootpath, env={**os.environ, "PDGATE_PURE": "1"},
        capture_output=True, text=True, timeout=SOURCE_RUN_TIMEOUT_S)
    tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
    assert done.returncode == 0 and re.search(r"^1 passed", done.stdout, re.M), "\n".join(tail)
    return True
