"""experts_indexed: the indexed class's two GEMMs (16-bit activations, a gated activation) in one
call give the bits of gemm_indexed_gated then gemm_indexed, on whichever backend runs the tests;
experts_indexed_quant (8-bit activations, any activation) those of two gemm_indexed_quant calls.
The layer takes them by default and agrees with the float64 oracle through them. (Their GPU launch
order, GEMM2 dependent on GEMM1 inside the call, has its own tests in test_cuda_fast_paths.py.)"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import layer_tolerance, random_layer, reference, run_standard

from humming_jax import testing
from humming_jax.experts import IndexedExperts
from humming_jax.ops import gemm as gemm_ops
from humming_jax.ops import routing as routing_ops
from humming_jax.quantize import SCHEMES, act_quant_params
from humming_jax.reference import InputQuant, relative_error


def _pair_forms(rng, scheme, dtype, m, k, e, h, i, activation, limit, pad=0.2, bias=True):
    """Random weights (w13 [e, 2i, h], w2 [e, h, i]) and ids: testing.experts_indexed_forms."""
    w13 = SCHEMES[scheme].quantize((rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(np.float32), dtype)
    w2 = SCHEMES[scheme].quantize((rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32), dtype)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)).astype(np.float32) * 0.1) if bias else None
    b2 = jnp.asarray(rng.standard_normal((e, h)).astype(np.float32) * 0.1) if bias else None
    ids = testing.distinct_topk_ids(rng, m, k, e, pad=pad)
    return testing.experts_indexed_forms(rng, w13, b13, w2, b2, dtype, ids, activation, limit)


@pytest.mark.parametrize("scheme,dtype", [("bf16", jnp.bfloat16), ("fp16", jnp.float16),
                                          ("w4a16-int4-g128", jnp.bfloat16), ("w4a16-mxfp4", jnp.bfloat16),
                                          ("w8a16-fp8-block128", jnp.float16)])
@pytest.mark.parametrize("activation,limit", [("silu", None), ("swigluoai", 7.0)])
def test_experts_indexed_equals_the_two_calls(rng, scheme, dtype, activation, limit):
    """The rows the routing fills: finite, not all zero, the two calls' bits."""
    fn, ops = _pair_forms(rng, scheme, dtype, m=9, k=3, e=6, h=256, i=128, activation=activation, limit=limit)
    testing.assert_fused_equals_two(jax.jit(fn)(*ops), exact=True)


def test_experts_indexed_without_biases_and_with_every_id_valid(rng):
    fn, ops = _pair_forms(rng, "w4a16-int4-g128", jnp.bfloat16, m=5, k=2, e=4, h=128, i=256, activation="silu",
                          limit=None, pad=0.0, bias=False)
    testing.assert_fused_equals_two(jax.jit(fn)(*ops), exact=True)


@pytest.mark.parametrize("scheme", ["w4a16-int4-g128", "bf16", "w4a16-mxfp4", "w8a8-fp8-block128", "w8a8-fp8-channel",
                                    "w8a8-int8-channel"])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_indexed_layer_through_the_one_call_matches_the_two_calls_and_the_oracle(rng, monkeypatch, scheme,
                                                                                 activation):
    """The layer with the one call (the default: experts_indexed, or experts_indexed_quant for
    8-bit activations) and with the two (HUMMING_JAX_FUSED_EXPERTS=0): the same bits, each within
    the layer tolerance of the float64 oracle (which quantizes the activations as the scheme does)."""
    layer = random_layer(rng, m=11, e=8, h=256, i=128, k=3, activation=activation, scheme=scheme, pad_frac=0.2)
    kw = dict(activation=activation, activation_limit=7.0 if activation == "swigluoai" else None)
    monkeypatch.delenv("HUMMING_JAX_FUSED_EXPERTS", raising=False)
    pair = np.asarray(run_standard(IndexedExperts, layer, **kw).astype(jnp.float32))
    monkeypatch.setenv("HUMMING_JAX_FUSED_EXPERTS", "0")
    two = np.asarray(run_standard(IndexedExperts, layer, **kw).astype(jnp.float32))
    assert np.all(np.isfinite(pair)) and np.any(pair != 0.0)
    np.testing.assert_array_equal(pair, two)
    quant = act_quant_params(SCHEMES[scheme].act_key)
    want = reference(layer, input_quant=InputQuant(*quant) if quant else None, **kw)
    assert relative_error(pair, want) <= layer_tolerance(layer.x.dtype, quant)


def _layer_calls(layer) -> set[str]:
    def f(out, x, w, tw, ids):
        return IndexedExperts().apply(out, x, w, tw, ids, activation="silu")

    args = (layer.x, layer.x, layer.weights, layer.topk_weights, layer.topk_ids)
    return set(re.findall(r"humming_jax\.\w+", jax.jit(f).lower(*args).as_text()))


def test_indexed_layer_graph_has_the_one_call_unless_switched_off(rng, monkeypatch):
    """16-bit activations with a gated activation (the one-call layer off, HUMMING_JAX_FUSED_LAYER=0):
    experts_indexed by default, the two GEMM calls with HUMMING_JAX_FUSED_EXPERTS=0 or without the
    fused activation; 8-bit activations keep their own calls."""
    layer = random_layer(rng, m=5, e=4, h=128, i=128, k=2, scheme="w4a16-int4-g128")
    monkeypatch.delenv("HUMMING_JAX_FUSED_EXPERTS", raising=False)
    monkeypatch.setenv("HUMMING_JAX_FUSED_LAYER", "0")  # routing, experts, finalize (test_layer_indexed.py)
    calls = _layer_calls(layer)
    assert "humming_jax.experts_indexed" in calls
    assert not {"humming_jax.gemm_indexed", "humming_jax.gemm_indexed_gated", "humming_jax.activation"} & calls
    monkeypatch.setenv("HUMMING_JAX_FUSED_EXPERTS", "0")
    calls = _layer_calls(layer)
    assert "humming_jax.experts_indexed" not in calls
    assert {"humming_jax.gemm_indexed_gated", "humming_jax.gemm_indexed"} <= calls
    monkeypatch.delenv("HUMMING_JAX_FUSED_EXPERTS")
    monkeypatch.setenv("HUMMING_JAX_FUSED_ACTIVATION", "0")
    assert "humming_jax.experts_indexed" not in _layer_calls(layer)
    monkeypatch.delenv("HUMMING_JAX_FUSED_ACTIVATION")
    quant = random_layer(rng, m=5, e=4, h=128, i=128, k=2, scheme="w8a8-fp8-block128")
    calls = _layer_calls(quant)
    assert "humming_jax.experts_indexed" not in calls
    assert "humming_jax.experts_indexed_quant" in calls
    assert not {"humming_jax.gemm_indexed_quant", "humming_jax.gemm_indexed", "humming_jax.quantize"} & calls
    monkeypatch.setenv("HUMMING_JAX_FUSED_EXPERTS", "0")
    calls = _layer_calls(quant)
    assert "humming_jax.experts_indexed_quant" not in calls
    assert "humming_jax.gemm_indexed_quant" in calls
    monkeypatch.delenv("HUMMING_JAX_FUSED_EXPERTS")
    monkeypatch.setenv("HUMMING_JAX_FUSED_INPUT_QUANT", "0")
    calls = _layer_calls(quant)
    assert not {"humming_jax.experts_indexed_quant", "humming_jax.gemm_indexed_quant"} & calls
    assert {"humming_jax.quantize", "humming_jax.gemm_indexed"} <= calls


# The bad-input tests' problem: 4 experts, H = 256, I = 128, 3 tokens of top-2, block_m 4.
_E, _H, _I, _M, _K = 4, 256, 128, 3, 2


def _bad_input_problem(rng, scheme):
    """(quantize, w13 [E, 2I, H], w2 [E, H, I], routing, x [M, H], the calls' common arguments)."""
    q = SCHEMES[scheme].quantize
    w13 = q(rng.standard_normal((_E, 2 * _I, _H)).astype(np.float32), jnp.bfloat16)
    w2 = q(rng.standard_normal((_E, _H, _I)).astype(np.float32), jnp.bfloat16)
    r = routing_ops.routing_indexed(testing.distinct_topk_ids(rng, _M, _K, _E, pad=0.0), None, _E, 4)
    x = jnp.asarray(rng.standard_normal((_M, _H)), jnp.bfloat16)
    return q, w13, w2, r, x, dict(rows=_M * _K, gather_div=_K, block_m=4, out_dtype=jnp.bfloat16)


def test_experts_indexed_rejects_bad_input(rng):
    e, h, i = _E, _H, _I
    q, w13, w2, r, x, common = _bad_input_problem(rng, "w4a16-int4-g128")
    with pytest.raises(ValueError, match="needs a gated activation"):
        gemm_ops.experts_indexed(x, w13, None, w2, None, r, activation="gelu_no_mul", **common)
    w2_wide = q(rng.standard_normal((e, h, 2 * i)).astype(np.float32), jnp.bfloat16)
    with pytest.raises(ValueError, match="w2 must have K"):
        gemm_ops.experts_indexed(x, w13, None, w2_wide, None, r, activation="silu", **common)
    # Caught by the handler's own checks (one parse for both backends): w2's rows must be x's columns.
    w2_short = q(rng.standard_normal((e, h // 2, i)).astype(np.float32), jnp.bfloat16)
    with pytest.raises(Exception, match="w2 must have H"):
        jax.block_until_ready(gemm_ops.experts_indexed(x, w13, None, w2_short, None, r, activation="silu", **common))


# 8-bit activations: fp8 per 128 columns, fp8 and int8 per token row.
_QUANT_SCHEMES = ["w8a8-fp8-block128", "w8a8-fp8-channel", "w8a8-int8-channel"]


def _quant_pair_forms(rng, scheme, dtype, m, k, e, h, i, activation, limit, pad=0.2, bias=True):
    """Random weights (w13 [e, 2i, h]; w2 [e, h, i], or [e, h, 2i] after a plain activation) and
    ids: testing.experts_indexed_quant_forms."""
    from humming_jax.activations import get_activation

    i2 = i if get_activation(activation, limit)[0].gated else 2 * i
    q = SCHEMES[scheme].quantize
    w13 = q((rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(np.float32), dtype)
    w2 = q((rng.standard_normal((e, h, i2)) / np.sqrt(i2)).astype(np.float32), dtype)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)).astype(np.float32) * 0.1) if bias else None
    b2 = jnp.asarray(rng.standard_normal((e, h)).astype(np.float32) * 0.1) if bias else None
    ids = testing.distinct_topk_ids(rng, m, k, e, pad=pad)
    quant = act_quant_params(SCHEMES[scheme].act_key)
    return testing.experts_indexed_quant_forms(rng, w13, b13, w2, b2, dtype, quant, ids, activation, limit)


@pytest.mark.parametrize("scheme", _QUANT_SCHEMES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation,limit", [("silu", None), ("swigluoai", 7.0), ("gelu_no_mul", None)])
def test_experts_indexed_quant_equals_the_two_calls(rng, scheme, dtype, activation, limit):
    """The rows the routing fills: finite, not all zero, the bits of two gemm_indexed_quant calls."""
    fn, ops = _quant_pair_forms(rng, scheme, dtype, m=9, k=3, e=6, h=256, i=128, activation=activation, limit=limit)
    testing.assert_fused_equals_two(jax.jit(fn)(*ops), exact=True)


@pytest.mark.parametrize("m", [1, 4, 40])
def test_experts_indexed_quant_without_biases(rng, m):
    fn, ops = _quant_pair_forms(rng, "w8a8-fp8-block128", jnp.bfloat16, m=m, k=2, e=4, h=384, i=256,
                                activation="silu", limit=None, pad=0.0 if m == 1 else 0.2, bias=False)
    testing.assert_fused_equals_two(jax.jit(fn)(*ops), exact=True)


def test_experts_indexed_quant_rejects_bad_input(rng):
    e, h, i, m = _E, _H, _I, _M
    q, w13, w2, r, x, common = _bad_input_problem(rng, "w8a8-fp8-block128")
    common.update(quant="fp8", act_group_k=128)
    # A plain activation keeps w13's 2i columns: w2 with K = i does not fit.
    with pytest.raises(ValueError, match="w2 must have K"):
        gemm_ops.experts_indexed_quant(x, w13, None, w2, None, r, activation="gelu_no_mul", **common)
    with pytest.raises(ValueError, match="unknown activation quantization"):
        gemm_ops.experts_indexed_quant(x, w13, None, w2, None, r, activation="silu", **{**common, "quant": "int4"})
    # Caught by the handler's own checks (one parse for both backends).
    w2_short = q(rng.standard_normal((e, h // 2, i)).astype(np.float32), jnp.bfloat16)
    with pytest.raises(Exception, match="w2 must have H"):
        jax.block_until_ready(gemm_ops.experts_indexed_quant(x, w13, None, w2_short, None, r, activation="silu",
                                                             **common))
    x_odd = jnp.asarray(rng.standard_normal((m, h - 64)), jnp.bfloat16)  # not whole 128-column groups
    with pytest.raises(ValueError, match="does not divide"):
        gemm_ops.experts_indexed_quant(x_odd, w13, None, w2, None, r, activation="silu", **common)
    x_narrow = jnp.asarray(rng.standard_normal((m, h - 128)), jnp.bfloat16)  # whole groups, K of w13 is h
    with pytest.raises(Exception, match="experts_indexed_quant"):
        jax.block_until_ready(gemm_ops.experts_indexed_quant(x_narrow, w13, None, w2, None, r, activation="silu",
                                                             **common))
