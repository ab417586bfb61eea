"""The test suite as one package (`tests.kernels`, `tests.server`, ...): it keeps `tests/` itself off sys.path, where
its `kernels` folder shadowed the `kernels` package that transformers (5.25 with `kernels` installed) imports."""
