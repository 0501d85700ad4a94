"""Host-clock timing of jitted calls, shared by the GEMM-only benchmarks."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import numpy as np


def median_ms(f: Callable[..., Any], args: Sequence[Any], samples: int) -> float:
    """Median wall time of f(*args) in ms over `samples` runs, after compiling and one warm-up."""
    jax.block_until_ready(f(*args))  # compile + warm-up
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3
