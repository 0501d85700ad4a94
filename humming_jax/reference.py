"""The oracle of the expert semantics (SPEC §2), in pure jnp and float32, independent of the kernels.

Rounding points follow the contract: ``gu`` (with bias) rounded to the output dtype; the
activation rounded to the output dtype, or quantized for 8-bit activation schemes; ``d`` (with
bias) rounded to the output dtype; the weighted sum over k accumulated in float32, then cast.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .activations import apply_activation

_HI = jax.lax.Precision.HIGHEST


def _on_host(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """Evaluates the oracle on the CPU, whose float32 arithmetic is plain IEEE (a GPU backend may
    use approximate division or transcendentals, which moves 8-bit rounding ties). Under a trace
    (inside jit) it runs where it is traced."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> jax.Array:
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            return fn(*args, **kwargs)
        cpu = jax.devices("cpu")[0]
        move = lambda x: jax.device_put(x, cpu) if isinstance(x, (jax.Array, np.ndarray)) else x  # noqa: E731
        args, kwargs = jax.tree_util.tree_map(move, (args, kwargs))
        with jax.default_device(cpu):
            return fn(*args, **kwargs)

    return wrapper


class InputQuant(NamedTuple):
    """Dynamic activation quantization: ``kind`` "fp8" or "int8"; ``group_k`` 0 = per token."""

    kind: str
    group_k: int


@_on_host
def fake_quantize(x: jax.Array, quant: InputQuant) -> jax.Array:
    """The float32 values a kernel sees after dynamic quantization of x [..., K] (codes * scale)."""
    v = x.astype(jnp.float32)
    k = v.shape[-1]
    g = quant.group_k or k
    grouped = v.reshape(*v.shape[:-1], k // g, g)
    qmax = 448.0 if quant.kind == "fp8" else 127.0
    absmax = jnp.max(jnp.abs(grouped), axis=-1, keepdims=True)
    # XLA may rewrite a division by a constant or a broadcast into a multiplication by its
    # reciprocal (one ulp off); the barriers keep both divisions true IEEE divisions, as in the kernels.
    barrier = jax.lax.optimization_barrier
    scale = absmax / barrier(jnp.full_like(absmax, qmax))
    safe = jnp.where(scale > 0, scale, 1.0)
    code = jnp.where(scale > 0, grouped / barrier(jnp.broadcast_to(safe, grouped.shape)), 0.0)
    if quant.kind == "fp8":
        code = jnp.clip(code, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        code = jnp.clip(jnp.round(code), -127.0, 127.0)
    return (code * scale).reshape(v.shape)


class _Experts(NamedTuple):
    """Float32 expert weights and biases, and how the MLP rounds (shared by both oracles)."""

    w13: jax.Array
    w2: jax.Array
    b13: jax.Array | None
    b2: jax.Array | None
    dtype: Any
    activation: str
    limit: float | None
    quant: InputQuant | None

    @classmethod
    def build(cls, w13: Any, w2: Any, b13: Any, b2: Any, dtype: Any, activation: str, limit: float | None,
              quant: InputQuant | None) -> "_Experts":
        f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)  # noqa: E731
        return cls(f32(w13), f32(w2), f32(b13), f32(b2), dtype, activation, limit, quant)

    def mlp(self, x: jax.Array, e: Any) -> jax.Array:
        """d for all rows of x through expert e: float32 values already rounded to dtype."""
        gu = jnp.matmul(x, self.w13[e].T, precision=_HI)
        if self.b13 is not None:
            gu = gu + self.b13[e]
        gu = gu.astype(self.dtype).astype(jnp.float32)
        a = apply_activation(gu, self.activation, self.limit)
        a = fake_quantize(a, self.quant) if self.quant is not None else a.astype(self.dtype).astype(jnp.float32)
        d = jnp.matmul(a, self.w2[e].T, precision=_HI)
        if self.b2 is not None:
            d = d + self.b2[e]
        return d.astype(self.dtype).astype(jnp.float32)


def _prepare_x(hidden_states: jax.Array, quant: InputQuant | None) -> jax.Array:
    x = jnp.asarray(hidden_states)
    return fake_quantize(x, quant) if quant is not None else x.astype(jnp.float32)


@_on_host
def moe_reference(
    hidden_states: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    activation: str = "silu",
    expert_map: jax.Array | None = None,
    b13: jax.Array | None = None,
    b2: jax.Array | None = None,
    activation_limit: float | None = None,
    input_quant: InputQuant | None = None,
) -> jax.Array:
    """Standard-format MoE: hidden_states [M, H], w13 [E, N1, H], w2 [E, H, I] (float values,
    e.g. ``MoEWeights.dequantize()``), topk [M, k]; returns [M, H] in hidden_states' dtype.

    Ids outside [0, E_global) and ids that ``expert_map`` sends to -1 are skipped."""
    dtype = jnp.asarray(hidden_states).dtype
    experts = _Experts.build(w13, w2, b13, b2, dtype, activation, activation_limit, input_quant)
    num_local = experts.w13.shape[0]
    ids = jnp.asarray(topk_ids).astype(jnp.int32)
    if expert_map is None:
        expert_map = jnp.arange(num_local, dtype=jnp.int32)
    expert_map = jnp.asarray(expert_map, jnp.int32)
    in_range = (ids >= 0) & (ids < expert_map.shape[0])
    local = jnp.where(in_range, expert_map[jnp.clip(ids, 0, expert_map.shape[0] - 1)], -1)
    local = jnp.where((local >= 0) & (local < num_local), local, -1)
    weights = jnp.asarray(topk_weights, jnp.float32)
    x = _prepare_x(hidden_states, input_quant)

    def body(acc: jax.Array, e: jax.Array) -> tuple[jax.Array, None]:
        d = experts.mlp(x, e)
        coef = jnp.sum(jnp.where(local == e, weights, 0.0), axis=1)  # [M]
        return acc + coef[:, None] * d, None

    acc0 = jnp.zeros((x.shape[0], experts.w2.shape[1]), jnp.float32)
    acc, _ = jax.lax.scan(body, acc0, jnp.arange(num_local))
    return acc.astype(dtype)


@_on_host
def batched_reference(
    hidden_states: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    expert_num_tokens: jax.Array,
    *,
    activation: str = "silu",
    b13: jax.Array | None = None,
    b2: jax.Array | None = None,
    activation_limit: float | None = None,
    input_quant: InputQuant | None = None,
) -> jax.Array:
    """Batched format: hidden_states [E, T, H] -> [E, T, H]; rows t >= expert_num_tokens[e] are 0."""
    hs = jnp.asarray(hidden_states)
    dtype = hs.dtype
    experts = _Experts.build(w13, w2, b13, b2, dtype, activation, activation_limit, input_quant)
    rows = []
    for e in range(hs.shape[0]):
        d = experts.mlp(_prepare_x(hs[e], input_quant), e)
        live = jnp.arange(hs.shape[1]) < jnp.asarray(expert_num_tokens)[e]
        rows.append(jnp.where(live[:, None], d, 0.0))
    return jnp.stack(rows).astype(dtype)


def relative_error(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| in float64 (NaN anywhere gives inf)."""
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    w = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if not np.all(np.isfinite(g)):
        return float("inf")
    denom = np.linalg.norm(w)
    return float(np.linalg.norm(g - w) / (denom if denom > 0 else 1.0))
