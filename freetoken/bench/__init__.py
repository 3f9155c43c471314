"""Benchmark and measurement tooling (not imported by the serving path)."""
