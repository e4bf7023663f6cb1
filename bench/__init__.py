"""Benchmark tools, run by hand from the repository's root (`python -m bench.NAME --help`), not by pytest: they need
system tools (nginx, wrk, valgrind) and minutes of wall time. docs/benchmarks.md holds their current figures."""
