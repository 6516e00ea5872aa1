"""The production side of pdgate: the gated decode path (``impl.decode``) and its drivers."""
