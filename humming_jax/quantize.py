"""Named quantization schemes and ``quantize_moe_weights``: float weights -> ``MoEWeights``.

A scheme fixes the weight codes and scales (its weight ``QuantKey``) and how activations enter
the GEMMs (its activation ``QuantKey``, None for 16-bit). Quantization runs in NumPy on the host,
once, when weights are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ._abi import WeightType
from .quant_keys import GroupShape, QuantKey, ScaleDesc
from .weights import FP4_E2M1_TABLE, MoEWeights, PackedWeight

# --- activation keys (dynamic, computed per call) -------------------------------------------
ACT_FP8_PER_TOKEN = QuantKey("float8_e4m3fn", ScaleDesc("float32", False, GroupShape.PER_TOKEN))
ACT_FP8_PER_GROUP_128 = QuantKey("float8_e4m3fn", ScaleDesc("float32", False, GroupShape(1, 128)))
ACT_INT8_PER_TOKEN = QuantKey("int8", ScaleDesc("float32", False, GroupShape.PER_TOKEN))


def act_quant_params(act_key: QuantKey | None) -> tuple[str, int] | None:
    """(kind, group_k) for a dynamic activation key; group_k 0 = one scale per token."""
    if act_key is None:
        return None
    kind = {"float8_e4m3fn": "fp8", "int8": "int8"}.get(act_key.dtype)
    if kind is None or act_key.scale is None or act_key.scale.static:
        raise ValueError(f"unsupported activation quantization {act_key}")
    col = act_key.scale.group_shape.col
    return kind, (col if col > 0 else 0)


@dataclass(frozen=True)
class Scheme:
    name: str
    weight_key: QuantKey
    act_key: QuantKey | None
    quantize: Callable[[np.ndarray, Any], PackedWeight]
    default_dtype: Any = jnp.bfloat16


# --- quantizers: float32 [E, N, K] -> PackedWeight ------------------------------------------
def _grid_absmax(w: np.ndarray, gn: int, gk: int) -> np.ndarray:
    e, n, k = w.shape
    pn, pk = -(-n // gn) * gn, -(-k // gk) * gk
    padded = np.zeros((e, pn, pk), np.float32)
    padded[:, :n, :k] = np.abs(w)
    return padded.reshape(e, pn // gn, gn, pk // gk, gk).max(axis=(2, 4))


def _expand(grid: np.ndarray, shape: tuple[int, int, int], gn: int, gk: int) -> np.ndarray:
    g = np.repeat(np.repeat(grid, gn, axis=1), gk, axis=2)
    return g[:, : shape[1], : shape[2]]


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    q = q.astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _check_divisible(w: np.ndarray, gk: int, what: str) -> None:
    if w.shape[2] % gk:
        raise ValueError(f"{what} needs K divisible by {gk}; got K = {w.shape[2]}")


def _float(dtype: Any) -> Callable[[np.ndarray, Any], PackedWeight]:
    def q(w: np.ndarray, _: Any) -> PackedWeight:
        return PackedWeight(jnp.asarray(w, dtype), wtype=WeightType.FLOAT, k=w.shape[2])

    return q


def _int4_group(group: int, symmetric: bool) -> Callable[[np.ndarray, Any], PackedWeight]:
    def q(w: np.ndarray, dtype: Any) -> PackedWeight:
        _check_divisible(w, group, f"int4 group {group}")
        e, n, k = w.shape
        g = w.reshape(e, n, k // group, group)
        if symmetric:
            scale = (2.0 * np.abs(g).max(-1) / 15.0).astype(np.float32)
            scale = np.asarray(jnp.asarray(scale, dtype).astype(jnp.float32))
            zero = np.full(scale.shape, 8.0, np.float32)
        else:
            lo, hi = np.minimum(g.min(-1), 0.0), np.maximum(g.max(-1), 0.0)
            scale = np.asarray(jnp.asarray((hi - lo) / 15.0, dtype).astype(jnp.float32))
            safe = np.where(scale > 0, scale, 1.0)
            zero = np.clip(np.round(-lo / safe), 0, 15)
        safe = np.where(scale > 0, scale, 1.0)
        codes = np.clip(np.round(g / safe[..., None]) + zero[..., None], 0, 15).reshape(e, n, k)
        return PackedWeight(
            jnp.asarray(_pack_nibbles(codes)),
            scale=jnp.asarray(scale, dtype),
            zero=None if symmetric else jnp.asarray(zero.astype(np.uint8)),
            wtype=WeightType.UINT4,
            k=k,
            group_n=1,
            group_k=group,
        )

    return q


def _int8_channel(w: np.ndarray, _: Any) -> PackedWeight:
    e, n, k = w.shape
    scale = (np.abs(w).max(-1, keepdims=True) / 127.0).astype(np.float32)
    codes = np.clip(np.round(w / np.where(scale > 0, scale, 1.0)), -127, 127).astype(np.int8)
    return PackedWeight(jnp.asarray(codes), scale=jnp.asarray(scale), wtype=WeightType.INT8, k=k, group_n=1, group_k=k)


def _fp8(gn: int | None, gk: int | None) -> Callable[[np.ndarray, Any], PackedWeight]:
    """gn/gk None: the whole dimension (per-channel = (1, None), per-tensor = (None, None))."""

    def q(w: np.ndarray, _: Any) -> PackedWeight:
        e, n, k = w.shape
        rn, rk = gn or n, gk or k
        scale = (_grid_absmax(w, rn, rk) / 448.0).astype(np.float32)
        full = _expand(scale, w.shape, rn, rk)
        codes = np.clip(w / np.where(full > 0, full, 1.0), -448, 448).astype(ml_dtypes.float8_e4m3fn)
        return PackedWeight(jnp.asarray(codes), scale=jnp.asarray(scale), wtype=WeightType.FP8_E4M3, k=k, group_n=rn, group_k=rk)

    return q


def _round_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest e2m1 code (0..15) of x, saturating at +-6."""
    mags = FP4_E2M1_TABLE[:8]
    bounds = (mags[1:] + mags[:-1]) / 2
    idx = np.searchsorted(bounds, np.minimum(np.abs(x), 6.0))
    return (idx + np.where(x < 0, 8, 0)).astype(np.uint8)


def _mxfp4(w: np.ndarray, _: Any) -> PackedWeight:
    _check_divisible(w, 32, "MXFP4")
    e, n, k = w.shape
    amax = np.abs(w.reshape(e, n, k // 32, 32)).max(-1)
    # Shared exponent: the block's largest magnitude lands in e2m1's top binade (max 6 = 1.5 * 2^2).
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-38))) - 2, -127)
    s = np.clip(exp + 127, 0, 254).astype(np.uint8)
    scale = np.exp2(s.astype(np.float64) - 127).astype(np.float32)
    codes = _round_e2m1(w / np.repeat(scale, 32, axis=2))
    return PackedWeight(jnp.asarray(_pack_nibbles(codes)), scale=jnp.asarray(s), wtype=WeightType.FP4_E2M1, k=k, group_n=1, group_k=32)


def _nvfp4(w: np.ndarray, _: Any) -> PackedWeight:
    _check_divisible(w, 16, "NVFP4")
    e, n, k = w.shape
    gmax = np.abs(w).reshape(e, -1).max(-1)
    scale2 = np.where(gmax > 0, gmax / (448.0 * 6.0), 1.0).astype(np.float32)
    amax = np.abs(w.reshape(e, n, k // 16, 16)).max(-1)
    s = (amax / 6.0 / scale2[:, None, None]).astype(ml_dtypes.float8_e4m3fn)
    full = np.repeat(s.astype(np.float32), 16, axis=2) * scale2[:, None, None]
    codes = _round_e2m1(w / np.where(full > 0, full, 1.0))
    return PackedWeight(
        jnp.asarray(_pack_nibbles(codes)),
        scale=jnp.asarray(s),
        scale2=jnp.asarray(scale2),
        wtype=WeightType.FP4_E2M1,
        k=k,
        group_n=1,
        group_k=16,
    )


# --- weight keys ----------------------------------------------------------------------------
W_BF16 = QuantKey("bfloat16")
W_FP16 = QuantKey("float16")
W_INT4_G128 = QuantKey("int4", ScaleDesc("bfloat16", True, GroupShape(1, 128)))
W_UINT4_ZP_G128 = QuantKey("uint4", ScaleDesc("bfloat16", True, GroupShape(1, 128)), symmetric=False)
W_INT8_CHANNEL = QuantKey("int8", ScaleDesc("float32", True, GroupShape.PER_CHANNEL))
W_FP8_BLOCK128 = QuantKey("float8_e4m3fn", ScaleDesc("float32", True, GroupShape(128, 128)))
W_FP8_CHANNEL = QuantKey("float8_e4m3fn", ScaleDesc("float32", True, GroupShape.PER_CHANNEL))
W_FP8_TENSOR = QuantKey("float8_e4m3fn", ScaleDesc("float32", True, GroupShape.PER_TENSOR))
W_MXFP4 = QuantKey("float4_e2m1fn", ScaleDesc("float8_e8m0fnu", True, GroupShape(1, 32)))
W_NVFP4 = QuantKey(
    "float4_e2m1fn",
    ScaleDesc("float8_e4m3fn", True, GroupShape(1, 16)),
    scale2=ScaleDesc("float32", True, GroupShape.PER_TENSOR),
)

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("bf16", W_BF16, None, _float(jnp.bfloat16), jnp.bfloat16),
        Scheme("fp16", W_FP16, None, _float(jnp.float16), jnp.float16),
        Scheme("w4a16-int4-g128", W_INT4_G128, None, _int4_group(128, True)),
        Scheme("w4a16-uint4-zp-g128", W_UINT4_ZP_G128, None, _int4_group(128, False)),
        Scheme("w8a16-int8-channel", W_INT8_CHANNEL, None, _int8_channel),
        Scheme("w8a8-int8-channel", W_INT8_CHANNEL, ACT_INT8_PER_TOKEN, _int8_channel),
        Scheme("w8a16-fp8-block128", W_FP8_BLOCK128, None, _fp8(128, 128)),
        Scheme("w8a8-fp8-block128", W_FP8_BLOCK128, ACT_FP8_PER_GROUP_128, _fp8(128, 128)),
        Scheme("w8a8-fp8-channel", W_FP8_CHANNEL, ACT_FP8_PER_TOKEN, _fp8(1, None)),
        Scheme("w8a8-fp8-tensor", W_FP8_TENSOR, ACT_FP8_PER_TOKEN, _fp8(None, None)),
        Scheme("w4a16-mxfp4", W_MXFP4, None, _mxfp4),
        Scheme("w4a8-mxfp4-fp8", W_MXFP4, ACT_FP8_PER_TOKEN, _mxfp4),
        Scheme("w4a16-nvfp4", W_NVFP4, None, _nvfp4),
    )
}

# Every (weight key, activation key) pair the kernels implement.
SUPPORTED_PAIRS: frozenset[tuple[QuantKey, QuantKey | None]] = frozenset(
    (s.weight_key, s.act_key) for s in SCHEMES.values()
)


def _as_f32(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype not in (ml_dtypes.bfloat16,):
        raise TypeError(f"{name} must be a float array, got dtype {arr.dtype}")
    return arr.astype(np.float32)


def quantize_moe_weights(
    w13: Any,
    w2: Any,
    scheme: str = "bf16",
    *,
    dtype: Any = None,
    b13: Any = None,
    b2: Any = None,
) -> MoEWeights:
    """Quantizes float expert weights w13 [E, N1, H] and w2 [E, H, I] with a named scheme.

    ``dtype`` is the activation/output dtype the layer will run in (bf16 or fp16; the scheme's
    default when None; fixed by ``bf16``/``fp16``). Optional float biases b13 [E, N1], b2 [E, H].
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; supported: {sorted(SCHEMES)}")
    spec = SCHEMES[scheme]
    if spec.weight_key in (W_BF16, W_FP16):
        if dtype is not None and jnp.dtype(dtype) != jnp.dtype(spec.default_dtype):
            raise ValueError(f"scheme {scheme!r} runs in {jnp.dtype(spec.default_dtype).name}, not {jnp.dtype(dtype).name}")
        dtype = spec.default_dtype
    dtype = jnp.dtype(dtype or spec.default_dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"activation dtype must be bfloat16 or float16, got {dtype.name}")
    a13, a2 = _as_f32(w13, "w13"), _as_f32(w2, "w2")
    if a13.ndim != 3 or a2.ndim != 3:
        raise ValueError(f"w13 and w2 must be [E, N1, H] and [E, H, I]; got {a13.shape} and {a2.shape}")
    e, _, h = a13.shape
    if a2.shape[0] != e or a2.shape[1] != h:
        raise ValueError(f"w2 {a2.shape} does not match w13 {a13.shape}: expected [{e}, {h}, I]")
    weights = MoEWeights(
        w13=spec.quantize(a13, dtype),
        w2=spec.quantize(a2, dtype),
        weight_key=spec.weight_key,
        act_key=spec.act_key,
        scheme=scheme,
        dtype=dtype,
    )
    if b13 is not None or b2 is not None:
        weights = weights.with_biases(b13, b2)
        _check_bias(weights)
    return weights


def _check_bias(w: MoEWeights) -> None:
    if w.b13 is not None and w.b13.shape != (w.num_experts, w.n1):
        raise ValueError(f"b13 must be [{w.num_experts}, {w.n1}], got {w.b13.shape}")
    if w.b2 is not None and w.b2.shape != (w.num_experts, w.hidden_size):
        raise ValueError(f"b2 must be [{w.num_experts}, {w.hidden_size}], got {w.b2.shape}")
