"""``convert_to_kernel_format``: published checkpoint layouts -> ``MoEWeights`` in kernel layout.

``w13`` and ``w2`` are dicts of checkpoint tensors (NumPy or jax arrays) for one MoE layer,
stacked over experts on a leading E axis; ``w13`` holds gate then up rows concatenated along N
(interleaved gate/up for ``swigluoai``, as gpt-oss stores it), ``w2`` the down projection.
A tensor is found by its published name, or by the one key ending in ``.<name>`` or ``_<name>``
(so ``gate_up_proj_blocks`` answers ``blocks``). Supported layouts, per expert, N = output and
K = input channels:

GPTQ (v1, AutoGPTQ)
    ``qweight`` int32 [K*bits/32, N] packed along K, low bits first; ``scales`` [K/g, N];
    ``qzeros`` int32 [K/g, N*bits/32] packed along N, holding zero - 1 (zero = stored + 1, so
    1..16 for 4 bits); ``g_idx`` accepted only when it is the plain ``k // g``.
AWQ (AutoAWQ GEMM)
    ``qweight`` int32 [K, N/8] packed along N, nibble i (low first) holding logical column
    [0, 2, 4, 6, 1, 3, 5, 7][i] of its group of 8; ``qzeros`` likewise [K/g, N/8] (zero as is);
    ``scales`` [K/g, N]. Without zero points the codes are centred on 8.
compressed-tensors ``pack-quantized`` (schemas GPTQ or Int8)
    ``weight_packed`` int32 [N, ceil(K*bits/32)] packed along K, low bits first, holding the
    signed code + 2^(bits-1); ``weight_scale`` [N, K/g] (group) or [N, 1] (channel); optional
    ``weight_zero_point`` int32 [ceil(N*bits/32), K/g] packed along N with the same offset (or
    int8 [N, K/g] unpacked, signed); optional ``weight_shape`` (N, K); ``weight_g_idx`` as g_idx.
FP8 (DeepSeek-V3, compressed-tensors ``float-quantized``)
    ``weight`` float8_e4m3fn [N, K]; block scales ``weight_scale_inv`` (or ``weight_scale``)
    [ceil(N/128), ceil(K/128)] that multiply (w = q * scale); per-channel ``weight_scale`` [N]
    or [N, 1]; per-tensor ``weight_scale`` [] or [1].
MXFP4 (gpt-oss)
    ``blocks`` uint8 [N, K/32, 16] (two e2m1 codes per byte, low nibble first), ``scales`` uint8
    e8m0 [N, K/32] meaning 2^(s - 127).
NVFP4 (ModelOpt)
    ``weight`` uint8 [N, K/2] (two e2m1 codes per byte, low nibble first), ``weight_scale``
    float8_e4m3fn [N, K/16], ``weight_scale_2`` float32 [] or [1] (or [2], gate and up, when
    equal); w = fp4 * weight_scale * weight_scale_2.
INT8 (compressed-tensors ``int-quantized``)
    ``weight`` int8 [N, K], ``weight_scale`` [N] or [N, 1].
Unquantized
    ``weight`` float [N, K], cast to the schema's dtype.

Every layout may carry ``bias`` [N] (float). Static activation scales (``input_scale``) are
ignored: the input schemas quantize activations dynamically.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import schemas as sc
from ._abi import WeightType
from .activations import get_activation
from .quantize import _check_bias
from .weights import MoEWeights, PackedWeight

__all__ = ["convert_to_kernel_format"]

_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
_FLOAT_DTYPES = _SCALE_DTYPES
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_INT32 = (np.dtype(np.int32), np.dtype(np.uint32))
_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])


class _Tensors:
    """The checkpoint tensors of one projection (w13 or w2), looked up by published name."""

    def __init__(self, tensors: Any, which: str) -> None:
        if not isinstance(tensors, Mapping):
            raise TypeError(f"{which} must be a dict of checkpoint tensors, got {type(tensors).__name__}")
        self.tensors = tensors
        self.which = which

    def key(self, name: str) -> str | None:
        if name in self.tensors:
            return name
        found = [k for k in self.tensors if isinstance(k, str) and (k.endswith("." + name) or k.endswith("_" + name))]
        if len(found) > 1:
            raise ValueError(f"{self.which}: tensor name {name!r} is ambiguous, matched by {sorted(found)}")
        return found[0] if found else None

    def has(self, name: str) -> bool:
        return self.key(name) is not None

    def get(self, name: str, *, required: bool = True, what: str = "") -> np.ndarray | None:
        key = self.key(name)
        if key is None:
            if required:
                hint = f" ({what})" if what else ""
                raise ValueError(
                    f"{self.which}: missing tensor {name!r}{hint}; got tensors {sorted(map(str, self.tensors))}"
                )
            return None
        value = self.tensors[key]
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"{self.which}: tensor {name!r} must be a NumPy or jax array, got {type(value).__name__}")
        return np.asarray(value)

    def dtype(self, arr: np.ndarray, name: str, allowed: tuple[np.dtype, ...], what: str) -> None:
        if arr.dtype not in allowed:
            raise TypeError(f"{self.which}: tensor {name!r} must be {what}, got dtype {arr.dtype}")

    def shape(self, arr: np.ndarray, name: str, want: tuple[int, ...], meaning: str) -> None:
        if tuple(arr.shape) != tuple(want):
            raise ValueError(
                f"{self.which}: tensor {name!r} must have shape {meaning} = {tuple(want)}, got {tuple(arr.shape)}"
            )

    def rank(self, arr: np.ndarray, name: str, rank: int, meaning: str) -> None:
        if arr.ndim != rank:
            raise ValueError(f"{self.which}: tensor {name!r} must be {meaning} (rank {rank}), got shape {arr.shape}")

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.which}: {message}")


# --- bit unpacking ----------------------------------------------------------------------------
def _unpack_int32(packed: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned codes of ``bits`` from int32 words along ``axis``, low bits first: [.., R, ..] ->
    [.., R * 32/bits, ..] with element r*pf + j taken from bits [bits*j, bits*(j+1)) of word r."""
    words = np.moveaxis(packed.view(np.uint32), axis, -1)
    shifts = np.arange(32 // bits, dtype=np.uint32) * np.uint32(bits)
    codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    codes = codes.reshape(*words.shape[:-1], -1).astype(np.uint8)
    return np.moveaxis(codes, -1, axis)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [..., K] -> [..., K/2], even k in the low nibble (the kernel layout)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _scale(t: _Tensors, name: str, **kw: Any) -> np.ndarray | None:
    arr = t.get(name, **kw)
    if arr is not None:
        t.dtype(arr, name, _SCALE_DTYPES, "float32, bfloat16 or float16")
    return arr


def _group(k: int, group_size: int) -> int:
    return k if group_size <= 0 else group_size


def _check_group_divides(t: _Tensors, k: int, g: int, source: str) -> None:
    if k % g:
        raise t.fail(f"K = {k} (from {source}) is not a multiple of the group size {g}")


def _check_g_idx(t: _Tensors, name: str, e: int, k: int, g: int) -> None:
    """Accepts only the plain g_idx = k // g (no activation reordering)."""
    g_idx = t.get(name, required=False)
    if g_idx is None:
        return
    if not np.issubdtype(g_idx.dtype, np.integer):
        raise TypeError(f"{t.which}: tensor {name!r} must be an integer array, got dtype {g_idx.dtype}")
    plain = np.arange(k) // g
    if g_idx.shape not in ((k,), (e, k)):
        raise ValueError(f"{t.which}: tensor {name!r} must have shape [E, K] = {(e, k)} or [K], got {g_idx.shape}")
    if not np.array_equal(np.broadcast_to(g_idx, (e, k)), np.broadcast_to(plain, (e, k))):
        raise ValueError(
            f"{t.which}: tensor {name!r} reorders input channels (desc_act / activation ordering), "
            "which is not supported; only g_idx = k // group_size is accepted"
        )


def _int_weight(
    codes: np.ndarray, zero: np.ndarray | None, scale: np.ndarray, bits: int, g: int
) -> PackedWeight:
    """Kernel layout of unsigned integer codes [E, N, K] with scale/zero grids [E, N, K/g].

    4-bit: uint8 nibbles, zero points uint8 (absent: 8). 8-bit (symmetric, centred on 128):
    int8 codes q - 128 with float32 scales."""
    k = codes.shape[2]
    if bits == 4:
        return PackedWeight(
            jnp.asarray(_pack_nibbles(codes)),
            scale=jnp.asarray(scale),
            zero=None if zero is None else jnp.asarray(zero.astype(np.uint8)),
            wtype=WeightType.UINT4,
            k=k,
            group_n=1,
            group_k=g,
        )
    signed = (codes.astype(np.int16) - 128).astype(np.int8)
    return PackedWeight(
        jnp.asarray(signed), scale=jnp.asarray(scale.astype(np.float32)), wtype=WeightType.INT8, k=k, group_n=1, group_k=g
    )


# --- converters: one projection's tensors -> PackedWeight -------------------------------------
def _gptq(t: _Tensors, s: sc.GPTQ) -> PackedWeight:
    if t.has("weight_packed"):
        return _ct_pack(t, s.bits, s.group_size, s.sym)
    bits, pf = s.bits, 32 // s.bits
    qweight = t.get("qweight", what="GPTQ int32 codes [E, K*bits/32, N]")
    t.dtype(qweight, "qweight", _INT32, "int32 (packed GPTQ codes)")
    t.rank(qweight, "qweight", 3, "[E, K*bits/32, N]")
    e, rows, n = qweight.shape
    k = rows * pf
    g = _group(k, s.group_size)
    _check_group_divides(t, k, g, f"qweight {qweight.shape}: {rows} rows x {pf} codes")
    scales = _scale(t, "scales")
    t.shape(scales, "scales", (e, k // g, n), "[E, K/g, N]")
    _check_g_idx(t, "g_idx", e, k, g)
    qzeros = t.get("qzeros", required=not s.sym, what="GPTQ zero points, required with sym=False")
    zero = None
    if qzeros is not None:
        t.dtype(qzeros, "qzeros", _INT32, "int32 (packed GPTQ zero points)")
        if n % pf:
            raise t.fail(f"N = {n} is not a multiple of {pf}, so 'qzeros' cannot pack {bits}-bit zero points along N")
        t.shape(qzeros, "qzeros", (e, k // g, n // pf), "[E, K/g, N*bits/32]")
        # v1 stores zero - 1; reading adds the 1 back (as AutoGPTQ does), giving 1 .. 2^bits.
        zero = _unpack_int32(qzeros, bits, axis=2).astype(np.int32) + 1
        if s.sym and not np.all(zero == 1 << (bits - 1)):
            raise t.fail(
                f"'qzeros' holds zero points other than {1 << (bits - 1)} but the schema says sym=True; "
                "use GPTQ(..., sym=False)"
            )
    codes = _unpack_int32(qweight, bits, axis=1).transpose(0, 2, 1)  # [E, N, K]
    zero_grid = None if (s.sym or zero is None) else zero.transpose(0, 2, 1)
    return _int_weight(codes, zero_grid, np.ascontiguousarray(scales.transpose(0, 2, 1)), bits, g)


def _awq(t: _Tensors, s: sc.AWQ) -> PackedWeight:
    qweight = t.get("qweight", what="AWQ int32 codes [E, K, N/8]")
    t.dtype(qweight, "qweight", _INT32, "int32 (packed AWQ codes)")
    t.rank(qweight, "qweight", 3, "[E, K, N/8]")
    e, k, cols = qweight.shape
    n = cols * 8
    g = _group(k, s.group_size)
    _check_group_divides(t, k, g, f"qweight {qweight.shape}")
    scales = _scale(t, "scales")
    t.shape(scales, "scales", (e, k // g, n), "[E, K/g, N]")
    inverse = np.argsort(_AWQ_ORDER)  # logical column p sits in nibble inverse[p]

    def unpack(packed: np.ndarray) -> np.ndarray:
        nib = _unpack_int32(packed, 4, axis=2)
        return nib.reshape(*nib.shape[:-1], -1, 8)[..., inverse].reshape(nib.shape)

    qzeros = t.get("qzeros", required=s.zero_point, what="AWQ zero points [E, K/g, N/8]")
    zero = None
    if s.zero_point:
        t.dtype(qzeros, "qzeros", _INT32, "int32 (packed AWQ zero points)")
        t.shape(qzeros, "qzeros", (e, k // g, cols), "[E, K/g, N/8]")
        zero = unpack(qzeros).transpose(0, 2, 1)
    elif qzeros is not None:
        raise t.fail("'qzeros' given but the schema says zero_point=False")
    codes = unpack(qweight).transpose(0, 2, 1)
    return _int_weight(codes, zero, np.ascontiguousarray(scales.transpose(0, 2, 1)), 4, g)


def _ct_pack(t: _Tensors, bits: int, group_size: int, sym: bool) -> PackedWeight:
    """compressed-tensors ``pack-quantized``: codes offset by 2^(bits-1), packed along K."""
    pf = 32 // bits
    packed = t.get("weight_packed")
    t.dtype(packed, "weight_packed", _INT32, "int32 (packed compressed-tensors codes)")
    t.rank(packed, "weight_packed", 3, "[E, N, ceil(K*bits/32)]")
    e, n, cols = packed.shape
    k = cols * pf
    shape = t.get("weight_shape", required=False)
    if shape is not None:
        rows = np.asarray(shape).reshape(-1, 2)
        if not np.issubdtype(rows.dtype, np.integer) or not np.all(rows == rows[0]):
            raise t.fail(f"'weight_shape' must hold one integer (N, K) pair for every expert, got {shape.tolist()}")
        if int(rows[0, 0]) != n or -(-int(rows[0, 1]) // pf) != cols:
            raise t.fail(f"'weight_shape' {tuple(int(d) for d in rows[0])} does not match weight_packed {packed.shape}")
        k = int(rows[0, 1])
    g = _group(k, group_size)
    _check_group_divides(t, k, g, "weight_shape" if shape is not None else f"weight_packed {packed.shape}")
    if bits == 4 and k % 2:
        raise t.fail(f"4-bit weights need an even K, got K = {k}")
    scale = _scale(t, "weight_scale")
    if scale.shape == (e, n) and g == k:
        scale = scale[..., None]
    t.shape(scale, "weight_scale", (e, n, k // g), "[E, N, K/g]" if g != k else "[E, N, 1]")
    _check_g_idx(t, "weight_g_idx", e, k, g)
    zp = t.get("weight_zero_point", required=not sym, what="zero points, required with sym=False")
    zero = None
    if zp is not None:
        if zp.dtype in _INT32:
            t.shape(zp, "weight_zero_point", (e, -(-n // pf), k // g), "[E, ceil(N*bits/32), K/g] (packed along N)")
            zero = _unpack_int32(zp, bits, axis=1)[:, :n].astype(np.int32)
        elif zp.dtype == np.int8:
            t.shape(zp, "weight_zero_point", (e, n, k // g), "[E, N, K/g] (unpacked, signed)")
            zero = zp.astype(np.int32) + (1 << (bits - 1))
        else:
            raise TypeError(f"{t.which}: tensor 'weight_zero_point' must be int32 (packed) or int8, got dtype {zp.dtype}")
        if sym:
            if not np.all(zero == 1 << (bits - 1)):
                raise t.fail("'weight_zero_point' holds non-zero points but the schema is symmetric; use sym=False")
            zero = None
    codes = _unpack_int32(packed, bits, axis=2)[:, :, :k]
    return _int_weight(codes, zero, scale, bits, g)


def _int8(t: _Tensors, s: sc.Int8) -> PackedWeight:
    if t.has("weight_packed"):
        return _ct_pack(t, 8, -1, True)
    weight = t.get("weight", what="int8 codes [E, N, K]")
    t.dtype(weight, "weight", (np.dtype(np.int8),), "int8")
    t.rank(weight, "weight", 3, "[E, N, K]")
    e, n, k = weight.shape
    scale = _scale(t, "weight_scale")
    if scale.shape == (e, n):
        scale = scale[..., None]
    t.shape(scale, "weight_scale", (e, n, 1), "[E, N] or [E, N, 1] (per output channel)")
    return PackedWeight(
        jnp.asarray(weight), scale=jnp.asarray(scale.astype(np.float32)), wtype=WeightType.INT8, k=k, group_n=1, group_k=k
    )


def _fp8(t: _Tensors, s: sc.FP8) -> PackedWeight:
    weight = t.get("weight", what="float8_e4m3fn codes [E, N, K]")
    t.dtype(weight, "weight", (_E4M3,), "float8_e4m3fn")
    t.rank(weight, "weight", 3, "[E, N, K]")
    e, n, k = weight.shape
    if s.block is not None:
        bn, bk = s.block
        names = [name for name in ("weight_scale_inv", "weight_scale") if t.has(name)]
        if len(names) > 1:
            raise t.fail("both 'weight_scale_inv' and 'weight_scale' given; a block-scaled FP8 weight has one")
        name = names[0] if names else "weight_scale_inv"
        scale = _scale(t, name, what=f"FP8 block scales [E, ceil(N/{bn}), ceil(K/{bk})]")
        t.shape(scale, name, (e, -(-n // bn), -(-k // bk)), f"[E, ceil(N/{bn}), ceil(K/{bk})]")
        gn, gk = bn, bk
    else:
        scale = _scale(t, "weight_scale", what="FP8 scales")
        if s.per_tensor:
            if scale.size != e or scale.shape[:1] != (e,) or scale.ndim > 3:
                raise ValueError(
                    f"{t.which}: tensor 'weight_scale' must have shape [E] = ({e},) (one scale per expert; "
                    f"[E, 1] also accepted) for per-tensor FP8, got {scale.shape}"
                )
            scale = scale.reshape(e, 1, 1)
            gn, gk = n, k
        else:
            if scale.shape == (e, n):
                scale = scale[..., None]
            if scale.shape != (e, n, 1):
                hint = " (one scale per expert: use FP8(per_tensor=True))" if scale.size == e else ""
                raise ValueError(
                    f"{t.which}: tensor 'weight_scale' must have shape [E, N] = {(e, n)} or [E, N, 1] for "
                    f"per-channel FP8, got {scale.shape}{hint}"
                )
            gn, gk = 1, k
    return PackedWeight(
        jnp.asarray(weight), scale=jnp.asarray(scale.astype(np.float32)), wtype=WeightType.FP8_E4M3, k=k, group_n=gn, group_k=gk
    )


def _mxfp4(t: _Tensors, s: sc.MXFP4) -> PackedWeight:
    blocks = t.get("blocks", what="gpt-oss MXFP4 codes [E, N, K/32, 16]")
    t.dtype(blocks, "blocks", (np.dtype(np.uint8),), "uint8 (two e2m1 codes per byte)")
    t.rank(blocks, "blocks", 4, "[E, N, K/32, 16]")
    e, n, kb, width = blocks.shape
    if width != 16:
        raise t.fail(f"tensor 'blocks' must have 16 bytes (32 codes) per block in its last axis, got {width}")
    scales = t.get("scales", what="MXFP4 e8m0 scales [E, N, K/32]")
    if hasattr(ml_dtypes, "float8_e8m0fnu") and scales.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        scales = scales.view(np.uint8)
    t.dtype(scales, "scales", (np.dtype(np.uint8),), "uint8 e8m0 (2^(s - 127))")
    t.shape(scales, "scales", (e, n, kb), "[E, N, K/32]")
    if np.any(scales == 255):
        raise t.fail("tensor 'scales' holds the e8m0 NaN code 255")
    return PackedWeight(
        jnp.asarray(np.ascontiguousarray(blocks).reshape(e, n, kb * 16)),
        scale=jnp.asarray(scales),
        wtype=WeightType.FP4_E2M1,
        k=kb * 32,
        group_n=1,
        group_k=32,
    )


def _nvfp4(t: _Tensors, s: sc.NVFP4) -> PackedWeight:
    weight = t.get("weight", what="NVFP4 codes [E, N, K/2]")
    t.dtype(weight, "weight", (np.dtype(np.uint8),), "uint8 (two e2m1 codes per byte)")
    t.rank(weight, "weight", 3, "[E, N, K/2]")
    e, n, half = weight.shape
    k = 2 * half
    _check_group_divides(t, k, 16, f"weight {weight.shape}")
    scale = t.get("weight_scale", what="NVFP4 e4m3 scales [E, N, K/16]")
    t.dtype(scale, "weight_scale", (_E4M3,), "float8_e4m3fn")
    t.shape(scale, "weight_scale", (e, n, k // 16), "[E, N, K/16]")
    scale2 = t.get("weight_scale_2", what="NVFP4 per-expert float32 scale [E]")
    t.dtype(scale2, "weight_scale_2", (np.dtype(np.float32),), "float32")
    if scale2.ndim == 2 and scale2.shape[0] == e and scale2.shape[1] >= 1:
        if not np.all(scale2 == scale2[:, :1]):
            raise t.fail(
                "'weight_scale_2' differs between the gate and up halves; the kernels take one "
                "second-level scale per expert"
            )
        scale2 = scale2[:, 0]
    t.shape(scale2, "weight_scale_2", (e,), "[E]")
    return PackedWeight(
        jnp.asarray(weight),
        scale=jnp.asarray(scale),
        scale2=jnp.asarray(scale2),
        wtype=WeightType.FP4_E2M1,
        k=k,
        group_n=1,
        group_k=16,
    )


def _unquantized(t: _Tensors, s: sc.Unquantized) -> PackedWeight:
    weight = t.get("weight", what="float weights [E, N, K]")
    t.dtype(weight, "weight", _FLOAT_DTYPES, "float32, bfloat16 or float16")
    t.rank(weight, "weight", 3, "[E, N, K]")
    return PackedWeight(jnp.asarray(weight.astype(s.dtype)), wtype=WeightType.FLOAT, k=weight.shape[2])


_CONVERTERS = {
    sc.GPTQ: _gptq,
    sc.AWQ: _awq,
    sc.Int8: _int8,
    sc.FP8: _fp8,
    sc.MXFP4: _mxfp4,
    sc.NVFP4: _nvfp4,
    sc.Unquantized: _unquantized,
}


def _bias(t: _Tensors) -> np.ndarray | None:
    bias = t.get("bias", required=False)
    if bias is not None:
        t.dtype(bias, "bias", _FLOAT_DTYPES, "float32, bfloat16 or float16")
        bias = bias.astype(np.float32)
    return bias


def _activation_dtype(weight_schema: Any, dtype: Any) -> np.dtype:
    if isinstance(weight_schema, sc.Unquantized):
        if dtype is not None and jnp.dtype(dtype) != weight_schema.dtype:
            raise ValueError(
                f"dtype {jnp.dtype(dtype).name} differs from the Unquantized schema's dtype {weight_schema.dtype.name}"
            )
        return weight_schema.dtype
    out = jnp.dtype(jnp.bfloat16 if dtype is None else dtype)
    if out not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"dtype (the activation dtype) must be bfloat16 or float16, got {out.name}")
    return out


def convert_to_kernel_format(
    w13: Mapping[str, Any],
    w2: Mapping[str, Any],
    weight_schema: sc.WeightSchema,
    input_schema: sc.InputSchema | None = None,
    activation: str = "silu",
    *,
    dtype: Any = None,
) -> MoEWeights:
    """Checkpoint tensors of one MoE layer -> ``MoEWeights`` in kernel layout.

    ``w13`` / ``w2``: dicts of the published tensors (see the module docstring), stacked over
    experts, for the gate+up [E, N1, H] and down [E, H, I] projections. ``weight_schema`` names
    the checkpoint's format; ``input_schema`` how activations enter the GEMMs (None: 16-bit);
    ``activation`` fixes N1 (2 I when gated, I for ``*_no_mul``); ``dtype`` is the activation
    dtype (bfloat16 by default; the schema's dtype for ``Unquantized``).

    Everything is validated before anything is converted: an unsupported (weight, input) pair,
    a missing tensor, a wrong dtype or shape, or K not a multiple of a group size raises a
    ValueError or TypeError that names the tensor. The result's ``dequantize()`` is exactly what
    the kernels compute with."""
    scheme = sc.resolve_scheme(weight_schema, input_schema)
    spec, _ = get_activation(activation)
    act_dtype = _activation_dtype(weight_schema, dtype)
    t13, t2 = _Tensors(w13, "w13"), _Tensors(w2, "w2")
    convert = _CONVERTERS[type(weight_schema)]
    p13, p2 = convert(t13, weight_schema), convert(t2, weight_schema)
    (e, n1, h), (e2, h2, i) = p13.shape, p2.shape
    if e2 != e or h2 != h:
        raise ValueError(f"w2 is [E, H, I] = {p2.shape}, which does not match w13 [E, N1, H] = {p13.shape}")
    if n1 != (2 * i if spec.gated else i):
        kind = f"gated activation {activation!r} needs N1 = 2 I" if spec.gated else f"activation {activation!r} needs N1 = I"
        raise ValueError(f"{kind} = {2 * i if spec.gated else i} for w2's I = {i}, but w13 has N1 = {n1}")
    if spec.gated and 1 < p13.group_n < n1 and i % p13.group_n:
        raise ValueError(
            f"w13: I = {i} is not a multiple of the scale block's {p13.group_n} rows, so a block would "
            "straddle the gate and up halves"
        )
    act_key = (input_schema or sc.NoInputQuant()).quant_key()
    act_group = 0 if act_key is None else max(act_key.scale.group_shape.col, 0)
    for what, k in (("H", h), ("I", i)):
        if act_group and k % act_group:
            raise ValueError(
                f"{input_schema!r} quantizes activations in groups of {act_group} along K, but {what} = {k} "
                f"is not a multiple of {act_group}"
            )
    b13, b2 = _bias(t13), _bias(t2)
    weights = MoEWeights(
        w13=p13,
        w2=p2,
        weight_key=weight_schema.quant_key(),
        act_key=act_key,
        scheme=scheme,
        dtype=act_dtype,
    )
    if b13 is not None or b2 is not None:
        weights = weights.with_biases(b13, b2)
        _check_bias(weights)
    return weights
