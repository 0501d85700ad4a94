"""Test helpers shared by the kernel tests and the sanitizer driver: random weights in kernel layout
with arbitrary types and group sizes (``quantize_moe_weights`` only builds the named schemes),
random routing inputs, and every GEMM form of one random problem as one function."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ._abi import WeightType
from .activations import get_activation
from .experts import indexed_block_m
from .ops import activation as act_ops
from .ops import gemm as gemm_ops
from .ops import routing as routing_ops
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


def random_routing(
    rng: np.random.Generator, m: int, k: int, e_global: int, e_local: int, pad_frac: float
) -> tuple[jax.Array, jax.Array]:
    """(topk_ids [m, k], expert_map [e_global]): ids uniform over the global experts, a fraction
    padded with -1 and two far out of range (2^31 - 1 and -2^31; every kernel must skip them); e_local
    of the global experts owned, in a random order."""
    ids = rng.integers(0, e_global, (m, k)).astype(np.int32)
    ids = np.where(rng.random((m, k)) < pad_frac, -1, ids).astype(np.int32)
    if m * k:
        ids.flat[rng.integers(0, m * k)] = 2**31 - 1
        ids.flat[rng.integers(0, m * k)] = -(2**31)
    emap = np.full(e_global, -1, np.int32)
    emap[rng.permutation(e_global)[:e_local]] = np.arange(e_local)
    return jnp.asarray(ids), jnp.asarray(emap)


def gemm_forms(
    rng: np.random.Generator,
    w: PackedWeight,
    bias: jax.Array | None,
    dtype: Any,
    quant: tuple[str, int] | None,
    ids: jax.Array,
    emap: jax.Array,
    t: int = 5,
) -> tuple[Callable[..., dict], tuple]:
    """Every GEMM call of one random problem, routed by ``ids`` [M, k] through ``emap``, as one
    function of its operands: gemm_indexed as GEMM1 (rows gathered by id // k) and as GEMM2
    (gather_div 1), gemm_grouped (rows permuted by expert), gemm_batched over [E, t, K] with random
    counts, and gemm_batched into a NaN-filled ``out``. Activations are quantized first when
    ``quant`` = (kind, group_k) is given. Returns (fn, operands); fn(*operands) gives a dict: c1, c2,
    cg, cb, cbi, and src (the indexed routing's source rows) and off (the grouped offsets). The
    operands are (x, a2, xb, ids, emap, counts, w, bias, out)."""
    e, kdim = w.num_experts, w.k
    n = int(w.data.shape[1])
    m, k = ids.shape
    x = jnp.asarray(rng.standard_normal((m, kdim)), dtype)
    a2 = jnp.asarray(rng.standard_normal((m * k, kdim)), dtype)
    xb = jnp.asarray(rng.standard_normal((e, t, kdim)), dtype)
    counts = jnp.asarray(rng.integers(-1, t + 2, e).astype(np.int32))
    out = jnp.full((e, t, n), jnp.nan, dtype)
    agk = quant[1] if quant else 0
    bm = indexed_block_m(m * k, e)

    def act(v):
        return act_ops.quantize(v, quant[0], quant[1]) if quant else (v, None)

    def fn(x, a2, xb, ids, emap, counts, w, bias, out):
        r = routing_ops.routing_indexed(ids, emap, e, bm)
        a, s = act(x)
        c1 = gemm_ops.gemm_indexed(a, s, w, bias, r, rows=m * k, gather_div=k, block_m=bm, out_dtype=dtype,
                                   act_group_k=agk)
        a2q, s2q = act(a2)
        c2 = gemm_ops.gemm_indexed(a2q, s2q, w, bias, r, rows=m * k, gather_div=1, block_m=bm, out_dtype=dtype,
                                   act_group_k=agk)
        rg = routing_ops.routing_grouped(ids, emap, e)
        ag, sg = act(routing_ops.permute_rows(x, rg, k))
        cg = gemm_ops.gemm_grouped(ag, sg, w, bias, rg.expert_first_token_offset, out_dtype=dtype, act_group_k=agk)
        ab, sb = act(xb.reshape(e * t, kdim))
        ab = ab.reshape(e, t, kdim)
        cb = gemm_ops.gemm_batched(ab, sb, w, bias, counts, out_dtype=dtype, act_group_k=agk)
        cbi = gemm_ops.gemm_batched(ab, sb, w, bias, counts, out_dtype=dtype, act_group_k=agk, out=out)
        return dict(c1=c1, c2=c2, cg=cg, cb=cb, cbi=cbi, src=r.src_rows, off=rg.expert_first_token_offset)

    return fn, (x, a2, xb, ids, emap, counts, w, bias, out)


def _token_rows(
    rng: np.random.Generator, rows: int, cols: int, decades: float, dtype: Any, tiny: float = 0.0
) -> jax.Array:
    """Random rows [rows, cols] of dtype whose magnitudes span +-decades decades row to row, with
    3% zeros, 3% negative zeros, a fraction ``tiny`` scaled by 1e-25, and (more than one row) a
    row of zeros."""
    xf = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-decades, decades, (rows, 1))
    xf[rng.random((rows, cols)) < 0.03] = 0.0
    xf[rng.random((rows, cols)) < 0.03] = -0.0
    if tiny:
        xf[rng.random((rows, cols)) < tiny] *= 1e-25
    if rows > 1:
        xf[rows // 2] = 0.0
    return jnp.asarray(xf, dtype)


def indexed_quant_forms(
    rng: np.random.Generator,
    w: PackedWeight,
    bias: jax.Array | None,
    dtype: Any,
    quant: tuple[str, int],
    ids: jax.Array,
    activation: str | None = None,
    limit: float | None = None,
) -> tuple[Callable[..., dict], tuple]:
    """One random indexed GEMM both ways: ``gemm_indexed_quant`` (the input quantized inside the
    GEMM's call) and the separate calls. Without ``activation``, GEMM1's form: token rows gathered
    by id // k, ``quantize`` + ``gemm_indexed``; with it, GEMM2's: one row per id, twice the
    columns for a gated activation, ``activation_quant`` + ``gemm_indexed``. Rows span six decades
    of magnitude (three with an activation), so the per-group scales differ row to row. Returns (fn, operands); fn(x, ids, w,
    bias) gives a dict: fused, two, src (the routing's source rows)."""
    e, kdim = w.num_experts, w.k
    m, k = ids.shape
    rows, gather_div, cols, decades = m, k, kdim, 3.0
    if activation is not None:  # a gated product squares the magnitudes: half the decades (float16)
        spec, _ = get_activation(activation, limit)
        rows, gather_div, cols, decades = m * k, 1, 2 * kdim if spec.gated else kdim, 1.5
    # Values a division by the scale treats apart: values far below their group's maximum (bf16
    # keeps them: ~1e-25 of it), beside _token_rows' signed zeros and row of zeros.
    x = _token_rows(rng, rows, cols, decades, dtype, tiny=0.02)
    bm = indexed_block_m(m * k, e)

    def fn(x, ids, w, bias):
        r = routing_ops.routing_indexed(ids, None, e, bm)
        common = dict(rows=m * k, gather_div=gather_div, block_m=bm, out_dtype=dtype)
        fused = gemm_ops.gemm_indexed_quant(
            x, w, bias, r, quant=quant[0], act_group_k=quant[1], activation=activation, limit=limit, **common
        )
        if activation is None:
            a, s = act_ops.quantize(x, quant[0], quant[1])
        else:
            a, s = act_ops.activation_quant(x, activation, limit, quant[0], quant[1])
        two = gemm_ops.gemm_indexed(a, s, w, bias, r, act_group_k=quant[1], **common)
        return dict(fused=fused, two=two, src=r.src_rows)

    return fn, (x, ids, w, bias)


def distinct_topk_ids(rng: np.random.Generator, m: int, k: int, e: int, pad: float = 0.15) -> jax.Array:
    """topk ids [m, k]: k distinct experts of e per token, a fraction ``pad`` of them -1 (at least
    one where pad > 0, so a test of dropped ids always has one to drop)."""
    ids = np.argsort(rng.random((m, e)), axis=1)[:, :k]
    drop = rng.random((m, k)) < pad
    if pad > 0.0 and not drop.any():
        drop.flat[rng.integers(m * k)] = True
    return jnp.asarray(np.where(drop, -1, ids).astype(np.int32))


def assert_fused_equals_two(got: dict, *, exact: bool = True) -> None:
    """indexed_quant_forms' / gated_forms' results: the rows the routing fills are finite, not
    all zero, and the same bits both ways. ``exact=False`` where the two ways may sum the GEMM's K
    split in another order (gemm_indexed_gated's halves pairing on the GPU takes at most 4 K groups,
    a separate gemm_indexed up to 8): then equal within a few units in the last place of the
    16-bit result, relative to the largest value."""
    valid = np.asarray(got["src"]).reshape(-1) >= 0
    fused = np.asarray(jnp.asarray(got["fused"]).astype(jnp.float32))[valid]
    two = np.asarray(jnp.asarray(got["two"]).astype(jnp.float32))[valid]
    assert np.all(np.isfinite(fused)) and np.any(fused != 0.0)
    if exact:
        np.testing.assert_array_equal(fused, two)
        return
    eps = float(jnp.finfo(jnp.asarray(got["two"]).dtype).eps)
    np.testing.assert_allclose(fused, two, rtol=8 * eps, atol=8 * eps * float(np.abs(two).max()))


def grouped_gated_both(
    x: jax.Array,
    ids: jax.Array,
    expert_map: jax.Array | None,
    w: PackedWeight,
    bias: jax.Array | None,
    activation: str,
    limit: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GEMM1 of the grouped class both ways on the permuted rows of x: (gemm_grouped_gated,
    gemm_grouped + ``activation``, the routing's expert_first_token_offset), both in x's dtype."""
    r = routing_ops.routing_grouped(ids, expert_map, w.num_experts)
    a, off = routing_ops.permute_rows(x, r, ids.shape[1]), r.expert_first_token_offset
    fused = gemm_ops.gemm_grouped_gated(a, w, bias, off, out_dtype=x.dtype, activation=activation, limit=limit)
    two = act_ops.activation(gemm_ops.gemm_grouped(a, None, w, bias, off, out_dtype=x.dtype), activation, limit)
    return fused, two, off


def gated_forms(
    rng: np.random.Generator,
    w: PackedWeight,
    bias: jax.Array | None,
    dtype: Any,
    ids: jax.Array,
    activation: str,
    limit: float | None = None,
    gemm_type: str = "indexed",
) -> tuple[Callable[..., dict], tuple]:
    """One random GEMM1 of the indexed or grouped class both ways: the gated call
    (``gemm_indexed_gated`` / ``gemm_grouped_gated``: the gated activation of the GEMM's rows in
    its call) and the GEMM + ``activation``; the indexed class gathers token rows by id // k, the
    grouped one permutes them. Returns (fn, operands); fn(x, ids, w, bias) gives a dict: fused, two,
    src (the indexed routing's source rows; for the grouped class 0 for the rows the routing fills
    and -1 past the last offset) and, for the grouped class, offsets."""
    if gemm_type not in ("indexed", "grouped"):
        raise ValueError(f"gemm_type must be 'indexed' or 'grouped', got {gemm_type!r}")
    e = w.num_experts
    m, k = ids.shape
    x = _token_rows(rng, m, w.k, 1.0, dtype)
    bm = indexed_block_m(m * k, e)

    def fn(x, ids, w, bias):
        if gemm_type == "indexed":
            r = routing_ops.routing_indexed(ids, None, e, bm)
            common = dict(rows=m * k, gather_div=k, block_m=bm, out_dtype=dtype)
            fused = gemm_ops.gemm_indexed_gated(x, None, w, bias, r, activation=activation, limit=limit, **common)
            two = act_ops.activation(gemm_ops.gemm_indexed(x, None, w, bias, r, **common), activation, limit)
            return dict(fused=fused, two=two, src=r.src_rows)
        fused, two, off = grouped_gated_both(x, ids, None, w, bias, activation, limit)
        return dict(fused=fused, two=two, src=jnp.where(jnp.arange(m * k) < off[-1], 0, -1), offsets=off)

    return fn, (x, ids, w, bias)


def experts_indexed_forms(
    rng: np.random.Generator,
    w13: PackedWeight,
    b13: jax.Array | None,
    w2: PackedWeight,
    b2: jax.Array | None,
    dtype: Any,
    ids: jax.Array,
    activation: str,
    limit: float | None = None,
) -> tuple[Callable[..., dict], tuple]:
    """The indexed class's two GEMMs both ways on random token rows: ``experts_indexed`` (one call)
    and ``gemm_indexed_gated`` then ``gemm_indexed``. Returns (fn, operands); fn(x, ids, w13, b13,
    w2, b2) gives a dict for assert_fused_equals_two: fused, two, src (the routing's source rows)."""
    e = w13.num_experts
    m, k = ids.shape
    x = _token_rows(rng, m, w13.k, 1.0, dtype)
    bm = indexed_block_m(m * k, e)

    def fn(x, ids, w13, b13, w2, b2):
        r = routing_ops.routing_indexed(ids, None, e, bm)
        common = dict(rows=m * k, block_m=bm, out_dtype=dtype)
        fused = gemm_ops.experts_indexed(x, w13, b13, w2, b2, r, gather_div=k, activation=activation, limit=limit,
                                         **common)
        y = gemm_ops.gemm_indexed_gated(x, None, w13, b13, r, gather_div=k, activation=activation, limit=limit,
                                        **common)
        two = gemm_ops.gemm_indexed(y, None, w2, b2, r, gather_div=1, **common)
        return dict(fused=fused, two=two, src=r.src_rows)

    return fn, (x, ids, w13, b13, w2, b2)


def experts_indexed_quant_forms(
    rng: np.random.Generator,
    w13: PackedWeight,
    b13: jax.Array | None,
    w2: PackedWeight,
    b2: jax.Array | None,
    dtype: Any,
    quant: tuple[str, int],
    ids: jax.Array,
    activation: str,
    limit: float | None = None,
) -> tuple[Callable[..., dict], tuple]:
    """The indexed class's two GEMMs with 8-bit activations both ways on random token rows:
    ``experts_indexed_quant`` (one call) and two ``gemm_indexed_quant`` calls. Rows span 1.5
    decades of magnitude either way (GEMM1's products stay inside float16's range), so the
    per-group scales differ row to row. Returns (fn, operands); fn(x, ids, w13, b13, w2, b2) gives
    a dict for assert_fused_equals_two: fused, two, src, and c (GEMM1's rows of the two calls)."""
    e = w13.num_experts
    m, k = ids.shape
    x = _token_rows(rng, m, w13.k, 1.5, dtype, tiny=0.02)
    bm = indexed_block_m(m * k, e)

    def fn(x, ids, w13, b13, w2, b2):
        r = routing_ops.routing_indexed(ids, None, e, bm)
        common = dict(rows=m * k, block_m=bm, out_dtype=dtype, quant=quant[0], act_group_k=quant[1])
        fused = gemm_ops.experts_indexed_quant(x, w13, b13, w2, b2, r, gather_div=k, activation=activation,
                                               limit=limit, **common)
        c = gemm_ops.gemm_indexed_quant(x, w13, b13, r, gather_div=k, **common)
        two = gemm_ops.gemm_indexed_quant(c, w2, b2, r, gather_div=1, activation=activation, limit=limit, **common)
        return dict(fused=fused, two=two, src=r.src_rows, c=c)

    return fn, (x, ids, w13, b13, w2, b2)
