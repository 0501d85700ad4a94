"""Host-clock timing of jitted calls and the two ceilings, shared by the GEMM-only and quick benchmarks."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
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


def copy_ceiling(samples: int, mbytes: int = 2048) -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read + written) of an elementwise pass."""
    x = jnp.ones((mbytes * 1024 * 1024 // 4,), jnp.float32)
    ms = median_ms(jax.jit(lambda x: x * 1.0001), (x,), samples)
    return 2 * x.size * 4 / (ms * 1e-3) / 1e12


def matmul_ceiling(samples: int, n: int = 8192) -> float:
    """bf16 square matrix product throughput in TFLOP/s (float32 accumulation)."""
    x = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(jnp.bfloat16)
    ms = median_ms(jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32).astype(jnp.bfloat16)), (x,),
                   samples)
    return 2 * n**3 / (ms * 1e-3) / 1e12
