"""The reference simulator: SimPy decides *when* events happen, ``model.spec`` decides
*what* every rank does (docs/SIMULATOR.md)."""
from model import _native

_native.guard()        # before sim.engine is imported: compiled only if fresh
