"""The expert GEMM custom calls in their three forms: indexed gather, grouped contiguous and
batched masked. All compute c = a' w'^T (+ bias) in float32 and round to ``out_dtype``."""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi
from .._abi import WeightType
from ..activations import get_activation
from ..weights import PackedWeight
from .activation import _quant_shapes  # the quantize calls' result shapes and checks
from .routing import IndexedRouting


def _operands(
    a: jax.Array, a_scale: jax.Array | None, w: PackedWeight, bias: jax.Array | None, act_group_k: int
) -> tuple[list[jax.Array], dict[str, int]]:
    # An absent operand's slot holds the weight codes again: the handlers take every operand as an
    # untyped buffer and read an optional one only when its has_* attribute (or the activation or
    # weight type) says it is there. A zero array in its place would cost a device kernel per call.
    stand_in = w.data
    ops = [
        a,
        a_scale if a_scale is not None else stand_in,
        w.data,
        w.scale if w.scale is not None else stand_in,
        w.zero if w.zero is not None else stand_in,
        w.scale2 if w.scale2 is not None else stand_in,
        bias if bias is not None else stand_in,
    ]
    attrs = dict(
        weight_type=int(w.wtype),
        group_n=w.group_n,
        group_k=w.group_k,
        has_zero=int(w.zero is not None),
        has_scale2=int(w.scale2 is not None),
        has_bias=int(bias is not None),
        act_group_k=act_group_k,
    )
    return ops, attrs


def _call_indexed(
    name: str,
    results: Any,
    a: jax.Array,
    a_scale: jax.Array | None,
    w: PackedWeight,
    bias: jax.Array | None,
    routing: IndexedRouting,
    act_group_k: int,
    **extra: Any,
) -> Any:
    """One of the indexed GEMM calls: the operands, then the routing's three arrays."""
    ops, attrs = _operands(a, a_scale, w, bias, act_group_k)
    return _ffi.call(
        name,
        results,
        *ops,
        routing.sorted_ids,
        routing.block_expert_ids,
        routing.num_tokens_post_padded,
        **attrs,
        **extra,
    )


def _activated_columns(x: jax.Array, activation: str | None, limit: float | None) -> tuple[int, float, int]:
    """(activation code, limit, columns of the result) of x's rows under ``activation`` (None: -1,
    0.0 and x's own columns); a gated activation halves an even number of columns."""
    if activation is None:
        return -1, 0.0, x.shape[1]
    spec, lim = get_activation(activation, limit)
    if spec.gated and x.shape[1] % 2:
        raise ValueError(f"a gated activation needs an even number of columns, got {x.shape[1]}")
    return int(spec.code), lim, x.shape[1] // 2 if spec.gated else x.shape[1]


def gemm_indexed(
    a: jax.Array,
    a_scale: jax.Array | None,
    w: PackedWeight,
    bias: jax.Array | None,
    routing: IndexedRouting,
    *,
    rows: int,
    gather_div: int,
    block_m: int,
    out_dtype: Any,
    act_group_k: int = 0,
) -> jax.Array:
    """c[id] = a[id // gather_div] w[e]^T for every sorted id of every block of expert e: [rows, N]."""
    return _call_indexed(
        "gemm_indexed",
        jax.ShapeDtypeStruct((rows, w.n), out_dtype),
        a,
        a_scale,
        w,
        bias,
        routing,
        act_group_k,
        gather_div=gather_div,
        block_m=block_m,
    )


def gemm_indexed_quant(
    x: jax.Array,
    w: PackedWeight,
    bias: jax.Array | None,
    routing: IndexedRouting,
    *,
    rows: int,
    gather_div: int,
    block_m: int,
    out_dtype: Any,
    quant: str,
    act_group_k: int,
    activation: str | None = None,
    limit: float | None = None,
) -> jax.Array:
    """``gemm_indexed`` of ``quantize(x, quant, act_group_k)`` in one call, or with ``activation``
    of ``activation_quant(x, activation, limit, quant, act_group_k)``: the same values as the two
    calls, bit for bit. On the GPU the decode kernel quantizes the rows (after silu, its one
    activation) as it loads them where it takes the launch (128-column fp8 groups, short K);
    elsewhere the call runs the quantization (or activation + quantization) kernel first."""
    act_code, lim, cols = _activated_columns(x, activation, limit)
    c, _, _ = _call_indexed(
        "gemm_indexed_quant",
        (jax.ShapeDtypeStruct((rows, w.n), out_dtype), *_quant_shapes(x.shape[0], cols, quant, act_group_k)),
        x,
        None,
        w,
        bias,
        routing,
        act_group_k,
        gather_div=gather_div,
        block_m=block_m,
        activation=act_code,
        limit=lim,
    )
    return c


def _gated_activation(call: str, w: PackedWeight, activation: str, limit: float | None) -> tuple[int, float]:
    """(activation code, limit) of a gated call's activation; it must be gated, and w's rows even."""
    spec, lim = get_activation(activation, limit)
    if not spec.gated:
        raise ValueError(f"{call} needs a gated activation, got {activation!r}")
    if w.n % 2:
        raise ValueError(f"a gated activation needs an even number of weight rows, got N = {w.n}")
    return int(spec.code), lim


def gemm_indexed_gated(
    a: jax.Array,
    a_scale: jax.Array | None,
    w: PackedWeight,
    bias: jax.Array | None,
    routing: IndexedRouting,
    *,
    rows: int,
    gather_div: int,
    block_m: int,
    out_dtype: Any,
    activation: str,
    limit: float | None = None,
    act_group_k: int = 0,
) -> jax.Array:
    """``activation(gemm_indexed(a, ...), activation, limit)`` for a gated activation in one call:
    [rows, N / 2]. On the GPU the decode kernel's epilogue activates each row's output pairs (gate
    and up rows in one CTA) where it takes the call; elsewhere the GEMM's rows go through the
    activation kernel. The values are the two calls', bit for bit, with one exception: for the
    halves layout (every gated activation but swigluoai) the decode kernel splits K over at most 4
    warp groups, where a separate ``gemm_indexed`` may take 8, and then sums K in another order
    (results within the last places of the 16-bit type)."""
    code, lim = _gated_activation("gemm_indexed_gated", w, activation, limit)
    y, _ = _call_indexed(
        "gemm_indexed_gated",
        (jax.ShapeDtypeStruct((rows, w.n // 2), out_dtype), jax.ShapeDtypeStruct((rows, w.n), out_dtype)),
        a,
        a_scale,
        w,
        bias,
        routing,
        act_group_k,
        gather_div=gather_div,
        block_m=block_m,
        activation=code,
        limit=lim,
    )
    return y


def _call_experts(
    name: str,
    results: Any,
    x: jax.Array,
    w13: PackedWeight,
    b13: jax.Array | None,
    w2: PackedWeight,
    b2: jax.Array | None,
    routing: IndexedRouting,
    **attrs: Any,
) -> Any:
    """An experts_* call: x, both GEMMs' weight operands and the routing's three arrays, GEMM1's
    weight attributes under gemm_indexed's names and GEMM2's with the prefix ``down_``."""
    weights, weight_attrs = experts_weight_operands(w13, b13, w2, b2)
    return _ffi.call(
        name,
        results,
        x,
        *weights,
        routing.sorted_ids,
        routing.block_expert_ids,
        routing.num_tokens_post_padded,
        **weight_attrs,
        **attrs,
    )


def experts_weight_operands(
    w13: PackedWeight, b13: jax.Array | None, w2: PackedWeight, b2: jax.Array | None
) -> tuple[list[jax.Array], dict[str, int]]:
    """The two GEMMs' weight operands (w13's qweight, scale, zero, scale2, bias, then w2's) and
    attributes (GEMM1's under gemm_indexed's names, GEMM2's with the prefix ``down_``) of the
    experts_* and layer_* calls."""
    up, up_attrs = _operands(w13.data, None, w13, b13, 0)
    down, down_attrs = _operands(w2.data, None, w2, b2, 0)
    up_attrs.pop("act_group_k")
    down_attrs.pop("act_group_k")
    return [*up[2:], *down[2:]], {**up_attrs, **{"down_" + k: v for k, v in down_attrs.items()}}


def experts_indexed(
    x: jax.Array,
    w13: PackedWeight,
    b13: jax.Array | None,
    w2: PackedWeight,
    b2: jax.Array | None,
    routing: IndexedRouting,
    *,
    rows: int,
    gather_div: int,
    block_m: int,
    out_dtype: Any,
    activation: str,
    limit: float | None = None,
) -> jax.Array:
    """The indexed layer's two GEMMs in one call, for 16-bit activations and a gated activation:
    ``gemm_indexed(gemm_indexed_gated(x, w13, ...), w2, gather_div=1)``, [rows, w2.n], the same
    values as those two calls bit for bit. On the GPU GEMM2's kernel is launched dependent on
    GEMM1's inside the call, so that under CUDA graphs (where each custom call is a graph of its
    own) it starts on GEMM1's tail: it reads the routing and issues its first weights before it
    waits for GEMM1's rows."""
    results, attrs = experts_indexed_results("experts_indexed", w13, w2, rows, out_dtype, activation, limit)
    d, *_ = _call_experts("experts_indexed", results, x, w13, b13, w2, b2, routing, gather_div=gather_div,
                          block_m=block_m, **attrs)
    return d


def experts_indexed_results(
    name: str, w13: PackedWeight, w2: PackedWeight, rows: int, out_dtype: Any, activation: str, limit: float | None
) -> tuple[tuple, dict[str, Any]]:
    """The checks, the result shapes (d, y, c) and the activation attributes of ``experts_indexed``,
    which ``layer_indexed`` returns after ``out``."""
    code, lim = _gated_activation(name, w13, activation, limit)
    if w2.k != w13.n // 2:
        raise ValueError(f"w2 must have K = {w13.n // 2} (half of w13's rows), got {w2.k}")
    results = (
        jax.ShapeDtypeStruct((rows, w2.n), out_dtype),
        jax.ShapeDtypeStruct((rows, w13.n // 2), out_dtype),
        jax.ShapeDtypeStruct((rows, w13.n), out_dtype),
    )
    return results, dict(activation=code, limit=lim)


def experts_indexed_quant(
    x: jax.Array,
    w13: PackedWeight,
    b13: jax.Array | None,
    w2: PackedWeight,
    b2: jax.Array | None,
    routing: IndexedRouting,
    *,
    rows: int,
    gather_div: int,
    block_m: int,
    out_dtype: Any,
    quant: str,
    act_group_k: int,
    activation: str,
    limit: float | None = None,
) -> jax.Array:
    """The indexed layer's two GEMMs in one call, for 8-bit activations:
    ``gemm_indexed_quant(gemm_indexed_quant(x, w13, ...), w2, gather_div=1, activation=activation)``,
    [rows, w2.n], the same values as those two calls bit for bit (any activation, gated or not).
    On the GPU GEMM2's kernel is launched dependent on the kernel before it inside the call, so that
    under CUDA graphs its decode kernel reads the routing on that kernel's tail."""
    results, attrs = experts_indexed_quant_results(x.shape[0], x.shape[1], w13, w2, rows, out_dtype, quant,
                                                  act_group_k, activation, limit)
    d, *_ = _call_experts("experts_indexed_quant", results, x, w13, b13, w2, b2, routing, gather_div=gather_div,
                          block_m=block_m, **attrs)
    return d


def experts_indexed_quant_results(
    x_rows: int,
    h: int,
    w13: PackedWeight,
    w2: PackedWeight,
    rows: int,
    out_dtype: Any,
    quant: str,
    act_group_k: int,
    activation: str,
    limit: float | None,
) -> tuple[tuple, dict[str, Any]]:
    """The checks, the result shapes (d, c, q1, q1_scale, q2, q2_scale) and the activation and
    quantization attributes of ``experts_indexed_quant`` (x: [x_rows, h]), which
    ``layer_indexed_quant`` returns after ``out``."""
    act_code, lim, cols = _activated_columns(jax.ShapeDtypeStruct((rows, w13.n), out_dtype), activation, limit)
    if w2.k != cols:
        raise ValueError(f"w2 must have K = {cols} (w13's rows after {activation!r}), got {w2.k}")
    results = (
        jax.ShapeDtypeStruct((rows, w2.n), out_dtype),
        jax.ShapeDtypeStruct((rows, w13.n), out_dtype),
        *_quant_shapes(x_rows, h, quant, act_group_k),
        *_quant_shapes(rows, cols, quant, act_group_k),
    )
    return results, dict(act_group_k=act_group_k, activation=act_code, limit=lim)


# The grouped GEMM's workspace (scratch of the CUDA prefill kernel: per-SM TMA descriptors for at
# most 256 SMs, then per-expert shapes, pointers and strides) is bounded by
#     GROUPED_WORKSPACE_BASE + GROUPED_WORKSPACE_PER_EXPERT * E   bytes,
# the bound cuda_ffi/gemm_prefill_sm90.h states (kWorkspaceBase, kWorkspacePerExpert); the CUDA
# handler checks the size it needs against what it is given. The CPU handler ignores it.
GROUPED_WORKSPACE_BASE = 256 * 1024
GROUPED_WORKSPACE_PER_EXPERT = 256


def grouped_workspace_bytes(num_experts: int) -> int:
    """Bytes of the uint8 workspace result of ``gemm_grouped`` for ``num_experts`` local experts
    (the prefill kernel's scratch; the dequantization buffer comes on top, dequant_buffer_bytes)."""
    return GROUPED_WORKSPACE_BASE + GROUPED_WORKSPACE_PER_EXPERT * int(num_experts)


# Prefill-sized grouped GEMMs with quantized weights and 16-bit activations dequantize a chunk of
# experts at a time into the workspace (exactly the w' of the contract, in the activation type)
# and run the 16-bit wgmma kernel on it. The buffer holds as many whole experts as fit in
# $HUMMING_JAX_DEQUANT_WORKSPACE_MB (default 512, read when the call is traced; 0 turns this path
# off), at least one; the CUDA handler takes the chunk size from the size it is given.
ENV_DEQUANT_WORKSPACE_MB = "HUMMING_JAX_DEQUANT_WORKSPACE_MB"
DEQUANT_WORKSPACE_MB_DEFAULT = 512
_DEQUANT_ALIGN = 128  # the buffer's base is rounded up to this inside the workspace
MIN_ROWS_PER_EXPERT = 32  # cuda_ffi/gemm_prefill_sm90.h, kMinRowsPerExpert
# The kinds on our 4-bit mainloop (MXFP4, and uint4 with whole 64-k scale groups, bf16 activations)
# start lower: their persistent forms stream the weights faster than the decode kernel from here.
RS4_MIN_ROWS_PER_EXPERT = 8  # cuda_ffi/gemm_prefill_sm90.h, kRs4MinRowsPerExpert
# $HUMMING_JAX_PREFILL_MIN_ROWS=<n> (n > 0) moves both to n on both sides, read when the call is traced
# (A/B timing of the prefill kinds at decode sizes; auto selection keeps its thresholds,
# selection.grouped_min_rows_per_expert).
ENV_PREFILL_MIN_ROWS = "HUMMING_JAX_PREFILL_MIN_ROWS"
# Quantized weights are dequantized for the prefill kernel only from this many rows per expert: 8-bit
# codes from DEQUANT_MIN_ROWS_PER_EXPERT, 4-bit ones from DEQUANT_MIN_ROWS_PER_EXPERT_4BIT
# (cuda_ffi/gemm_decode_sm90.cu, kMaxRowsPerExpertQuantGrouped / kMaxRowsPerExpertQuant4Grouped):
# below it the codes go to the decode or the generic kernel. $HUMMING_JAX_QUANT_DECODE_ROWS=<n>
# replaces both on both sides (A/B timing).
DEQUANT_MIN_ROWS_PER_EXPERT = 64
DEQUANT_MIN_ROWS_PER_EXPERT_4BIT = 128
ENV_QUANT_DECODE_ROWS = "HUMMING_JAX_QUANT_DECODE_ROWS"


def _env_int(name: str, what: str) -> int | None:
    """The whole number in environment variable ``name`` (None when unset or empty). Only the
    spellings the CUDA handlers read the same way (optional leading blanks and sign, then digits);
    anything else is an error here rather than a different value there."""
    raw = os.environ.get(name, "")
    if not raw:
        return None
    if re.fullmatch(r"\s*[+-]?[0-9]+", raw) is None:
        raise ValueError(f"{name} = {raw!r} is not {what}")
    return int(raw)


def _positive_override(name: str, built_in: int) -> int:
    """Environment variable ``name`` where it is a positive count, else ``built_in`` (the CUDA
    handlers' positive_override)."""
    override = _env_int(name, "a whole number")
    return override if override is not None and override > 0 else built_in


def _min_rows_or_override(built_in: int) -> int:
    """$HUMMING_JAX_PREFILL_MIN_ROWS where it is a positive count, else ``built_in``."""
    return _positive_override(ENV_PREFILL_MIN_ROWS, built_in)


def prefill_min_rows_per_expert() -> int:
    """Rows per expert (on average) from which the prefill kinds take ``gemm_grouped`` calls (those
    on the 4-bit mainloop: ``rs4_min_rows_per_expert``)."""
    return _min_rows_or_override(MIN_ROWS_PER_EXPERT)


def rs4_min_rows_per_expert() -> int:
    """Rows per expert (on average) from which the 4-bit mainloop takes ``gemm_grouped`` calls."""
    return _min_rows_or_override(RS4_MIN_ROWS_PER_EXPERT)


def dequant_min_rows_per_expert(w: PackedWeight) -> int:
    """Rows per expert (on average) from which ``w`` is dequantized for the prefill kernel."""
    override = _env_int(ENV_QUANT_DECODE_ROWS, "a whole number")
    if override is not None and override > 0:
        return override
    if w.wtype in (WeightType.UINT4, WeightType.FP4_E2M1):
        return DEQUANT_MIN_ROWS_PER_EXPERT_4BIT
    return DEQUANT_MIN_ROWS_PER_EXPERT


# uint4 codes centred on 8 (no zero points, no second scale) with bf16 scales per 1 x group_k and
# bf16 activations run on the mixed-input kernels (Kind::kU4Bf16 and its 64- and 256-token twins of
# cuda_ffi/gemm_prefill_sm90.h) from MIN_ROWS_PER_EXPERT rows per expert up, instead of the decode
# kernel or the dequantizing path: they convert the codes in their
# mainloop, so nothing is dequantized, and need only the scales transposed, E * N * ceil(K / group_k)
# bf16 values (mixed_scale_bytes) on top of the grouped workspace. Scale groups must be whole K
# tiles of MIXED_TILE_K or span K; K a multiple of 32, N of 8. $HUMMING_JAX_PREFILL_MIXED=0 (read
# when the call is traced, as by the CUDA handler at each call) gives these calls back to the other
# paths, for A/B timing.
ENV_PREFILL_MIXED = "HUMMING_JAX_PREFILL_MIXED"
MIXED_TILE_K = 64  # cuda_ffi/gemm_prefill_sm90.h, kMixedTileK
_MAX_EXPERTS = 8192  # cuda_ffi/gemm_prefill_sm90.h, kMaxExperts


def _mixed_input_fits(rows: int, w: PackedWeight, act_dtype: Any, act_quantized: bool,
                      min_rows: int | None = None) -> bool:
    """uint4 codes the mixed-input kinds (or our 4-bit mainloop, u4rs_prefill) can take, from
    ``min_rows`` rows per expert (default ``prefill_min_rows_per_expert()``)."""
    if min_rows is None:
        min_rows = prefill_min_rows_per_expert()
    e, n, k = w.num_experts, w.n, w.k
    if os.environ.get(ENV_PREFILL_MIXED, "") == "0":
        return False
    return (w.wtype == WeightType.UINT4 and w.zero is None and w.scale2 is None and w.scale is not None
            and jnp.dtype(w.scale.dtype) == jnp.bfloat16 and not act_quantized
            and jnp.dtype(act_dtype) == jnp.bfloat16 and w.group_n == 1
            and (w.group_k % MIXED_TILE_K == 0 or w.group_k >= k) and k % 32 == 0 and n % 8 == 0
            and 0 < e <= _MAX_EXPERTS and min_rows * e <= rows
            and e * n * ((-(-k // w.group_k) + 7) // 8) < 2**31)


def mixed_prefill(rows: int, w: PackedWeight, act_dtype: Any, act_quantized: bool) -> bool:
    """Whether a ``gemm_grouped`` call of ``rows`` rows is one the CUTLASS mixed-input prefill kernel
    takes (on an sm_90 device; elsewhere the workspace it asks for is ignored)."""
    return (_mixed_input_fits(rows, w, act_dtype, act_quantized)
            and not u4rs_prefill(rows, w, act_dtype, act_quantized))


def mixed_scale_bytes(rows: int, w: PackedWeight, act_dtype: Any, act_quantized: bool) -> int:
    """Workspace bytes ``gemm_grouped`` adds for the mixed-input kernel's transposed scales (0 when
    the call does not take that kernel)."""
    if not mixed_prefill(rows, w, act_dtype, act_quantized):
        return 0
    return w.num_experts * w.n * -(-w.k // w.group_k) * 2


# MXFP4 weights (e2m1 codes, uint8 e8m0 scales per 1 x 32, no zero points or second scale) with
# bf16 activations and output run on the MXFP4 prefill kinds (Kind::kFp4Bf16 of
# cuda_ffi/gemm_prefill_sm90.h) from RS4_MIN_ROWS_PER_EXPERT up to below FP4_MAX_ROWS_PER_EXPERT rows per
# expert: the codes are converted in the mainloop, and the activations are first copied into the
# workspace in the mainloop's k order (rs4_workspace_bytes) unless they come in it (a_k_order,
# rs4_act_order). K a multiple of 64, N of 8.
# $HUMMING_JAX_PREFILL_FP4=0 (read when the call is traced, as by the CUDA handler at each call)
# gives these calls back to the decode kernel and the dequantizing path;
# $HUMMING_JAX_PREFILL_FP4_MAX_ROWS=<n> > 0 moves the upper bound to n rows per expert (A/B timing
# against the dequantizing path).
ENV_PREFILL_FP4 = "HUMMING_JAX_PREFILL_FP4"
ENV_PREFILL_FP4_MAX_ROWS = "HUMMING_JAX_PREFILL_FP4_MAX_ROWS"
FP4_MAX_ROWS_PER_EXPERT = 3072  # cuda_ffi/gemm_prefill_sm90.h, kFp4MaxRowsPerExpert


def fp4_max_rows_per_expert() -> int:
    """The upper bound (rows per expert, exclusive) of MXFP4 calls on the 4-bit mainloop."""
    return _positive_override(ENV_PREFILL_FP4_MAX_ROWS, FP4_MAX_ROWS_PER_EXPERT)


def fp4_prefill(rows: int, w: PackedWeight, act_dtype: Any, act_quantized: bool, out_dtype: Any = jnp.bfloat16) -> bool:
    """Whether a ``gemm_grouped`` call of ``rows`` rows is one the MXFP4 prefill kernel takes (on an
    sm_90 device)."""
    e, n, k = w.num_experts, w.n, w.k
    if os.environ.get(ENV_PREFILL_FP4, "") == "0":
        return False
    return (w.wtype == WeightType.FP4_E2M1 and w.zero is None and w.scale2 is None and w.scale is not None
            and w.group_n == 1 and w.group_k == 32 and not act_quantized
            and jnp.dtype(act_dtype) == jnp.bfloat16 and jnp.dtype(out_dtype) == jnp.bfloat16
            and k % 64 == 0 and n % 8 == 0 and e > 0
            and rs4_min_rows_per_expert() * e <= rows < fp4_max_rows_per_expert() * e
            and -(-rows // 32) + e + 1 <= 65535)


# uint4 calls of the mixed-input kinds whose scale groups are whole 64-k tiles (or span K), K a
# multiple of 64, from RS4_MIN_ROWS_PER_EXPERT up to below U4RS_MAX_ROWS_PER_EXPERT rows per expert,
# except U4RS_CUTLASS_WINDOW (where the CUTLASS kinds measured faster), run on the same 4-bit mainloop
# as MXFP4 (Kind::kU4Bf16Rs), with the same workspace (rs4_workspace_bytes) instead of the transposed
# scales. $HUMMING_JAX_PREFILL_U4RS=0 keeps them on the mixed-input kinds; =<n> has the mainloop
# take them below n rows per expert, no window (A/B timing); read when the call is traced, as by the
# CUDA handler at each call.
ENV_PREFILL_U4RS = "HUMMING_JAX_PREFILL_U4RS"
U4RS_MAX_ROWS_PER_EXPERT = 1024  # cuda_ffi/gemm_prefill_sm90.h, kU4RsMaxRowsPerExpert
U4RS_CUTLASS_WINDOW = (408, 504)  # kU4RsCutlassFrom, kU4RsCutlassTo: rows per expert, [from, to)


def u4rs_rows_fit(rows: int, e: int) -> bool:
    """Whether ``rows`` rows over ``e`` experts lie where uint4 calls take the 4-bit mainloop (its
    other conditions aside)."""
    override = _env_int(ENV_PREFILL_U4RS, "a whole number")
    if override is not None:
        return override > 0 and rows < override * e
    lo, hi = U4RS_CUTLASS_WINDOW
    return rows < U4RS_MAX_ROWS_PER_EXPERT * e and not lo * e <= rows < hi * e


def u4rs_prefill(rows: int, w: PackedWeight, act_dtype: Any, act_quantized: bool, out_dtype: Any = jnp.bfloat16) -> bool:
    """Whether a ``gemm_grouped`` call of ``rows`` rows with uint4 weights runs on the 4-bit
    mainloop (on an sm_90 device)."""
    e, k = w.num_experts, w.k
    return (_mixed_input_fits(rows, w, act_dtype, act_quantized, rs4_min_rows_per_expert())
            and jnp.dtype(out_dtype) == jnp.bfloat16 and k % 64 == 0 and (w.group_k % 64 == 0 or w.group_k >= k)
            and u4rs_rows_fit(rows, e) and -(-rows // 32) + e + 1 <= 65535)


# The 4-bit mainloop's k order (cuda_ffi/rs4_k_order.h): within each 64-column tile, logical column L
# holds physical column rs4_k_of(L). For a gemm_grouped call that mainloop takes, the grouped class has
# permute_rows (GEMM1) and the activation (GEMM2) write their rows in this order and tells the call so
# (a_k_order), which then reads them where they are instead of copying them into that order first.
# Where the call runs on another kernel after all (another GPU, or a switch set since it was traced),
# the CUDA handler first puts the rows back in their natural order. $HUMMING_JAX_RS4_ACT_ORDER=0
# (read when the class is traced) keeps the natural order throughout (A/B timing).
RS4_ORDER_TILE = 64
ENV_RS4_ACT_ORDER = "HUMMING_JAX_RS4_ACT_ORDER"


def rs4_k_of(logical: int) -> int:
    """Physical column, within a 64-column tile, of the value logical column ``logical`` holds."""
    L = logical
    return 16 * ((L >> 1) & 3) + 8 * (L >> 5) + 2 * ((L >> 4) & 1) + ((L >> 3) & 1) + 4 * (L & 1)


def rs4_column_order(cols: int) -> np.ndarray:
    """For each logical column of a row in the k order, the physical column it holds
    (``y[:, L] = x[:, order[L]]``); ``cols`` a multiple of 64."""
    if cols % RS4_ORDER_TILE:
        raise ValueError(f"the 4-bit mainloop's k order needs a multiple of {RS4_ORDER_TILE} columns, got {cols}")
    tile = np.array([rs4_k_of(L) for L in range(RS4_ORDER_TILE)], np.int64)
    return (np.arange(0, cols, RS4_ORDER_TILE)[:, None] + tile[None, :]).reshape(-1)


def rs4_act_order(rows: int, w: PackedWeight, act_dtype: Any, out_dtype: Any = jnp.bfloat16,
                  act_quantized: bool = False) -> bool:
    """Whether the grouped class hands this ``gemm_grouped`` call its rows in the 4-bit mainloop's k
    order: a call that mainloop takes (``fp4_prefill``, ``u4rs_prefill``), unless
    $HUMMING_JAX_RS4_ACT_ORDER=0 or $HUMMING_JAX_PREFILL=0."""
    switch = os.environ.get(ENV_RS4_ACT_ORDER, "")
    if switch not in ("", "0", "1"):
        raise ValueError(f"{ENV_RS4_ACT_ORDER} = {switch!r} is not 0 or 1")
    if switch == "0" or os.environ.get("HUMMING_JAX_PREFILL", "") == "0" or act_quantized:
        return False
    return bool(fp4_prefill(rows, w, act_dtype, False, out_dtype) or u4rs_prefill(rows, w, act_dtype, False, out_dtype))


# The 4-bit mainloop's warp-specialized forms (cuda_ffi/gemm_prefill_sm90_4bit.cu): gemm4_ws_kernel,
# a producer warp loading by TMA, tiles of at most 96 token rows (32 with two weight slabs per
# warpgroup); gemm4_wsp_kernel, one persistent CTA per SM with four consumer warpgroups of two slabs
# and tiles of at most 48 rows, or of one slab and 128. $HUMMING_JAX_PREFILL_RS4_WS=1 (=2: two
# slabs, =3 / =4: the persistent form with two slabs / one) takes it for every call of the
# mainloop, =0 never; unset, the CUDA handler's rule (run_rs4). Read when the call is traced, as by
# the CUDA handler at each call.
ENV_PREFILL_RS4_WS = "HUMMING_JAX_PREFILL_RS4_WS"


def rs4_warp_specialized_switch() -> int | None:
    """$HUMMING_JAX_PREFILL_RS4_WS as 0 to 4 (the form with one or two weight slabs per warpgroup,
    or the persistent form with two slabs or one), None when unset; any other value is an error."""
    value = _env_int(ENV_PREFILL_RS4_WS, "0, 1, 2, 3 or 4")
    if value not in (None, 0, 1, 2, 3, 4):
        raise ValueError(f"{ENV_PREFILL_RS4_WS} = {os.environ[ENV_PREFILL_RS4_WS]!r} is not 0, 1, 2, 3 or 4")
    return value


# Our own persistent kernels (cuda_ffi/gemm_prefill_sm90_bf16_wsp.cu, gemm_prefill_sm90_fp8_wsp.cu):
# the bf16 grouped GEMM with unquantized bf16 weights takes its kernel by default, on tiles of up to
# 256 tokens, below 2048 rows per expert on average, on clusters of two CTAs from 512 rows per expert
# or 64 Mi weight elements an expert; w8a8-fp8-block128 takes its own (tiles of up to 128 tokens, one
# CTA per SM) for experts of fewer than 8 Mi weight elements at 32 to 2047 rows per expert, the
# CUTLASS kinds otherwise (both rules: cuda_ffi/gemm_prefill_sm90.cu, wsp_form). The switches
# $HUMMING_JAX_PREFILL_BF16_WSP and $HUMMING_JAX_PREFILL_FP8_WSP fix the form: =1 one CTA per SM, =2
# clusters of two sharing the tokens, =3 / =4 the same on tiles of up to 256 tokens (two consumer
# warpgroups); =0 the CUTLASS kind. Their tile list fits in grouped_workspace_bytes wherever the rules
# pick them (below 2048 rows per expert), and up to some 2 M rows by a switch. Read when the call is
# traced, as by the CUDA handler at each call.
ENV_PREFILL_BF16_WSP = "HUMMING_JAX_PREFILL_BF16_WSP"
ENV_PREFILL_FP8_WSP = "HUMMING_JAX_PREFILL_FP8_WSP"


def _wsp_switch(name: str, top: int) -> int | None:
    allowed = ", ".join(str(v) for v in range(top)) + f" or {top}"
    value = _env_int(name, allowed)
    if value is not None and not 0 <= value <= top:
        raise ValueError(f"{name} = {os.environ[name]!r} is not {allowed}")
    return value


def bf16_wsp_switch() -> int | None:
    """$HUMMING_JAX_PREFILL_BF16_WSP as 0-4 (the CUTLASS kind; tiles of up to 128 tokens, one CTA
    per SM or clusters of two; tiles of up to 256 tokens, the same), None when unset (the default
    rule); any other value is an error."""
    return _wsp_switch(ENV_PREFILL_BF16_WSP, 4)


def fp8_wsp_switch() -> int | None:
    """$HUMMING_JAX_PREFILL_FP8_WSP as 0-4, as bf16_wsp_switch; None when unset (fp8's default rule)."""
    return _wsp_switch(ENV_PREFILL_FP8_WSP, 4)


# The 4-bit persistent kernel's split of a small last round over K (cuda_ffi/gemm_prefill_sm90_4bit.cu,
# kSplitBytes): the flags (66 slots x 4 warpgroups, 128-byte aligned), then 66 slots of partial sums
# (512 threads x 64 float32).
RS4_SPLIT_BYTES = -(-66 * 4 * 4 // 128) * 128 + 66 * 512 * 64 * 4


def rs4_workspace_bytes(rows: int, w: PackedWeight, act_dtype: Any, act_quantized: bool,
                        out_dtype: Any = jnp.bfloat16) -> int:
    """Workspace bytes ``gemm_grouped`` adds for the 4-bit mainloop (its tile list and the permuted
    activations; cuda_ffi/gemm_prefill_sm90_4bit.cu, rs4_workspace_bytes), 0 when the call does not
    take it."""
    if not (fp4_prefill(rows, w, act_dtype, act_quantized, out_dtype)
            or u4rs_prefill(rows, w, act_dtype, act_quantized, out_dtype)):
        return 0
    rs4_warp_specialized_switch()  # a malformed switch fails here, not as another kernel there
    # Tiles of at least 32 rows' capacity (the two-slab form's): at most rows / 32 + E + 1 list entries.
    tile_list = (-(-rows // 32) + w.num_experts + 1) * 16
    return 128 + -(-(128 + tile_list) // 128) * 128 + rows * w.k * 2 + RS4_SPLIT_BYTES


def dequant_buffer_bytes(rows: int, w: PackedWeight, act_dtype: Any, act_quantized: bool) -> int:
    """Workspace bytes ``gemm_grouped`` adds for dequantizing experts (0 when the call cannot take
    that path: 16-bit weights, 8-bit activations, too few rows per expert, K or N not a multiple
    of 8, scale groups that are not whole 8-column runs; or when the mixed-input kernel takes it)."""
    e, n, k = w.num_experts, w.n, w.k
    if (mixed_prefill(rows, w, act_dtype, act_quantized) or fp4_prefill(rows, w, act_dtype, act_quantized)
            or u4rs_prefill(rows, w, act_dtype, act_quantized)):
        return 0
    if (w.wtype == WeightType.FLOAT or act_quantized or jnp.dtype(act_dtype) not in (jnp.bfloat16, jnp.float16)
            or e <= 0 or rows < dequant_min_rows_per_expert(w) * e or n % 8 or k % 8 or not (w.group_k % 8 == 0 or w.group_k >= k)):
        return 0
    budget_mb = _env_int(ENV_DEQUANT_WORKSPACE_MB, "a whole number of MiB")
    if budget_mb is None:
        budget_mb = DEQUANT_WORKSPACE_MB_DEFAULT
    if budget_mb <= 0:
        return 0
    per_expert = n * k * 2
    experts = max(1, min(e, (budget_mb << 20) // per_expert))
    return _DEQUANT_ALIGN + experts * per_expert


def _grouped_workspace(rows: int, a_dtype: Any, a_scale: jax.Array | None, w: PackedWeight, out_dtype: Any) -> int:
    """Bytes of ``gemm_grouped``'s workspace result for ``rows`` rows of activations."""
    if w.wtype == WeightType.FLOAT and jnp.dtype(a_dtype) == jnp.bfloat16:
        bf16_wsp_switch()  # a malformed switch fails here, not as another kernel there
    if w.wtype == WeightType.FP8_E4M3 and a_scale is not None:
        fp8_wsp_switch()
    quantized = a_scale is not None
    return (grouped_workspace_bytes(w.num_experts) + dequant_buffer_bytes(rows, w, a_dtype, quantized)
            + mixed_scale_bytes(rows, w, a_dtype, quantized)
            + rs4_workspace_bytes(rows, w, a_dtype, quantized, out_dtype))


def gemm_grouped(
    a: jax.Array,
    a_scale: jax.Array | None,
    w: PackedWeight,
    bias: jax.Array | None,
    expert_first_token_offset: jax.Array,
    *,
    out_dtype: Any,
    act_group_k: int = 0,
    a_k_order: bool = False,
) -> jax.Array:
    """Rows [off[e], off[e+1]) of a use expert e; rows past off[E] become zeros: [R, N].

    ``a_k_order=True``: a's columns are in the 4-bit prefill mainloop's k order
    (``rs4_column_order``), as ``permute_rows`` and ``activation`` write them with ``k_order=True``;
    only for calls ``rs4_act_order`` accepts. The call also returns a uint8 workspace (an XLA value,
    so its buffer is apart from every other live one); it is dropped here."""
    if a_k_order and not rs4_act_order(a.shape[0], w, a.dtype, out_dtype, a_scale is not None):
        raise ValueError("gemm_grouped: a_k_order=True is for calls on the 4-bit prefill mainloop "
                         "(rs4_act_order), not for this one")
    ops, attrs = _operands(a, a_scale, w, bias, act_group_k)
    attrs["a_k_order"] = int(a_k_order)
    c, _workspace = _ffi.call(
        "gemm_grouped",
        (
            jax.ShapeDtypeStruct((a.shape[0], w.n), out_dtype),
            jax.ShapeDtypeStruct((_grouped_workspace(a.shape[0], a.dtype, a_scale, w, out_dtype),), jnp.uint8),
        ),
        *ops,
        expert_first_token_offset,
        **attrs,
    )
    return c


def gemm_grouped_gated(
    a: jax.Array,
    w: PackedWeight,
    bias: jax.Array | None,
    expert_first_token_offset: jax.Array,
    *,
    out_dtype: Any,
    activation: str,
    limit: float | None = None,
) -> jax.Array:
    """``activation(gemm_grouped(a, None, w, ...), activation, limit)`` for a gated activation in
    one call: [R, N / 2], rows past off[E] zeros. On the GPU the persistent bf16 kernel's epilogue
    activates each row's gate and up values where it takes the call on tiles of 256 tokens (N a
    multiple of 16); elsewhere the GEMM's rows go through the activation kernel. The values are the
    two calls', bit for bit: the epilogue rounds the GEMM's values as it would store them first."""
    code, lim = _gated_activation("gemm_grouped_gated", w, activation, limit)
    ops, attrs = _operands(a, None, w, bias, 0)
    rows = a.shape[0]
    y, _c, _workspace = _ffi.call(
        "gemm_grouped_gated",
        (
            jax.ShapeDtypeStruct((rows, w.n // 2), out_dtype),
            jax.ShapeDtypeStruct((rows, w.n), out_dtype),
            jax.ShapeDtypeStruct((_grouped_workspace(rows, a.dtype, None, w, out_dtype),), jnp.uint8),
        ),
        *ops,
        expert_first_token_offset,
        activation=code,
        limit=lim,
        **attrs,
    )
    return y


# HUMMING_JAX_PREFILL_GATHER: 0 or unset, the grouped class permutes its token rows (permute_rows)
# before GEMM1; 1, its GEMM1 is gemm_grouped_gather, whose persistent bf16 kernel gathers the rows
# itself on clusters of one CTA; 2, also on clusters of two (cuda_ffi/gemm_prefill_sm90.h,
# gather_switch). Read when the class is traced (and by the CUDA handler at each call). Off by
# default: gathering by cp.async measured slower than the permuted copy at 256-token tiles (v17).
ENV_PREFILL_GATHER = "HUMMING_JAX_PREFILL_GATHER"
GATHER_COPY_ALIGN = 256  # cuda_ffi/ffi_common.h, kGatherCopyAlign


def gather_switch() -> int | None:
    """$HUMMING_JAX_PREFILL_GATHER as 0-2, None when unset (0); any other value is an error."""
    return _wsp_switch(ENV_PREFILL_GATHER, 2)


def gather_copy_bytes(rows: int, k: int, dtype: Any) -> int:
    """Room ``gemm_grouped_gather`` keeps at its workspace's end for the permuted rows, which a path
    that does not gather them makes there (cuda_ffi/ffi_common.h, gather_copy_bytes)."""
    return rows * k * jnp.dtype(dtype).itemsize + GATHER_COPY_ALIGN


def gemm_grouped_gather(
    x: jax.Array,
    w: PackedWeight,
    bias: jax.Array | None,
    permutation: jax.Array,
    expert_first_token_offset: jax.Array,
    top_k: int,
    *,
    out_dtype: Any,
) -> jax.Array:
    """``gemm_grouped(permute_rows(x, routing, top_k), ...)`` in one call: row r of the problem is
    x[permutation[r] // top_k] (zeros past the last offset): [M * top_k, N].

    x holds 16-bit token rows [M, K]. On the GPU the persistent bf16 kernel reads the rows where
    they lie when $HUMMING_JAX_PREFILL_GATHER allows it; elsewhere the call permutes them into its
    workspace first. The result is the same, bit for bit."""
    if x.ndim != 2:
        raise ValueError(f"gemm_grouped_gather: x must be [M, K], got shape {x.shape}")
    if top_k <= 0:
        raise ValueError(f"gemm_grouped_gather: top_k must be positive, got {top_k}")
    gather_switch()
    rows = permutation.shape[0]
    ops, attrs = _operands(x, None, w, bias, 0)
    c, _workspace = _ffi.call(
        "gemm_grouped_gather",
        (
            jax.ShapeDtypeStruct((rows, w.n), out_dtype),
            jax.ShapeDtypeStruct((_grouped_workspace(rows, x.dtype, None, w, out_dtype)
                                  + gather_copy_bytes(rows, w.k, x.dtype),), jnp.uint8),
        ),
        *ops,
        permutation,
        expert_first_token_offset,
        top_k=top_k,
        **attrs,
    )
    return c


def gemm_batched(
    a: jax.Array,
    a_scale: jax.Array | None,
    w: PackedWeight,
    bias: jax.Array | None,
    expert_num_tokens: jax.Array,
    *,
    out_dtype: Any,
    act_group_k: int = 0,
    out: jax.Array | None = None,
) -> jax.Array:
    """a [E, T, K] -> [E, T, N]; rows t >= expert_num_tokens[e] become zeros.

    With ``out`` the result is written into that buffer (declared input-output alias)."""
    ops, attrs = _operands(a, a_scale, w, bias, act_group_k)
    shape = jax.ShapeDtypeStruct((a.shape[0], a.shape[1], w.n), out_dtype)
    if out is None:
        return _ffi.call("gemm_batched", shape, *ops, expert_num_tokens, **attrs)
    return _ffi.call(
        "gemm_batched_into",
        shape,
        *ops,
        expert_num_tokens,
        out,
        aliases={len(ops) + 1: 0},
        **attrs,
    )
