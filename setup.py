"""Builds pdgate; compiles the simulator's hot modules with mypyc where it can.

Everything else is in pyproject.toml. The modules in model/_native.py's COMPILED are
type-checked and compiled to C (the same source; about 1.5x the simulator's speed). No
C compiler, a failed build or PDGATE_PURE_BUILD=1 leaves them plain Python, with the same
results. The build records each module's source hash (model/_native.json), so a source
edited after the build is imported as source, not as the stale extension.
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_pdgate_native", HERE / "model" / "_native.py")
native = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native)


def _say(msg: str) -> None:
    print(f"pdgate: {msg}", file=sys.stderr)


def _extensions() -> list:
    if os.environ.get("PDGATE_PURE_BUILD", "") not in ("", "0"):
        _say("PDGATE_PURE_BUILD set: the simulator stays plain Python")
        return []
    try:
        from mypyc.build import mypycify
        paths = [str(native.source_path(m, Path("."))) for m in native.COMPILED]
        # (only the compiled modules must type-check: errors elsewhere are not reported;
        # a module without stubs is Any, as where numpy or simpy is not in the build env)
        return mypycify(["--follow-imports=silent", "--ignore-missing-imports", *paths], opt_level="3", group_name=native.GROUP)
    except (Exception, SystemExit) as exc:     # mypy missing, or its type check failed
        _say(f"compiled build skipped ({type(exc).__name__}: {exc}); the simulator stays plain Python")
        return []


class OptionalBuildExt(build_ext):
    """build_ext whose failure leaves a working pure-Python install, and which records
    the compiled sources' hashes beside the extensions."""

    def _manifest(self) -> Path:
        """model/_native.json, in the model package where this build puts it."""
        return Path(self.get_ext_fullpath("model._native")).parent / native.MANIFEST

    def run(self) -> None:
        if not self.extensions:
            return
        try:
            super().run()
        except Exception as exc:      # no compiler, no headers
            _say(f"compiled build failed ({type(exc).__name__}: {exc}); the simulator stays plain Python")
            return
        self._manifest().write_text(json.dumps(native.manifest(HERE), indent=1, sort_keys=True) + "\n")

    def get_outputs(self) -> list:
        return super().get_outputs() + ([str(self._manifest())] if self.extensions else [])


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
