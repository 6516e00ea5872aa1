"""Benchmarks (``pdgate bench``): speed goals are figures here, never timed tests."""
