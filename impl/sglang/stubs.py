"""The one stub layer: SGLang's decode-side modules imported from a release's wheel, with
every other ``sglang.*`` module replaced by a recorder.

A release's ``sglang/srt/disaggregation/decode.py`` imports half of SGLang (model configs,
memory pools, the scheduler...). The transfer queue needs none of it on CPU, so only the
modules in ``REAL`` are executed from the wheel; any other ``sglang.*`` name resolves to a
``StubModule`` whose attributes are ``Stub`` classes. Every attribute the real code reads
from a stub is recorded (``Recorder.reads``), so what a new release needs shows up as a
list of names, not as a crash. Stubs are classes (the real code may subclass them or test
``isinstance``); calling one returns a falsy stub instance (stubbed feature tests such as
``is_npu()`` answer "no"), except that a stub called with one function returns it
unchanged (stubbed decorators leave the function alone). ``provide`` replaces chosen stub
attributes by fakes (``impl.sglang.fakes``).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from typing import Any, Callable

# Executed from the wheel; everything else under ``sglang`` is a StubModule.
REAL = ("sglang.srt.environ", "sglang.srt.disaggregation.base",
        "sglang.srt.disaggregation.base.conn", "sglang.srt.disaggregation.utils",
        "sglang.srt.disaggregation.decode_hicache_mixin", "sglang.srt.disaggregation.decode",
        "sglang.srt.disaggregation.prefill")      # prefill: only conform --points imports it
REAL_EXTRA: set[str] = set()     # added for one run (conform --pp: the scheduler PP mixin)


def _real(name: str) -> bool:
    return name in REAL or name in REAL_EXTRA


class Recorder:
    """Names read from stubs, in first-read order (``module.attr`` or ``module.A.b``)."""

    def __init__(self) -> None:
        self._seen: dict[str, None] = {}

    def note(self, name: str) -> None:
        self._seen.setdefault(name, None)

    @property
    def reads(self) -> list[str]:
        return list(self._seen)


class _StubMeta(type):
    """Class-level attribute reads on a stub make (and record) nested stubs."""

    def __getattr__(cls, name: str) -> Any:
        return _nested_stub(cls, cls.__stub_name__, cls.__stub_recorder__, name)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]) and cls.__stub_name__:
            return args[0]                      # a stubbed decorator: leave the function
        return super().__call__()


class Stub(metaclass=_StubMeta):
    __stub_name__ = ""
    __stub_recorder__ = Recorder()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __bool__(self) -> bool:
        return False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return Stub()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        type(self).__stub_recorder__.note(f"{type(self).__stub_name__}().{name}")
        return Stub()


def _nested_stub(owner: Any, prefix: str, recorder: Recorder, name: str) -> type:
    """A read of ``owner.name`` (a stub class or module): recorded, answered by a new
    stub class that is kept on the owner, so the next read finds it directly."""
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    qual = f"{prefix}.{name}"
    recorder.note(qual)
    child = make_stub(qual, recorder)
    setattr(owner, name, child)
    return child


def make_stub(qualname: str, recorder: Recorder) -> type:
    return _StubMeta(qualname.rsplit(".", 1)[-1], (Stub,),
                     {"__stub_name__": qualname, "__stub_recorder__": recorder})


class StubModule(types.ModuleType):
    """A stubbed ``sglang.*`` module (a package too, so submodules resolve)."""

    def __init__(self, name: str, recorder: Recorder):
        super().__init__(name)
        self.__path__: list[str] = []
        self.__stub_recorder__ = recorder

    def __getattr__(self, name: str) -> Any:
        return _nested_stub(self, self.__name__, self.__stub_recorder__, name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves every ``sglang`` name: REAL ones from ``source_of``, others as stubs."""

    def __init__(self, source_of: Callable[[str], tuple[str, bool]], recorder: Recorder,
                 provided: dict[str, dict[str, Any]]):
        self.source_of, self.recorder, self.provided = source_of, recorder, provided

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        is_pkg = not _real(fullname) or self.source_of(fullname)[1]
        return importlib.util.spec_from_loader(fullname, self, is_package=is_pkg)

    def create_module(self, spec: Any) -> types.ModuleType | None:
        if _real(spec.name):
            return None
        module = StubModule(spec.name, self.recorder)
        for attr, value in self.provided.get(spec.name, {}).items():
            setattr(module, attr, value)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if not _real(module.__name__):
            return
        source, _ = self.source_of(module.__name__)
        code = compile(source, f"<sglang wheel>/{module.__name__.replace('.', '/')}.py", "exec")
        exec(code, module.__dict__)


def purge() -> None:
    """Forget every loaded ``sglang`` module and finder (before loading another release)."""
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def install(source_of: Callable[[str], tuple[str, bool]],
            provided: dict[str, dict[str, Any]]) -> Recorder:
    """Make ``import sglang...`` resolve through the stub layer; returns the recorder.

    ``source_of(module) -> (source text, is_package)`` reads a REAL module from a wheel;
    ``provided[module][attr]`` are fakes set on stub modules instead of stubs."""
    purge()
    recorder = Recorder()
    sys.meta_path.insert(0, _Finder(source_of, recorder, provided))
    return recorder
