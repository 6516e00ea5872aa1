"""Loaded by every Python process of ``pdgate live`` (its folder is first on PYTHONPATH).

What a CPU-only SGLang 0.5.23 needs and PyPI cannot give it:
- torchvision from PyPI is a CUDA build whose C ops cannot load next to torch's CPU
  build; its fake (meta) registrations for those ops then raise at import. They are
  skipped for torchvision ops that do not exist (SGLang only uses its transforms).
- Mooncake's sender claims ``supports_host_tensor_indices``, a path that pins host
  memory and records a CUDA event; on CPU it must take the plain path.
Then, in the decode ranks, ``live_hooks`` (the strict patch, the fault, the rank logs)
when ``PDGATE_LIVE_ROLE=decode``; in the prefill, with ``PDGATE_LIVE_PATCH=strict``,
strict's prefill side (impl/sglang/prefill_patch.py: the room written last), and with
``PDGATE_LIVE_FAIL_SEND=RANK`` every KV transfer to decode rank RANK failing (the
release's own failure path from there on).
"""
import importlib.abc
import importlib.util
import os
import sys

import torch.library

_register_fake = torch.library.register_fake


def _guarded_register_fake(op, *args, **kwargs):
    name = op if isinstance(op, str) else ""
    if name.startswith("torchvision::"):
        try:
            torch._C._dispatch_find_schema_or_throw(name, "")
        except RuntimeError:
            return lambda fn: fn            # the op was never loaded: nothing to fake
    return _register_fake(op, *args, **kwargs)


torch.library.register_fake = _guarded_register_fake


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``fn(module)`` right after ``name`` is first executed."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        own_exec = spec.loader.exec_module

        def exec_module(module):
            own_exec(module)
            self.fn(module)
        spec.loader.exec_module = exec_module
        return spec


def after_import(name, fn):
    sys.meta_path.insert(0, _AfterImport(name, fn))


def _no_host_indices(conn):
    conn.MooncakeKVSender.supports_host_tensor_indices = False


after_import("sglang.srt.disaggregation.mooncake.conn", _no_host_indices)

if os.environ.get("PDGATE_LIVE_ROLE") == "decode":
    import live_hooks
    after_import("sglang.srt.disaggregation.decode", live_hooks.wrap)

if os.environ.get("PDGATE_LIVE_ROLE") == "prefill":
    import live_prefill
    live_prefill.install(after_import)

