"""The reference simulator: SimPy decides *when* events happen, ``model.spec`` decides
*what* every rank does (docs/SIMULATOR.md)."""
import model  # noqa: F401  (its __init__ runs the compiled build's guard before sim.engine loads)
