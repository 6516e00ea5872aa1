"""SGLang's released decode code, run on CPU from its wheels and checked against the spec
(``pdgate conform``), plus the strict patch for a live decode worker (``patch.install``).
See docs/SGLANG.md."""
