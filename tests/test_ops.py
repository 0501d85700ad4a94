"""Each custom call on its own, against NumPy/jnp definitions of its contract."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from humming_jax.activations import ACTIVATIONS, apply_activation
from humming_jax.ops import activation as act_ops
from humming_jax.ops import finalize as fin_ops
from humming_jax.ops import routing as routing_ops
from humming_jax.reference import InputQuant, fake_quantize


def _local(ids: np.ndarray, emap: np.ndarray, e_local: int) -> np.ndarray:
    ok = (ids >= 0) & (ids < len(emap))
    loc = np.where(ok, emap[np.clip(ids, 0, len(emap) - 1)], -1)
    return np.where((loc >= 0) & (loc < e_local), loc, -1)


def _random_ids(rng, m, k, e_global):
    ids = rng.integers(-2, e_global + 2, (m, k)).astype(np.int32)
    emap = rng.permutation(np.r_[np.arange(e_global // 2), -np.ones(e_global - e_global // 2)]).astype(np.int32)
    return ids, emap, e_global // 2


@pytest.mark.parametrize("m,k,e_global,block_m", [(0, 2, 8, 16), (1, 1, 2, 16), (37, 4, 16, 16), (200, 8, 64, 32), (300, 2, 8, 64)])
def test_routing_indexed_layout(rng, m, k, e_global, block_m):
    ids, emap, e = _random_ids(rng, m, k, e_global)
    r = jax.jit(routing_ops.routing_indexed, static_argnums=(2, 3))(jnp.asarray(ids), jnp.asarray(emap), e, block_m)
    sorted_ids, blocks, ntpp, src = (np.asarray(a) for a in r)
    local = _local(ids, emap, e).reshape(-1)
    counts = np.bincount(local[local >= 0], minlength=e)
    padded = -(-counts // block_m) * block_m
    assert int(ntpp[0]) == padded.sum()
    assert sorted_ids.shape[0] == routing_ops.indexed_padded_rows(m * k, e, block_m)
    start = 0
    for ex in range(e):
        seg = sorted_ids[start : start + padded[ex]]
        real = seg[seg < m * k]
        assert sorted(real.tolist()) == np.flatnonzero(local == ex).tolist()
        assert np.all(seg[len(real):] == m * k), "padding after the expert's rows"
        assert np.all(blocks[start // block_m : (start + padded[ex]) // block_m] == ex)
        start += padded[ex]
    assert np.all(sorted_ids[start:] == m * k) and np.all(blocks[start // block_m :] == -1)
    np.testing.assert_array_equal(src.reshape(-1), np.where(local >= 0, np.arange(m * k), -1))


@pytest.mark.parametrize("m,k,e_global", [(0, 2, 8), (1, 1, 2), (37, 4, 16), (500, 8, 128)])
def test_routing_grouped_layout_and_permute(rng, m, k, e_global):
    ids, emap, e = _random_ids(rng, m, k, e_global)
    r = routing_ops.routing_grouped(jnp.asarray(ids), jnp.asarray(emap), e)
    perm, off, src = (np.asarray(a) for a in r)
    local = _local(ids, emap, e).reshape(-1)
    counts = np.bincount(local[local >= 0], minlength=e)
    np.testing.assert_array_equal(off, np.r_[0, np.cumsum(counts)])
    for ex in range(e):
        assert sorted(perm[off[ex] : off[ex + 1]].tolist()) == np.flatnonzero(local == ex).tolist()
    assert np.all(perm[off[-1]:] == -1)
    flat_src = src.reshape(-1)
    for i in range(m * k):
        assert (flat_src[i] == -1) == (local[i] < 0)
        if flat_src[i] >= 0:
            assert perm[flat_src[i]] == i
    x = jnp.asarray(rng.standard_normal((m, 24)), jnp.bfloat16)
    y = np.asarray(routing_ops.permute_rows(x, r, k).astype(jnp.float32))
    xs = np.asarray(x.astype(jnp.float32))
    for p in range(m * k):
        want = xs[perm[p] // k] if p < off[-1] else np.zeros(24)
        np.testing.assert_array_equal(y[p], want)


@pytest.mark.parametrize("m,k,e_global,e_local", [(1, 2, 8, 8), (37, 4, 16, 6), (300, 8, 64, 64)])
def test_empty_expert_map_is_the_identity_over_local_experts(rng, m, k, e_global, e_local):
    """No expert_map (None or empty) routes as the explicit map [0, 1, .., e_local - 1, -1, ..]: ids
    past the local experts, negative ids and ids far out of range are skipped, the others keep
    their slot."""
    ids = rng.integers(-3, e_global + 3, (m, k)).astype(np.int32)
    ids.flat[rng.integers(0, m * k)] = 2**31 - 1
    ids.flat[rng.integers(0, m * k)] = -(2**31)
    explicit = np.where(np.arange(e_global) < e_local, np.arange(e_global), -1).astype(np.int32)
    ids_j, explicit_j = jnp.asarray(ids), jnp.asarray(explicit)
    want_indexed = {bm: routing_ops.routing_indexed(ids_j, explicit_j, e_local, bm) for bm in (1, 16)}
    want_grouped = routing_ops.routing_grouped(ids_j, explicit_j, e_local)
    for no_map in (jnp.asarray(np.zeros((0,), np.int32)), None):
        for block_m, a in want_indexed.items():
            b = routing_ops.routing_indexed(ids_j, no_map, e_local, block_m)
            for name, x, y in zip(routing_ops.IndexedRouting._fields, a, b):
                np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=name)
        b = routing_ops.routing_grouped(ids_j, no_map, e_local)
        for name, x, y in zip(routing_ops.GroupedRouting._fields, want_grouped, b):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x), err_msg=name)
    kept = (np.asarray(b.src_rows).reshape(-1) >= 0).tolist()  # the explicit map's too, equal above
    assert kept == ((ids >= 0) & (ids < e_local)).reshape(-1).tolist()


@pytest.mark.parametrize("quant,group_k", [("fp8", 128), ("fp8", 0), ("int8", 64)])
def test_quantize_then_permute_equals_permute_then_quantize(rng, quant, group_k):
    """The grouped class quantizes the M token rows and permutes codes and scales; every routed
    row must come out as quantizing the permuted rows would give it, bit for bit."""
    m, k, e, cols = 29, 4, 7, 256
    ids = np.stack([rng.permutation(e + 2)[:k] for _ in range(m)]).astype(np.int32)
    emap = np.concatenate([np.arange(e), [-1, -1]]).astype(np.int32)  # two remote experts
    x = jnp.asarray(rng.standard_normal((m, cols)) * rng.uniform(0.01, 30, (m, 1)), jnp.bfloat16)
    r = routing_ops.routing_grouped(jnp.asarray(ids), jnp.asarray(emap), e)
    q, s = act_ops.quantize(x, quant, group_k)
    qp, sp = routing_ops.permute_rows(q, r, k), routing_ops.permute_rows(s, r, k)
    q_ref, s_ref = act_ops.quantize(routing_ops.permute_rows(x, r, k), quant, group_k)
    valid = int(np.asarray(r.expert_first_token_offset)[-1])
    assert 0 < valid < m * k  # remote experts leave rows past the valid ones
    np.testing.assert_array_equal(np.asarray(qp[:valid]).view(np.uint8), np.asarray(q_ref[:valid]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(sp[:valid]), np.asarray(s_ref[:valid]))
    assert np.all(np.asarray(sp[:valid]) > 0)


@pytest.mark.parametrize("quant,group_k,cols", [("fp8", 128, 256), ("int8", 8, 64), ("fp8", 256, 512)])
@pytest.mark.parametrize("consistent", [True, False])
def test_quantize_permuted_is_permute_rows_of_quantize(rng, quant, group_k, cols, consistent):
    """y[p] = quantize(x)[perm[p] // k] for p below the (clamped) last offset and an id in range,
    zeros elsewhere, codes and scales: over the routing's layout and over arbitrary metadata."""
    m, k, e = 23, 3, 5
    x = jnp.asarray(rng.standard_normal((m, cols)) * rng.uniform(0.01, 30, (m, 1)), jnp.bfloat16)
    if consistent:
        ids = np.stack([rng.permutation(e + 2)[:k] for _ in range(m)]).astype(np.int32)
        r = routing_ops.routing_grouped(jnp.asarray(ids), jnp.asarray(np.r_[np.arange(e), -1, -1].astype(np.int32)), e)
        perm, off, src = r.permutation, r.expert_first_token_offset, r.src_rows
    else:
        perm = jnp.asarray(rng.integers(-2, m * k + 2, m * k).astype(np.int32))
        off = jnp.asarray(np.array([0, m * k // 2, m * k - 4], np.int32))
        src = jnp.asarray(rng.integers(-1, m * k + 1, (m, k)).astype(np.int32))
    q, s = act_ops.quantize_permuted(x, perm, off, src, quant, group_k)
    q0, s0 = act_ops.quantize(x, quant, group_k)
    q0, s0 = np.asarray(jax.lax.bitcast_convert_type(q0, jnp.uint8)), np.asarray(s0)
    pn, valid = np.asarray(perm), min(max(int(np.asarray(off)[-1]), 0), m * k)
    want_q = np.zeros((m * k, cols), np.uint8)
    want_s = np.zeros((m * k, cols // group_k), np.float32)
    for p in range(valid):
        if 0 <= pn[p] < m * k:
            want_q[p], want_s[p] = q0[pn[p] // k], s0[pn[p] // k]
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8)), want_q)
    np.testing.assert_array_equal(np.asarray(s), want_s)
    assert np.count_nonzero(want_s) > m  # the rows are not mostly zeros


@pytest.mark.parametrize("group_k,cols", [(0, 256), (40, 200), (512, 512), (128, 192)])
def test_quantize_permuted_rejects_other_groupings(rng, group_k, cols):
    x = jnp.asarray(rng.standard_normal((4, cols)), jnp.bfloat16)
    perm, off, src = jnp.arange(8, dtype=jnp.int32), jnp.asarray([0, 8], jnp.int32), jnp.zeros((4, 2), jnp.int32)
    assert not act_ops.quantize_permuted_supported(group_k, cols)
    with pytest.raises(ValueError, match="groups of 8 to 256"):
        act_ops.quantize_permuted(x, perm, off, src, "fp8", group_k)


@pytest.mark.parametrize("what,match", [("group", "group_k must be a power of two"),
                                        ("rows", "permutation must have M \\* top_k entries"),
                                        ("src", "src_rows must have one row per row of x")])
def test_quantize_permuted_handler_checks_its_operands(rng, what, match):
    """The handler's own checks (shared by the CPU and CUDA handlers), past the Python wrapper."""
    from humming_jax import _ffi

    m, k, cols, group_k = 4, 2, 256, 128
    x = jnp.asarray(rng.standard_normal((m, cols)), jnp.bfloat16)
    perm = jnp.arange(m * k + (what == "rows"), dtype=jnp.int32)
    src = jnp.zeros((m + (what == "src"), k), jnp.int32)
    group_k = 40 if what == "group" else group_k
    shapes = (jax.ShapeDtypeStruct((perm.shape[0], cols), jnp.float8_e4m3fn),
              jax.ShapeDtypeStruct((perm.shape[0], cols // group_k), jnp.float32))
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(_ffi.call("quantize_permuted", shapes, x, perm, jnp.asarray([0, m * k], jnp.int32), src,
                                        group_k=group_k))


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_activation_matches_jnp(rng, name, dtype):
    x = jnp.asarray(rng.standard_normal((33, 2 * 40)) * 3, dtype)
    got = act_ops.activation(x, name)
    want = apply_activation(x, name).astype(dtype)
    # Same formula; transcendental ulps may flip a rounding of the 16-bit result.
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)), rtol=8e-3, atol=1e-3)


def _codes(v: np.ndarray, scale: np.ndarray, kind: str) -> np.ndarray:
    """The contract's codes for float32 values v [R, G, g] and scales [R, G] (NumPy, exact division)."""
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)[:, :, None]
    c = np.where(scale[:, :, None] > 0, v / safe, 0.0).astype(np.float32)
    if kind == "fp8":
        return np.clip(c, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.clip(np.rint(c), -127, 127)


@pytest.mark.parametrize("kind,group", [("fp8", 0), ("fp8", 128), ("int8", 0)])
def test_quantize_matches_definition(rng, kind, group):
    x = jnp.asarray(rng.standard_normal((17, 256)) * rng.random((17, 1)) * 10, jnp.bfloat16)
    x = x.at[3].set(0)  # an all-zero row: scale 0, codes 0
    q, s = act_ops.quantize(x, kind, group)
    groups = 256 // group if group else 1
    assert s.shape == (17, groups)
    v = np.asarray(x.astype(jnp.float32)).reshape(17, groups, -1)
    sn = np.asarray(s)
    np.testing.assert_allclose(sn, np.abs(v).max(-1) / (448.0 if kind == "fp8" else 127.0), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)).reshape(17, groups, -1), _codes(v, sn, kind))
    assert np.all(sn[3] == 0) and np.all(np.asarray(q.astype(jnp.float32))[3] == 0)


@pytest.mark.parametrize("kind,group", [("fp8", 0), ("fp8", 128), ("int8", 0)])
@pytest.mark.parametrize("name", ["silu", "swigluoai", "gelu_no_mul"])
def test_activation_quant_is_quantized_activation(rng, kind, group, name):
    cols = 256 if ACTIVATIONS[name].gated else 128
    x = jnp.asarray(rng.standard_normal((9, cols)) * 2, jnp.bfloat16)
    q, s = act_ops.activation_quant(x, name, None, kind, group)
    groups = 128 // group if group else 1
    v = np.asarray(apply_activation(x, name)).reshape(9, groups, -1)
    sn = np.asarray(s)
    np.testing.assert_allclose(sn, np.abs(v).max(-1) / (448.0 if kind == "fp8" else 127.0), rtol=1e-5)
    codes = np.asarray(q.astype(jnp.float32)).reshape(9, groups, -1)
    # The activation's float32 value may differ by an ulp between implementations, which can move
    # a code by one step at a rounding boundary; almost all codes agree exactly.
    want = _codes(v, sn, kind)
    assert np.mean(codes == want) > 0.99
    np.testing.assert_allclose(codes, want, rtol=0.07, atol=1.0)


def test_finalize_weighted_sum_and_alias(rng):
    m, k, h, rows = 11, 3, 40, 50
    d = jnp.asarray(rng.standard_normal((rows, h)), jnp.bfloat16)
    w = jnp.asarray(rng.random((m, k)), jnp.float32)
    src = rng.integers(-1, rows, (m, k)).astype(np.int32)
    src[2] = -1
    src[4, 1] = rows + 7  # out of range: skipped
    out = jnp.full((m, h), jnp.nan, jnp.bfloat16)
    got = np.asarray(jax.jit(fin_ops.finalize)(d, w, jnp.asarray(src), out).astype(jnp.float32))
    dn, wn = np.asarray(d.astype(jnp.float32)), np.asarray(w)
    want = np.zeros((m, h), np.float32)
    for t in range(m):
        for j in range(k):
            if 0 <= src[t, j] < rows:
                want[t] += wn[t, j] * dn[src[t, j]]
    np.testing.assert_allclose(got, np.asarray(jnp.asarray(want).astype(jnp.bfloat16).astype(jnp.float32)), rtol=1e-2, atol=1e-2)
    assert np.all(got[2] == 0.0)
