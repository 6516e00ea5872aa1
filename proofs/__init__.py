"""Proof obligations, the explicit-state explorer and `pdgate prove`."""
