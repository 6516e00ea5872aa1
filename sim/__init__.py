"""The reference simulator: SimPy decides *when* events happen, ``model.spec`` decides
*what* every rank does (docs/SIMULATOR.md)."""
