"""The compiled build (setup.py, model/_native.py): the install compiled the simulator's
hot modules, they report exactly what their source reports, and a build older than
its source, or PDGATE_PURE=1, imports the source instead."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from model import _native
from tests.sim.digests import digests

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120
_WHERE = ("import model._native as n, model.spec.packed, sim.engine, sim.steptimes; "
          "print(n.compiled(), *(m.__file__.endswith('.py') for m in "
          "(model.spec.packed, sim.engine, sim.steptimes)))")


def _python(code: str, cwd: Path, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(cwd), **env}, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_install_compiled_the_simulator():
    """CI installs with scripts/install.sh: a C compiler is there, so the build must be."""
    import model.spec.packed
    import sim.engine
    assert _native.compiled()
    for module in (model.spec.packed, sim.engine):
        assert not module.__file__.endswith(".py"), module.__file__


def test_compiled_and_source_give_the_same_runs():
    source = json.loads(_python("import json; from tests.sim.digests import digests; "
                                "print(json.dumps(digests()))", ROOT, PDGATE_PURE="1"))
    assert source == json.loads(json.dumps(digests()))
    kinds = {o for d in source.values() for o in d["outcomes"]}
    assert {1, 2} <= kinds and any(d["divergence"] for d in source.values())


def test_pure_env_imports_the_source():
    assert _python(_WHERE, ROOT, PDGATE_PURE="1") == "False True True True"
    assert _python(_WHERE, ROOT) == "True False False False"


@pytest.fixture
def tree(tmp_path):
    """A copy of the installed packages, compiled extensions and manifest included."""
    for pkg in ("model", "sim"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for lib in ROOT.glob(f"{_native.GROUP}__mypyc*"):
        shutil.copy(lib, tmp_path)
    return tmp_path


def test_a_copy_of_the_build_runs_compiled(tree):
    assert _python(_WHERE, tree) == "True False False False"


@pytest.mark.parametrize("stale", ["sim/steptimes.py", "model/spec/packed.py", "model/_native.json"])
def test_a_source_edited_after_the_build_is_imported_as_source(tree, stale):
    """One edited module (or a changed manifest) puts all of them on their source:
    compiled modules call each other's classes natively."""
    path = tree / stale
    path.write_text(path.read_text().replace("}", ', "x": "y"}') if stale.endswith(".json")
                    else path.read_text() + "\n# edited\n")
    assert _python(_WHERE, tree) == "False True True True"


@pytest.mark.parametrize("missing", ["model/_native.json", "sim/engine.*.so"])
def test_a_missing_manifest_or_extension_means_source(tree, missing):
    gone = list(tree.glob(missing))
    assert gone
    for path in gone:
        path.unlink()
    assert _python(_WHERE, tree) == "False True True True"
