"""Random weights in kernel layout with arbitrary types and group sizes, for kernel tests and the
sanitizer driver (``quantize_moe_weights`` only builds the named schemes)."""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ._abi import WeightType
from .weights import PackedWeight


def random_packed_weight(
    rng: np.random.Generator,
    wtype: WeightType,
    e: int,
    n: int,
    k: int,
    group_k: int,
    *,
    scale_dtype: Any = np.float32,
    zero: bool = False,
    scale2: bool = False,
    scale_values: Sequence[Any] | None = None,
    fp8_std: float = 1.0,
) -> PackedWeight:
    """Random codes [E, N, K] with one scale per row and group of ``group_k`` columns (drawn from
    ``scale_values`` when given), optional uint8 zero points and per-expert scale2. For
    ``WeightType.FLOAT`` the values are normal in ``scale_dtype`` and carry no scale."""
    cols = -(-k // group_k)
    if scale_values is not None:
        scale = jnp.asarray(rng.choice(np.asarray(scale_values), (e, n, cols)))
    else:
        scale = jnp.asarray((rng.random((e, n, cols)) * 0.05 + 0.01).astype(scale_dtype))
    if wtype in (WeightType.UINT4, WeightType.FP4_E2M1):
        data = jnp.asarray(rng.integers(0, 256, (e, n, k // 2)).astype(np.uint8))
    elif wtype == WeightType.INT8:
        data = jnp.asarray(rng.integers(-127, 128, (e, n, k)).astype(np.int8))
    elif wtype == WeightType.FP8_E4M3:
        data = jnp.asarray((rng.standard_normal((e, n, k)) * fp8_std).astype(ml_dtypes.float8_e4m3fn))
    else:
        return PackedWeight(jnp.asarray(rng.standard_normal((e, n, k)), scale_dtype), wtype=WeightType.FLOAT, k=k)
    z = jnp.asarray(rng.integers(0, 16, (e, n, cols)).astype(np.uint8)) if zero else None
    s2 = jnp.asarray((rng.random(e) + 0.5).astype(np.float32)) if scale2 else None
    return PackedWeight(data, scale, z, s2, wtype, k, 1, group_k)
