"""Tooling, not the serving runtime: benchmarks, the bandwidth probe, synthetic routing and
replay, random weights for real-shape models, and the `ft bench` subcommands."""
