"""Each expert class against the oracle on fresh random layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BACKEND, TOL, nan_out, random_layer, random_weights, reference, run_standard

from humming_jax.activations import ACTIVATIONS
from humming_jax.experts import BatchedExperts, GroupedExperts, IndexedExperts
from humming_jax.reference import batched_reference, relative_error

STANDARD = [IndexedExperts, GroupedExperts]


def _assert_close(got: jax.Array, want: jax.Array, dtype: jnp.dtype = jnp.dtype(jnp.bfloat16)) -> None:
    got = np.asarray(got.astype(jnp.float32))
    assert np.all(np.isfinite(got)), "output holds NaN/inf: some element was not written"
    err = relative_error(got, want)
    assert err <= TOL[jnp.dtype(dtype)], f"relative error {err:.2e}"


@pytest.mark.parametrize("cls", STANDARD)
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_every_activation(rng, cls, activation):
    layer = random_layer(rng, m=12, e=6, h=64, i=48, k=2, activation=activation)
    got = run_standard(cls, layer, activation=activation)
    _assert_close(got, reference(layer, activation=activation))


@pytest.mark.parametrize("cls", STANDARD)
@pytest.mark.parametrize(
    "m,e,k",
    [(0, 4, 2), (1, 4, 1), (1, 128, 8), (7, 3, 3), (33, 16, 4), (64, 128, 8), (5, 8, 8)],
)
def test_shapes(rng, cls, m, e, k):
    layer = random_layer(rng, m=m, e=e, h=32, i=16, k=k)
    got = run_standard(cls, layer)
    assert got.shape == (m, 32)
    if m:
        _assert_close(got, reference(layer))


@pytest.mark.parametrize("cls", STANDARD)
def test_all_tokens_on_one_expert_and_empty_experts(rng, cls):
    layer = random_layer(rng, m=40, e=16, h=32, i=32, k=1)
    ids = jnp.full((40, 1), 5, jnp.int32)
    layer.topk_ids = ids
    got = run_standard(cls, layer)
    _assert_close(got, reference(layer))


@pytest.mark.parametrize("cls", STANDARD)
def test_padding_ids_are_skipped(rng, cls):
    layer = random_layer(rng, m=24, e=8, h=32, i=16, k=4, pad_frac=0.4)
    ids = np.asarray(layer.topk_ids).copy()
    ids[3, :] = -1  # a token with no expert at all
    layer.topk_ids = jnp.asarray(ids)
    got = run_standard(cls, layer)
    _assert_close(got, reference(layer))
    assert np.all(np.asarray(got[3].astype(jnp.float32)) == 0.0)


@pytest.mark.parametrize("cls", STANDARD)
def test_expert_map(rng, cls):
    # 32 global experts, this device holds 8 of them in a scattered order.
    e_global, e_local = 32, 8
    layer = random_layer(rng, m=30, e=e_local, h=32, i=16, k=4, e_global=e_global, pad_frac=0.1)
    emap = -np.ones(e_global, np.int32)
    owned = rng.choice(e_global, e_local, replace=False)
    emap[owned] = rng.permutation(e_local)
    emap = jnp.asarray(emap)
    got = run_standard(cls, layer, expert_map=emap)
    want = reference(layer, expert_map=emap)
    _assert_close(got, want)
    # Tokens whose experts all live elsewhere are exactly 0.
    local = np.isin(np.asarray(layer.topk_ids), owned)
    none_local = ~local.any(axis=1)
    assert np.all(np.asarray(got.astype(jnp.float32))[none_local] == 0.0)


@pytest.mark.parametrize("cls", STANDARD)
def test_global_num_experts_without_map(rng, cls):
    # Ids in [E_local, E_global) are valid globally but not local: skipped.
    layer = random_layer(rng, m=16, e=4, h=32, i=16, k=2, e_global=10)
    got = run_standard(cls, layer, global_num_experts=10)
    _assert_close(got, reference(layer, expert_map=jnp.asarray(np.r_[np.arange(4), -np.ones(6)].astype(np.int32))))


@pytest.mark.parametrize("cls", [IndexedExperts, GroupedExperts])
def test_no_expert_map_builds_no_map_array(rng, cls):
    """Without an expert_map the routing call (or the one-call layer, which routes) gets no map
    buffer: the layer's program holds no iota and no zero-sized array (a kernel per call, and a
    zero-sized constant that one XLA CPU compiler crashed on inside shard_map)."""
    layer = random_layer(rng, m=5, e=4, h=32, i=16, k=2)
    out = nan_out(layer.x.shape, layer.x.dtype)
    hlo = jax.jit(lambda *a: cls().apply(*a)).lower(out, layer.x, layer.weights, layer.topk_weights,
                                                    layer.topk_ids).as_text()
    assert "routing_" in hlo or "layer_indexed" in hlo
    assert "iota" not in hlo and "tensor<0x" not in hlo, hlo


@pytest.mark.parametrize("cls", STANDARD)
def test_biases_and_fp16(rng, cls):
    weights = random_weights(rng, 6, 48, 32, scheme="fp16", bias=True)
    from conftest import Layer, random_routing

    x = jnp.asarray(rng.standard_normal((10, 48)), jnp.float16)
    tw, ids = random_routing(rng, 10, 2, 6)
    w13, w2 = weights.dequantize()
    layer = Layer(x, weights, tw, ids, w13, w2)
    got = run_standard(cls, layer)
    _assert_close(got, reference(layer, b13=weights.b13, b2=weights.b2), jnp.float16)


@pytest.mark.parametrize("cls", STANDARD)
def test_activation_limit(rng, cls):
    layer = random_layer(rng, m=16, e=4, h=32, i=16, k=2)
    layer.x = layer.x * 8  # push pre-activations past the clamp
    got = run_standard(cls, layer, activation="silu", activation_limit=0.5)
    _assert_close(got, reference(layer, activation="silu", activation_limit=0.5))
    unclamped = reference(layer, activation="silu")
    assert relative_error(got, unclamped) > 1e-2  # the clamp changed the result


@pytest.mark.parametrize("activation", ["silu", "swigluoai", "relu2_no_mul"])
@pytest.mark.parametrize("t", [1, 9])
def test_batched(rng, activation, t):
    e, h, i = 6, 64, 32
    weights = random_weights(rng, e, h, i, gated=ACTIVATIONS[activation].gated)
    x = jnp.asarray(rng.standard_normal((e, t, h)), jnp.bfloat16)
    counts = jnp.asarray(rng.integers(0, t + 1, e).astype(np.int32).clip(0, t))
    counts = counts.at[0].set(t).at[1].set(0)  # one full slab, one empty
    out = nan_out(x.shape, x.dtype)
    fn = jax.jit(lambda o, x, w, c: BatchedExperts().apply(o, x, w, None, None, activation=activation, expert_num_tokens=c))
    got = fn(out, x, weights, counts)
    w13, w2 = weights.dequantize()
    want = batched_reference(x, w13, w2, counts, activation=activation)
    _assert_close(got, want)
    rows = np.arange(t)[None, :] >= np.asarray(counts)[:, None]
    assert np.all(np.asarray(got.astype(jnp.float32))[rows] == 0.0), "rows past the count must be zeros"


def test_batched_counts_out_of_range_are_clamped(rng):
    e, t, h, i = 3, 4, 32, 16
    weights = random_weights(rng, e, h, i)
    x = jnp.asarray(rng.standard_normal((e, t, h)), jnp.bfloat16)
    counts = jnp.asarray([-5, 1000, 2], jnp.int32)
    got = BatchedExperts().apply(nan_out(x.shape, x.dtype), x, weights, None, None, expert_num_tokens=counts)
    w13, w2 = weights.dequantize()
    want = batched_reference(x, w13, w2, jnp.clip(counts, 0, t))
    _assert_close(got, want)


def test_classes_agree_bitwise_on_same_inputs(rng):
    layer = random_layer(rng, m=20, e=8, h=64, i=32, k=3, pad_frac=0.2)
    a = run_standard(IndexedExperts, layer)
    b = run_standard(GroupedExperts, layer)
    if BACKEND == "cpu":
        # One GEMM loop serves both layouts on the CPU: results agree to the last bit.
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    else:
        _assert_close(a, b)


def test_eager_equals_jit(rng):
    layer = random_layer(rng, m=9, e=4, h=32, i=16, k=2)
    a = run_standard(IndexedExperts, layer, jit=False)
    b = run_standard(IndexedExperts, layer, jit=True)
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


@pytest.mark.parametrize("scheme,one_call", [("w8a8-fp8-block128", True), ("w8a8-fp8-channel", False)])
def test_grouped_quantized_input_one_call_or_two(rng, monkeypatch, scheme, one_call):
    """The grouped class quantizes and permutes its input in one call (quantize_permuted) where the
    grouping allows it (groups of 8-256 columns), else quantize then permute_rows; a CUDA build that
    lacks the call (an A/B library) takes the two calls. Both give the same layer, bit for bit."""
    from humming_jax import _ffi

    layer = random_layer(rng, m=21, e=6, h=256, i=128, k=3, scheme=scheme, pad_frac=0.2, e_global=8)

    def hlo():
        f = jax.jit(lambda o, x, w, tw, ids: GroupedExperts().apply(o, x, w, tw, ids))
        return f.lower(nan_out(layer.x.shape, layer.x.dtype), layer.x, layer.weights, layer.topk_weights,
                       layer.topk_ids).as_text()

    assert ("humming_jax.quantize_permuted" in hlo()) == one_call
    one = run_standard(GroupedExperts, layer)
    monkeypatch.setitem(_ffi._state, "cuda_missing", ["quantize_permuted"])
    assert "humming_jax.quantize_permuted" not in hlo()
    two = run_standard(GroupedExperts, layer)
    assert np.all(np.isfinite(np.asarray(one.astype(jnp.float32))))
    np.testing.assert_array_equal(np.asarray(one.astype(jnp.float32)), np.asarray(two.astype(jnp.float32)))
