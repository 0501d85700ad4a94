"""Expert weights in kernel format: ``PackedWeight`` (one GEMM's weights) and ``MoEWeights``.

Kernel layout of one weight tensor of logical shape [E, N, K]:
- ``data``: float values [E, N, K] (bf16/fp16), or codes: uint8 [E, N, K/2] for 4-bit codes
  (low nibble = even k), int8 [E, N, K], float8_e4m3fn [E, N, K];
- ``scale``: [E, ceil(N/group_n), ceil(K/group_k)] (float32, bf16, fp16, float8_e4m3fn, or uint8
  e8m0 meaning 2^(s-127));
- ``zero``: uint8 zero points on the scale grid (4-bit integer codes only; absent: 8);
- ``scale2``: float32 [E], a second per-expert scale (NVFP4).

The value a kernel uses is ``((q - zero) * scale) * scale2`` in float32, rounded to the
activation dtype when the activations are 16-bit. ``MoEWeights.dequantize`` returns exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._abi import WeightType
from .quant_keys import QuantKey

_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
FP4_E2M1_TABLE = np.concatenate([_FP4_VALUES, -_FP4_VALUES])


def e8m0_to_float32(s: jax.Array) -> jax.Array:
    """uint8 e8m0 scale codes to float32: 2^(s - 127); 255 is NaN."""
    s32 = s.astype(jnp.uint32)
    normal = jax.lax.bitcast_convert_type(s32 << 23, jnp.float32)
    tiny = jnp.float32(2.0**-127)
    out = jnp.where(s32 == 0, tiny, normal)
    return jnp.where(s32 == 255, jnp.float32(jnp.nan), out)


def scale_to_float32(scale: jax.Array) -> jax.Array:
    if scale.dtype == jnp.uint8:
        return e8m0_to_float32(scale)
    return scale.astype(jnp.float32)


def unpack_nibbles(data: jax.Array) -> jax.Array:
    """uint8 [..., K/2] -> uint8 [..., K], low nibble first."""
    lo = data & 0xF
    hi = data >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class PackedWeight:
    """One expert GEMM's weights in kernel layout (see the module docstring)."""

    data: jax.Array
    scale: jax.Array | None = None
    zero: jax.Array | None = None
    scale2: jax.Array | None = None
    wtype: WeightType = WeightType.FLOAT
    k: int = 0  # logical K (data holds K/2 bytes per row for 4-bit codes)
    group_n: int = 1
    group_k: int = 1

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return (self.data, self.scale, self.zero, self.scale2), (
            self.wtype,
            self.k,
            self.group_n,
            self.group_k,
        )

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any, ...]) -> "PackedWeight":
        data, scale, zero, scale2 = children
        wtype, k, gn, gk = aux
        return cls(data, scale, zero, scale2, wtype, k, gn, gk)

    @property
    def num_experts(self) -> int:
        return int(self.data.shape[0])

    @property
    def n(self) -> int:
        return int(self.data.shape[1])

    @property
    def shape(self) -> tuple[int, int, int]:
        """Logical [E, N, K]."""
        return (self.num_experts, self.n, self.k)

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales (what a GEMM streams)."""
        return sum(int(a.size) * a.dtype.itemsize for a in (self.data, self.scale, self.zero, self.scale2) if a is not None)

    def values(self) -> jax.Array:
        """The float32 weight values before rounding to the activation dtype, [E, N, K]."""
        if self.wtype == WeightType.FLOAT:
            return self.data.astype(jnp.float32)
        if self.wtype == WeightType.UINT4:
            q = unpack_nibbles(self.data).astype(jnp.int32)
            z = 8 if self.zero is None else self._expand(self.zero).astype(jnp.int32)
            v = (q - z).astype(jnp.float32)
        elif self.wtype == WeightType.INT8:
            v = self.data.astype(jnp.float32)
        elif self.wtype == WeightType.FP8_E4M3:
            v = self.data.astype(jnp.float32)
        elif self.wtype == WeightType.FP4_E2M1:
            v = jnp.asarray(FP4_E2M1_TABLE)[unpack_nibbles(self.data).astype(jnp.int32)]
        else:  # pragma: no cover - guarded by construction
            raise ValueError(f"unknown weight type {self.wtype}")
        v = v * self._expand(scale_to_float32(self.scale))
        if self.scale2 is not None:
            v = v * self.scale2.astype(jnp.float32)[:, None, None]
        return v

    def _expand(self, grid: jax.Array) -> jax.Array:
        """Broadcasts a per-group grid [E, N/gn, K/gk] to [E, N, K]."""
        e, n, k = self.shape
        g = jnp.repeat(grid, self.group_n, axis=1)[:, :n]
        return jnp.repeat(g, self.group_k, axis=2)[:, :, :k]


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class MoEWeights:
    """The experts of one MoE layer in kernel format, with the metadata the kernels need.

    ``w13`` is [E, N1, H] (N1 = 2 I for gated activations: gate rows then up rows, or
    interleaved for ``swigluoai``; N1 = I for ``*_no_mul``); ``w2`` is [E, H, I]; ``b13``/``b2``
    optional float32 biases [E, N1] / [E, H]. ``dtype`` is the activation (and output) dtype
    the weights are meant for; ``act_key`` says how activations are quantized (None: 16-bit).
    """

    w13: PackedWeight
    w2: PackedWeight
    b13: jax.Array | None = None
    b2: jax.Array | None = None
    weight_key: QuantKey | None = None
    act_key: QuantKey | None = None
    scheme: str = "bf16"
    dtype: Any = field(default=jnp.bfloat16)

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return (self.w13, self.w2, self.b13, self.b2), (
            self.weight_key,
            self.act_key,
            self.scheme,
            jnp.dtype(self.dtype).name,
        )

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any, ...]) -> "MoEWeights":
        w13, w2, b13, b2 = children
        weight_key, act_key, scheme, dtype = aux
        return cls(w13, w2, b13, b2, weight_key, act_key, scheme, jnp.dtype(dtype))

    @property
    def num_experts(self) -> int:
        return self.w13.num_experts

    @property
    def hidden_size(self) -> int:
        return self.w13.k

    @property
    def intermediate_size(self) -> int:
        return self.w2.k

    @property
    def n1(self) -> int:
        return self.w13.n

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    def with_biases(self, b13: jax.Array | None, b2: jax.Array | None) -> "MoEWeights":
        """A copy carrying float32 biases b13 [E, N1] and b2 [E, H]."""
        return replace(
            self,
            b13=None if b13 is None else jnp.asarray(b13, jnp.float32),
            b2=None if b2 is None else jnp.asarray(b2, jnp.float32),
        )

    def dequantize(self) -> tuple[jax.Array, jax.Array]:
        """(w13 [E, N1, H], w2 [E, H, I]) as float32: exactly the values the kernels multiply."""
        out = []
        for w in (self.w13, self.w2):
            v = w.values()
            if self.act_key is None:
                v = v.astype(self.dtype).astype(jnp.float32)
            out.append(v)
        return out[0], out[1]
