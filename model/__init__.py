"""pdgate model: the executable spec (model.spec) and its Z3 encoding (model.encoding)."""
from model import _native

_native.guard()        # before model.spec.packed is imported: compiled only if fresh
