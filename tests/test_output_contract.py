"""The caller-owned output contract (SPEC §4): aliasing, donation, every element written."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_out_written_in_place, nan_out, random_layer, random_weights

import humming_jax as hj
from humming_jax.experts import BatchedExperts, GroupedExperts, IndexedExperts

STANDARD = [IndexedExperts, GroupedExperts]


def _standard_fn(cls):
    return lambda out, x, w, tw, ids: cls().apply(out, x, w, tw, ids)


def _batched_fn(out, x, w, counts):
    return BatchedExperts().apply(out, x, w, None, None, expert_num_tokens=counts)


def _layer_args(layer):
    return (layer.x, layer.weights, layer.topk_weights, layer.topk_ids)


@pytest.mark.parametrize("cls", STANDARD)
def test_donated_out_is_written_in_place(rng, cls):
    layer = random_layer(rng, m=16, e=4, h=64, i=32, k=2)
    f = jax.jit(_standard_fn(cls), donate_argnums=0)
    out = nan_out(layer.x.shape, layer.x.dtype)
    hlo = f.lower(out, *_layer_args(layer)).compile().as_text()
    assert_out_written_in_place(hlo, 0)
    ptr = out.unsafe_buffer_pointer()
    y = f(out, *_layer_args(layer))
    assert y.unsafe_buffer_pointer() == ptr
    assert out.is_deleted()
    assert np.all(np.isfinite(np.asarray(y.astype(jnp.float32))))


def test_donated_out_batched(rng):
    weights = random_weights(rng, 4, 64, 32)
    x = jnp.asarray(rng.standard_normal((4, 8, 64)), jnp.bfloat16)
    counts = jnp.asarray([8, 0, 3, 5], jnp.int32)
    f = jax.jit(_batched_fn, donate_argnums=0)
    out = nan_out(x.shape, x.dtype)
    hlo = f.lower(out, x, weights, counts).compile().as_text()
    assert_out_written_in_place(hlo, 0)
    ptr = out.unsafe_buffer_pointer()
    y = f(out, x, weights, counts)
    assert y.unsafe_buffer_pointer() == ptr
    assert np.all(np.isfinite(np.asarray(y.astype(jnp.float32))))


def test_fused_moe_donation(rng):
    layer = random_layer(rng, m=8, e=4, h=64, i=32, k=2)
    f = jax.jit(lambda out, x, w, tw, ids: hj.fused_moe(x, w, tw, ids, out=out), donate_argnums=0)
    out = nan_out(layer.x.shape, layer.x.dtype)
    ptr = out.unsafe_buffer_pointer()
    y = f(out, *_layer_args(layer))
    assert y.unsafe_buffer_pointer() == ptr


@pytest.mark.parametrize("cls", STANDARD)
def test_without_donation_callers_out_is_unchanged(rng, cls):
    layer = random_layer(rng, m=12, e=4, h=32, i=16, k=2)
    sentinel = jnp.asarray(rng.standard_normal(layer.x.shape), layer.x.dtype)
    before = np.asarray(sentinel.astype(jnp.float32)).copy()
    y = jax.jit(_standard_fn(cls))(sentinel, *_layer_args(layer))
    np.testing.assert_array_equal(np.asarray(sentinel.astype(jnp.float32)), before)
    assert not np.array_equal(np.asarray(y.astype(jnp.float32)), before)


@pytest.mark.parametrize("cls", STANDARD)
def test_rows_without_local_expert_are_zero_in_poisoned_out(rng, cls):
    layer = random_layer(rng, m=10, e=4, h=32, i=16, k=2)
    ids = np.asarray(layer.topk_ids).copy()
    ids[::2] = -1
    layer.topk_ids = jnp.asarray(ids)
    y = np.asarray(jax.jit(_standard_fn(cls))(nan_out(layer.x.shape, layer.x.dtype), *_layer_args(layer)).astype(jnp.float32))
    assert np.all(np.isfinite(y))
    assert np.all(y[::2] == 0.0)
    assert np.all(np.abs(y[1::2]).sum(axis=1) > 0)


@pytest.mark.parametrize("cls", STANDARD)
def test_deterministic_donated_or_not(rng, cls):
    layer = random_layer(rng, m=64, e=16, h=64, i=32, k=4, pad_frac=0.1)
    plain = jax.jit(_standard_fn(cls))
    donated = jax.jit(_standard_fn(cls), donate_argnums=0)
    results = [plain(nan_out(layer.x.shape, layer.x.dtype), *_layer_args(layer)) for _ in range(2)]
    results += [donated(nan_out(layer.x.shape, layer.x.dtype), *_layer_args(layer)) for _ in range(2)]
    ref = np.asarray(results[0].astype(jnp.float32))
    for r in results[1:]:
        np.testing.assert_array_equal(np.asarray(r.astype(jnp.float32)), ref)


@pytest.mark.parametrize("cls", STANDARD)
@pytest.mark.parametrize(
    "shape,dtype,exc,match",
    [
        ((12, 31), jnp.bfloat16, ValueError, "out has shape"),
        ((11, 32), jnp.bfloat16, ValueError, "out has shape"),
        ((12, 32), jnp.float16, TypeError, "out has dtype"),
        ((12, 32), jnp.float32, TypeError, "out has dtype"),
    ],
)
def test_out_mismatch_is_rejected(rng, cls, shape, dtype, exc, match):
    layer = random_layer(rng, m=12, e=4, h=32, i=16, k=2)
    with pytest.raises(exc, match=match):
        cls().apply(jnp.zeros(shape, dtype), *_layer_args(layer))


def test_out_mismatch_batched(rng):
    weights = random_weights(rng, 2, 32, 16)
    x = jnp.ones((2, 4, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="out has shape"):
        BatchedExperts().apply(jnp.zeros((2, 4, 33), jnp.bfloat16), x, weights, None, None, expert_num_tokens=jnp.ones(2, jnp.int32))
