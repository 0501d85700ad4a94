"""gemm_indexed_quant: a GEMM with its input quantized inside the GEMM's call (GEMM1's; GEMM2's
after the activation) gives the bits of the separate quantize / activation_quant + gemm_indexed
calls, on whichever backend runs the tests (the GPU's fused decode kernel has its own tests in
test_cuda_fast_paths.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_layer, run_standard

from humming_jax import testing
from humming_jax.experts import IndexedExperts
from humming_jax.ops import gemm as gemm_ops
from humming_jax.ops import routing as routing_ops
from humming_jax.quantize import SCHEMES, act_quant_params


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "scheme,quant",
    [("w8a8-fp8-block128", None), ("w8a8-fp8-channel", ("fp8", 0)), ("w8a8-int8-channel", None),
     ("w8a8-fp8-block128", ("fp8", 64))],
)
@pytest.mark.parametrize("activation,limit", [(None, None), ("silu", None), ("swigluoai", 7.0), ("gelu_no_mul", None)])
def test_fused_input_quant_equals_two_calls(rng, scheme, quant, dtype, activation, limit):
    """GEMM1's form (no activation) and GEMM2's (the activation first, one row per id)."""
    e, n, kdim, m, k = 6, 40, 256, 9, 3
    w = SCHEMES[scheme].quantize((rng.standard_normal((e, n, kdim)) / np.sqrt(kdim)).astype(np.float32), dtype)
    quant = quant or act_quant_params(SCHEMES[scheme].act_key)
    bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32) * 0.1)
    ids = testing.distinct_topk_ids(rng, m, k, e)
    fn, ops = testing.indexed_quant_forms(rng, w, bias, dtype, quant, ids, activation, limit)
    testing.assert_fused_equals_two(jax.jit(fn)(*ops))


def test_indexed_layer_same_bits_with_or_without_the_fused_call(rng, monkeypatch):
    layer = random_layer(rng, m=11, e=8, h=256, i=128, k=3, scheme="w8a8-fp8-block128", pad_frac=0.2)
    fused = run_standard(IndexedExperts, layer)
    monkeypatch.setenv("HUMMING_JAX_FUSED_INPUT_QUANT", "0")
    two = run_standard(IndexedExperts, layer)
    a, b = np.asarray(fused.astype(jnp.float32)), np.asarray(two.astype(jnp.float32))
    assert np.all(np.isfinite(a)) and np.any(a != 0.0)
    np.testing.assert_array_equal(a, b)


def test_fused_input_quant_rejects_bad_input(rng):
    e, n, kdim, m, k = 4, 16, 128, 3, 2
    w = SCHEMES["w8a8-fp8-block128"].quantize(rng.standard_normal((e, n, kdim)).astype(np.float32), jnp.bfloat16)
    r = routing_ops.routing_indexed(testing.distinct_topk_ids(rng, m, k, e, pad=0.0), None, e, 4)
    common = dict(rows=m * k, gather_div=k, block_m=4, out_dtype=jnp.bfloat16)
    x32 = jnp.asarray(rng.standard_normal((m, kdim)), jnp.float32)
    with pytest.raises(Exception, match="x must be"):
        jax.block_until_ready(gemm_ops.gemm_indexed_quant(x32, w, None, r, quant="fp8", act_group_k=128, **common))
    x = jnp.asarray(rng.standard_normal((m, kdim)), jnp.bfloat16)
    with pytest.raises(ValueError, match="does not divide"):
        gemm_ops.gemm_indexed_quant(x, w, None, r, quant="fp8", act_group_k=96, **common)
    with pytest.raises(ValueError, match="unknown activation quantization"):
        gemm_ops.gemm_indexed_quant(x, w, None, r, quant="fp4", act_group_k=128, **common)
    with pytest.raises(ValueError, match="unknown activation"):
        gemm_ops.gemm_indexed_quant(x, w, None, r, quant="fp8", act_group_k=128, activation="tanh", **common)
    with pytest.raises(ValueError, match="even number of columns"):
        gemm_ops.gemm_indexed_quant(x[:, :-1], w, None, r, quant="fp8", act_group_k=128, activation="silu", **common)
    # GEMM2's form: x's columns must be twice the weights' K for a gated activation
    with pytest.raises(Exception, match="does not hold K = 64"):
        jax.block_until_ready(
            gemm_ops.gemm_indexed_quant(x, w, None, r, quant="fp8", act_group_k=64, activation="silu", **common)
        )
