"""convert_to_kernel_format against independent NumPy packers of each published layout.

Each packer below is written from the published format (not from humming_jax): it draws random
codes, scales and zero points, packs them as the format stores them, and computes the weight
values in float64 itself. The converted weights' ``dequantize()`` must equal those values, value
for value (rounded as the kernels round: to float32, then to the activation dtype for 16-bit
activation schemes).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import nan_out, random_routing

import humming_jax as hj
from humming_jax import schemas as sc
from humming_jax.quantize import SCHEMES
from humming_jax.reference import InputQuant, moe_reference, relative_error

E, H, I = 2, 256, 128  # w13: N = 2 I = 256, K = H; w2: N = H, K = I
SHAPES = {"w13": (2 * I, H), "w2": (H, I)}  # (N, K) of each projection
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# --- independent packers ----------------------------------------------------------------------
def pack_rows_low_first(codes: np.ndarray, bits: int) -> np.ndarray:
    """Packs unsigned codes [E, R, C] along R into int32 [E, R*bits/32, C]: word w holds codes
    w*pf .. w*pf+pf-1 in its bit fields 0, bits, 2 bits, ... (AutoGPTQ's loop)."""
    pf = 32 // bits
    e, r, c = codes.shape
    out = np.zeros((e, r // pf, c), np.uint64)
    for row in range(r // pf):
        for j in range(pf):
            out[:, row, :] |= codes[:, row * pf + j, :].astype(np.uint64) << np.uint64(bits * j)
    return out.astype(np.uint32).view(np.int32)


def pack_cols_low_first(codes: np.ndarray, bits: int) -> np.ndarray:
    """Packs unsigned codes [E, R, C] along C into int32 [E, R, C*bits/32]."""
    return np.ascontiguousarray(pack_rows_low_first(codes.transpose(0, 2, 1), bits).transpose(0, 2, 1))


def pack_awq(codes: np.ndarray) -> np.ndarray:
    """AutoAWQ: [E, R, N] 4-bit codes -> int32 [E, R, N/8], nibble i of word c holding column
    8c + AWQ_ORDER[i]."""
    e, r, n = codes.shape
    out = np.zeros((e, r, n // 8), np.uint32)
    for c in range(n // 8):
        for i in range(8):
            out[:, :, c] |= codes[:, :, 8 * c + AWQ_ORDER[i]].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def pack_fp4_bytes(codes: np.ndarray) -> np.ndarray:
    """Two e2m1 codes per byte along the last axis, the even index in the low nibble."""
    flat = codes.reshape(-1, 2)
    return (flat[:, 0] | (flat[:, 1] << 4)).astype(np.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2)


def e2m1_value(code: np.ndarray) -> np.ndarray:
    """e2m1 from its bits: sign bit 3; exponent bits 2..1 (bias 1); mantissa bit 0."""
    code = code.astype(np.int64)
    exp, man = (code >> 1) & 3, code & 1
    mag = np.where(exp == 0, 0.5 * man, np.exp2(exp - 1.0) * (1.0 + 0.5 * man))
    return np.where(code & 8, -mag, mag)


def rand_scales(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return (rng.uniform(0.5, 2.0, shape) * 0.01).astype(dtype)


def f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float32).astype(np.float64)


def expand(grid: np.ndarray, n: int, k: int, gn: int = 128, gk: int = 128) -> np.ndarray:
    """Grid [E, ceil(n/gn), ceil(k/gk)] (last blocks may be partial) -> [E, n, k]."""
    return np.repeat(np.repeat(grid, gn, axis=1), gk, axis=2)[:, :n, :k]


# Each maker returns ({name: tensor}, float64 values [E, N, K]) for one projection.
def make_gptq(rng, n, k, bits=4, group=128, sym=True, g_idx=False):
    g = k if group == -1 else group
    codes = rng.integers(0, 1 << bits, (E, k, n)).astype(np.uint32)  # [E, K, N]
    scales = rand_scales(rng, (E, k // g, n), np.float16)
    zero = np.full((E, k // g, n), 1 << (bits - 1)) if sym else rng.integers(1, (1 << bits) + 1, (E, k // g, n))
    tensors = {
        "qweight": pack_rows_low_first(codes, bits),
        "scales": scales,
        "qzeros": pack_cols_low_first((zero - 1).astype(np.uint32), bits),  # v1: zero - 1
    }
    if g_idx:
        tensors["g_idx"] = (np.arange(k) // g).astype(np.int32)
    vals = (codes.astype(np.float64) - np.repeat(zero, g, axis=1)) * np.repeat(f64(scales), g, axis=1)
    return tensors, vals.transpose(0, 2, 1)


def make_awq(rng, n, k, group=128, zero_point=True):
    codes = rng.integers(0, 16, (E, k, n)).astype(np.uint32)
    scales = rand_scales(rng, (E, k // group, n), np.float16)
    zero = rng.integers(0, 16, (E, k // group, n)) if zero_point else np.full((E, k // group, n), 8)
    tensors = {"qweight": pack_awq(codes), "scales": scales}
    if zero_point:
        tensors["qzeros"] = pack_awq(zero.astype(np.uint32))
    vals = (codes - np.repeat(zero, group, axis=1)) * np.repeat(f64(scales), group, axis=1)
    return tensors, vals.transpose(0, 2, 1)


def make_ct_int(rng, n, k, bits=4, group=128, sym=True, packed_zp=True):
    """compressed-tensors pack-quantized: signed codes + 2^(bits-1), packed along K."""
    g = k if group == -1 else group
    half = 1 << (bits - 1)
    q = rng.integers(-half, half, (E, n, k))
    scale = rand_scales(rng, (E, n, k // g), ml_dtypes.bfloat16)
    tensors = {
        "weight_packed": pack_cols_low_first((q + half).astype(np.uint32), bits),
        "weight_scale": scale,
        "weight_shape": np.array([n, k], np.int64),
    }
    zp = np.zeros((E, n, k // g), np.int64)
    if not sym:
        zp = rng.integers(-half, half, (E, n, k // g))
        if packed_zp:
            tensors["weight_zero_point"] = pack_rows_low_first((zp + half).astype(np.uint32), bits)
        else:
            tensors["weight_zero_point"] = zp.astype(np.int8)
    vals = (q - np.repeat(zp, g, axis=2)) * np.repeat(f64(scale), g, axis=2)
    return tensors, vals


def make_fp8(rng, n, k, kind="block", scale_name="weight_scale_inv"):
    w = (rng.standard_normal((E, n, k)) * 64).astype(ml_dtypes.float8_e4m3fn)
    if kind == "block":
        scale = rng.uniform(1e-3, 1e-2, (E, -(-n // 128), -(-k // 128))).astype(np.float32)
        full = expand(scale, n, k)
    elif kind == "channel":
        scale = rng.uniform(1e-3, 1e-2, (E, n, 1)).astype(np.float32)
        full = np.repeat(scale, k, axis=2)
    else:
        scale = rng.uniform(1e-3, 1e-2, (E,)).astype(np.float32)
        full = np.broadcast_to(scale[:, None, None], (E, n, k))
    return {"weight": w, scale_name: scale, "input_scale": np.ones((E,), np.float32)}, f64(w) * full.astype(np.float64)


def make_mxfp4(rng, n, k, prefix=""):
    codes = rng.integers(0, 16, (E, n, k)).astype(np.uint8)
    s = rng.integers(110, 140, (E, n, k // 32)).astype(np.uint8)
    blocks = pack_fp4_bytes(codes).reshape(E, n, k // 32, 16)
    vals = e2m1_value(codes) * np.repeat(np.exp2(s.astype(np.float64) - 127), 32, axis=2)
    return {prefix + "blocks": blocks, prefix + "scales": s}, vals


def make_nvfp4(rng, n, k):
    codes = rng.integers(0, 16, (E, n, k)).astype(np.uint8)
    scale = rng.uniform(0.1, 400, (E, n, k // 16)).astype(ml_dtypes.float8_e4m3fn)
    scale2 = rng.uniform(1e-4, 1e-3, (E,)).astype(np.float32)
    vals = e2m1_value(codes) * np.repeat(f64(scale), 16, axis=2) * f64(scale2)[:, None, None]
    tensors = {"weight": pack_fp4_bytes(codes), "weight_scale": scale, "weight_scale_2": scale2, "input_scale": scale2}
    return tensors, vals


def make_int8(rng, n, k, scale_shape="2d"):
    q = rng.integers(-128, 128, (E, n, k)).astype(np.int8)
    scale = rand_scales(rng, (E, n), ml_dtypes.bfloat16)
    vals = q.astype(np.float64) * f64(scale)[..., None]
    return {"weight": q, "weight_scale": scale if scale_shape == "2d" else scale[..., None]}, vals


def make_float(rng, n, k):
    w = rng.standard_normal((E, n, k)).astype(np.float32)
    return {"weight": w}, w.astype(np.float64)


def make_pair(maker, rng, **kw):
    (t13, v13), (t2, v2) = (maker(rng, *SHAPES[p], **kw) for p in ("w13", "w2"))
    return t13, t2, v13, v2


def kernel_values(vals: np.ndarray, dtype: Any) -> np.ndarray:
    """float64 values as the kernels hold them: float32, then the activation dtype (if any)."""
    v = vals.astype(np.float32)
    return v if dtype is None else v.astype(dtype).astype(np.float32)


def assert_values(weights: hj.MoEWeights, v13: np.ndarray, v2: np.ndarray, dtype: Any = ml_dtypes.bfloat16) -> None:
    got13, got2 = weights.dequantize()
    assert got13.shape == v13.shape and got2.shape == v2.shape
    np.testing.assert_array_equal(np.asarray(got13), kernel_values(v13, dtype))
    np.testing.assert_array_equal(np.asarray(got2), kernel_values(v2, dtype))


# --- value-for-value conversions --------------------------------------------------------------
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_dtype", [jnp.bfloat16, jnp.float16])
def test_gptq_int4(rng, sym, act_dtype):
    t13, t2, v13, v2 = make_pair(make_gptq, rng, sym=sym, g_idx=True)
    w = hj.convert_to_kernel_format(t13, t2, sc.GPTQ(4, 128, sym=sym), dtype=act_dtype)
    assert w.scheme == ("w4a16-int4-g128" if sym else "w4a16-uint4-zp-g128")
    assert w.weight_key == SCHEMES[w.scheme].weight_key and w.act_key is None
    assert (w.w13.zero is None) == sym
    assert_values(w, v13, v2, np.dtype(jnp.dtype(act_dtype).name) if act_dtype == jnp.float16 else ml_dtypes.bfloat16)


def test_gptq_v1_zero_of_16(rng):
    # A stored zero of 15 reads back as 16 (v1 stores zero - 1): codes 0..15 then give -16..-1.
    t13, t2, v13, v2 = make_pair(make_gptq, rng, sym=False)
    codes = rng.integers(0, 16, (E, H, 2 * I)).astype(np.uint32)
    scales = t13["scales"]
    t13["qweight"] = pack_rows_low_first(codes, 4)
    t13["qzeros"] = pack_cols_low_first(np.full((E, H // 128, 2 * I), 15, np.uint32), 4)
    v13 = ((codes - 16.0) * np.repeat(f64(scales), 128, axis=1)).transpose(0, 2, 1)
    assert_values(hj.convert_to_kernel_format(t13, t2, sc.GPTQ(4, 128, sym=False)), v13, v2)


@pytest.mark.parametrize("input_schema", [None, sc.Int8Dynamic()])
def test_gptq_int8_per_channel(rng, input_schema):
    t13, t2, v13, v2 = make_pair(make_gptq, rng, bits=8, group=-1, sym=True)
    w = hj.convert_to_kernel_format(t13, t2, sc.GPTQ(8, -1), input_schema)
    assert w.scheme == ("w8a16-int8-channel" if input_schema is None else "w8a8-int8-channel")
    assert w.w13.data.dtype == jnp.int8
    assert_values(w, v13, v2, None if input_schema else ml_dtypes.bfloat16)


@pytest.mark.parametrize("zero_point", [True, False])
def test_awq_nibble_order(rng, zero_point):
    t13, t2, v13, v2 = make_pair(make_awq, rng, zero_point=zero_point)
    w = hj.convert_to_kernel_format(t13, t2, sc.AWQ(4, 128, zero_point=zero_point))
    assert w.scheme == ("w4a16-uint4-zp-g128" if zero_point else "w4a16-int4-g128")
    assert_values(w, v13, v2)


def test_awq_single_nibble_lands_on_its_column(rng):
    # Nibble i of a word holds logical column AWQ_ORDER[i] of its group of 8: set one at a time.
    t13, t2, _, _ = make_pair(make_awq, rng, zero_point=False)
    t13["scales"] = np.ones_like(t13["scales"])
    for i, col in enumerate(AWQ_ORDER):
        qweight = np.zeros((E, H, 2 * I // 8), np.uint32)
        qweight[0, 5, 0] = np.uint32(0xF) << np.uint32(4 * i)
        w = hj.convert_to_kernel_format({**t13, "qweight": qweight.view(np.int32)}, t2, sc.AWQ(zero_point=False))
        got = np.asarray(w.dequantize()[0])[0, :8, 5]  # output columns 0..7 at input row k = 5
        want = np.full(8, -8.0)
        want[col] = 7.0
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("sym,packed_zp", [(True, True), (False, True), (False, False)])
def test_compressed_tensors_int4(rng, sym, packed_zp):
    t13, t2, v13, v2 = make_pair(make_ct_int, rng, sym=sym, packed_zp=packed_zp)
    w = hj.convert_to_kernel_format(t13, t2, sc.GPTQ(4, 128, sym=sym))
    assert w.scheme == ("w4a16-int4-g128" if sym else "w4a16-uint4-zp-g128")
    assert_values(w, v13, v2)


@pytest.mark.parametrize("schema", [sc.Int8(), sc.GPTQ(8, -1)])
def test_compressed_tensors_int8_packed(rng, schema):
    t13, t2, v13, v2 = make_pair(make_ct_int, rng, bits=8, group=-1)
    w = hj.convert_to_kernel_format(t13, t2, schema, sc.Int8Dynamic())
    assert w.scheme == "w8a8-int8-channel"
    assert_values(w, v13, v2, None)


@pytest.mark.parametrize("scale_shape", ["2d", "3d"])
def test_int8_per_channel(rng, scale_shape):
    t13, t2, v13, v2 = make_pair(make_int8, rng, scale_shape=scale_shape)
    assert_values(hj.convert_to_kernel_format(t13, t2, sc.Int8()), v13, v2)


@pytest.mark.parametrize("input_schema", [None, sc.FP8Dynamic(128)])
@pytest.mark.parametrize("scale_name", ["weight_scale_inv", "weight_scale"])
def test_fp8_block(rng, input_schema, scale_name):
    t13, t2, v13, v2 = make_pair(make_fp8, rng, kind="block", scale_name=scale_name)
    w = hj.convert_to_kernel_format(t13, t2, sc.FP8(block=(128, 128)), input_schema)
    assert w.scheme == ("w8a16-fp8-block128" if input_schema is None else "w8a8-fp8-block128")
    assert (w.w13.group_n, w.w13.group_k) == (128, 128)
    assert_values(w, v13, v2, None if input_schema else ml_dtypes.bfloat16)


def test_fp8_block_partial_blocks(rng):
    # Non-gated I = 192: grids of ceil(192 / 128) = 2 blocks, the last one partial.
    i = 192
    (t13, v13), (t2, v2) = make_fp8(rng, i, H), make_fp8(rng, H, i)
    w = hj.convert_to_kernel_format(t13, t2, sc.FP8(block=(128, 128)), activation="silu_no_mul")
    assert w.w13.scale.shape == (E, 2, 2) and w.w2.scale.shape == (E, 2, 2)
    assert_values(w, v13, v2)


@pytest.mark.parametrize("kind", ["channel", "tensor"])
def test_fp8_channel_and_tensor(rng, kind):
    t13, t2, v13, v2 = make_pair(make_fp8, rng, kind=kind, scale_name="weight_scale")
    schema = sc.FP8(per_tensor=kind == "tensor")
    w = hj.convert_to_kernel_format(t13, t2, schema, sc.FP8Dynamic())
    assert w.scheme == f"w8a8-fp8-{kind}"
    assert_values(w, v13, v2, None)


def test_mxfp4_gpt_oss_names(rng):
    (t13, v13), (t2, v2) = make_mxfp4(rng, 2 * I, H, "gate_up_proj_"), make_mxfp4(rng, H, I, "down_proj_")
    t13["gate_up_proj_bias"] = rng.standard_normal((E, 2 * I)).astype(ml_dtypes.bfloat16)
    w = hj.convert_to_kernel_format(t13, t2, sc.MXFP4(), activation="swigluoai")
    assert w.scheme == "w4a16-mxfp4" and w.b2 is None
    np.testing.assert_array_equal(np.asarray(w.b13), t13["gate_up_proj_bias"].astype(np.float32))
    assert_values(w, v13, v2)
    w8 = hj.convert_to_kernel_format(t13, t2, sc.MXFP4(), sc.FP8Dynamic(), activation="swigluoai")
    assert w8.scheme == "w4a8-mxfp4-fp8"
    assert_values(w8, v13, v2, None)


def test_nvfp4(rng):
    t13, t2, v13, v2 = make_pair(make_nvfp4, rng)
    w = hj.convert_to_kernel_format(t13, t2, sc.NVFP4())
    assert w.scheme == "w4a16-nvfp4"
    assert_values(w, v13, v2)
    # ModelOpt keeps one weight_scale_2 per shard (gate, up); equal ones are accepted.
    t13 = {**t13, "weight_scale_2": np.repeat(t13["weight_scale_2"][:, None], 2, axis=1)}
    assert_values(hj.convert_to_kernel_format(t13, t2, sc.NVFP4()), v13, v2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_unquantized(rng, dtype):
    t13, t2, v13, v2 = make_pair(make_float, rng)
    w = hj.convert_to_kernel_format(t13, t2, sc.Unquantized(dtype))
    assert w.scheme == ("bf16" if dtype == jnp.bfloat16 else "fp16") and w.dtype == jnp.dtype(dtype)
    assert_values(w, v13, v2, ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16)


def test_jax_arrays_accepted(rng):
    t13, t2, v13, v2 = make_pair(make_nvfp4, rng)
    as_jax = lambda t: {k: jnp.asarray(v) for k, v in t.items()}  # noqa: E731
    assert_values(hj.convert_to_kernel_format(as_jax(t13), as_jax(t2), sc.NVFP4()), v13, v2)


# --- converted weights run on the kernels -----------------------------------------------------
@pytest.mark.parametrize(
    "maker,schema,input_schema,kw",
    [
        (make_gptq, sc.GPTQ(4, 128, sym=False), None, {"sym": False}),
        (make_awq, sc.AWQ(), None, {}),
        (make_fp8, sc.FP8(block=(128, 128)), sc.FP8Dynamic(128), {}),
        (make_nvfp4, sc.NVFP4(), None, {}),
    ],
    ids=["gptq", "awq", "fp8-block", "nvfp4"],
)
def test_converted_weights_run(rng, maker, schema, input_schema, kw):
    t13, t2, _, _ = make_pair(maker, rng, **kw)
    weights = hj.convert_to_kernel_format(t13, t2, schema, input_schema)
    w13, w2 = weights.dequantize()
    # Scale the layer so activations stay O(1) whatever the checkpoint's magnitudes.
    x = rng.standard_normal((12, H)) / (np.sqrt(H) * float(jnp.std(w13)))
    x = jnp.asarray(x, jnp.bfloat16)
    tw, ids = random_routing(rng, 12, 2, E)
    got = jax.jit(lambda o, x, w, tw, ids: hj.fused_moe(x, w, tw, ids, out=o))(nan_out(x.shape, x.dtype), x, weights, tw, ids)
    quant = None if input_schema is None else InputQuant("fp8", 128)
    want = moe_reference(x, w13, w2, tw, ids, input_quant=quant)
    assert np.all(np.isfinite(np.asarray(got.astype(jnp.float32))))
    assert relative_error(got, want) < (3e-2 if quant else 1.2e-2)


# --- schemas ----------------------------------------------------------------------------------
def test_schema_keys():
    assert sc.Unquantized().quant_key() == SCHEMES["bf16"].weight_key
    assert sc.Unquantized(jnp.float16).quant_key() == SCHEMES["fp16"].weight_key
    assert sc.GPTQ(4, 128).quant_key() == SCHEMES["w4a16-int4-g128"].weight_key
    assert sc.GPTQ(4, 128, sym=False).quant_key() == SCHEMES["w4a16-uint4-zp-g128"].weight_key
    assert sc.AWQ(4, 128).quant_key() == SCHEMES["w4a16-uint4-zp-g128"].weight_key
    assert sc.GPTQ(8, -1).quant_key() == sc.Int8().quant_key() == SCHEMES["w8a16-int8-channel"].weight_key
    assert sc.FP8(block=(128, 128)).quant_key() == SCHEMES["w8a8-fp8-block128"].weight_key
    assert sc.FP8().quant_key() == SCHEMES["w8a8-fp8-channel"].weight_key
    assert sc.FP8(per_tensor=True).quant_key() == SCHEMES["w8a8-fp8-tensor"].weight_key
    assert sc.MXFP4().quant_key() == SCHEMES["w4a16-mxfp4"].weight_key
    assert sc.NVFP4().quant_key() == SCHEMES["w4a16-nvfp4"].weight_key
    assert sc.NoInputQuant().quant_key() is None
    assert sc.FP8Dynamic().quant_key() == SCHEMES["w8a8-fp8-channel"].act_key
    assert sc.FP8Dynamic(128).quant_key() == SCHEMES["w8a8-fp8-block128"].act_key
    assert sc.Int8Dynamic().quant_key() == SCHEMES["w8a8-int8-channel"].act_key


def test_every_scheme_is_reachable_from_schemas():
    weights = [sc.Unquantized(), sc.Unquantized(jnp.float16), sc.GPTQ(), sc.GPTQ(sym=False), sc.Int8(),
               sc.FP8(block=(128, 128)), sc.FP8(), sc.FP8(per_tensor=True), sc.MXFP4(), sc.NVFP4()]
    inputs = [None, sc.FP8Dynamic(), sc.FP8Dynamic(128), sc.Int8Dynamic()]
    reached = set()
    for w in weights:
        for a in inputs:
            try:
                reached.add(sc.resolve_scheme(w, a))
            except ValueError:
                pass
    assert reached == set(SCHEMES)


@pytest.mark.parametrize(
    "weight_schema,input_schema",
    [
        (sc.GPTQ(4, 128), sc.FP8Dynamic()),
        (sc.GPTQ(4, 64), None),
        (sc.AWQ(4, 32), None),
        (sc.FP8(block=(128, 128)), sc.FP8Dynamic()),
        (sc.FP8(), None),
        (sc.NVFP4(), sc.FP8Dynamic()),
        (sc.Int8(per_channel=False), None),
        (sc.MXFP4(), sc.FP8Dynamic(64)),
        (sc.Unquantized(), sc.Int8Dynamic()),
    ],
)
def test_unsupported_pairs_name_the_pair_and_list_supported(weight_schema, input_schema):
    with pytest.raises(ValueError) as err:
        hj.convert_to_kernel_format({}, {}, weight_schema, input_schema)
    msg = str(err.value)
    assert "unsupported quantization pair" in msg and repr(weight_schema) in msg
    assert all(name in msg for name in SCHEMES), "the message must list every supported pair"


@pytest.mark.parametrize(
    "make,err",
    [
        (lambda: sc.GPTQ(4, 128, desc_act=True), "desc_act"),
        (lambda: sc.GPTQ(3, 128), "bits"),
        (lambda: sc.GPTQ(8, 128, sym=False), "zero points"),
        (lambda: sc.GPTQ(4, 0), "group_size"),
        (lambda: sc.AWQ(8), "4-bit"),
        (lambda: sc.FP8(block=(128, 128), per_tensor=True), "exclude"),
        (lambda: sc.Unquantized(jnp.float32), "bfloat16 or float16"),
        (lambda: sc.FP8Dynamic(0), "group_size"),
    ],
)
def test_invalid_schemas(make, err):
    with pytest.raises(ValueError, match=err):
        make()


def test_not_a_schema():
    with pytest.raises(TypeError, match="weight_schema"):
        hj.convert_to_kernel_format({}, {}, "gptq")
    with pytest.raises(TypeError, match="input_schema"):
        hj.convert_to_kernel_format({}, {}, sc.GPTQ(), "fp8")


# --- checkpoint errors ------------------------------------------------------------------------
def _gptq_pair(rng, **kw):
    return make_pair(make_gptq, rng, **kw)[:2]


def test_missing_tensor_is_named(rng):
    t13, t2 = _gptq_pair(rng, sym=False)
    del t2["qzeros"]
    with pytest.raises(ValueError, match=r"w2: missing tensor 'qzeros'"):
        hj.convert_to_kernel_format(t13, t2, sc.GPTQ(4, 128, sym=False))
    t13, t2, _, _ = make_pair(make_nvfp4, rng)
    del t13["weight_scale_2"]
    with pytest.raises(ValueError, match=r"w13: missing tensor 'weight_scale_2'"):
        hj.convert_to_kernel_format(t13, t2, sc.NVFP4())
    t13, t2, _, _ = make_pair(make_fp8, rng)
    del t13["weight_scale_inv"]
    with pytest.raises(ValueError, match=r"w13: missing tensor 'weight_scale_inv'"):
        hj.convert_to_kernel_format(t13, t2, sc.FP8(block=(128, 128)))


@pytest.mark.parametrize(
    "maker,schema,tensor,bad",
    [
        (make_gptq, sc.GPTQ(), "qweight", lambda a: a.astype(np.float32)),
        (make_gptq, sc.GPTQ(), "qweight", lambda a: a.astype(np.int64)),
        (make_gptq, sc.GPTQ(), "scales", lambda a: a.astype(np.int32)),
        (make_awq, sc.AWQ(), "qzeros", lambda a: a.view(np.uint8)),
        (make_fp8, sc.FP8(block=(128, 128)), "weight", lambda a: a.view(np.uint8)),
        (make_mxfp4, sc.MXFP4(), "blocks", lambda a: a.view(np.int8)),
        (make_nvfp4, sc.NVFP4(), "weight_scale", lambda a: a.astype(np.float32)),
        (make_nvfp4, sc.NVFP4(), "weight_scale_2", lambda a: a.astype(np.float64)),
        (make_int8, sc.Int8(), "weight", lambda a: a.astype(np.int16)),
        (make_ct_int, sc.GPTQ(), "weight_packed", lambda a: a.view(np.float32)),
    ],
)
def test_wrong_dtypes(rng, maker, schema, tensor, bad):
    t13, t2, _, _ = make_pair(maker, rng)
    t2[tensor] = bad(t2[tensor])
    with pytest.raises(TypeError, match=rf"w2: tensor '{tensor}' must be"):
        hj.convert_to_kernel_format(t13, t2, schema)


@pytest.mark.parametrize(
    "maker,schema,tensor,bad",
    [
        (make_gptq, sc.GPTQ(), "scales", lambda a: a[..., :-1]),
        (make_gptq, sc.GPTQ(sym=False), "qzeros", lambda a: a[..., :-1]),
        (make_awq, sc.AWQ(), "scales", lambda a: a[..., :-8]),
        (make_fp8, sc.FP8(block=(128, 128)), "weight_scale_inv", lambda a: a[:, :1]),
        (make_mxfp4, sc.MXFP4(), "scales", lambda a: a[..., :-1]),
        (make_nvfp4, sc.NVFP4(), "weight_scale", lambda a: a[:, :-1]),
        (make_nvfp4, sc.NVFP4(), "weight_scale_2", lambda a: a[:1]),
        (make_int8, sc.Int8(), "weight_scale", lambda a: a[:, :-1]),
        (make_ct_int, sc.GPTQ(), "weight_scale", lambda a: a[:, :-1]),
    ],
)
def test_wrong_scale_shapes(rng, maker, schema, tensor, bad):
    t13, t2, _, _ = make_pair(maker, rng)
    t2[tensor] = bad(t2[tensor])
    with pytest.raises(ValueError, match=rf"w2: tensor '{tensor}' must have shape"):
        hj.convert_to_kernel_format(t13, t2, schema)


def test_fp8_scale_granularity_hints(rng):
    t13, t2, _, _ = make_pair(make_fp8, rng, kind="tensor", scale_name="weight_scale")
    with pytest.raises(ValueError, match="per_tensor=True"):
        hj.convert_to_kernel_format(t13, t2, sc.FP8(), sc.FP8Dynamic())
    t13, t2, _, _ = make_pair(make_fp8, rng, kind="channel", scale_name="weight_scale")
    with pytest.raises(ValueError, match="per-tensor"):
        hj.convert_to_kernel_format(t13, t2, sc.FP8(per_tensor=True), sc.FP8Dynamic())


def test_misaligned_k_for_group(rng):
    # GPTQ: K = 192 (24 int32 rows of 8 codes) is not a multiple of 128.
    t13, _ = _gptq_pair(rng)
    (t2, _) = make_gptq(rng, H, 256)
    t2 = {"qweight": t2["qweight"][:, :24], "scales": t2["scales"][:, :1]}
    with pytest.raises(ValueError, match=r"w2: K = 192 .* not a multiple of the group size 128"):
        hj.convert_to_kernel_format(t13, t2, sc.GPTQ(4, 128))
    # AWQ: K = 200 rows.
    t13, t2, _, _ = make_pair(make_awq, rng)
    t2 = {**t2, "qweight": np.zeros((E, 200, H // 8), np.int32)}
    with pytest.raises(ValueError, match=r"w2: K = 200 .* group size 128"):
        hj.convert_to_kernel_format(t13, t2, sc.AWQ())
    # NVFP4: K = 2 * 12 = 24 is not a multiple of 16.
    t13, t2, _, _ = make_pair(make_nvfp4, rng)
    t2 = {**t2, "weight": t2["weight"][..., :12]}
    with pytest.raises(ValueError, match=r"w2: K = 24 .* group size 16"):
        hj.convert_to_kernel_format(t13, t2, sc.NVFP4())
    # compressed-tensors: weight_shape says K = 160.
    t13, t2, _, _ = make_pair(make_ct_int, rng)
    t13 = {**t13, "weight_packed": t13["weight_packed"][..., :20], "weight_shape": np.array([2 * I, 160])}
    with pytest.raises(ValueError, match=r"w13: K = 160 .* group size 128"):
        hj.convert_to_kernel_format(t13, t2, sc.GPTQ())


def test_misaligned_n(rng):
    # GPTQ zero points pack 8 per int32 along N: N = 12 cannot be packed.
    tensors, _ = make_gptq(rng, 16, 128, sym=False)
    tensors["qweight"] = tensors["qweight"][..., :12]
    tensors["scales"] = tensors["scales"][..., :12]
    with pytest.raises(ValueError, match=r"N = 12 is not a multiple of 8"):
        hj.convert_to_kernel_format(tensors, tensors, sc.GPTQ(4, 128, sym=False))
    # FP8 block: I = 192 means a 128-row block straddles gate and up in w13.
    (t13, _), (t2, _) = make_fp8(rng, 2 * 192, H), make_fp8(rng, H, 192)
    with pytest.raises(ValueError, match="straddle the gate and up"):
        hj.convert_to_kernel_format(t13, t2, sc.FP8(block=(128, 128)))


def test_activation_groups_must_divide_k(rng):
    # Partial 128-blocks are fine for 16-bit activations, not for 128-wide activation groups.
    (t13, _), (t2, _) = make_fp8(rng, 192, H), make_fp8(rng, H, 192)
    hj.convert_to_kernel_format(t13, t2, sc.FP8(block=(128, 128)), activation="silu_no_mul")
    with pytest.raises(ValueError, match=r"groups of 128 along K, but I = 192"):
        hj.convert_to_kernel_format(t13, t2, sc.FP8(block=(128, 128)), sc.FP8Dynamic(128), activation="silu_no_mul")


def test_g_idx_reordering_rejected(rng):
    t13, t2 = _gptq_pair(rng, g_idx=True)
    t13["g_idx"] = rng.permutation(t13["g_idx"])  # K = 256: two groups to mix
    with pytest.raises(ValueError, match=r"w13: tensor 'g_idx' reorders input channels"):
        hj.convert_to_kernel_format(t13, t2, sc.GPTQ())


def test_zero_points_contradicting_schema(rng):
    t13, t2 = _gptq_pair(rng, sym=False)
    with pytest.raises(ValueError, match="sym=False"):
        hj.convert_to_kernel_format(t13, t2, sc.GPTQ(4, 128, sym=True))
    t13, t2, _, _ = make_pair(make_awq, rng)
    with pytest.raises(ValueError, match="zero_point=False"):
        hj.convert_to_kernel_format(t13, t2, sc.AWQ(zero_point=False))


def test_projection_mismatch(rng):
    t13, t2, _, _ = make_pair(make_int8, rng)
    with pytest.raises(ValueError, match="needs N1 = I"):
        hj.convert_to_kernel_format(t13, t2, sc.Int8(), activation="relu2_no_mul")
    with pytest.raises(ValueError, match="does not match w13"):
        hj.convert_to_kernel_format(t13, make_int8(rng, H + 16, I)[0], sc.Int8())
    with pytest.raises(ValueError, match="unknown activation"):
        hj.convert_to_kernel_format(t13, t2, sc.Int8(), activation="swish")


def test_other_input_errors(rng):
    t13, t2, _, _ = make_pair(make_mxfp4, rng)
    with pytest.raises(TypeError, match="w13 must be a dict"):
        hj.convert_to_kernel_format([t13], t2, sc.MXFP4())
    with pytest.raises(ValueError, match="NaN code 255"):
        hj.convert_to_kernel_format({**t13, "scales": np.full_like(t13["scales"], 255)}, t2, sc.MXFP4())
    with pytest.raises(ValueError, match="activation dtype"):
        hj.convert_to_kernel_format(t13, t2, sc.MXFP4(), dtype=jnp.float32)
    with pytest.raises(ValueError, match="differs from the Unquantized"):
        hj.convert_to_kernel_format(*make_pair(make_float, rng)[:2], sc.Unquantized(), dtype=jnp.float16)
    t13, t2, _, _ = make_pair(make_nvfp4, rng)
    t13["weight_scale_2"] = np.stack([t13["weight_scale_2"], 2 * t13["weight_scale_2"]], axis=1)
    with pytest.raises(ValueError, match="differs between the gate and up"):
        hj.convert_to_kernel_format(t13, t2, sc.NVFP4())
