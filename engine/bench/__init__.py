"""Benchmarks of the engine and of servers; each writes its figures to docs/benchmarks.md."""
