"""The import surface of the bandwidth measurement, kept where it was: the code is in
experts/calibrate.py (the measurement) and experts/random_fill.py (the random pools); the
bench-only timing helpers (`bench_banner`, `time_call`) moved to freetoken/bench/bandwidth.py.
"""
from __future__ import annotations

from freetoken.experts.calibrate import (  # noqa: F401
    GB,
    ExpertFn,
    FillBench,
    cpu_kernel_fn,
    fresh_routes,
    host_read_gbps,
    measure_overlap,
    measure_profile,
    time_experts,
)
from freetoken.experts.random_fill import make_pool  # noqa: F401
