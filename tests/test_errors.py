"""Bad input fails before any kernel runs, with an error that names the problem; routed ids
far out of range are data and behave as padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOL, nan_out, random_layer, random_weights, reference

import humming_jax as hj
from humming_jax.experts import BatchedExperts, GroupedExperts, IndexedExperts
from humming_jax.reference import relative_error

STANDARD = [IndexedExperts, GroupedExperts]


@pytest.fixture
def layer(rng):
    return random_layer(rng, m=8, e=4, h=32, i=16, k=2)


def _apply(cls, layer, **overrides):
    args = dict(
        out=jnp.zeros(layer.x.shape, layer.x.dtype),
        hidden_states=layer.x,
        weights=layer.weights,
        topk_weights=layer.topk_weights,
        topk_ids=layer.topk_ids,
    )
    kw = {k: v for k, v in overrides.items() if k not in args}
    args.update({k: v for k, v in overrides.items() if k in args})
    return cls().apply(args["out"], args["hidden_states"], args["weights"], args["topk_weights"], args["topk_ids"], **kw)


@pytest.mark.parametrize("cls", STANDARD)
@pytest.mark.parametrize(
    "override,exc,match",
    [
        (dict(hidden_states=jnp.zeros((8, 32, 1), jnp.bfloat16)), ValueError, "hidden_states must have rank 2"),
        (dict(hidden_states=jnp.zeros((8, 32), jnp.float32)), TypeError, "hidden_states must be bfloat16 or float16"),
        (dict(hidden_states=jnp.zeros((8, 32), jnp.float16)), TypeError, "activation dtype"),
        (dict(hidden_states=jnp.zeros((8, 48), jnp.bfloat16), out=jnp.zeros((8, 48), jnp.bfloat16)), ValueError, "hidden size mismatch"),
        (dict(topk_ids=jnp.zeros((8, 2), jnp.int64 if jax.config.jax_enable_x64 else jnp.int16)), TypeError, "topk_ids must be int32"),
        (dict(topk_ids=jnp.zeros((8, 2), jnp.float32)), TypeError, "topk_ids must be int32"),
        (dict(topk_ids=jnp.zeros((8,), jnp.int32)), ValueError, "topk_ids must have rank 2"),
        (dict(topk_ids=jnp.zeros((7, 2), jnp.int32), topk_weights=jnp.zeros((7, 2))), ValueError, "rows"),
        (dict(topk_weights=jnp.zeros((8, 3))), ValueError, "differ in shape"),
        (dict(topk_weights=jnp.zeros((8, 2), jnp.int32)), TypeError, "topk_weights must be a float"),
        (dict(weights=(1, 2)), TypeError, "weights must be MoEWeights"),
        (dict(activation="swish"), ValueError, "unknown activation"),
        (dict(activation="relu2_no_mul"), ValueError, "intermediate size mismatch"),
        (dict(activation="gelu", activation_limit=1.0), ValueError, "takes no clamp limit"),
        (dict(expert_map=jnp.zeros((4,), jnp.float32)), TypeError, "expert_map must be int32"),
        (dict(expert_map=jnp.zeros((6,), jnp.int32), global_num_experts=5), ValueError, "global_num_experts"),
        (dict(global_num_experts=2), ValueError, "below the 4 local experts"),
        (dict(expert_num_tokens=jnp.zeros((4,), jnp.int32)), ValueError, "batched format"),
        (dict(out=None), ValueError, "out is required"),
    ],
)
def test_bad_input_raises(layer, cls, override, exc, match):
    with pytest.raises(exc, match=match):
        _apply(cls, layer, **override)


def test_intermediate_mismatch_between_w13_and_w2(rng):
    w = random_weights(rng, 4, 32, 16)
    bad = hj.MoEWeights(w.w13, random_weights(rng, 4, 32, 24).w2, weight_key=w.weight_key, scheme=w.scheme, dtype=w.dtype)
    x = jnp.zeros((2, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="intermediate size mismatch"):
        IndexedExperts().apply(jnp.zeros_like(x), x, bad, jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32))


def test_batched_bad_input(rng):
    w = random_weights(rng, 4, 32, 16)
    x = jnp.zeros((4, 3, 32), jnp.bfloat16)
    out = jnp.zeros_like(x)
    with pytest.raises(ValueError, match="needs expert_num_tokens"):
        BatchedExperts().apply(out, x, w, None, None)
    with pytest.raises(ValueError, match="takes no topk"):
        BatchedExperts().apply(out, x, w, jnp.ones((3, 1)), None, expert_num_tokens=jnp.ones(4, jnp.int32))
    with pytest.raises(ValueError, match="expert slabs"):
        BatchedExperts().apply(jnp.zeros((3, 3, 32), jnp.bfloat16), jnp.zeros((3, 3, 32), jnp.bfloat16), w, None, None, expert_num_tokens=jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="expert_num_tokens must be int32"):
        BatchedExperts().apply(out, x, w, None, None, expert_num_tokens=jnp.ones(4, jnp.float32))
    with pytest.raises(ValueError, match="hidden_states must have rank 3"):
        BatchedExperts().apply(jnp.zeros((4, 32), jnp.bfloat16), jnp.zeros((4, 32), jnp.bfloat16), w, None, None, expert_num_tokens=jnp.ones(4, jnp.int32))


def test_errors_raise_before_tracing_kernels(layer):
    # Validation runs at trace time: jit raises the same clear error, no kernel launched.
    f = jax.jit(lambda out, x, w, tw, ids: IndexedExperts().apply(out, x, w, tw, ids))
    with pytest.raises(ValueError, match="out has shape"):
        f(jnp.zeros((8, 31), jnp.bfloat16), layer.x, layer.weights, layer.topk_weights, layer.topk_ids)


def test_quantize_moe_weights_rejects_bad_input(rng):
    w13 = rng.standard_normal((4, 32, 32)).astype(np.float32)
    w2 = rng.standard_normal((4, 32, 16)).astype(np.float32)
    with pytest.raises(ValueError, match="unknown scheme"):
        hj.quantize_moe_weights(w13, w2, "int3")
    with pytest.raises(ValueError, match="does not match"):
        hj.quantize_moe_weights(w13, w2[:3], "bf16")
    with pytest.raises(ValueError, match="must be"):
        hj.quantize_moe_weights(w13[0], w2, "bf16")
    with pytest.raises(TypeError, match="float array"):
        hj.quantize_moe_weights(w13.astype(np.int32), w2, "bf16")
    with pytest.raises(ValueError, match="runs in bfloat16"):
        hj.quantize_moe_weights(w13, w2, "bf16", dtype=jnp.float16)


@pytest.mark.parametrize("cls", STANDARD)
def test_ids_far_out_of_range_are_padding(rng, cls):
    layer = random_layer(rng, m=16, e=8, h=32, i=16, k=4)
    ids = np.asarray(layer.topk_ids).copy()
    bad = np.array([8, 9, 1 << 20, (1 << 31) - 1, -2, -(1 << 31), -1000003], np.int64)
    mask = rng.random(ids.shape) < 0.35
    ids[mask] = rng.choice(bad, mask.sum())
    layer.topk_ids = jnp.asarray(ids.astype(np.int32))
    out = jax.jit(lambda o, x, w, tw, ids: cls().apply(o, x, w, tw, ids))(
        nan_out(layer.x.shape, layer.x.dtype), layer.x, layer.weights, layer.topk_weights, layer.topk_ids
    )
    want = reference(layer)
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))
    assert relative_error(out, want) <= TOL[jnp.dtype(jnp.bfloat16)]
    # Same as if those ids had been -1.
    padded = np.where(mask, -1, ids).astype(np.int32)
    layer.topk_ids = jnp.asarray(padded)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(jax.jit(lambda o, x, w, tw, ids: cls().apply(o, x, w, tw, ids))(
        nan_out(layer.x.shape, layer.x.dtype), layer.x, layer.weights, layer.topk_weights, layer.topk_ids).astype(jnp.float32)))


@pytest.mark.parametrize("cls", STANDARD)
def test_expert_map_entries_out_of_range_are_skipped(rng, cls):
    # A corrupt expert_map (slots >= E_local or < -1) never addresses weights.
    layer = random_layer(rng, m=16, e=4, h=32, i=16, k=2, e_global=8)
    emap = jnp.asarray([0, 1, 2, 3, 4, 99, -7, 1 << 30], jnp.int32)
    got = jax.jit(lambda o, x, w, tw, ids, m: cls().apply(o, x, w, tw, ids, expert_map=m))(
        nan_out(layer.x.shape, layer.x.dtype), layer.x, layer.weights, layer.topk_weights, layer.topk_ids, emap
    )
    want = reference(layer, expert_map=jnp.where((emap >= 0) & (emap < 4), emap, -1))
    assert relative_error(got, want) <= TOL[jnp.dtype(jnp.bfloat16)]


def test_a_named_cuda_library_that_is_missing_is_reported_not_replaced(tmp_path):
    """$HUMMING_JAX_CUDA_LIB names one build (an A/B run's): when that file is missing, no other
    library is loaded in its place, and the report says which name was wrong."""
    import json
    import os
    import subprocess
    import sys

    missing = tmp_path / "old.so"
    code = "import json, humming_jax as hj; print(json.dumps(hj._ffi.backend_report()))"
    env = dict(os.environ, HUMMING_JAX_CUDA_LIB=str(missing))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["cuda"] is None
    assert report["cuda_unavailable_because"] == f"HUMMING_JAX_CUDA_LIB={missing} is not a file"
