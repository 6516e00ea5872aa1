"""SGLang's released wheels: where they are cached and how a release's modules are read.

``scripts/install.sh`` fetches every release in ``RELEASES`` (``pip download --no-deps``)
into the cache; nothing here downloads. A release missing from the cache is a ``MissingRelease``
whose message names the install command.
"""
from __future__ import annotations

import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

# Every release install.sh fetches (`--sglang all`): each one's source is read and checked
# against the variants that model it (`pdgate conform --facts`).
RELEASES = tuple(f"0.5.{n}" for n in range(12, 24))
# The releases whose code the heavier conform modes run by default (`--sglang pinned`):
# the ones the variants were first read from (docs/SGLANG.md says which modes run all).
PINNED = ("0.5.12", "0.5.13", "0.5.18", "0.5.19", "0.5.21", "0.5.23")
_VERSION = re.compile(r"^\d+\.\d+\.\d+(\.post\d+)?$")


class MissingRelease(LookupError):
    """The wheel of a release is not in the cache (one line, names the fix)."""


def cache_dir() -> Path:
    """``$PDGATE_SGLANG_CACHE``, default ``~/.cache/pdgate/sglang``."""
    env = os.environ.get("PDGATE_SGLANG_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdgate" / "sglang"


def parse_version(text: str) -> tuple[int, ...]:
    """``0.5.13`` -> (0, 5, 13); ``.postN`` adds a fourth number. ValueError otherwise."""
    if not _VERSION.match(text):
        raise ValueError(f"not an SGLang release number: {text!r} (like 0.5.13)")
    return tuple(int(x) for x in text.replace(".post", ".").split("."))


def wheel_path(version: str) -> Path:
    parse_version(version)
    found = sorted(cache_dir().glob(f"sglang-{version}-*.whl"))
    if not found:
        raise MissingRelease(
            f"SGLang {version} is not in {cache_dir()}: run `bash scripts/install.sh` (or "
            f"`pip download --no-deps sglang=={version} -d {cache_dir()}`)")
    return found[0]


@dataclass
class Wheel:
    """One release's wheel, opened for reading modules."""
    version: str
    path: Path

    def __post_init__(self) -> None:
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (OSError, zipfile.BadZipFile) as exc:
            raise MissingRelease(f"SGLang {self.version}: cannot read {self.path}: {exc}; "
                                 f"delete it and run `bash scripts/install.sh`") from None
        self._names = set(self._zip.namelist())

    overlay: Path | None = None      # a source tree read before the wheel (a patched copy)

    def source_of(self, module: str) -> tuple[str, bool]:
        """(source text, is_package) of ``module``, from ``overlay`` where that tree has
        the file, else from the wheel; MissingRelease if neither has it."""
        for name, is_pkg in module_files(module):
            if self.overlay is not None and (self.overlay / name).is_file():
                return (self.overlay / name).read_text(encoding="utf-8"), is_pkg
            if name in self._names:
                return self._zip.read(name).decode("utf-8"), is_pkg
        raise MissingRelease(f"SGLang {self.version}: {module} is not in {self.path.name}")

    def member(self, name: str) -> str:
        """The text of one file of the wheel (``sglang/srt/...py``)."""
        return self._zip.read(name).decode("utf-8")


def module_files(module: str) -> tuple[tuple[str, bool], ...]:
    """Where ``module``'s source lives in a wheel or source tree: (path, is_package)."""
    base = module.replace(".", "/")
    return ((f"{base}.py", False), (f"{base}/__init__.py", True))


def open_wheel(version: str, overlay: str | Path | None = None) -> Wheel:
    """``overlay``: a source tree (e.g. the release's files with the strict diff applied)
    whose modules replace the wheel's."""
    return Wheel(version, wheel_path(version), None if overlay is None else Path(overlay))
