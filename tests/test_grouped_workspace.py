"""The grouped GEMM's workspace result (SPEC §7, workspace as a result): requested by the wrapper
with the documented bound, hidden from callers, validated by the handlers. Runs on the CPU
(the CUDA prefill kernel that uses the workspace is checked in test_cuda_fast_paths.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, cuda_constant

from humming_jax import _ffi
from humming_jax._abi import WeightType
from humming_jax.ops import gemm as gemm_ops
from humming_jax.ops import routing as routing_ops
from humming_jax.weights import PackedWeight

# The 4-bit persistent kernel's split area (cuda_ffi/gemm_prefill_sm90_4bit.cu, kSplitBytes): 1152
# bytes of flags (66 x 4 words, 128-byte aligned) and 66 slots of 512 x 64 float32.
_RS4_SPLIT = 1152 + 66 * 512 * 64 * 4


def _problem(rng, e=4, n=16, k=32, m=10, topk=2):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(e, topk, replace=False) for _ in range(m)]).astype(np.int32))
    emap = jnp.arange(e, dtype=jnp.int32)
    w = PackedWeight(jnp.asarray(rng.standard_normal((e, n, k)) / np.sqrt(k), jnp.bfloat16), wtype=WeightType.FLOAT, k=k)
    r = routing_ops.routing_grouped(ids, emap, e)
    a = routing_ops.permute_rows(x, r, topk)
    return a, w, r.expert_first_token_offset


def test_bound_grows_with_experts():
    assert gemm_ops.grouped_workspace_bytes(0) == gemm_ops.GROUPED_WORKSPACE_BASE
    assert gemm_ops.grouped_workspace_bytes(128) == 256 * 1024 + 256 * 128


def test_bound_matches_the_cuda_header():
    """The CUDA handler checks its need against the same bound the wrapper requests."""
    text = (ROOT / "cuda_ffi" / "gemm_prefill_sm90.h").read_text()
    base = re.search(r"kWorkspaceBase = size_t\((\d+)\) << (\d+);", text)
    per = re.search(r"kWorkspacePerExpert = (\d+);", text)
    assert base and per, "bound constants not found in gemm_prefill_sm90.h"
    assert int(base.group(1)) << int(base.group(2)) == gemm_ops.GROUPED_WORKSPACE_BASE
    assert int(per.group(1)) == gemm_ops.GROUPED_WORKSPACE_PER_EXPERT


def test_wrapper_returns_c_only_and_the_call_has_the_workspace(rng):
    a, w, off = _problem(rng)
    f = jax.jit(lambda a, w, off: gemm_ops.gemm_grouped(a, None, w, None, off, out_dtype=jnp.bfloat16))
    c = f(a, w, off)
    assert c.shape == (a.shape[0], w.n) and c.dtype == jnp.bfloat16
    want = np.einsum("rk,rnk->rn", np.asarray(a, np.float32), np.asarray(w.data, np.float32)[_experts(off, a.shape[0])])
    np.testing.assert_allclose(np.asarray(c, np.float32), want, rtol=2e-2, atol=2e-2)
    hlo = f.lower(a, w, off).as_text()
    call = next(line for line in hlo.splitlines() if "humming_jax.gemm_grouped" in line)
    size = gemm_ops.grouped_workspace_bytes(w.num_experts)
    assert f"(tensor<{a.shape[0]}x{w.n}xbf16>, tensor<{size}xui8>)" in call, call


def _int4(rng, e, n, k, group_k=128):
    codes = jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8)
    scale = jnp.asarray(rng.random((e, n, max(1, k // group_k))), jnp.bfloat16)
    return PackedWeight(codes, scale, wtype=WeightType.UINT4, k=k, group_n=1, group_k=group_k)


def test_dequant_buffer_is_sized_by_the_budget(rng, monkeypatch):
    """Prefill-sized calls with quantized weights and 16-bit activations get a buffer of whole
    experts (at least one, at most E) within $HUMMING_JAX_DEQUANT_WORKSPACE_MB; every other call
    gets none. (int4 with bf16 scales and activations takes this path with
    HUMMING_JAX_PREFILL_MIXED=0 only.)"""
    monkeypatch.delenv(gemm_ops.ENV_DEQUANT_WORKSPACE_MB, raising=False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIXED, "0")
    e, n, k = 8, 384, 512
    w = _int4(rng, e, n, k)
    per = n * k * 2
    rows = gemm_ops.DEQUANT_MIN_ROWS_PER_EXPERT_4BIT * e  # 4-bit codes
    assert gemm_ops.dequant_min_rows_per_expert(w) == gemm_ops.DEQUANT_MIN_ROWS_PER_EXPERT_4BIT
    assert gemm_ops.dequant_buffer_bytes(rows, w, jnp.bfloat16, False) == 128 + e * per  # all fit in 512 MiB
    assert gemm_ops.dequant_buffer_bytes(rows - 1, w, jnp.bfloat16, False) == 0  # the decode kernel's
    assert gemm_ops.dequant_buffer_bytes(rows, w, jnp.bfloat16, True) == 0  # 8-bit activations
    assert gemm_ops.dequant_buffer_bytes(rows, w, jnp.float32, False) == 0
    assert gemm_ops.dequant_buffer_bytes(rows, _int4(rng, e, n, 12, group_k=12), jnp.bfloat16, False) == 0
    bf16 = PackedWeight(jnp.zeros((e, n, k), jnp.bfloat16), wtype=WeightType.FLOAT, k=k)
    assert gemm_ops.dequant_buffer_bytes(rows, bf16, jnp.bfloat16, False) == 0
    monkeypatch.setenv(gemm_ops.ENV_DEQUANT_WORKSPACE_MB, "1")
    assert gemm_ops.dequant_buffer_bytes(rows, w, jnp.bfloat16, False) == 128 + 2 * per
    monkeypatch.setenv(gemm_ops.ENV_DEQUANT_WORKSPACE_MB, "0")
    assert gemm_ops.dequant_buffer_bytes(rows, w, jnp.bfloat16, False) == 0
    monkeypatch.setenv(gemm_ops.ENV_DEQUANT_WORKSPACE_MB, "lots")
    with pytest.raises(ValueError, match="HUMMING_JAX_DEQUANT_WORKSPACE_MB"):
        gemm_ops.dequant_buffer_bytes(rows, w, jnp.bfloat16, False)


def test_mixed_input_calls_request_the_transposed_scales_instead(rng, monkeypatch):
    """uint4 codes without zero points, bf16 scales per 1 x group_k (whole 64-k tiles or spanning
    K) and bf16 activations from 32 rows per expert: the mixed-input kernel's transposed scales
    (2 bytes per scale) and no dequantization buffer; HUMMING_JAX_PREFILL_MIXED=0 swaps the two."""
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_MIXED, raising=False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_U4RS, "0")  # the CUTLASS kinds at every size
    e, n, k = 8, 384, 512
    w = _int4(rng, e, n, k)
    rows = gemm_ops.DEQUANT_MIN_ROWS_PER_EXPERT * e
    assert gemm_ops.mixed_prefill(rows, w, jnp.bfloat16, False)
    assert gemm_ops.mixed_scale_bytes(rows, w, jnp.bfloat16, False) == e * n * (k // 128) * 2
    assert gemm_ops.dequant_buffer_bytes(rows, w, jnp.bfloat16, False) == 0
    spanning = _int4(rng, e, n, 160, group_k=160)  # one group spanning K
    assert gemm_ops.mixed_scale_bytes(rows, spanning, jnp.bfloat16, False) == e * n * 2
    declined = {
        "too few rows": (gemm_ops.MIN_ROWS_PER_EXPERT * e - 1, w, jnp.bfloat16),
        "fp16 activations": (rows, w, jnp.float16),
        "fp16 scales": (rows, PackedWeight(w.data, w.scale.astype(jnp.float16), wtype=WeightType.UINT4, k=k,
                                           group_k=128), jnp.bfloat16),
        "zero points": (rows, PackedWeight(w.data, w.scale, jnp.zeros(w.scale.shape, jnp.uint8),
                                           wtype=WeightType.UINT4, k=k, group_k=128), jnp.bfloat16),
        "scale2": (rows, PackedWeight(w.data, w.scale, None, jnp.ones((e,), jnp.float32), wtype=WeightType.UINT4,
                                      k=k, group_k=128), jnp.bfloat16),
        "32-k groups": (rows, _int4(rng, e, n, k, group_k=32), jnp.bfloat16),
        "K not a multiple of 32": (rows, _int4(rng, e, n, 144, group_k=144), jnp.bfloat16),
        "N not a multiple of 8": (rows, _int4(rng, e, 20, k), jnp.bfloat16),
    }
    for what, (r, wd, dtype) in declined.items():
        assert not gemm_ops.mixed_prefill(r, wd, dtype, False), what
        assert gemm_ops.mixed_scale_bytes(r, wd, dtype, False) == 0, what
    assert not gemm_ops.mixed_prefill(rows, w, jnp.bfloat16, True)  # 8-bit activations
    small = gemm_ops.MIN_ROWS_PER_EXPERT * e  # below the dequantizing path: the 64-token tiles
    assert gemm_ops.mixed_prefill(small, w, jnp.bfloat16, False)
    assert gemm_ops.mixed_scale_bytes(small, w, jnp.bfloat16, False) == e * n * (k // 128) * 2
    assert gemm_ops.dequant_buffer_bytes(small, w, jnp.bfloat16, False) == 0
    big = 4096 * e  # no upper bound: the 256-token tiles beat dequantizing at 1024-4096 rows per expert
    assert gemm_ops.mixed_prefill(big, w, jnp.bfloat16, False)
    assert gemm_ops.dequant_buffer_bytes(big, w, jnp.bfloat16, False) == 0
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIXED, "0")
    assert not gemm_ops.mixed_prefill(rows, w, jnp.bfloat16, False)
    assert gemm_ops.mixed_scale_bytes(rows, w, jnp.bfloat16, False) == 0
    assert gemm_ops.dequant_buffer_bytes(rows, w, jnp.bfloat16, False) == 0  # the decode kernel's below 128
    assert gemm_ops.dequant_buffer_bytes(big, w, jnp.bfloat16, False) == 128 + e * n * k * 2


def test_mixed_input_constants_match_the_cuda_sources():
    assert cuda_constant("gemm_prefill_sm90.h", "kMixedTileK") == gemm_ops.MIXED_TILE_K
    assert cuda_constant("gemm_prefill_sm90.h", "kMaxExperts") == gemm_ops._MAX_EXPERTS


def test_min_rows_match_the_cuda_sources():
    assert cuda_constant("gemm_prefill_sm90.h", "kMinRowsPerExpert") == gemm_ops.MIN_ROWS_PER_EXPERT
    assert cuda_constant("gemm_prefill_sm90.h", "kRs4MinRowsPerExpert") == gemm_ops.RS4_MIN_ROWS_PER_EXPERT
    assert gemm_ops.RS4_MIN_ROWS_PER_EXPERT < gemm_ops.MIN_ROWS_PER_EXPERT
    # One number per code width: where the decode kernel stops taking codes, the dequantizing path starts.
    assert cuda_constant("gemm_decode_sm90.cu", "kMaxRowsPerExpertQuantGrouped") == gemm_ops.DEQUANT_MIN_ROWS_PER_EXPERT
    assert cuda_constant("gemm_decode_sm90.cu", "kMaxRowsPerExpertQuant4Grouped") == gemm_ops.DEQUANT_MIN_ROWS_PER_EXPERT_4BIT


def test_dequant_threshold_by_code_width_and_its_override(rng, monkeypatch):
    monkeypatch.delenv(gemm_ops.ENV_QUANT_DECODE_ROWS, raising=False)
    int4 = _int4(rng, 2, 16, 256)
    int8 = PackedWeight(jnp.zeros((2, 16, 256), jnp.int8), jnp.ones((2, 16, 1), jnp.float32), wtype=WeightType.INT8,
                        k=256, group_k=256)
    assert gemm_ops.dequant_min_rows_per_expert(int4) == gemm_ops.DEQUANT_MIN_ROWS_PER_EXPERT_4BIT == 128
    assert gemm_ops.dequant_min_rows_per_expert(int8) == gemm_ops.DEQUANT_MIN_ROWS_PER_EXPERT == 64
    monkeypatch.setenv(gemm_ops.ENV_QUANT_DECODE_ROWS, "96")
    assert gemm_ops.dequant_min_rows_per_expert(int4) == gemm_ops.dequant_min_rows_per_expert(int8) == 96
    monkeypatch.setenv(gemm_ops.ENV_QUANT_DECODE_ROWS, "many")
    with pytest.raises(ValueError, match="HUMMING_JAX_QUANT_DECODE_ROWS"):
        gemm_ops.dequant_min_rows_per_expert(int4)


@pytest.mark.parametrize("mixed", ["1", "0"])
def test_quantized_prefill_call_requests_the_buffer_and_matches_the_reference(rng, monkeypatch, mixed):
    """On the CPU the buffer (the mixed-input kernel's transposed scales, or with
    HUMMING_JAX_PREFILL_MIXED=0 the dequantized experts) is only requested (the handler ignores
    it); the result is the dequantized product either way."""
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIXED, mixed)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_U4RS, "0")  # the CUTLASS kinds at every size
    e, n, k, topk = 2, 16, 256, 1
    m = gemm_ops.DEQUANT_MIN_ROWS_PER_EXPERT_4BIT * e
    w = _int4(rng, e, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, e, (m, topk)).astype(np.int32))
    r = routing_ops.routing_grouped(ids, jnp.arange(e, dtype=jnp.int32), e)
    a = routing_ops.permute_rows(x, r, topk)
    f = jax.jit(lambda a, w, off: gemm_ops.gemm_grouped(a, None, w, None, off, out_dtype=jnp.bfloat16))
    hlo = f.lower(a, w, r.expert_first_token_offset).as_text()
    dequant = gemm_ops.dequant_buffer_bytes(m, w, jnp.bfloat16, False)
    scales = gemm_ops.mixed_scale_bytes(m, w, jnp.bfloat16, False)
    assert (scales, dequant) == ((e * n * 2 * 2, 0) if mixed == "1" else (0, 128 + e * n * k * 2))
    size = gemm_ops.grouped_workspace_bytes(e) + dequant + scales
    assert f"tensor<{size}xui8>" in hlo
    codes = np.asarray(w.data)
    q = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(e, n, k).astype(np.float32)  # even k: low nibble
    scale = np.repeat(np.asarray(w.scale, np.float32), 128, axis=2)
    wd = np.asarray(jnp.asarray((q - 8) * scale, jnp.bfloat16), np.float32)  # w' in the activation type
    want = np.einsum("rk,rnk->rn", np.asarray(a, np.float32), wd[_experts(r.expert_first_token_offset, m)])
    got = np.asarray(f(a, w, r.expert_first_token_offset), np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def _experts(off, rows):
    off = np.asarray(off)
    return np.searchsorted(off[1:], np.arange(rows), side="right")


def _raw_call(a, w, off, workspace):
    ops, attrs = gemm_ops._operands(a, None, w, None, 0)
    return _ffi.call(
        "gemm_grouped",
        (jax.ShapeDtypeStruct((a.shape[0], w.n), jnp.bfloat16), workspace),
        *ops,
        off,
        **attrs,
        a_k_order=0,
    )


@pytest.mark.parametrize(
    "workspace,match",
    [
        (jax.ShapeDtypeStruct((64,), jnp.float32), "workspace must be uint8"),
        (jax.ShapeDtypeStruct((8, 8), jnp.uint8), "workspace must have rank 1"),
    ],
)
def test_handler_rejects_a_malformed_workspace(rng, workspace, match):
    a, w, off = _problem(rng)
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(jax.jit(lambda a, w, off: _raw_call(a, w, off, workspace))(a, w, off))


def test_cpu_takes_any_uint8_workspace_size(rng):
    """The CPU handler needs no scratch (even an empty workspace is fine); results are the same."""
    a, w, off = _problem(rng)
    small = jax.jit(lambda a, w, off: _raw_call(a, w, off, jax.ShapeDtypeStruct((0,), jnp.uint8))[0])(a, w, off)
    full = jax.jit(lambda a, w, off: gemm_ops.gemm_grouped(a, None, w, None, off, out_dtype=jnp.bfloat16))(a, w, off)
    np.testing.assert_array_equal(np.asarray(small, np.float32), np.asarray(full, np.float32))


def _mxfp4(rng, e, n, k):
    codes = jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8)
    scale = jnp.asarray(rng.integers(100, 130, (e, n, k // 32)), jnp.uint8)
    return PackedWeight(codes, scale, wtype=WeightType.FP4_E2M1, k=k, group_n=1, group_k=32)


def test_mxfp4_calls_request_the_permuted_activations_instead(rng, monkeypatch):
    """MXFP4 weights with bf16 activations and output from RS4_MIN_ROWS_PER_EXPERT up to below
    FP4_MAX_ROWS_PER_EXPERT rows per expert: the MXFP4 kernel's tile list and permuted activations
    (R x K bf16) and no dequantization buffer; HUMMING_JAX_PREFILL_FP4=0 swaps the two (from 128 rows
    per expert; below, the decode kernel)."""
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_FP4, raising=False)
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_FP4_MAX_ROWS, raising=False)
    e, n, k = 8, 384, 512
    w = _mxfp4(rng, e, n, k)
    for rows in (gemm_ops.RS4_MIN_ROWS_PER_EXPERT * e, 256 * e, gemm_ops.FP4_MAX_ROWS_PER_EXPERT * e - 1):
        assert gemm_ops.fp4_prefill(rows, w, jnp.bfloat16, False), rows
        tiles = -(-rows // 32) + e + 1
        assert gemm_ops.rs4_workspace_bytes(rows, w, jnp.bfloat16, False) == 128 + -(-(128 + 16 * tiles) // 128) * 128 + rows * k * 2 + _RS4_SPLIT
        assert gemm_ops.dequant_buffer_bytes(rows, w, jnp.bfloat16, False) == 0
    declined = {
        "too few rows": (gemm_ops.RS4_MIN_ROWS_PER_EXPERT * e - 1, w, jnp.bfloat16, jnp.bfloat16),
        "too many rows": (gemm_ops.FP4_MAX_ROWS_PER_EXPERT * e, w, jnp.bfloat16, jnp.bfloat16),
        "fp16 activations": (256 * e, w, jnp.float16, jnp.float16),
        "float32 output": (256 * e, w, jnp.bfloat16, jnp.float32),
        "K not a multiple of 64": (256 * e, _mxfp4(rng, e, n, 480), jnp.bfloat16, jnp.bfloat16),
        "N not a multiple of 8": (256 * e, _mxfp4(rng, e, 20, k), jnp.bfloat16, jnp.bfloat16),
        "scale2": (256 * e, PackedWeight(w.data, w.scale, None, jnp.ones((e,), jnp.float32), wtype=WeightType.FP4_E2M1,
                                         k=k, group_k=32), jnp.bfloat16, jnp.bfloat16),
        "uint4 codes": (256 * e, _int4(rng, e, n, k, group_k=32), jnp.bfloat16, jnp.bfloat16),
    }
    for what, (r, wd, dtype, out) in declined.items():
        assert not gemm_ops.fp4_prefill(r, wd, dtype, False, out), what
        assert gemm_ops.rs4_workspace_bytes(r, wd, dtype, False, out) == 0, what
    assert not gemm_ops.fp4_prefill(256 * e, w, jnp.bfloat16, True)  # 8-bit activations
    assert gemm_ops.dequant_buffer_bytes(gemm_ops.FP4_MAX_ROWS_PER_EXPERT * e, w, jnp.bfloat16, False) > 0
    # HUMMING_JAX_PREFILL_FP4_MAX_ROWS=<n> moves the bound (A/B); non-positive values keep it.
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_FP4_MAX_ROWS, "4096")
    assert gemm_ops.fp4_prefill(gemm_ops.FP4_MAX_ROWS_PER_EXPERT * e, w, jnp.bfloat16, False)
    assert gemm_ops.dequant_buffer_bytes(gemm_ops.FP4_MAX_ROWS_PER_EXPERT * e, w, jnp.bfloat16, False) == 0
    assert not gemm_ops.fp4_prefill(4096 * e, w, jnp.bfloat16, False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_FP4_MAX_ROWS, "768")
    assert not gemm_ops.fp4_prefill(768 * e, w, jnp.bfloat16, False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_FP4_MAX_ROWS, "0")
    assert not gemm_ops.fp4_prefill(gemm_ops.FP4_MAX_ROWS_PER_EXPERT * e, w, jnp.bfloat16, False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_FP4_MAX_ROWS, "lots")
    with pytest.raises(ValueError, match="HUMMING_JAX_PREFILL_FP4_MAX_ROWS"):
        gemm_ops.fp4_prefill(256 * e, w, jnp.bfloat16, False)
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_FP4_MAX_ROWS)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_FP4, "0")
    assert not gemm_ops.fp4_prefill(256 * e, w, jnp.bfloat16, False)
    assert gemm_ops.dequant_buffer_bytes(256 * e, w, jnp.bfloat16, False) > 0
    assert gemm_ops.dequant_buffer_bytes(64 * e, w, jnp.bfloat16, False) == 0  # the decode kernel's


def test_int4_calls_below_the_u4rs_bound_take_the_4bit_mainloop(rng, monkeypatch):
    """uint4 calls of the mixed-input kinds with scale groups of whole 64-k tiles (or spanning K)
    and K % 64 == 0 run on the 4-bit mainloop below U4RS_MAX_ROWS_PER_EXPERT rows per expert but
    U4RS_CUTLASS_WINDOW: its permuted activations and no transposed scales; HUMMING_JAX_PREFILL_U4RS=0
    gives them back, =<n> moves the bound and drops the window."""
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_MIXED, raising=False)
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_U4RS, raising=False)
    e, n, k = 8, 384, 512
    w = _int4(rng, e, n, k)
    lo, hi = gemm_ops.U4RS_CUTLASS_WINDOW
    for rows in (gemm_ops.RS4_MIN_ROWS_PER_EXPERT * e, lo * e - 1, hi * e, gemm_ops.U4RS_MAX_ROWS_PER_EXPERT * e - 1):
        assert gemm_ops.u4rs_prefill(rows, w, jnp.bfloat16, False), rows
        assert not gemm_ops.mixed_prefill(rows, w, jnp.bfloat16, False), rows
        assert gemm_ops.mixed_scale_bytes(rows, w, jnp.bfloat16, False) == 0
        assert gemm_ops.dequant_buffer_bytes(rows, w, jnp.bfloat16, False) == 0
        tiles = -(-rows // 32) + e + 1
        assert gemm_ops.rs4_workspace_bytes(rows, w, jnp.bfloat16, False) == 128 + -(-(128 + 16 * tiles) // 128) * 128 + rows * k * 2 + _RS4_SPLIT
    # Below RS4_MIN_ROWS_PER_EXPERT neither; from it up to MIN_ROWS_PER_EXPERT only the mainloop (with
    # it switched off, the decode kernel: no mixed-input kind below MIN_ROWS_PER_EXPERT).
    low = gemm_ops.RS4_MIN_ROWS_PER_EXPERT * e - 1
    assert not gemm_ops.u4rs_prefill(low, w, jnp.bfloat16, False) and not gemm_ops.mixed_prefill(low, w, jnp.bfloat16, False)
    assert gemm_ops.rs4_workspace_bytes(low, w, jnp.bfloat16, False) == 0
    for wide in (lo * e, hi * e - 1, gemm_ops.U4RS_MAX_ROWS_PER_EXPERT * e):  # the window, and the bound
        assert not gemm_ops.u4rs_prefill(wide, w, jnp.bfloat16, False), wide
        assert gemm_ops.mixed_prefill(wide, w, jnp.bfloat16, False), wide
        assert gemm_ops.rs4_workspace_bytes(wide, w, jnp.bfloat16, False) == 0, wide
    assert gemm_ops.u4rs_prefill(64 * e, _int4(rng, e, n, 192, group_k=192), jnp.bfloat16, False)  # spanning K
    declined = {
        "32-k groups": _int4(rng, e, n, k, group_k=32),
        "96-k groups": _int4(rng, e, n, 576, group_k=96),
        "K not a multiple of 64": _int4(rng, e, n, 160, group_k=160),
    }
    for what, wd in declined.items():
        assert not gemm_ops.u4rs_prefill(64 * e, wd, jnp.bfloat16, False), what
    assert not gemm_ops.u4rs_prefill(64 * e, w, jnp.bfloat16, False, jnp.float32)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_U4RS, "0")
    assert not gemm_ops.u4rs_prefill(64 * e, w, jnp.bfloat16, False) and gemm_ops.mixed_prefill(64 * e, w, jnp.bfloat16, False)
    between = gemm_ops.RS4_MIN_ROWS_PER_EXPERT * e
    assert not gemm_ops.u4rs_prefill(between, w, jnp.bfloat16, False)
    assert not gemm_ops.mixed_prefill(between, w, jnp.bfloat16, False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_U4RS, "512")
    assert gemm_ops.u4rs_prefill(256 * e, w, jnp.bfloat16, False)
    assert gemm_ops.u4rs_prefill(lo * e, w, jnp.bfloat16, False)  # no window under an override
    assert not gemm_ops.u4rs_prefill(512 * e, w, jnp.bfloat16, False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_U4RS, "-3")
    assert not gemm_ops.u4rs_prefill(64 * e, w, jnp.bfloat16, False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_U4RS, "many")
    with pytest.raises(ValueError, match="HUMMING_JAX_PREFILL_U4RS"):
        gemm_ops.u4rs_prefill(64 * e, w, jnp.bfloat16, False)


def test_prefill_min_rows_override_moves_the_4bit_mainloop_down(rng, monkeypatch):
    """$HUMMING_JAX_PREFILL_MIN_ROWS=<n> lets the prefill kinds (and so their workspace) take calls
    from n rows per expert instead of MIN_ROWS_PER_EXPERT (the 4-bit mainloop: instead of
    RS4_MIN_ROWS_PER_EXPERT); auto selection keeps its thresholds."""
    from humming_jax.selection import GROUPED_MIN_ROWS_PER_EXPERT, GROUPED_MIN_ROWS_PER_EXPERT_4BIT

    for var in (gemm_ops.ENV_PREFILL_MIN_ROWS, gemm_ops.ENV_PREFILL_FP4, gemm_ops.ENV_PREFILL_U4RS,
                gemm_ops.ENV_PREFILL_MIXED):
        monkeypatch.delenv(var, raising=False)
    e, n, k = 8, 384, 512
    int4, fp4 = _int4(rng, e, n, k), _mxfp4(rng, e, n, k)
    rows = (gemm_ops.RS4_MIN_ROWS_PER_EXPERT // 2) * e
    assert gemm_ops.prefill_min_rows_per_expert() == gemm_ops.MIN_ROWS_PER_EXPERT
    assert gemm_ops.rs4_min_rows_per_expert() == gemm_ops.RS4_MIN_ROWS_PER_EXPERT
    for w, take in ((int4, gemm_ops.u4rs_prefill), (fp4, gemm_ops.fp4_prefill)):
        assert not take(rows, w, jnp.bfloat16, False)
        assert gemm_ops.rs4_workspace_bytes(rows, w, jnp.bfloat16, False) == 0
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, "1")
    assert gemm_ops.prefill_min_rows_per_expert() == gemm_ops.rs4_min_rows_per_expert() == 1
    for w, take in ((int4, gemm_ops.u4rs_prefill), (fp4, gemm_ops.fp4_prefill)):
        assert take(rows, w, jnp.bfloat16, False) and not take(e - 1, w, jnp.bfloat16, False)
        tiles = -(-rows // 32) + e + 1
        assert gemm_ops.rs4_workspace_bytes(rows, w, jnp.bfloat16, False) == 128 + -(-(128 + 16 * tiles) // 128) * 128 + rows * k * 2 + _RS4_SPLIT
    assert GROUPED_MIN_ROWS_PER_EXPERT == gemm_ops.MIN_ROWS_PER_EXPERT
    assert GROUPED_MIN_ROWS_PER_EXPERT_4BIT == gemm_ops.RS4_MIN_ROWS_PER_EXPERT
    for bad in ("0", "-3"):  # not a count: the built-in threshold
        monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, bad)
        assert gemm_ops.prefill_min_rows_per_expert() == gemm_ops.MIN_ROWS_PER_EXPERT
        assert gemm_ops.rs4_min_rows_per_expert() == gemm_ops.RS4_MIN_ROWS_PER_EXPERT
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, " +4")
    assert gemm_ops.prefill_min_rows_per_expert() == gemm_ops.rs4_min_rows_per_expert() == 4
    # Spellings Python's int() takes but the CUDA handler's strtoll would not read as the same number.
    for bad in ("few", "4 ", "1_6", "4.0", "0x10"):
        monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, bad)
        with pytest.raises(ValueError, match="HUMMING_JAX_PREFILL_MIN_ROWS"):
            gemm_ops.u4rs_prefill(rows, int4, jnp.bfloat16, False)


def test_persistent_kernel_switches_are_checked_when_their_calls_are_traced(rng, monkeypatch):
    """$HUMMING_JAX_PREFILL_BF16_WSP and $HUMMING_JAX_PREFILL_FP8_WSP take 0 to 4 (or nothing); any
    other value fails when a grouped call of their kernel is traced (bf16 weights and activations;
    fp8 codes on both sides), and not for the other's call."""
    e, n, k, rows = 4, 128, 256, 32
    off = jnp.asarray([0, 8, 16, 24, 32], jnp.int32)
    x16 = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w16 = PackedWeight(jnp.asarray(rng.standard_normal((e, n, k)) / np.sqrt(k), jnp.bfloat16), wtype=WeightType.FLOAT, k=k)
    a8 = jnp.asarray(rng.standard_normal((rows, k)), jnp.float8_e4m3fn)
    s8 = jnp.asarray(rng.random((rows, k // 128)) + 0.5, jnp.float32)
    w8 = PackedWeight(jnp.asarray(rng.standard_normal((e, n, k)), jnp.float8_e4m3fn),
                      jnp.asarray(rng.random((e, n // 128, k // 128)) + 0.5, jnp.float32),
                      wtype=WeightType.FP8_E4M3, k=k, group_n=128, group_k=128)

    def bf16_call():
        jax.eval_shape(lambda x, off: gemm_ops.gemm_grouped(x, None, w16, None, off, out_dtype=jnp.bfloat16), x16, off)

    def fp8_call():
        jax.eval_shape(lambda a, s, off: gemm_ops.gemm_grouped(a, s, w8, None, off, out_dtype=jnp.bfloat16,
                                                               act_group_k=128), a8, s8, off)

    top = 4
    for env, switch, call, other in ((gemm_ops.ENV_PREFILL_BF16_WSP, gemm_ops.bf16_wsp_switch, bf16_call, fp8_call),
                                     (gemm_ops.ENV_PREFILL_FP8_WSP, gemm_ops.fp8_wsp_switch, fp8_call, bf16_call)):
        for var in (gemm_ops.ENV_PREFILL_BF16_WSP, gemm_ops.ENV_PREFILL_FP8_WSP):
            monkeypatch.delenv(var, raising=False)
        assert switch() is None
        for good in [str(v) for v in range(top + 1)] + [f" +{top}"]:
            monkeypatch.setenv(env, good)
            assert switch() == int(good)
            call()
        for bad in (str(top + 1), "-1", "yes", "1 ", "0x1"):
            monkeypatch.setenv(env, bad)
            with pytest.raises(ValueError, match=env):
                switch()
            with pytest.raises(ValueError, match=env):
                call()
            other()


def test_rs4_warp_specialized_switch_is_checked_when_the_call_is_traced(rng, monkeypatch):
    """$HUMMING_JAX_PREFILL_RS4_WS takes 0 to 4 (or nothing); any other value fails where the
    4-bit mainloop's workspace is sized, and the workspace is the same for every form."""
    for var in (gemm_ops.ENV_PREFILL_MIN_ROWS, gemm_ops.ENV_PREFILL_FP4, gemm_ops.ENV_PREFILL_U4RS,
                gemm_ops.ENV_PREFILL_MIXED, gemm_ops.ENV_PREFILL_RS4_WS):
        monkeypatch.delenv(var, raising=False)
    e, n, k = 8, 384, 512
    rows = 40 * e
    for w in (_int4(rng, e, n, k), _mxfp4(rng, e, n, k)):
        unset = gemm_ops.rs4_workspace_bytes(rows, w, jnp.bfloat16, False)
        assert unset > rows * k * 2
        for good in ("0", "1", "2", "3", "4", " +1"):
            monkeypatch.setenv(gemm_ops.ENV_PREFILL_RS4_WS, good)
            assert gemm_ops.rs4_warp_specialized_switch() == int(good)
            assert gemm_ops.rs4_workspace_bytes(rows, w, jnp.bfloat16, False) == unset
        for bad in ("5", "-1", "yes", "1 ", "0x1"):
            monkeypatch.setenv(gemm_ops.ENV_PREFILL_RS4_WS, bad)
            with pytest.raises(ValueError, match="HUMMING_JAX_PREFILL_RS4_WS"):
                gemm_ops.rs4_workspace_bytes(rows, w, jnp.bfloat16, False)
        monkeypatch.delenv(gemm_ops.ENV_PREFILL_RS4_WS)


# gemm_grouped_gather: GEMM1 of the grouped class reads the token rows through the permutation.

def _gather_problem(rng, wtype, m=37, k_top=3, e_global=10, e_local=6, n=24, k=64, dtype=jnp.bfloat16, bias=True):
    from humming_jax.testing import random_packed_weight, random_routing

    ids, emap = random_routing(rng, m, k_top, e_global, e_local, pad_frac=0.2)
    r = routing_ops.routing_grouped(ids, emap, e_local)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    if wtype == WeightType.FLOAT:
        w = PackedWeight(jnp.asarray(rng.standard_normal((e_local, n, k)) / np.sqrt(k), dtype), wtype=wtype, k=k)
    else:
        w = random_packed_weight(rng, wtype, e_local, n, k, 32, scale_dtype=np.float32)
    b = jnp.asarray(rng.standard_normal((e_local, n)), jnp.float32) if bias else None
    return x, w, b, r, k_top


@pytest.mark.parametrize("wtype,dtype,bias", [(WeightType.FLOAT, jnp.bfloat16, True), (WeightType.FLOAT, jnp.float16, False),
                                              (WeightType.UINT4, jnp.bfloat16, True), (WeightType.INT8, jnp.float16, True)])
def test_gemm_grouped_gather_is_permute_then_grouped_gemm(rng, wtype, dtype, bias):
    """Bitwise the rows of permute_rows followed by gemm_grouped, and within rounding of a float64
    reference; rows past the last offset (dropped ids) are zeros."""
    x, w, b, r, k_top = _gather_problem(rng, wtype, dtype=dtype, bias=bias)
    off = r.expert_first_token_offset
    fused = jax.jit(lambda x, perm, off: gemm_ops.gemm_grouped_gather(x, w, b, perm, off, k_top, out_dtype=dtype))
    got = np.asarray(fused(x, r.permutation, off).astype(jnp.float32))
    two = gemm_ops.gemm_grouped(routing_ops.permute_rows(x, r, k_top), None, w, b, off, out_dtype=dtype)
    np.testing.assert_array_equal(got, np.asarray(two.astype(jnp.float32)))
    wf = np.asarray(w.values().astype(dtype).astype(jnp.float32), np.float64)  # the activation-type rounding
    xs = np.asarray(x.astype(jnp.float32), np.float64)
    perm, offs = np.asarray(r.permutation), np.asarray(off)
    assert offs[-1] < perm.shape[0], "the draw must drop some rows"
    for e in range(w.num_experts):
        for p in range(offs[e], offs[e + 1]):
            want = wf[e] @ xs[perm[p] // k_top] + (np.asarray(b)[e] if b is not None else 0.0)
            np.testing.assert_allclose(got[p], want, rtol=2e-2, atol=3e-2 * np.abs(want).max())
    assert np.all(got[offs[-1]:] == 0)


def test_gemm_grouped_gather_reserves_room_for_the_permuted_rows(rng):
    x, w, b, r, k_top = _gather_problem(rng, WeightType.FLOAT)
    rows = r.permutation.shape[0]
    f = jax.jit(lambda x, perm, off: gemm_ops.gemm_grouped_gather(x, w, b, perm, off, k_top, out_dtype=jnp.bfloat16))
    hlo = f.lower(x, r.permutation, r.expert_first_token_offset).as_text()
    call = next(line for line in hlo.splitlines() if "humming_jax.gemm_grouped_gather" in line)
    size = gemm_ops.grouped_workspace_bytes(w.num_experts) + rows * w.k * 2 + gemm_ops.GATHER_COPY_ALIGN
    assert f"(tensor<{rows}x{w.n}xbf16>, tensor<{size}xui8>)" in call, call
    text = (ROOT / "cuda_ffi" / "ffi_common.h").read_text()
    assert int(re.search(r"kGatherCopyAlign = (\d+);", text).group(1)) == gemm_ops.GATHER_COPY_ALIGN


def test_gemm_grouped_gather_rejects_bad_operands(rng, monkeypatch):
    x, w, b, r, k_top = _gather_problem(rng, WeightType.FLOAT)
    perm, off = r.permutation, r.expert_first_token_offset
    call = lambda x, perm, off, k_top: gemm_ops.gemm_grouped_gather(x, w, b, perm, off, k_top, out_dtype=jnp.bfloat16)
    with pytest.raises(Exception, match="permutation must have M \\* top_k entries"):
        jax.jit(call, static_argnums=3)(x, perm, off, k_top + 1).block_until_ready()
    with pytest.raises(Exception, match="x must be bfloat16 or float16"):
        jax.jit(call, static_argnums=3)(x.astype(jnp.float32), perm, off, k_top).block_until_ready()
    with pytest.raises(ValueError, match="x must be \\[M, K\\]"):
        call(x[None], perm, off, k_top)
    with pytest.raises(ValueError, match="top_k must be positive"):
        call(x, perm, off, 0)
    with pytest.raises(Exception, match="expert_first_token_offset"):
        jax.jit(call, static_argnums=3)(x, perm, off[:-1], k_top).block_until_ready()
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_GATHER, "3")
    with pytest.raises(ValueError, match="HUMMING_JAX_PREFILL_GATHER"):
        call(x, perm, off, k_top)
