"""pdgate model: the executable spec (model.spec) and its Z3 encoding (model.encoding)."""
