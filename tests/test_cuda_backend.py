"""GPU-only checks of the CUDA backend: every custom call against its CPU twin in the same process,
the caller-owned output contract on the device, CUDA graphs (command buffers), determinism and
zero-size problems.

Skipped unless the CUDA handlers are registered. HUMMING_JAX_TEST_CUDA_AS_CPU=1 runs the same
checks with the CPU standing in for the GPU (to test the tests where there is no GPU).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import TOL, assert_out_written_in_place, layer_tolerance, nan_out, random_layer
from graph_replay import replay_both_ways

import humming_jax as hj
from humming_jax._abi import WeightType
from humming_jax.activations import ACTIVATIONS
from humming_jax.experts import BatchedExperts, GroupedExperts, IndexedExperts
from humming_jax.ops import activation as act_ops
from humming_jax.ops import finalize as fin_ops
from humming_jax.ops import gemm as gemm_ops
from humming_jax.ops import routing as routing_ops
from humming_jax.quantize import SCHEMES, act_quant_params
from humming_jax.reference import InputQuant, batched_reference, moe_reference, relative_error
from humming_jax.testing import gemm_forms, random_packed_weight, random_routing
from humming_jax.weights import PackedWeight

_STAND_IN = os.environ.get("HUMMING_JAX_TEST_CUDA_AS_CPU") == "1"
CPU = jax.devices("cpu")[0]
if hj.cuda_available():
    GPU = jax.devices("cuda")[0]
elif _STAND_IN:
    GPU = CPU
else:
    GPU = None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPU is None, reason="CUDA backend not available (humming_jax.cuda_available() is False)"),
]

STANDARD = [IndexedExperts, GroupedExperts]


def run_on(dev, fn, *args):
    """fn jitted on `dev` (inputs committed there), results as NumPy arrays."""
    placed = jax.device_put(args, dev)
    out = jax.jit(fn)(*placed)
    return jax.tree.map(lambda a: np.asarray(a.astype(jnp.float32) if a.dtype != jnp.int32 else a), out)


def both(fn, *args):
    return run_on(CPU, fn, *args), run_on(GPU, fn, *args)


def assert_close_16(got, want, dtype, what=""):
    """GPU vs CPU results of one 16-bit computation: equal up to accumulation order."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    tol = 6e-3 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else 1.5e-3
    denom = max(np.linalg.norm(want), 1e-30)
    rel = np.linalg.norm(got - want) / denom
    assert rel < tol, f"{what}: relative error {rel:.3g} >= {tol}"
    scale = np.abs(want).max() if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=4 * tol, atol=4 * tol * scale + 1e-6, err_msg=what)


# ------------------------------------------------------------------------------------------------
# Routing and permutation: the GPU places entries in the CPU's order, so results are identical.
# ------------------------------------------------------------------------------------------------
ROUTING_CASES = [
    (0, 2, 8, 8, 16, 0.0),
    (1, 8, 128, 128, 16, 0.0),
    (7, 3, 16, 5, 5, 0.2),
    (300, 2, 8, 8, 64, 0.1),
    (1000, 8, 256, 32, 32, 0.05),
    (16384, 8, 128, 128, 64, 0.0),
    (5000, 6, 300, 256, 32, 0.1),
    (2048, 4, 10000, 64, 16, 0.1),  # an expert map too long to stage in shared memory
    (64, 2, 8000, 5000, 16, 0.0),  # staged map + histogram beyond 48 KB of shared memory
    # At most 32 entries: the single-warp kernel (routing_small_kernel); 33: the per-expert one.
    (16, 2, 8, 8, 16, 0.1),
    (11, 3, 8, 8, 16, 0.1),
    (4, 8, 300, 256, 32, 0.1),
    (2, 8, 10000, 5000, 128, 0.25),  # tails of ~640k rows over many blocks
    (3, 4, 6, 6, 1, 0.0),
]


def assert_routing_matches_cpu(ids, emap, e_local, block_m):
    """Both routing layouts of ids through emap, GPU against CPU, field by field; returns the CPU's
    grouped layout."""
    ci, gi = both(lambda i, e: routing_ops.routing_indexed(i, e, e_local, block_m), ids, emap)
    for name, c, g in zip(routing_ops.IndexedRouting._fields, ci, gi):
        np.testing.assert_array_equal(g, c, err_msg=f"indexed {name}")
    cg, gg = both(lambda i, e: routing_ops.routing_grouped(i, e, e_local), ids, emap)
    for name, c, g in zip(routing_ops.GroupedRouting._fields, cg, gg):
        np.testing.assert_array_equal(g, c, err_msg=f"grouped {name}")
    return cg


@pytest.mark.parametrize("m,k,e_global,e_local,block_m,pad", ROUTING_CASES)
def test_routing_matches_cpu(rng, m, k, e_global, e_local, block_m, pad):
    ids, emap = random_routing(rng, m, k, e_global, e_local, pad)
    assert_routing_matches_cpu(ids, emap, e_local, block_m)


@pytest.mark.parametrize("m,k,e_local,block_m", [(1, 8, 128, 16), (11, 3, 8, 16), (300, 2, 8, 64), (5000, 6, 256, 32)])
def test_routing_with_empty_expert_map_matches_cpu(rng, m, k, e_local, block_m):
    """No expert map (an empty one: the identity over the local experts) on both routing kernels
    (single-warp at <= 32 entries, per-expert above), ids past e_local and out of range skipped."""
    ids, _ = random_routing(rng, m, k, e_local + 5, e_local, 0.1)
    cg = assert_routing_matches_cpu(ids, jnp.zeros((0,), jnp.int32), e_local, block_m)
    src = np.asarray(cg[2]).reshape(-1)
    flat = np.asarray(ids).reshape(-1)
    assert ((src >= 0) == ((flat >= 0) & (flat < e_local))).all()


@pytest.mark.parametrize("m,k,e_global,e_local,block_m,pad", [c for c in ROUTING_CASES if c[0] * c[1] <= 32])
def test_routing_per_expert_kernel_at_decode_sizes(rng, monkeypatch, m, k, e_global, e_local, block_m, pad):
    """HUMMING_JAX_ROUTING_SMALL=0 keeps the per-expert kernel at decode sizes: it must agree too."""
    monkeypatch.setenv("HUMMING_JAX_ROUTING_SMALL", "0")
    test_routing_matches_cpu(rng, m, k, e_global, e_local, block_m, pad)


@pytest.mark.parametrize("cols,dtype,m,k", [(64, jnp.bfloat16, 37, 3), (33, jnp.bfloat16, 37, 3), (7, jnp.float16, 37, 3),
                                            (128, jnp.float8_e4m3fn, 37, 3), (5, jnp.float8_e4m3fn, 37, 3),
                                            (3, jnp.float32, 37, 3), (16, jnp.int8, 37, 3),
                                            # rows of >= 32 units (33 2-byte ones above) take a warp a row: 257
                                            # 16-byte units (a lane's second batch, partly past the row), and more
                                            # rows than the launch's warps (each warp takes several)
                                            (2056, jnp.bfloat16, 150, 4), (256, jnp.bfloat16, 4200, 8)])
def test_permute_rows_matches_cpu(rng, cols, dtype, m, k):
    e = 6
    ids, emap = random_routing(rng, m, k, e, e, 0.2)
    x = jnp.asarray(rng.standard_normal((m, cols)) * 4, dtype)

    def f(x, ids, emap):
        return routing_ops.permute_rows(x, routing_ops.routing_grouped(ids, emap, e), k)

    c, g = both(f, x, ids, emap)
    np.testing.assert_array_equal(g, c)


# ------------------------------------------------------------------------------------------------
# GEMMs: every scheme, every form, against the CPU handler on the same inputs.
# ------------------------------------------------------------------------------------------------
def _packed(rng, scheme, e, n, k, dtype):
    w = rng.standard_normal((e, n, k)).astype(np.float32) / np.sqrt(k)
    return SCHEMES[scheme].quantize(w, dtype)




GEMM_SCHEMES = sorted(SCHEMES)


def _gemm_forms(rng, w, bias, dtype, quant, m=23, topk=3):
    """Runs every GEMM form (humming_jax.testing.gemm_forms) on CPU and GPU over random routing
    with padding and far out-of-range ids; returns [(name, cpu, gpu)] of the rows to compare."""
    e = w.num_experts
    ids, emap = random_routing(rng, m, topk, e + 2, e, 0.15)
    fn, operands = gemm_forms(rng, w, bias, dtype, quant, ids, emap, t=9)
    c, g = both(fn, *operands)
    np.testing.assert_array_equal(g["src"], c["src"])
    valid = c["src"].reshape(-1) >= 0  # rows of c written by the indexed GEMMs
    return [("indexed", c["c1"][valid], g["c1"][valid]), ("indexed gather_div=1", c["c2"][valid], g["c2"][valid]),
            ("grouped", c["cg"], g["cg"]), ("batched", c["cb"], g["cb"]), ("batched_into", c["cbi"], g["cbi"])]


@pytest.mark.parametrize("scheme", GEMM_SCHEMES)
def test_gemm_every_scheme_matches_cpu(rng, scheme):
    spec = SCHEMES[scheme]
    dtype = spec.default_dtype
    quant = act_quant_params(spec.act_key)
    e, n, k = 5, 200, 256  # N not a multiple of the 128-column tile
    w = _packed(rng, scheme, e, n, k, dtype)
    bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32) * 0.1)
    for name, c, g in _gemm_forms(rng, w, bias, dtype, quant):
        assert_close_16(g, c, dtype, f"{scheme} {name}")


@pytest.mark.parametrize(
    "wtype,k,group_k,zero,scale_dtype,scale2,dtype,quant",
    [
        (WeightType.UINT4, 48, 12, True, np.float32, False, jnp.bfloat16, None),  # groups narrower than a chunk
        (WeightType.UINT4, 40, 8, False, ml_dtypes.bfloat16, False, jnp.float16, None),
        (WeightType.INT8, 38, 38, False, np.float16, False, jnp.bfloat16, None),  # K % 8 != 0
        (WeightType.FP8_E4M3, 100, 4, False, np.float32, True, jnp.float16, None),
        (WeightType.FP4_E2M1, 64, 16, False, ml_dtypes.float8_e4m3fn, True, jnp.bfloat16, None),
        (WeightType.FP4_E2M1, 96, 32, False, np.float32, False, jnp.bfloat16, ("fp8", 0)),
        (WeightType.UINT4, 256, 128, True, np.float32, False, jnp.bfloat16, ("fp8", 128)),
        (WeightType.INT8, 48, 16, False, np.float32, True, jnp.float16, ("int8", 16)),
        (WeightType.FP8_E4M3, 80, 80, False, np.float32, False, jnp.bfloat16, ("int8", 0)),
    ],
)
def test_gemm_odd_shapes_and_groups_match_cpu(rng, wtype, k, group_k, zero, scale_dtype, scale2, dtype, quant):
    e, n = 4, 72
    w = random_packed_weight(rng, wtype, e, n, k, group_k, zero=zero, scale_dtype=scale_dtype, scale2=scale2)
    for name, c, g in _gemm_forms(rng, w, None, dtype, quant, m=11, topk=2):
        assert_close_16(g, c, dtype, f"{wtype.name} K={k} g={group_k} {name}")


def test_gemm_float_weights_odd_k(rng):
    e, n, k, dtype = 3, 130, 21, jnp.float16
    w = PackedWeight(jnp.asarray(rng.standard_normal((e, n, k)), dtype), wtype=WeightType.FLOAT, k=k)
    for name, c, g in _gemm_forms(rng, w, None, dtype, None, m=5, topk=2):
        assert_close_16(g, c, dtype, name)


@pytest.mark.skipif(_STAND_IN, reason="a limit of the CUDA kernel")
def test_gemm_rejects_8bit_scale_groups_that_split_an_mma_step(rng):
    e, n, k = 2, 16, 64
    w = random_packed_weight(rng, WeightType.FP8_E4M3, e, n, k, 8)
    x = jax.device_put(jnp.asarray(rng.standard_normal((e, 4, k)), jnp.bfloat16), GPU)
    counts = jax.device_put(jnp.full((e,), 4, jnp.int32), GPU)

    def f(x, counts, w):
        a, s = act_ops.quantize(x.reshape(e * 4, k), "fp8", 0)
        return gemm_ops.gemm_batched(a.reshape(e, 4, k), s, w, None, counts, out_dtype=jnp.bfloat16)

    with pytest.raises(Exception, match="multiples of 16"):
        jax.block_until_ready(jax.jit(f)(x, counts, jax.device_put(w, GPU)))


# ------------------------------------------------------------------------------------------------
# Activation, quantization, finalize.
# ------------------------------------------------------------------------------------------------
# I = 52: the scalar kernel (I % 8 != 0); I = 64 with 700 rows: the vectorized kernel over more
# vectors than one grid pass.
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows,i", [(37, 52), (700, 64)])
def test_activation_matches_cpu(rng, name, dtype, rows, i):
    x = jnp.asarray(rng.standard_normal((rows, 2 * i)) * 3, dtype)
    limit = 5.0 if name in ("silu", "swigluoai") else None
    c, g = both(lambda x: act_ops.activation(x, name, limit), x)
    assert_close_16(g, c, dtype, name)


# Vectorized kernels: group sizes 8..256 and whole rows over I % 8 == 0; the scalar kernel for
# I = 200 with group 40 (not a power of two) and I = 100 (I % 8 != 0).
@pytest.mark.parametrize("quant,group_k,i", [("fp8", 0, 256), ("fp8", 128, 256), ("int8", 0, 256), ("int8", 16, 256),
                                             ("fp8", 8, 256), ("fp8", 32, 256), ("int8", 64, 256), ("fp8", 256, 512),
                                             ("fp8", 40, 200), ("int8", 0, 100)])
@pytest.mark.parametrize("act", ["silu", "swigluoai", "gelu_tanh_no_mul"])
def test_activation_quant_and_quantize_match_cpu(rng, quant, group_k, i, act):
    dtype = jnp.float16 if act == "gelu_tanh_no_mul" else jnp.bfloat16
    n1 = i if act.endswith("no_mul") else 2 * i
    x = jnp.asarray(rng.standard_normal((29, n1)) * 2, dtype)
    limit = 7.0 if act == "swigluoai" else None
    for fn in (lambda x: act_ops.activation_quant(x, act, limit, quant, group_k),
               lambda x: act_ops.quantize(x, quant, group_k)):
        (cq, cs), (gq, gs) = both(fn, x)
        np.testing.assert_allclose(gs, cs, rtol=1e-5, err_msg="scales")
        # Codes may differ by one step where the activation's last bit differs between libms.
        step = 1.0 if quant == "int8" else np.abs(cq) / 8 + 2.0**-9
        assert np.mean(gq != cq) < 0.01
        assert np.all(np.abs(gq - cq) <= step + 1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_e4m3_codes_match_cpu_bit_for_bit(rng, dtype):
    """Every 16-bit value in [-448, 448] quantized with scale 1 (each group of 128 holds 448): the
    GPU's e4m3 codes equal the CPU's and an independent round-to-nearest-even conversion, ties,
    subnormals and signed zeros included."""
    import ml_dtypes

    bits = np.arange(0, 0x5F01 if dtype == jnp.float16 else 0x43E1, dtype=np.uint16)
    vals = bits.view(np.float16 if dtype == jnp.float16 else ml_dtypes.bfloat16).astype(np.float32)
    vals = np.concatenate([vals, -vals])
    assert vals.max() == 448.0
    rng.shuffle(vals)
    per = 127
    vals = np.concatenate([vals, np.ones(-len(vals) % per, np.float32)]).reshape(-1, per)
    groups = np.concatenate([np.full((len(vals), 1), 448.0, np.float32), vals], axis=1)  # scale 448 / 448 = 1
    groups = np.concatenate([groups, np.full((-len(groups) % 2, 128), 448.0, np.float32)])
    x = jnp.asarray(groups.reshape(-1, 256), dtype)
    fn = lambda x: jax.lax.bitcast_convert_type(act_ops.quantize(x, "fp8", 128)[0], jnp.uint8)
    cpu, gpu = both(fn, x)
    want = np.asarray(x, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(cpu, want, err_msg="CPU codes vs round-to-nearest-even")
    np.testing.assert_array_equal(gpu, cpu, err_msg="GPU codes vs CPU codes")


@pytest.mark.parametrize("quant", ["fp8", "int8"])
def test_zero_groups_quantize_to_zero_codes(rng, quant):
    """Groups of signed zeros have scale 0 and codes 0 (quant_code_value: no division by a zero
    scale), bit for bit the CPU's, beside groups of random values."""
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[1, :128] = -0.0
    x[2, 256:384] = 0.0
    x[3, :] = -0.0
    x[4, 128:256] = np.where(rng.random(128) < 0.5, -0.0, 0.0)
    x = jnp.asarray(x, jnp.bfloat16)
    fn = lambda x: act_ops.quantize(x, quant, 128)
    (cq, cs), (gq, gs) = both(fn, x)
    np.testing.assert_array_equal(np.asarray(gs), np.asarray(cs), err_msg="scales")
    gbits = np.asarray(jax.lax.bitcast_convert_type(gq, jnp.uint8))
    cbits = np.asarray(jax.lax.bitcast_convert_type(cq, jnp.uint8))
    np.testing.assert_array_equal(gbits, cbits, err_msg="codes")
    assert np.all(cbits[1, :128] == 0) and np.all(cbits[3] == 0) and np.all(np.asarray(cs)[3] == 0)


def _codes_and_scales(out):
    q, s = out
    return jax.lax.bitcast_convert_type(q, jnp.uint8), s


def _inconsistent_grouping(rng, m, k):
    """A permutation and src_rows outside the routing's invariant: repeated and out-of-range ids,
    src_rows entries naming positions the permutation does not name back, and a last offset past
    the rows, so the kernel's fill loop quantizes rows where they land and zeroes others."""
    r = m * k
    perm = rng.permutation(r).astype(np.int32)
    perm[rng.integers(0, r, r // 5)] = perm[rng.integers(0, r, r // 5)]  # repeats
    perm[rng.integers(0, r, 4)] = -3
    perm[rng.integers(0, r, 2)] = r + 7
    src = np.full(r, -1, np.int32)
    for p in rng.permutation(r):
        if 0 <= perm[p] < r and rng.random() < 0.8:
            src[perm[p]] = p  # the last position naming an id wins; others stay the fill loop's
    src[rng.integers(0, r, 3)] = r + 5
    offsets = np.array([0, r // 3, r + 100], np.int32)
    return jnp.asarray(perm), jnp.asarray(offsets), jnp.asarray(src.reshape(m, k))


@pytest.mark.parametrize("quant,group_k,cols,dtype,m,k", [("fp8", 128, 256, jnp.bfloat16, 37, 3),
                                                          ("fp8", 128, 7168, jnp.bfloat16, 300, 8),
                                                          ("fp8", 8, 64, jnp.float16, 50, 2),
                                                          ("int8", 32, 96, jnp.bfloat16, 41, 4),
                                                          ("fp8", 256, 512, jnp.bfloat16, 4200, 1),
                                                          ("int8", 64, 192, jnp.float16, 1, 8)])
def test_quantize_permuted_matches_cpu(rng, quant, group_k, cols, dtype, m, k):
    """The one-pass quantize + permutation against the CPU's quantize-then-permute, bit for bit:
    over the routing (remote experts and skipped ids leave zero rows past the valid ones), run after
    a call whose outputs filled the same buffers with codes (so a row left unwritten shows), and
    over metadata outside the routing's invariant (the fill loop's rows)."""
    e = 6
    x = jnp.asarray(rng.standard_normal((m, cols)) * rng.uniform(0.01, 30, (m, 1)), dtype)

    def routed(x, ids, emap):
        r = routing_ops.routing_grouped(ids, emap, e)
        return _codes_and_scales(act_ops.quantize_permuted(x, r.permutation, r.expert_first_token_offset,
                                                           r.src_rows, quant, group_k))

    full_ids, full_map = random_routing(rng, m, k, e, e, 0.0)
    run_on(GPU, routed, x, full_ids, full_map)  # fills the allocator's blocks with codes
    ids, emap = random_routing(rng, m, k, e + 3, e, 0.2)
    (cq, cs), (gq, gs) = both(routed, x, ids, emap)
    np.testing.assert_array_equal(gq, cq, err_msg="codes")
    np.testing.assert_array_equal(gs, cs, err_msg="scales")
    r = routing_ops.routing_grouped(ids, emap, e)
    valid = int(np.asarray(r.expert_first_token_offset)[-1])
    assert np.all(cs[valid:] == 0) and np.all(cq[valid:] == 0)
    if valid:
        assert np.all(cs[:valid] > 0)

    perm, offsets, src = _inconsistent_grouping(rng, m, k)
    fn = lambda x, p, o, s: _codes_and_scales(act_ops.quantize_permuted(x, p, o, s, quant, group_k))
    (cq, cs), (gq, gs) = both(fn, x, perm, offsets, src)
    np.testing.assert_array_equal(gq, cq, err_msg="codes, metadata outside the invariant")
    np.testing.assert_array_equal(gs, cs, err_msg="scales, metadata outside the invariant")


@pytest.mark.parametrize("k", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("dtype,h", [(jnp.bfloat16, 64), (jnp.float16, 48), (jnp.bfloat16, 40), (jnp.float16, 37)])
def test_finalize_matches_cpu_and_writes_every_row(rng, dtype, h, k):
    """Each form of the finalize kernel (by k: 2 entries of 4 vectors a thread, 4 of 2, 8 of 1; by H:
    the most vectors that divide a row's 8-column vectors, 64: 8, 48: 6, 40: 5; 37: a thread a
    column), with out-of-range, padded and remote entries, against the CPU."""
    m, rows = 19, 60
    d = rng.standard_normal((rows, h)).astype(np.float32)
    src = rng.integers(-1, rows + 3, (m, k)).astype(np.int32)
    src[3] = -1  # a token with no valid entry
    d[rows - 1] = np.nan  # a row nothing points at
    src[src == rows - 1] = 0
    w = rng.random((m, k)).astype(np.float32)
    out = jnp.full((m, h), jnp.nan, dtype)
    c, g = both(lambda d, w, s, o: fin_ops.finalize(d, w, s, o), jnp.asarray(d, dtype), jnp.asarray(w),
                jnp.asarray(src), out)
    assert_close_16(g, c, dtype, "finalize")
    assert np.all(g[3] == 0.0)


# ------------------------------------------------------------------------------------------------
# Whole layers on the device: every scheme against the oracle, the output contract, graphs.
# ------------------------------------------------------------------------------------------------
def _on_gpu(layer):
    return jax.device_put((layer.x, layer.weights, layer.topk_weights, layer.topk_ids), GPU)


def _standard(cls):
    return lambda out, x, w, tw, ids: cls().apply(out, x, w, tw, ids)


@pytest.mark.parametrize("scheme", GEMM_SCHEMES)
@pytest.mark.parametrize("cls", STANDARD)
def test_layer_every_scheme_against_reference(rng, scheme, cls):
    layer = random_layer(rng, m=33, e=6, h=256, i=128, k=3, scheme=scheme, pad_frac=0.1, e_global=8)
    x, w, tw, ids = _on_gpu(layer)
    got = jax.jit(_standard(cls))(jax.device_put(nan_out(x.shape, x.dtype), GPU), x, w, tw, ids)
    quant = act_quant_params(layer.weights.act_key)
    want = moe_reference(layer.x, layer.w13, layer.w2, layer.topk_weights, layer.topk_ids,
                         input_quant=InputQuant(*quant) if quant else None)
    tol = layer_tolerance(x.dtype, quant)
    err = relative_error(got, want)
    assert err <= tol, f"{scheme}: relative error {err:.2e} > {tol:.1e}"


def test_batched_layer_against_reference(rng):
    e, t, h, i = 4, 40, 128, 128
    w = hj.quantize_moe_weights(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), rng.standard_normal((e, h, i)) / np.sqrt(i),
                                "w4a16-int4-g128")
    x = jnp.asarray(rng.standard_normal((e, t, h)), jnp.bfloat16)
    counts = jnp.asarray([0, 40, 17, 99], jnp.int32)
    f = jax.jit(lambda o, x, w, c: BatchedExperts().apply(o, x, w, None, None, expert_num_tokens=c))
    got = f(*jax.device_put((nan_out(x.shape, x.dtype), x, w, counts), GPU))
    w13, w2 = w.dequantize()
    want = batched_reference(x, w13, w2, jnp.clip(counts, 0, t))
    assert relative_error(got, want) < TOL[jnp.dtype(jnp.bfloat16)]
    assert np.all(np.asarray(got[0].astype(jnp.float32)) == 0.0)


@pytest.mark.parametrize("cls", STANDARD)
@pytest.mark.parametrize("scheme", ["bf16", "w4a16-int4-g128", "w8a8-fp8-block128"])
def test_donation_in_place_and_no_copy_on_gpu(rng, cls, scheme):
    layer = random_layer(rng, m=40, e=8, h=256, i=128, k=2, scheme=scheme)
    args = _on_gpu(layer)
    f = jax.jit(_standard(cls), donate_argnums=0)
    out = jax.device_put(nan_out(layer.x.shape, layer.x.dtype), GPU)
    assert_out_written_in_place(f.lower(out, *args).compile().as_text(), 0)
    ptr = out.unsafe_buffer_pointer()
    y = f(out, *args)
    assert y.unsafe_buffer_pointer() == ptr
    assert np.all(np.isfinite(np.asarray(y.astype(jnp.float32))))


@pytest.mark.parametrize("cls", STANDARD)
def test_nan_poisoned_out_fully_written_on_gpu(rng, cls):
    layer = random_layer(rng, m=64, e=8, h=128, i=64, k=2, e_global=16, pad_frac=0.3)
    ids = np.asarray(layer.topk_ids).copy()
    ids[::3] = -1  # tokens with no expert at all
    ids[1::3] = 8 + np.arange(2)  # tokens routed only to non-local experts
    x, w, tw, _ = _on_gpu(layer)
    y = jax.jit(_standard(cls))(jax.device_put(nan_out(x.shape, x.dtype), GPU), x, w, tw,
                                jax.device_put(jnp.asarray(ids), GPU))
    y = np.asarray(y.astype(jnp.float32))
    assert np.all(np.isfinite(y))
    assert np.all(y[::3] == 0.0) and np.all(y[1::3] == 0.0)


@pytest.mark.parametrize("cls", STANDARD + [BatchedExperts])
def test_zero_tokens(rng, cls):
    w = hj.quantize_moe_weights(rng.standard_normal((4, 64, 32)), rng.standard_normal((4, 32, 32)), "bf16")
    if cls is BatchedExperts:
        x = jnp.zeros((4, 0, 32), jnp.bfloat16)
        f = lambda o, x, w: cls().apply(o, x, w, None, None, expert_num_tokens=jnp.zeros((4,), jnp.int32))
        y = jax.jit(f)(*jax.device_put((x, x, w), GPU))
    else:
        x = jnp.zeros((0, 32), jnp.bfloat16)
        tw, ids = jnp.zeros((0, 2), jnp.float32), jnp.zeros((0, 2), jnp.int32)
        y = jax.jit(_standard(cls))(*jax.device_put((x, x, w, tw, ids), GPU))
    assert y.shape == x.shape


@pytest.mark.parametrize("cls", STANDARD)
def test_deterministic_at_larger_shapes(rng, cls):
    layer = random_layer(rng, m=512, e=32, h=256, i=128, k=4, scheme="w8a8-fp8-block128", pad_frac=0.05)
    args = _on_gpu(layer)
    f = jax.jit(_standard(cls))
    runs = [np.asarray(f(jax.device_put(nan_out(layer.x.shape, layer.x.dtype), GPU), *args).astype(jnp.float32))
            for _ in range(3)]
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])


@pytest.mark.parametrize("scheme", ["bf16", "w4a16-int4-g128"])
def test_command_buffers_give_the_same_results(tmp_path, scheme):
    results, _ = replay_both_ways(tmp_path, scheme=scheme, classes=("IndexedExperts", "GroupedExperts"), e=16, h=256,
                                  i=128, k=4, m=48, seed=7, extra_ids=4, w_scale=(16, 11), cpu=_STAND_IN)
    assert np.all(np.isfinite(results["graphs"]))
    np.testing.assert_array_equal(results["graphs"], results["plain"])
