"""Property tests over routing: any ids (duplicates, padding, non-local, out of range) give the
same result in every class, equal to the oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import TOL, nan_out, random_weights
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from humming_jax.experts import BatchedExperts, GroupedExperts, IndexedExperts
from humming_jax.reference import batched_reference, moe_reference, relative_error

H, I = 32, 16
_WEIGHTS = {}


def _weights(e: int):
    if e not in _WEIGHTS:
        _WEIGHTS[e] = random_weights(np.random.default_rng(1000 + e), e, H, I)
    return _WEIGHTS[e]


_apply = {
    cls: jax.jit(lambda o, x, w, tw, ids, emap, cls=cls: cls().apply(o, x, w, tw, ids, expert_map=emap))
    for cls in (IndexedExperts, GroupedExperts)
}


@st.composite
def routings(draw):
    e_local = draw(st.sampled_from([1, 3, 8, 32]))
    e_global = draw(st.sampled_from([e_local, 2 * e_local, e_local + 5]))
    m = draw(st.integers(0, 24))
    k = draw(st.integers(1, 6))
    id_strategy = st.one_of(
        st.integers(0, e_global - 1),
        st.integers(0, e_global - 1),
        st.just(-1),
        st.integers(-(2**31), 2**31 - 1),
    )
    ids = draw(st.lists(st.lists(id_strategy, min_size=k, max_size=k), min_size=m, max_size=m))
    perm = draw(st.permutations(range(e_global)))
    owned = perm[:e_local]
    emap = np.full(e_global, -1, np.int32)
    emap[list(owned)] = np.arange(e_local)
    seed = draw(st.integers(0, 2**32 - 1))
    return e_local, np.asarray(ids, np.int64).reshape(m, k).astype(np.int32), emap, seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routings())
def test_classes_agree_with_reference(r):
    e_local, ids, emap, seed = r
    rng = np.random.default_rng(seed)
    m, k = ids.shape
    w = _weights(e_local)
    x = jnp.asarray(rng.standard_normal((m, H)), jnp.bfloat16)
    tw = jnp.asarray(rng.random((m, k)).astype(np.float32))
    ids_j, emap_j = jnp.asarray(ids), jnp.asarray(emap)
    w13, w2 = w.dequantize()
    want = moe_reference(x, w13, w2, tw, ids_j, expert_map=emap_j)
    results = []
    for cls, fn in _apply.items():
        got = fn(nan_out(x.shape, x.dtype), x, w, tw, ids_j, emap_j)
        g = np.asarray(got.astype(jnp.float32))
        assert np.all(np.isfinite(g)), cls.__name__
        if m:
            assert relative_error(got, want) <= TOL[jnp.dtype(jnp.bfloat16)], cls.__name__
        results.append(g)
    np.testing.assert_allclose(results[0], results[1], rtol=2e-2, atol=2e-2)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**32 - 1))
def test_batched_agrees_with_standard(e, t, seed):
    """Dispatching each token to one expert slab and weighting after equals the standard path."""
    rng = np.random.default_rng(seed)
    w = _weights(e)
    counts = rng.integers(0, t + 1, e).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((e, t, H)), jnp.bfloat16)
    got = BatchedExperts().apply(nan_out(x.shape, x.dtype), x, w, None, None, expert_num_tokens=jnp.asarray(counts))
    # The same rows as a standard layer with k = 1 and weight 1.
    rows = [(ei, ti) for ei in range(e) for ti in range(counts[ei])]
    if rows:
        xs = jnp.stack([x[ei, ti] for ei, ti in rows])
        ids = jnp.asarray([[ei] for ei, _ in rows], jnp.int32)
        std = IndexedExperts().apply(nan_out(xs.shape, xs.dtype), xs, w, jnp.ones((len(rows), 1)), ids)
        batched_rows = jnp.stack([got[ei, ti] for ei, ti in rows])
        np.testing.assert_array_equal(np.asarray(batched_rows.astype(jnp.float32)), np.asarray(std.astype(jnp.float32)))
    w13, w2 = w.dequantize()
    assert relative_error(got, batched_reference(x, w13, w2, jnp.asarray(counts))) <= TOL[jnp.dtype(jnp.bfloat16)]
