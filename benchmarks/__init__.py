"""Maintained benchmark scripts (README.md). Run from the repository root with PYTHONPATH=$PWD; the modules they
share (`scripted_server`, `agent_sessions`) import as `benchmarks.<name>`, from the tests too."""
