"""The compiled build of the simulator's hot modules, and the guard that keeps it honest.

``setup.py`` compiles COMPILED with mypyc where it can (a C compiler and the Python
headers; ``PDGATE_PURE_BUILD=1`` skips it) and writes MANIFEST: each module's source
hash at build time. The compiled modules are the same source, type-checked and turned
into C; a missing compiler leaves plain Python, with the same results.

Python imports an extension module before a source file of the same name, so a build
older than its source would run old code. ``guard()`` (called by ``model/__init__``,
before any of these modules is imported) routes every COMPILED module to its source
when any one of them is stale or missing, or when ``PDGATE_PURE=1``: all or none,
because compiled modules call each other's classes natively.

Standard library only: ``setup.py`` loads this file before anything is installed.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path

COMPILED = ("model.spec.packed", "sim.engine", "sim.steptimes")
MANIFEST = "_native.json"        # in the model package, beside this file
GROUP = "pdgate_native"          # mypyc's shared library: pdgate_native__mypyc.*.so
_ROOT = Path(__file__).resolve().parents[1]     # the folder holding model/ and sim/


def source_path(module: str, root: Path = _ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest(root: Path = _ROOT) -> dict[str, str]:
    """{module: source sha256} of COMPILED as they were compiled."""
    return {m: digest(source_path(m, root)) for m in COMPILED}


def _built(module: str) -> bool:
    """An extension module for ``module`` lies beside its source."""
    src = source_path(module)
    return any(src.with_suffix(suffix).exists()
               for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def _fresh() -> bool:
    """Every COMPILED module has an extension whose source is unchanged since the build."""
    try:
        recorded = json.loads((_ROOT / "model" / MANIFEST).read_text())
        return all(_built(m) for m in COMPILED) and recorded == manifest()
    except (OSError, ValueError):
        return False


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Imports COMPILED modules from their .py files, whatever extension lies beside."""

    def find_spec(self, name: str, path: object = None, target: object = None):
        if name not in COMPILED:
            return None
        return importlib.util.spec_from_file_location(name, source_path(name))


_compiled: bool | None = None      # guard()'s decision, once per process


def guard() -> None:
    """Decide once per process: the compiled modules, or every one from source."""
    global _compiled
    if _compiled is not None:
        return
    _compiled = os.environ.get("PDGATE_PURE", "") in ("", "0") and _fresh()
    if not _compiled:
        sys.meta_path.insert(0, _SourceFinder())


def compiled() -> bool:
    """Whether this process runs the compiled modules (see guard)."""
    guard()
    return bool(_compiled)
