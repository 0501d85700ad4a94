"""gemm_indexed_gated and gemm_grouped_gated: GEMM1 of the indexed and grouped classes with 16-bit
activations, the gated activation applied to the GEMM's rows inside its call, gives the bits of the
separate GEMM + activation calls, on whichever backend runs the tests (the GPU kernels' gated
epilogues have their own tests in test_cuda_fast_paths.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_layer, run_standard

from humming_jax import testing
from humming_jax.experts import GroupedExperts, IndexedExperts
from humming_jax.ops import gemm as gemm_ops
from humming_jax.ops import routing as routing_ops
from humming_jax.quantize import SCHEMES


def _exact(activation: str) -> bool:
    """Whether the fused and separate forms must agree bit for bit: on the CPU always; on a GPU for
    swigluoai (interleaved gate / up rows), while the halves layout's pairing takes at most 4 K
    groups where a separate GEMM may take 8, summing K in another order."""
    return jax.default_backend() == "cpu" or activation == "swigluoai"


@pytest.mark.parametrize("scheme", ["w4a16-int4-g128", "bf16"])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_indexed_layer_same_bits_with_or_without_the_fused_activation(rng, monkeypatch, scheme, activation):
    """The same bits either way, except on a GPU for the halves layout (see _exact)."""
    layer = random_layer(rng, m=11, e=8, h=256, i=128, k=3, activation=activation, scheme=scheme, pad_frac=0.2)
    kw = dict(activation=activation, activation_limit=7.0 if activation == "swigluoai" else None)
    fused = run_standard(IndexedExperts, layer, **kw)
    monkeypatch.setenv("HUMMING_JAX_FUSED_ACTIVATION", "0")
    two = run_standard(IndexedExperts, layer, **kw)
    a, b = np.asarray(fused.astype(jnp.float32)), np.asarray(two.astype(jnp.float32))
    assert np.all(np.isfinite(a)) and np.any(a != 0.0)
    if _exact(activation):
        np.testing.assert_array_equal(a, b)
    else:  # GEMM1's rows may differ in the last place; GEMM2 sums them into out
        eps = float(jnp.finfo(fused.dtype).eps)
        np.testing.assert_allclose(a, b, rtol=0, atol=16 * eps * float(np.abs(b).max()))


def _layer_calls(layer, activation: str, cls: type = IndexedExperts) -> set[str]:
    """The custom calls of a layer's graph (traced anew: it reads the switch)."""

    def f(out, x, w, tw, ids):
        return cls().apply(out, x, w, tw, ids, activation=activation)

    args = (layer.x, layer.x, layer.weights, layer.topk_weights, layer.topk_ids)
    return set(re.findall(r"humming_jax\.\w+", jax.jit(f).lower(*args).as_text()))


def test_indexed_layer_calls_the_gated_gemm(rng, monkeypatch):
    """The layer's graph with its GEMMs as two calls (HUMMING_JAX_FUSED_EXPERTS=0; by default they
    are one, test_experts_indexed.py): GEMM1 takes a gated activation (no activation call) unless
    switched off; an activation that is not gated keeps its own call."""
    monkeypatch.setenv("HUMMING_JAX_FUSED_EXPERTS", "0")
    layer = random_layer(rng, m=5, e=4, h=128, i=128, k=2, scheme="w4a16-int4-g128")
    calls = _layer_calls(layer, "silu")
    assert {"humming_jax.gemm_indexed_gated", "humming_jax.gemm_indexed"} <= calls
    assert "humming_jax.activation" not in calls
    plain = random_layer(rng, m=5, e=4, h=128, i=128, k=2, activation="gelu_no_mul", scheme="w4a16-int4-g128")
    assert {"humming_jax.gemm_indexed_gated"} & _layer_calls(plain, "gelu_no_mul") == set()
    assert "humming_jax.activation" in _layer_calls(plain, "gelu_no_mul")
    monkeypatch.setenv("HUMMING_JAX_FUSED_ACTIVATION", "0")
    calls = _layer_calls(layer, "silu")
    assert "humming_jax.gemm_indexed_gated" not in calls and "humming_jax.activation" in calls
    monkeypatch.setenv("HUMMING_JAX_FUSED_ACTIVATION", "gemm2")
    with pytest.raises(ValueError, match="HUMMING_JAX_FUSED_ACTIVATION"):
        _layer_calls(layer, "silu")


@pytest.mark.parametrize("scheme,dtype", [("bf16", jnp.bfloat16), ("fp16", jnp.float16),
                                          ("w4a16-int4-g128", jnp.bfloat16), ("w4a16-mxfp4", jnp.bfloat16),
                                          ("w8a16-fp8-block128", jnp.float16)])
@pytest.mark.parametrize("activation,limit", [("silu", None), ("swigluoai", 7.0), ("gelu", None)])
def test_gated_gemm_equals_two_calls(rng, scheme, dtype, activation, limit):
    """gemm_indexed_gated (GEMM1 writing the activated rows) gives gemm_indexed + activation's bits
    (on a GPU, for the halves layout, within the last places: see _exact)."""
    e, n, kdim, m, k = 6, 2 * 40, 256, 9, 3
    w = SCHEMES[scheme].quantize((rng.standard_normal((e, n, kdim)) / np.sqrt(kdim)).astype(np.float32), dtype)
    bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32) * 0.1)
    fn, ops = testing.gated_forms(rng, w, bias, dtype, testing.distinct_topk_ids(rng, m, k, e), activation,
                                  limit)
    testing.assert_fused_equals_two(jax.jit(fn)(*ops), exact=_exact(activation))


def test_gated_gemm_rejects_bad_input(rng):
    e, n, kdim, m, k = 4, 16, 128, 3, 2
    w = SCHEMES["w4a16-int4-g128"].quantize(rng.standard_normal((e, n, kdim)).astype(np.float32), jnp.bfloat16)
    r = routing_ops.routing_indexed(testing.distinct_topk_ids(rng, m, k, e, pad=0.0), None, e, 4)
    common = dict(rows=m * k, gather_div=k, block_m=4, out_dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, kdim)), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs a gated activation"):
        gemm_ops.gemm_indexed_gated(x, None, w, None, r, activation="gelu_no_mul", **common)
    w_odd = SCHEMES["bf16"].quantize(rng.standard_normal((e, n + 1, kdim)).astype(np.float32), jnp.bfloat16)
    with pytest.raises(ValueError, match="even number of weight rows"):
        gemm_ops.gemm_indexed_gated(x, None, w_odd, None, r, activation="silu", **common)


# The grouped class: its GEMM1 over the permuted rows, the activation in the GEMM's call where the
# GPU's persistent bf16 kernel takes it; bit for bit the two calls' values on every backend.


@pytest.mark.parametrize("scheme", ["bf16", "w4a16-int4-g128"])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_grouped_layer_same_bits_with_or_without_the_fused_activation(rng, monkeypatch, scheme, activation):
    """The grouped layer gives the same bits either way, and stays within the 16-bit rounding of the
    float reference."""
    from conftest import reference

    from humming_jax.reference import relative_error

    layer = random_layer(rng, m=37, e=8, h=256, i=128, k=3, activation=activation, scheme=scheme, pad_frac=0.2,
                         bias=True)
    kw = dict(activation=activation, activation_limit=7.0 if activation == "swigluoai" else None)
    monkeypatch.setenv("HUMMING_JAX_FUSED_ACTIVATION", "2")
    fused = run_standard(GroupedExperts, layer, **kw)
    monkeypatch.setenv("HUMMING_JAX_FUSED_ACTIVATION", "0")
    two = run_standard(GroupedExperts, layer, **kw)
    a, b = np.asarray(fused.astype(jnp.float32)), np.asarray(two.astype(jnp.float32))
    assert np.all(np.isfinite(a)) and np.any(a != 0.0)
    np.testing.assert_array_equal(a, b)
    if scheme == "bf16":  # the reference takes the dequantized weights; bias enters both GEMMs there too
        ref = reference(layer, activation=activation, activation_limit=kw["activation_limit"],
                        b13=layer.weights.b13, b2=layer.weights.b2)
        assert relative_error(fused, ref) < 2e-2


def test_grouped_layer_calls_the_gated_gemm_when_asked(rng, monkeypatch):
    """The grouped layer's graph: GEMM1 takes a gated activation (no activation call) with
    HUMMING_JAX_FUSED_ACTIVATION=2 only (by default, and with 0 or 1, the activation keeps its own
    call); an activation that is not gated keeps its own call."""
    layer = random_layer(rng, m=5, e=4, h=128, i=128, k=2)
    for switch in (None, "0", "1"):
        if switch is None:
            monkeypatch.delenv("HUMMING_JAX_FUSED_ACTIVATION", raising=False)
        else:
            monkeypatch.setenv("HUMMING_JAX_FUSED_ACTIVATION", switch)
        calls = _layer_calls(layer, "silu", GroupedExperts)
        assert "humming_jax.gemm_grouped_gated" not in calls and "humming_jax.activation" in calls, switch
    monkeypatch.setenv("HUMMING_JAX_FUSED_ACTIVATION", "2")
    calls = _layer_calls(layer, "silu", GroupedExperts)
    assert {"humming_jax.gemm_grouped_gated", "humming_jax.gemm_grouped"} <= calls
    assert "humming_jax.activation" not in calls
    monkeypatch.setenv("HUMMING_JAX_FUSED_EXPERTS", "0")  # the indexed class's two calls (else experts_indexed)
    assert "humming_jax.gemm_indexed_gated" in _layer_calls(layer, "silu")  # the indexed class's too
    plain = random_layer(rng, m=5, e=4, h=128, i=128, k=2, activation="gelu_no_mul")
    calls = _layer_calls(plain, "gelu_no_mul", GroupedExperts)
    assert "humming_jax.gemm_grouped_gated" not in calls and "humming_jax.activation" in calls


@pytest.mark.parametrize("scheme,dtype", [("bf16", jnp.bfloat16), ("fp16", jnp.float16),
                                          ("w4a16-int4-g128", jnp.bfloat16), ("w8a16-fp8-block128", jnp.float16)])
@pytest.mark.parametrize("activation,limit", [("silu", None), ("silu", 3.0), ("swigluoai", 7.0), ("gelu", None),
                                              ("gelu_tanh", None)])
def test_grouped_gated_gemm_equals_two_calls(rng, scheme, dtype, activation, limit):
    """gemm_grouped_gated gives gemm_grouped + activation's bits, dropped ids' rows (past the last
    offset) zeros both ways."""
    e, n, kdim, m, k = 6, 2 * 40, 256, 9, 3
    w = SCHEMES[scheme].quantize((rng.standard_normal((e, n, kdim)) / np.sqrt(kdim)).astype(np.float32), dtype)
    bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32) * 0.1)
    fn, ops = testing.gated_forms(rng, w, bias, dtype, testing.distinct_topk_ids(rng, m, k, e), activation,
                                  limit, gemm_type="grouped")
    got = jax.jit(fn)(*ops)
    testing.assert_fused_equals_two(got)
    last = int(got["offsets"][-1])
    assert last < m * k, "the ids should drop some rows"
    assert np.all(np.asarray(got["fused"].astype(jnp.float32))[last:] == 0.0)


def test_grouped_gated_gemm_against_float64(rng):
    """gemm_grouped_gated against an independent float64 computation: act(gate, up) of the rounded
    GEMM rows of the permuted tokens, per expert."""
    from humming_jax.activations import ACTIVATIONS

    e, n, kdim, m, k = 5, 2 * 24, 64, 12, 2
    wf = (rng.standard_normal((e, n, kdim)) / np.sqrt(kdim)).astype(np.float32)
    w = SCHEMES["bf16"].quantize(wf, jnp.bfloat16)
    ids = testing.distinct_topk_ids(rng, m, k, e, pad=0.0)
    x = jnp.asarray(rng.standard_normal((m, kdim)), jnp.bfloat16)
    r = routing_ops.routing_grouped(ids, None, e)
    a = routing_ops.permute_rows(x, r, k)
    y = gemm_ops.gemm_grouped_gated(a, w, None, r.expert_first_token_offset, out_dtype=jnp.bfloat16,
                                    activation="silu")
    off = np.asarray(r.expert_first_token_offset)
    a64 = np.asarray(a.astype(jnp.float32), np.float64)
    w64 = np.asarray(jnp.asarray(wf, jnp.bfloat16).astype(jnp.float32), np.float64)
    want = np.zeros((m * k, n // 2))
    for ex in range(e):
        rows = slice(off[ex], off[ex + 1])
        c = a64[rows] @ w64[ex].T
        g, u = c[:, : n // 2], c[:, n // 2:]
        want[rows] = g / (1.0 + np.exp(-g)) * u
    got = np.asarray(y.astype(jnp.float32), np.float64)
    assert ACTIVATIONS["silu"].gated
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2 * np.abs(want).max())


def test_grouped_gated_gemm_rejects_bad_input(rng):
    e, n, kdim, m, k = 4, 16, 128, 3, 2
    w = SCHEMES["bf16"].quantize(rng.standard_normal((e, n, kdim)).astype(np.float32), jnp.bfloat16)
    r = routing_ops.routing_grouped(testing.distinct_topk_ids(rng, m, k, e, pad=0.0), None, e)
    a = routing_ops.permute_rows(jnp.asarray(rng.standard_normal((m, kdim)), jnp.bfloat16), r, k)
    off = r.expert_first_token_offset
    with pytest.raises(ValueError, match="needs a gated activation"):
        gemm_ops.gemm_grouped_gated(a, w, None, off, out_dtype=jnp.bfloat16, activation="gelu_no_mul")
    w_odd = SCHEMES["bf16"].quantize(rng.standard_normal((e, n + 1, kdim)).astype(np.float32), jnp.bfloat16)
    with pytest.raises(ValueError, match="even number of weight rows"):
        gemm_ops.gemm_grouped_gated(a, w_odd, None, off, out_dtype=jnp.bfloat16, activation="silu")
    with pytest.raises(Exception, match="expert_first_token_offset"):
        jax.block_until_ready(gemm_ops.gemm_grouped_gated(a, w, None, off[:-1], out_dtype=jnp.bfloat16,
                                                          activation="silu"))
