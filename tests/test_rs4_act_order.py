"""Rows in the 4-bit prefill mainloop's k order (cuda_ffi/rs4_k_order.h): permute_rows and the
activation write them (k_order), gemm_grouped reads them (a_k_order), and the grouped class uses
both for the calls that mainloop takes. On the CPU the values are the natural order's, bit for bit;
the CUDA side is checked in test_cuda_fast_paths.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_layer, run_standard

from humming_jax.experts import GroupedExperts
from humming_jax.ops import activation as act_ops
from humming_jax.ops import gemm as gemm_ops
from humming_jax.ops import routing as routing_ops


def _tile_formula(L: int) -> int:
    """The order restated from its definition: L = 16 j + 8 s + 2 t + h holds 16 t + 8 (j >> 1) +
    2 (j & 1) + s + 4 h."""
    j, s, t, h = L // 16, (L // 8) % 2, (L // 2) % 4, L % 2
    return 16 * t + 8 * (j >> 1) + 2 * (j & 1) + s + 4 * h


def test_the_order_is_a_permutation_of_each_tile():
    order = gemm_ops.rs4_column_order(192)
    for t in range(3):
        tile = order[64 * t: 64 * (t + 1)] - 64 * t
        assert sorted(tile.tolist()) == list(range(64))
        assert tile.tolist() == [_tile_formula(L) for L in range(64)]
    with pytest.raises(ValueError, match="multiple of 64"):
        gemm_ops.rs4_column_order(96)


def _routing(rng, m, e, k):
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(m)]).astype(np.int32))
    return routing_ops.routing_grouped(ids, jnp.arange(e, dtype=jnp.int32), e)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_permute_rows_writes_the_order(rng, dtype):
    m, e, k, cols = 24, 6, 2, 128
    x = jnp.asarray(rng.standard_normal((m, cols)), dtype)
    r = _routing(rng, m, e, k)
    plain = np.asarray(routing_ops.permute_rows(x, r, k).astype(jnp.float32))
    ordered = np.asarray(routing_ops.permute_rows(x, r, k, k_order=True).astype(jnp.float32))
    np.testing.assert_array_equal(ordered, plain[:, gemm_ops.rs4_column_order(cols)])
    assert np.any(ordered != plain)


def test_permute_rows_rejects_an_order_it_cannot_write(rng):
    m, e, k = 8, 4, 2
    r = _routing(rng, m, e, k)
    with pytest.raises(Exception, match="the columns a multiple of 64"):
        jax.block_until_ready(routing_ops.permute_rows(jnp.ones((m, 96), jnp.bfloat16), r, k, k_order=True))
    with pytest.raises(Exception, match="16-bit rows"):
        jax.block_until_ready(routing_ops.permute_rows(jnp.ones((m, 64), jnp.float32), r, k, k_order=True))


@pytest.mark.parametrize("name", ["silu", "swigluoai", "relu2_no_mul"])
def test_activation_writes_the_order(rng, name):
    rows, i = 10, 128
    cols = 2 * i if name != "relu2_no_mul" else i
    x = jnp.asarray(rng.standard_normal((rows, cols)), jnp.bfloat16)
    plain = np.asarray(act_ops.activation(x, name).astype(jnp.float32))
    ordered = np.asarray(act_ops.activation(x, name, k_order=True).astype(jnp.float32))
    np.testing.assert_array_equal(ordered, plain[:, gemm_ops.rs4_column_order(i)])
    with pytest.raises(Exception, match="the columns a multiple of 64"):
        jax.block_until_ready(act_ops.activation(x[:, :96], "silu", k_order=True))


def _mxfp4(rng, e, n, k):
    from humming_jax._abi import WeightType
    from humming_jax.weights import PackedWeight

    codes = jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8)
    scale = jnp.asarray(rng.integers(118, 130, (e, n, k // 32)), jnp.uint8)
    return PackedWeight(codes, scale, wtype=WeightType.FP4_E2M1, k=k, group_n=1, group_k=32)


def test_gemm_grouped_reads_the_order(rng, monkeypatch):
    monkeypatch.delenv(gemm_ops.ENV_RS4_ACT_ORDER, raising=False)
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_FP4, raising=False)
    e, n, kdim, m, k = 4, 64, 128, 64, 2  # 32 rows per expert: a call the 4-bit mainloop takes
    w = _mxfp4(rng, e, n, kdim)
    x = jnp.asarray(rng.standard_normal((m, kdim)), jnp.bfloat16)
    r = _routing(rng, m, e, k)
    assert gemm_ops.rs4_act_order(m * k, w, jnp.bfloat16)
    a = routing_ops.permute_rows(x, r, k)
    off = r.expert_first_token_offset
    f = jax.jit(lambda a, o, order: gemm_ops.gemm_grouped(a, None, w, None, o, out_dtype=jnp.bfloat16, a_k_order=order),
                static_argnums=2)
    plain = np.asarray(f(a, off, False).astype(jnp.float32))
    ordered = np.asarray(f(routing_ops.permute_rows(x, r, k, k_order=True), off, True).astype(jnp.float32))
    assert np.all(np.isfinite(plain)) and np.any(plain != 0)
    np.testing.assert_array_equal(ordered, plain)
    assert "a_k_order = 1" in f.lower(a, off, True).as_text()


def test_gemm_grouped_refuses_the_order_for_other_calls(rng, monkeypatch):
    monkeypatch.delenv(gemm_ops.ENV_RS4_ACT_ORDER, raising=False)
    e, n, kdim = 4, 64, 128
    w = _mxfp4(rng, e, n, kdim)
    rows = 4 * e  # 4 rows per expert: the decode kernel's
    a = jnp.ones((rows, kdim), jnp.bfloat16)
    off = jnp.asarray(np.arange(e + 1) * 4, jnp.int32)
    with pytest.raises(ValueError, match="a_k_order=True is for calls on the 4-bit prefill mainloop"):
        gemm_ops.gemm_grouped(a, None, w, None, off, out_dtype=jnp.bfloat16, a_k_order=True)
    monkeypatch.setenv(gemm_ops.ENV_RS4_ACT_ORDER, "2")
    with pytest.raises(ValueError, match="HUMMING_JAX_RS4_ACT_ORDER"):
        gemm_ops.rs4_act_order(32 * e, w, jnp.bfloat16)


@pytest.mark.parametrize("scheme", ["w4a16-mxfp4", "w4a16-int4-g128"])
def test_grouped_layer_uses_the_order_with_the_same_values(rng, monkeypatch, scheme):
    """The grouped class at 16+ rows per expert with K % 64 == 0 hands both GEMMs their rows in the
    k order (seen in the lowered calls); its output equals the natural order's, bit for bit."""
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_FP4, raising=False)
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_U4RS, raising=False)
    layer = random_layer(rng, m=64, e=4, h=128, i=128, k=2, scheme=scheme)  # 32 rows per expert
    monkeypatch.delenv(gemm_ops.ENV_RS4_ACT_ORDER, raising=False)
    ordered = np.asarray(run_standard(GroupedExperts, layer).astype(jnp.float32))
    text = jax.jit(lambda *a: GroupedExperts().apply(*a)).lower(
        layer.x, layer.x, layer.weights, layer.topk_weights, layer.topk_ids).as_text()
    assert text.count("k_order = 1") >= 4, "permute_rows, both GEMMs and the activation in the k order"
    monkeypatch.setenv(gemm_ops.ENV_RS4_ACT_ORDER, "0")
    plain = np.asarray(run_standard(GroupedExperts, layer).astype(jnp.float32))
    assert np.all(np.isfinite(plain))
    np.testing.assert_array_equal(ordered, plain)
