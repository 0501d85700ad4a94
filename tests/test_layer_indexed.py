"""layer_indexed: the indexed layer (16-bit activations, a gated activation) as one call, routing,
both GEMMs and finalize, gives the bits of its three calls (routing_indexed, experts_indexed,
finalize) on whichever backend runs the tests, with and without an expert map, and agrees with the
float64 oracle; layer_indexed_quant the same for 8-bit activations (experts_indexed_quant, any
activation); the layer takes them by default; bad input is refused before anything runs. (Their
GPU launch order has its own tests in test_cuda_fast_paths.py.)"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import layer_tolerance, nan_out, random_layer, reference, run_standard

from humming_jax import testing
from humming_jax.experts import IndexedExperts
from humming_jax.ops import layer as layer_ops
from humming_jax.quantize import SCHEMES, act_quant_params
from humming_jax.reference import InputQuant, relative_error


def _both(monkeypatch, layer, **kw):
    """The layer with the one call (the default) and with three (HUMMING_JAX_FUSED_LAYER=0)."""
    monkeypatch.delenv("HUMMING_JAX_FUSED_LAYER", raising=False)
    one = np.asarray(run_standard(IndexedExperts, layer, **kw).astype(jnp.float32))
    monkeypatch.setenv("HUMMING_JAX_FUSED_LAYER", "0")
    three = np.asarray(run_standard(IndexedExperts, layer, **kw).astype(jnp.float32))
    monkeypatch.delenv("HUMMING_JAX_FUSED_LAYER")
    return one, three


def _one_call_is_three(rng, monkeypatch, scheme, activation, m):
    """A biased layer of ``scheme`` through the one call and through three: finite, not all zero and
    bit-equal. Returns the layer, its keyword arguments and the one call's result."""
    layer = random_layer(rng, m=m, e=8, h=256, i=128, k=3, activation=activation, scheme=scheme, bias=True,
                         pad_frac=0.2 if m > 1 else 0.0)  # one token: keep its entries (not all padding)
    kw = dict(activation=activation, activation_limit=7.0 if activation == "swigluoai" else None)
    one, three = _both(monkeypatch, layer, **kw)
    assert np.all(np.isfinite(one)) and np.any(one != 0.0)
    np.testing.assert_array_equal(one, three)
    return layer, kw, one


@pytest.mark.parametrize("scheme", ["bf16", "fp16", "w4a16-int4-g128", "w4a16-mxfp4", "w8a16-fp8-block128"])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("m", [1, 13])
def test_layer_indexed_equals_the_three_calls_and_the_oracle(rng, monkeypatch, scheme, activation, m):
    layer, kw, one = _one_call_is_three(rng, monkeypatch, scheme, activation, m)
    want = reference(layer, b13=layer.weights.b13, b2=layer.weights.b2, **kw)
    assert relative_error(one, want) <= layer_tolerance(layer.x.dtype, None)


@pytest.mark.parametrize("scheme", ["w8a8-fp8-block128", "w8a8-fp8-channel", "w8a8-int8-channel"])
@pytest.mark.parametrize("activation", ["silu", "swigluoai", "gelu_no_mul"])
@pytest.mark.parametrize("m", [1, 13])
def test_layer_indexed_quant_equals_the_three_calls_and_the_oracle(rng, monkeypatch, scheme, activation, m):
    """8-bit activations: layer_indexed_quant against routing_indexed, experts_indexed_quant and
    finalize, and against the oracle that quantizes the activations as the scheme does."""
    layer, kw, one = _one_call_is_three(rng, monkeypatch, scheme, activation, m)
    quant = act_quant_params(SCHEMES[scheme].act_key)
    want = reference(layer, b13=layer.weights.b13, b2=layer.weights.b2, input_quant=InputQuant(*quant), **kw)
    assert relative_error(one, want) <= layer_tolerance(layer.x.dtype, quant)


def test_layer_indexed_with_an_expert_map(rng, monkeypatch):
    """32 global experts, 8 of them local in a scattered order: the three calls' bits, and tokens
    whose experts all live elsewhere exactly 0."""
    e_global, e_local = 32, 8
    layer = random_layer(rng, m=30, e=e_local, h=128, i=128, k=4, e_global=e_global, scheme="w4a16-int4-g128",
                         pad_frac=0.1)
    emap = -np.ones(e_global, np.int32)
    owned = rng.choice(e_global, e_local, replace=False)
    emap[owned] = rng.permutation(e_local)
    one, three = _both(monkeypatch, layer, expert_map=jnp.asarray(emap))
    np.testing.assert_array_equal(one, three)
    assert relative_error(one, reference(layer, expert_map=jnp.asarray(emap))) <= layer_tolerance(layer.x.dtype, None)
    none_local = ~np.isin(np.asarray(layer.topk_ids), owned).any(axis=1)
    assert none_local.any() and np.all(one[none_local] == 0.0)
    assert np.all(np.isfinite(one))


def _calls(layer, scheme_activation="silu") -> set[str]:
    def f(out, x, w, tw, ids):
        return IndexedExperts().apply(out, x, w, tw, ids, activation=scheme_activation)

    args = (layer.x, layer.x, layer.weights, layer.topk_weights, layer.topk_ids)
    return set(re.findall(r"humming_jax\.\w+", jax.jit(f).lower(*args).as_text()))


def test_indexed_layer_graph_has_one_call_unless_switched_off(rng, monkeypatch):
    """16-bit activations, a gated activation: layer_indexed alone by default; routing_indexed,
    experts_indexed and finalize with HUMMING_JAX_FUSED_LAYER=0 or HUMMING_JAX_FUSED_EXPERTS=0 (then
    the two GEMM calls). 8-bit activations: layer_indexed_quant alone, or the three calls with
    HUMMING_JAX_FUSED_LAYER=0, or neither one-call form with HUMMING_JAX_FUSED_INPUT_QUANT=0. A plain
    activation with 16-bit activations keeps its own calls."""
    layer = random_layer(rng, m=5, e=4, h=128, i=128, k=2, scheme="w4a16-int4-g128")
    for var in ("HUMMING_JAX_FUSED_LAYER", "HUMMING_JAX_FUSED_EXPERTS", "HUMMING_JAX_FUSED_ACTIVATION"):
        monkeypatch.delenv(var, raising=False)
    assert _calls(layer) == {"humming_jax.layer_indexed"}
    monkeypatch.setenv("HUMMING_JAX_FUSED_LAYER", "0")
    assert _calls(layer) == {"humming_jax.routing_indexed", "humming_jax.experts_indexed", "humming_jax.finalize"}
    monkeypatch.delenv("HUMMING_JAX_FUSED_LAYER")
    monkeypatch.setenv("HUMMING_JAX_FUSED_EXPERTS", "0")
    assert "humming_jax.layer_indexed" not in _calls(layer)
    monkeypatch.delenv("HUMMING_JAX_FUSED_EXPERTS")
    quant = random_layer(rng, m=5, e=4, h=128, i=128, k=2, scheme="w8a8-fp8-block128")
    assert _calls(quant) == {"humming_jax.layer_indexed_quant"}
    monkeypatch.setenv("HUMMING_JAX_FUSED_LAYER", "0")
    assert _calls(quant) == {"humming_jax.routing_indexed", "humming_jax.experts_indexed_quant",
                             "humming_jax.finalize"}
    monkeypatch.delenv("HUMMING_JAX_FUSED_LAYER")
    monkeypatch.setenv("HUMMING_JAX_FUSED_INPUT_QUANT", "0")
    assert not {"humming_jax.layer_indexed", "humming_jax.layer_indexed_quant"} & _calls(quant)
    monkeypatch.delenv("HUMMING_JAX_FUSED_INPUT_QUANT")
    plain = random_layer(rng, m=5, e=4, h=128, i=128, k=2, activation="gelu_no_mul", scheme="bf16")
    assert not {"humming_jax.layer_indexed", "humming_jax.layer_indexed_quant"} & _calls(plain, "gelu_no_mul")


def test_layer_indexed_result_aliases_out_under_donation(rng):
    """The call's result is out's buffer: a jitted step that donates out gets it back in place."""
    layer = random_layer(rng, m=7, e=4, h=128, i=128, k=2, scheme="bf16")

    def step(out, x, w, tw, ids):
        return IndexedExperts().apply(out, x, w, tw, ids, activation="silu")

    lowered = jax.jit(step, donate_argnums=0).lower(nan_out(layer.x.shape, layer.x.dtype), layer.x, layer.weights,
                                                    layer.topk_weights, layer.topk_ids)
    text = lowered.as_text()
    assert "humming_jax.layer_indexed" in text
    assert re.search(r"output_operand_aliases = \[#stablehlo\.output_operand_alias<output_tuple_indices = \[0\],"
                     r" operand_index = 14", text)
    got = lowered.compile()(nan_out(layer.x.shape, layer.x.dtype), layer.x, layer.weights, layer.topk_weights,
                            layer.topk_ids)
    assert np.all(np.isfinite(np.asarray(got.astype(jnp.float32))))


def test_layer_indexed_rejects_bad_input(rng):
    e, h, i, m, k = 4, 256, 128, 3, 2
    q = SCHEMES["w4a16-int4-g128"].quantize
    w13 = q(rng.standard_normal((e, 2 * i, h)).astype(np.float32), jnp.bfloat16)
    w2 = q(rng.standard_normal((e, h, i)).astype(np.float32), jnp.bfloat16)
    ids = jnp.asarray(testing.distinct_topk_ids(rng, m, k, e, pad=0.0))
    tw = jnp.asarray(rng.random((m, k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    out = jnp.zeros_like(x)
    common = dict(block_m=4)
    with pytest.raises(ValueError, match="needs a gated activation"):
        layer_ops.layer_indexed(x, w13, None, w2, None, ids, None, tw, out, activation="gelu_no_mul", **common)
    w2_wide = q(rng.standard_normal((e, h, 2 * i)).astype(np.float32), jnp.bfloat16)
    with pytest.raises(ValueError, match="w2 must have K"):
        layer_ops.layer_indexed(x, w13, None, w2_wide, None, ids, None, tw, out, activation="silu", **common)
    # Caught by the handler's own checks (one parse for both backends).
    run = lambda *a, **kw: jax.block_until_ready(layer_ops.layer_indexed(*a, activation="silu", **common, **kw))
    with pytest.raises(Exception, match="x has 2 rows, topk_ids 3"):
        run(x[:2], w13, None, w2, None, ids, None, tw, out[:2])
    w2_short = q(rng.standard_normal((e, h // 2, i)).astype(np.float32), jnp.bfloat16)
    with pytest.raises(Exception, match="d must|w2 must have H"):
        run(x, w13, None, w2_short, None, ids, None, tw, out)
    with pytest.raises(Exception, match="topk_weights must be float32"):
        run(x, w13, None, w2, None, ids, None, tw.astype(jnp.bfloat16), out)
    with pytest.raises(Exception, match="out must have the dtype of d"):
        run(x, w13, None, w2, None, ids, None, tw, out.astype(jnp.float16))
    q8 = SCHEMES["w8a8-fp8-block128"].quantize
    w13q = q8(rng.standard_normal((e, 2 * i, h)).astype(np.float32), jnp.bfloat16)
    w2q = q8(rng.standard_normal((e, h, 2 * i)).astype(np.float32), jnp.bfloat16)
    with pytest.raises(ValueError, match="w2 must have K"):
        layer_ops.layer_indexed_quant(x, w13q, None, w2q, None, ids, None, tw, out, block_m=4, quant="fp8",
                                      act_group_k=128, activation="silu")
    with pytest.raises(ValueError, match="unknown activation quantization"):
        layer_ops.layer_indexed_quant(x, w13q, None, w2q, None, ids, None, tw, out, block_m=4, quant="fp4",
                                      act_group_k=128, activation="gelu_no_mul")
