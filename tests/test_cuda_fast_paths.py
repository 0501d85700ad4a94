"""GPU checks of the fast GEMM paths (libraries built with HUMMING_JAX_FAST_PATHS=ON): each path
against the CPU handler, the generic CUDA kernel or the oracle at the shapes it serves, and proof
that the path actually ran.

Skipped unless the CUDA handlers are registered; each path's tests also skip when the library was
built without it. Sections: prefill (CUTLASS grouped GEMM, cuda_ffi/gemm_prefill_sm90*); decode
(weight-streaming GEMM, cuda_ffi/gemm_decode_sm90*).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import TOL, cuda_constant, layer_tolerance, nan_out, random_layer, random_routing
from graph_replay import replay_both_ways

import humming_jax as hj
from humming_jax import _ffi
from humming_jax._abi import WeightType
from humming_jax.activations import get_activation
from humming_jax.experts import BatchedExperts, GroupedExperts, IndexedExperts, indexed_block_m
from humming_jax.ops import activation as act_ops
from humming_jax.ops import gemm as gemm_ops
from humming_jax.ops import routing as routing_ops
from humming_jax.quantize import SCHEMES, act_quant_params
from humming_jax.reference import InputQuant, batched_reference, moe_reference, relative_error
from humming_jax.testing import (
    experts_indexed_forms,
    experts_indexed_quant_forms,
    gated_forms,
    gemm_forms,
    grouped_gated_both,
    indexed_quant_forms,
    random_packed_weight,
)

CPU = jax.devices("cpu")[0]
GPU = jax.devices("cuda")[0] if hj.cuda_available() else None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPU is None, reason="CUDA backend not available (humming_jax.cuda_available() is False)"),
]


class _LaunchCount:
    """Counts the launches a fast-path counter records inside the block (host-side launches)."""

    def __init__(self, counter):
        self.counter = counter

    def __enter__(self):
        self.start = self.counter()
        return self

    def __exit__(self, *exc):
        self.count = self.counter() - self.start
        return False


def _to_np(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32) if x.dtype != jnp.int32 else x)


def _assert_close(got, want, dtype, what, tol=None):
    """Results of one computation by two kernels: equal up to accumulation order."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    tol = tol or (6e-3 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else 1.5e-3)
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert rel < tol, f"{what}: relative error {rel:.3g} >= {tol}"
    scale = np.abs(want).max() if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=4 * tol, atol=4 * tol * scale + 1e-6, err_msg=what)


# ================================================================================================
# Prefill: the CUTLASS grouped GEMM (cuda_ffi/gemm_prefill_sm90*). It takes gemm_grouped calls with
# 16-bit weights or w8a8-fp8-block128, K and N multiples of 8 (128 for fp8), and at least
# kMinRowsPerExpert = 32 rows per local expert on average (64-row pingpong tiles below 64 rows per
# expert for 16-bit kinds and 128 for fp8, 128-row cooperative tiles from there); uint4 codes
# without zero points with bf16 group scales and bf16 activations from 32 rows per expert on the
# mixed-input kernels (128-token tiles below 256 rows, 256-token tiles from 256; from 16 up to below
# 192 rows our 4-bit mainloop when the groups are whole 64-k tiles), mxfp4 with bf16 activations from
# 8 up to 3071 rows per expert on our 4-bit mainloop, other quantized
# weights with 16-bit activations dequantized first, from 64 rows per expert for 8-bit codes and
# from 128 for 4-bit ones;
# HUMMING_JAX_PREFILL=0 turns it off, HUMMING_JAX_PREFILL_MIXED=0 (HUMMING_JAX_PREFILL_FP4=0) gives the
# mixed-input (MXFP4) calls to the decode kernel or the dequantizing path, HUMMING_JAX_PREFILL_U4RS=0
# the uint4 calls of the 4-bit mainloop to the mixed-input kinds.
# ================================================================================================
_PREFILL_LAUNCHES = _ffi.launch_counter("HjPrefillLaunches") if GPU is not None else None
_SM90 = GPU is not None and str(getattr(GPU, "compute_capability", "")) == "9.0"

requires_prefill = pytest.mark.skipif(
    _PREFILL_LAUNCHES is None or not _SM90,
    reason="prefill path absent: library built without HUMMING_JAX_FAST_PATHS, or not an sm_90 device",
)



def _routing_ids(rng, m, k, e, kind):
    """topk ids [m, k] for a routing pattern over e local experts (e_global = 2e for 'tail')."""
    if kind == "uniform":
        ids = np.argsort(rng.random((m, e)), axis=1)[:, :k]
    elif kind == "zero_rows":  # only every third expert receives tokens; the others have 0 rows
        used = np.arange(0, e, 3)
        ids = used[np.argsort(rng.random((m, len(used))), axis=1)[:, :k]]
    elif kind == "one_expert":  # every row on one expert (k = 1)
        ids = np.full((m, k), e // 2)
    elif kind == "tail":  # half the entries on other devices' experts or padding: rows past off[E]
        ids = np.argsort(rng.random((m, 2 * e)), axis=1)[:, :k]
        ids = np.where(rng.random((m, k)) < 0.1, -1, ids)
    else:
        raise ValueError(kind)
    return jnp.asarray(ids.astype(np.int32))


def _expert_map(e, kind):
    """Global id -> local slot; for 'tail', experts e..2e-1 live on another device."""
    if kind == "tail":
        return jnp.asarray(np.concatenate([np.arange(e), np.full(e, -1)]).astype(np.int32))
    return jnp.arange(e, dtype=jnp.int32)


def _gemm_inputs(rng, scheme, m, k, e, n, kdim, kind, bias=False, dtype=None, weight=None):
    """GEMM operands built on the GPU: permuted (and for fp8, quantized) activations, offsets,
    weights (the scheme's quantization of random values, or `weight`), bias; returned as
    host-independent jax arrays on the GPU."""
    spec = SCHEMES[scheme]
    dtype = dtype or spec.default_dtype
    quant = act_quant_params(spec.act_key)
    w = weight if weight is not None else spec.quantize(
        (rng.standard_normal((e, n, kdim)) / np.sqrt(kdim)).astype(np.float32), dtype)
    b = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32) * 0.1) if bias else None
    x = jnp.asarray(rng.standard_normal((m, kdim)), dtype)
    ids, emap = _routing_ids(rng, m, k, e, kind), _expert_map(e, kind)

    def build(x, ids, emap):
        r = routing_ops.routing_grouped(ids, emap, e)
        xp = routing_ops.permute_rows(x, r, k)
        a, s = act_ops.quantize(xp, quant[0], quant[1]) if quant else (xp, None)
        return a, s, r.expert_first_token_offset

    a, s, off = jax.jit(build)(*jax.device_put((x, ids, emap), GPU))
    agk = quant[1] if quant else 0
    return dict(a=a, s=s, w=jax.device_put(w, GPU), b=None if b is None else jax.device_put(b, GPU), off=off,
                dtype=dtype, agk=agk)


def _run_gemm(dev, p, poison=True):
    """gemm_grouped on `dev` with the operands of _gemm_inputs; NumPy float32 result.

    With `poison`, a NaN array of the result's size is freed just before the call, so the
    allocator likely hands its memory to the result: rows the kernel fails to write stay NaN."""
    a, s, w, b, off = jax.device_put((p["a"], p["s"], p["w"], p["b"], p["off"]), dev)
    f = jax.jit(lambda a, s, w, b, off: gemm_ops.gemm_grouped(a, s, w, b, off, out_dtype=p["dtype"],
                                                              act_group_k=p["agk"]))
    if poison:
        junk = jax.device_put(jnp.full((a.shape[0], w.n), jnp.nan, p["dtype"]), dev)
        junk.block_until_ready()
        del junk
    return _to_np(jax.block_until_ready(f(a, s, w, b, off)))


def _prefill_once_matches_cpu(p, what, kernel):
    """gemm_grouped of `p` on the GPU: one launch of the prefill kernel, equal to the CPU, rows past
    off[E] zero. Returns the GPU result and off[E]."""
    with _LaunchCount(_PREFILL_LAUNCHES) as launched:
        got = _run_gemm(GPU, p)
    assert launched.count == 1, f"the {kernel} kernel did not run"
    _assert_close(got, _run_gemm(CPU, p, poison=False), jnp.bfloat16, what)
    last = int(np.asarray(p["off"])[-1])
    assert np.all(got[last:] == 0.0), "rows past the last expert must be zeros"
    return got, last


PREFILL_CASES = [
    # scheme, activation dtype (None: the scheme's), M tokens, top-k, E, N, K, routing
    ("bf16", None, 1024, 2, 8, 768, 512, "uniform"),
    ("fp16", None, 1024, 2, 8, 512, 256, "uniform"),
    ("bf16", None, 2048, 8, 64, 384, 256, "zero_rows"),
    ("bf16", None, 1024, 1, 8, 256, 512, "one_expert"),
    ("bf16", None, 1024, 4, 16, 264, 136, "tail"),  # N, K multiples of 8 but not of the tiles
    ("w8a8-fp8-block128", None, 1024, 2, 8, 768, 512, "uniform"),
    ("w8a8-fp8-block128", None, 2048, 8, 64, 384, 256, "zero_rows"),
    ("w8a8-fp8-block128", None, 1024, 1, 8, 256, 512, "one_expert"),
    ("w8a8-fp8-block128", None, 1024, 4, 16, 256, 384, "tail"),
    # Quantized weights with 16-bit activations (from 128 rows per expert for 4-bit codes, 64 for
    # 8-bit): experts dequantized into the workspace, then the 16-bit kernel (one launch: every expert
    # fits the default buffer); int4 with bf16 scales and activations: the mixed-input kernel (more in
    # test_prefill_mixed_input_*).
    ("w4a16-int4-g128", jnp.bfloat16, 1024, 2, 8, 384, 512, "uniform"),
    ("w4a16-int4-g128", jnp.float16, 1024, 2, 8, 256, 256, "uniform"),
    ("w4a16-uint4-zp-g128", jnp.bfloat16, 1024, 2, 8, 256, 256, "tail"),
    ("w4a16-mxfp4", jnp.bfloat16, 1024, 4, 16, 264, 256, "zero_rows"),
    ("w4a16-nvfp4", jnp.bfloat16, 1024, 2, 8, 256, 512, "uniform"),
    ("w8a16-int8-channel", jnp.bfloat16, 1024, 1, 8, 256, 136, "one_expert"),
    ("w8a16-fp8-block128", jnp.float16, 1024, 2, 8, 256, 256, "uniform"),
    # 32 to 63 rows per expert (fp8: to 127): the 64-row pingpong kinds.
    ("bf16", None, 192, 2, 8, 768, 512, "uniform"),  # 48 rows per expert
    ("fp16", None, 128, 4, 16, 264, 136, "tail"),  # 32, half of them elsewhere
    ("bf16", None, 384, 8, 64, 384, 256, "zero_rows"),  # 48 on average, a third of the experts used
    ("w8a8-fp8-block128", None, 256, 2, 8, 768, 512, "uniform"),  # 64
    ("w8a8-fp8-block128", None, 256, 8, 64, 384, 256, "zero_rows"),  # 32
    ("w4a16-int4-g128", jnp.bfloat16, 256, 2, 8, 384, 512, "uniform"),  # 64: the mixed-input kernel
    ("w4a16-int4-g128", jnp.float16, 1024, 2, 8, 384, 512, "uniform"),  # 256 (4-bit codes from 128): dequantized
]


@requires_prefill
@pytest.mark.parametrize("scheme,dtype,m,k,e,n,kdim,kind", PREFILL_CASES)
def test_prefill_grouped_gemm_matches_cpu(rng, scheme, dtype, m, k, e, n, kdim, kind):
    p = _gemm_inputs(rng, scheme, m, k, e, n, kdim, kind, bias=kind == "uniform", dtype=dtype)
    with _LaunchCount(_PREFILL_LAUNCHES) as launched:
        got = _run_gemm(GPU, p)
    assert launched.count == 1, "the prefill kernel did not run"
    want = _run_gemm(CPU, p, poison=False)
    _assert_close(got, want, p["dtype"], f"{scheme} {kind}")
    last = int(np.asarray(p["off"])[-1])
    assert np.all(got[last:] == 0.0), "rows past the last expert must be zeros"
    if kind == "tail":
        assert last < got.shape[0], "the tail case must leave rows past off[E]"


@requires_prefill
@pytest.mark.parametrize(
    "scheme,m,k,e,n,kdim",
    [
        # Model-like (E, top-k) with N or K cut so the host-made weights stay below ~1 GB.
        ("bf16", 4096, 8, 128, 1536, 1024),  # qwen3-30b-a3b GEMM1 (K cut from 2048)
        ("bf16", 4096, 2, 8, 2048, 4096),  # mixtral-8x7b GEMM1-like (N cut from 28672)
        ("fp16", 4096, 4, 32, 1024, 1024),
        ("w8a8-fp8-block128", 4096, 8, 32, 2048, 2048),  # deepseek-v3-ep8 GEMM2-like (N cut)
        ("w8a8-fp8-block128", 4096, 8, 128, 2048, 768),  # qwen3-30b-a3b GEMM2
        ("w4a16-int4-g128", 4096, 2, 8, 2048, 4096),  # mixtral-8x7b GEMM1-like: 1024 rows per expert, 256-token tiles
        ("w4a16-int4-g128", 4096, 8, 128, 1536, 1024),  # qwen3-30b-a3b GEMM1-like (K cut): the mixed-input kernel
    ],
)
def test_prefill_matches_generic_kernel_at_model_shapes(rng, monkeypatch, scheme, m, k, e, n, kdim):
    p = _gemm_inputs(rng, scheme, m, k, e, n, kdim, "uniform")
    with _LaunchCount(_PREFILL_LAUNCHES) as launched:
        got = _run_gemm(GPU, p)
    assert launched.count == 1
    monkeypatch.setenv("HUMMING_JAX_PREFILL", "0")
    with _LaunchCount(_PREFILL_LAUNCHES) as generic:
        want = _run_gemm(GPU, p, poison=False)
    assert generic.count == 0, "HUMMING_JAX_PREFILL=0 must leave the call to the generic kernel"
    _assert_close(got, want, p["dtype"], f"{scheme} M={m} E={e} N={n} K={kdim}")


@requires_prefill
def test_prefill_dequantizes_in_chunks_when_the_buffer_is_small(rng, monkeypatch):
    """A 1 MiB dequantization buffer holds 2 of the 8 experts (384 x 512 bf16 each): four chunks,
    each its own GEMM launch, the zero tail written once, the result as on the CPU; 0 MiB turns the
    path off (the generic kernel runs). (int4 with bf16 scales takes the dequantizing path only with
    HUMMING_JAX_PREFILL_MIXED=0.)"""
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIXED, "0")
    monkeypatch.setenv(gemm_ops.ENV_DEQUANT_WORKSPACE_MB, "1")
    p = _gemm_inputs(rng, "w4a16-int4-g128", 1024, 4, 8, 384, 512, "tail", bias=True)
    with _LaunchCount(_PREFILL_LAUNCHES) as launched:
        got = _run_gemm(GPU, p)
    assert launched.count == 4
    want = _run_gemm(CPU, p, poison=False)
    _assert_close(got, want, p["dtype"], "int4 in 4 chunks")
    last = int(np.asarray(p["off"])[-1])
    assert last < got.shape[0] and np.all(got[last:] == 0.0)
    monkeypatch.setenv(gemm_ops.ENV_DEQUANT_WORKSPACE_MB, "0")
    with _LaunchCount(_PREFILL_LAUNCHES) as generic:
        again = _run_gemm(GPU, p)
    assert generic.count == 0
    _assert_close(again, want, p["dtype"], "int4 on the generic kernel")


# uint4 codes (offset 8, no zero points) with bf16 group scales times bf16 activations, from 64 rows
# per expert: the mixed-input kernel (Kind::kU4Bf16), which converts the codes in its mainloop. Such
# a call requests no dequantization buffer (gemm_ops.mixed_prefill), so one prefill launch proves
# the mixed-input kernel ran: the dequantizing path cannot run without its buffer.
MIXED_CASES = [
    # M tokens, top-k, E, N, K, group_k, routing, bias
    (1024, 2, 8, 768, 512, 128, "uniform", True),
    (1024, 2, 8, 768, 512, 128, "uniform", False),
    (2048, 8, 64, 384, 640, 128, "zero_rows", False),  # two thirds of the experts empty; K = 5 groups
    (1024, 1, 8, 256, 1152, 128, "one_expert", True),  # 1024 rows on one expert, none on the rest
    (1024, 4, 16, 264, 384, 128, "tail", True),  # N not a multiple of the tile; rows past off[E]
    (1024, 4, 16, 264, 384, 128, "tail", False),
    (512, 2, 8, 200, 160, 160, "uniform", True),  # one group spanning K, K not a multiple of the 64-k tile
    (1024, 2, 8, 256, 512, 256, "uniform", False),  # 256-k groups: four K tiles per scale
    # Below kWideRowsPerExpertMixed = 128 rows per expert: 64-token tiles.
    (256, 2, 8, 384, 512, 128, "uniform", True),  # 64 rows per expert
    (128, 2, 8, 384, 512, 128, "uniform", True),  # 32, the least the kernels take (else the decode kernel's)
    (192, 2, 8, 264, 384, 128, "tail", False),  # 48, rows past off[E]
    (512, 8, 64, 384, 640, 128, "zero_rows", True),  # 64 on average, ~190 on the used experts: several tiles each
    (448, 2, 8, 200, 160, 160, "uniform", False),  # 112, one group spanning K
    # From kTallRowsPerExpertMixed = 256 rows per expert: 256-token tiles.
    (2048, 2, 8, 768, 512, 128, "uniform", True),  # 512 rows per expert
    (2048, 4, 16, 264, 384, 128, "tail", True),  # N not a multiple of the tile; rows past off[E]
    (2048, 2, 8, 200, 160, 160, "uniform", False),  # one group spanning K
    (4096, 1, 8, 256, 1152, 128, "one_expert", False),  # 4096 rows on one expert
]


def _mixed_weight(rng, e, n, kdim, group_k):
    if group_k == 128:
        return SCHEMES["w4a16-int4-g128"].quantize(
            (rng.standard_normal((e, n, kdim)) / np.sqrt(kdim)).astype(np.float32), jnp.bfloat16)
    return random_packed_weight(rng, WeightType.UINT4, e, n, kdim, group_k, scale_dtype=jnp.bfloat16)


@requires_prefill
@pytest.mark.parametrize("m,k,e,n,kdim,group_k,kind,bias", MIXED_CASES)
def test_prefill_mixed_input_int4_matches_cpu_and_the_dequantizing_path(rng, monkeypatch, m, k, e, n, kdim, group_k,
                                                                        kind, bias):
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_MIXED, raising=False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_U4RS, "0")  # the CUTLASS kinds at every size
    p = _gemm_inputs(rng, "w4a16-int4-g128", m, k, e, n, kdim, kind, bias=bias, dtype=jnp.bfloat16,
                     weight=_mixed_weight(rng, e, n, kdim, group_k))
    rows, what = p["a"].shape[0], f"int4 g{group_k} {kind} M={m} E={e} N={n} K={kdim} bias={bias}"
    assert gemm_ops.mixed_prefill(rows, p["w"], jnp.bfloat16, False)
    assert gemm_ops.dequant_buffer_bytes(rows, p["w"], jnp.bfloat16, False) == 0
    got, last = _prefill_once_matches_cpu(p, what, "mixed-input prefill")
    if kind == "tail":
        assert last < got.shape[0], "the tail case must leave rows past off[E]"
    # The same w' through the dequantizing path and the bf16 kernel (below 128 rows per expert for
    # 4-bit codes: the decode kernel): equal up to accumulation order.
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIXED, "0")
    dequantizing = rows >= gemm_ops.dequant_min_rows_per_expert(p["w"]) * e
    assert (gemm_ops.dequant_buffer_bytes(rows, p["w"], jnp.bfloat16, False) > 0) == dequantizing
    with _LaunchCount(_PREFILL_LAUNCHES) as dequantized:
        again = _run_gemm(GPU, p)
    assert dequantized.count == int(dequantizing), "HUMMING_JAX_PREFILL_MIXED=0 must give the call back"
    _assert_close(got, again, jnp.bfloat16, what + " against the other path", tol=2e-3)


@requires_prefill
@pytest.mark.parametrize("rows_per_expert", [gemm_ops.U4RS_CUTLASS_WINDOW[0], gemm_ops.U4RS_CUTLASS_WINDOW[1] - 8])
def test_int4_in_the_u4rs_window_runs_on_the_mixed_input_kind(rng, monkeypatch, rows_per_expert):
    """uint4 calls at U4RS_CUTLASS_WINDOW's rows per expert (built-in rule, no switch set) take the
    CUTLASS mixed-input kind with its workspace (transposed scales, no permuted activations): the
    handler's rule and the Python mirror that sized the workspace agree there; equal to the CPU."""
    for var in (gemm_ops.ENV_PREFILL_MIXED, gemm_ops.ENV_PREFILL_U4RS, gemm_ops.ENV_PREFILL_MIN_ROWS):
        monkeypatch.delenv(var, raising=False)
    e, n, kdim = 8, 264, 512
    p = _gemm_inputs(rng, "w4a16-int4-g128", rows_per_expert * e, 1, e, n, kdim, "uniform", bias=True,
                     dtype=jnp.bfloat16, weight=_mixed_weight(rng, e, n, kdim, 128))
    rows = p["a"].shape[0]
    assert rows == rows_per_expert * e
    assert gemm_ops.mixed_prefill(rows, p["w"], jnp.bfloat16, False)
    assert not gemm_ops.u4rs_prefill(rows, p["w"], jnp.bfloat16, False)
    assert gemm_ops.mixed_scale_bytes(rows, p["w"], jnp.bfloat16, False) > 0
    assert gemm_ops.rs4_workspace_bytes(rows, p["w"], jnp.bfloat16, False) == 0
    _prefill_once_matches_cpu(p, f"int4 at {rows_per_expert} rows per expert", "mixed-input prefill")


FP4_CASES = [
    # M tokens, top-k, E, N, K, routing, bias. Tiles of 128 weight rows x an expert's rows split
    # into near-equal parts of at most 128 (wgmma N: the part's rows rounded up to 16).
    (256, 2, 8, 384, 512, "uniform", True),  # 64 rows per expert
    (128, 2, 8, 384, 512, "uniform", False),  # 32
    (64, 2, 8, 384, 512, "uniform", False),  # 16
    (32, 2, 8, 384, 512, "uniform", True),  # 8, the least the kind takes (else the decode kernel's)
    (96, 2, 8, 264, 2048, "tail", True),  # 24: the persistent forms below the other kinds' bound
    (192, 2, 8, 264, 384, "tail", True),  # 48; N not a multiple of the tile; rows past off[E]
    (512, 8, 64, 384, 640, "zero_rows", True),  # 64 on average, ~190 on the used experts: several tiles each
    (256, 2, 8, 200, 192, "uniform", False),  # K = 3 tiles (an odd count), N = 200
    (1024, 2, 8, 200, 192, "uniform", True),  # 256 rows per expert: 2-3 tiles each
    (160, 2, 8, 136, 128, "uniform", False),  # 40 rows per expert: widths 32-64, N = 136
    (2048, 2, 8, 768, 512, "uniform", True),  # 512 rows per expert
    (4096, 2, 8, 264, 256, "uniform", True),  # 1024 rows per expert: eight tiles each
    (1024, 4, 16, 264, 384, "tail", False),  # 256 rows per expert with rows past off[E]
    (1024, 1, 8, 256, 1152, "one_expert", True),  # 1024 rows on one expert, none on the rest
    # K a multiple of 512 (64 / 48 scale bytes a row): the persistent forms take the scales by TMA in
    # windows of 8 stages (four windows; three, several items per CTA), rows past N in the last box.
    (128, 2, 8, 264, 2048, "tail", False),
    (1024, 8, 64, 384, 1536, "zero_rows", True),
]


U4RS_CASES = [  # below U4RS_MAX_ROWS_PER_EXPERT rows per expert, outside U4RS_CUTLASS_WINDOW; (M, top-k, E, N, K, routing, bias, group_k)
    (256, 2, 8, 384, 512, "uniform", True, 128),  # 64 rows per expert
    (128, 2, 8, 384, 512, "uniform", False, 128),  # 32
    (64, 2, 8, 384, 512, "uniform", False, 128),  # 16
    (32, 2, 8, 384, 512, "uniform", True, 128),  # 8, the least the kind takes (else the decode kernel's)
    (96, 2, 8, 264, 2048, "tail", True, 128),  # 24: below the mixed-input kinds' bound
    (192, 2, 8, 264, 384, "tail", True, 128),  # 48; N not a multiple of the tile; rows past off[E]
    (512, 8, 64, 384, 640, "zero_rows", True, 128),  # ~190 on the used experts: several tiles each
    (896, 2, 8, 384, 512, "uniform", False, 128),  # 224: two tiles each
    (1216, 2, 8, 384, 512, "uniform", True, 128),  # 304: three tiles each
    (2400, 2, 8, 264, 512, "uniform", True, 128),  # 600, past the CUTLASS window: five tiles each
    (256, 2, 8, 200, 192, "uniform", False, 192),  # one group spanning K (3 tiles)
    (448, 2, 8, 136, 512, "uniform", True, 256),  # 112; 256-k groups (four tiles per scale)
    (448, 1, 8, 256, 1152, "one_expert", True, 128),  # 448 rows on one expert: four tiles
    (1280, 1, 8, 264, 512, "uniform", True, 128),  # 160 rows per expert: two tiles each, N = 264
    # 150 rows per expert over 64 experts: more work items than SMs in both persistent forms (~256
    # tiles of at most 48 rows x one 512-row block; 128 of at most 128 x two 256-row blocks), so
    # their CTAs take several, the ring running on across them; 7 k tiles
    (2400, 4, 64, 512, 448, "uniform", True, 64),
    # Scale columns a multiple of 8 (16, 24): the persistent forms take the scales by TMA in windows
    # of 8 groups (two windows of two stages' groups; three of one, several items per CTA), rows
    # past N in the last 256-row box.
    (128, 2, 8, 264, 2048, "tail", False, 128),
    (1024, 8, 64, 384, 1536, "zero_rows", True, 64),
]


def _rs4_params():
    for case in FP4_CASES:
        yield pytest.param("w4a16-mxfp4", *case, 32, id=f"mxfp4-{'-'.join(map(str, case))}")
    for case in U4RS_CASES:
        yield pytest.param("w4a16-int4-g128", *case, id=f"int4-{'-'.join(map(str, case))}")


@requires_prefill
@pytest.mark.parametrize("scheme,m,k,e,n,kdim,kind,bias,group_k", list(_rs4_params()))
def test_prefill_4bit_mainloop_matches_cpu_and_the_other_paths(rng, monkeypatch, scheme, m, k, e, n, kdim, kind,
                                                              bias, group_k):
    """MXFP4 weights (8-3071 rows per expert) and uint4 ones (8-1023 but 408-503) with bf16 activations: our
    4-bit mainloop runs (one launch, no dequantization buffer or transposed scales), equal to the
    CPU, rows past off[E] zero; and equal up to accumulation order to the path taken without it
    (HUMMING_JAX_PREFILL_FP4=0: the decode kernel or the dequantizing path; HUMMING_JAX_PREFILL_U4RS=0:
    the CUTLASS mixed-input kinds)."""
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_FP4, raising=False)
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_U4RS, raising=False)
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_MIXED, raising=False)
    weight = _mixed_weight(rng, e, n, kdim, group_k) if scheme.startswith("w4a16-int4") else None
    p = _gemm_inputs(rng, scheme, m, k, e, n, kdim, kind, bias=bias, dtype=jnp.bfloat16, weight=weight)
    rows, what = p["a"].shape[0], f"{scheme} {kind} M={m} E={e} N={n} K={kdim} g{group_k} bias={bias}"
    int4 = scheme.startswith("w4a16-int4")
    assert (gemm_ops.u4rs_prefill if int4 else gemm_ops.fp4_prefill)(rows, p["w"], jnp.bfloat16, False)
    assert gemm_ops.dequant_buffer_bytes(rows, p["w"], jnp.bfloat16, False) == 0
    assert gemm_ops.mixed_scale_bytes(rows, p["w"], jnp.bfloat16, False) == 0
    got, last = _prefill_once_matches_cpu(p, what, "4-bit prefill")
    if kind == "tail":
        assert last < got.shape[0], "the tail case must leave rows past off[E]"
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_U4RS if int4 else gemm_ops.ENV_PREFILL_FP4, "0")
    assert gemm_ops.rs4_workspace_bytes(rows, p["w"], jnp.bfloat16, False) == 0
    # int4: the mixed-input kinds from MIN_ROWS_PER_EXPERT; mxfp4: the dequantizing path from its bound;
    # else the decode kernel.
    prefill = rows >= (gemm_ops.MIN_ROWS_PER_EXPERT if int4 else gemm_ops.dequant_min_rows_per_expert(p["w"])) * e
    with _LaunchCount(_PREFILL_LAUNCHES) as other:
        again = _run_gemm(GPU, p)
    assert other.count == int(prefill), "the switch must give the call back"
    _assert_close(got, again, jnp.bfloat16, what + " against the other path", tol=2e-3)


@requires_prefill
@pytest.mark.parametrize("scheme,m,k,e,n,kdim,kind,bias,group_k", list(_rs4_params()))
def test_prefill_4bit_warp_specialized_matches_the_mainloop_bit_for_bit(rng, monkeypatch, scheme, m, k, e, n, kdim,
                                                                       kind, bias, group_k):
    """HUMMING_JAX_PREFILL_RS4_WS=1 to 4: the warp-specialized forms of the 4-bit mainloop (load by
    TMA; one weight slab per warpgroup and tiles of at most 96 tokens, two and 32, or the persistent
    form's four warpgroups of two slabs and 48 or one and 128) equal the CPU, and the plain mainloop
    bit for bit (each output's sum runs over k in the same MMA order)."""
    for var in (gemm_ops.ENV_PREFILL_FP4, gemm_ops.ENV_PREFILL_U4RS, gemm_ops.ENV_PREFILL_MIXED):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_RS4_WS, "0")
    monkeypatch.setenv(ENV_RS4_SPLIT, "0")  # whole items: each output's sum in the mainloop's order
    weight = _mixed_weight(rng, e, n, kdim, group_k) if scheme.startswith("w4a16-int4") else None
    p = _gemm_inputs(rng, scheme, m, k, e, n, kdim, kind, bias=bias, dtype=jnp.bfloat16, weight=weight)
    what = f"{scheme} {kind} M={m} E={e} N={n} K={kdim} g{group_k} bias={bias}"
    plain, _ = _prefill_once_matches_cpu(p, what, "4-bit prefill")
    # One / two weight slabs per warpgroup; persistent, two / one, with the scales by TMA where their
    # rows span whole 16 bytes, and again with HUMMING_JAX_PREFILL_RS4_TMA_SCALES=0 (per-row loads).
    for form, tma in (("1", None), ("2", None), ("3", None), ("4", None), ("3", "0"), ("4", "0")):
        monkeypatch.setenv(gemm_ops.ENV_PREFILL_RS4_WS, form)
        if tma is not None:
            monkeypatch.setenv("HUMMING_JAX_PREFILL_RS4_TMA_SCALES", tma)
        label = f"{form}" + ("" if tma is None else " without TMA scales")
        got, _ = _prefill_once_matches_cpu(p, f"{what} warp-specialized {label}", "4-bit prefill")
        np.testing.assert_array_equal(got, plain, err_msg=f"{what}: the warp-specialized form {label} differs")


ENV_RS4_SPLIT = "HUMMING_JAX_PREFILL_RS4_SPLIT"


def _rs4_split_parts(off, rows_in, e, n, kdim, form, sms):
    """The parts each item of the persistent form's last round takes (cuda_ffi/gemm_prefill_sm90_4bit.cu,
    wsp_items; the launch's grid from its bound on the tiles of `rows_in` rows), restated: 1 where
    the round is not split."""
    rows_cta, max_tok = (512, 48) if form == 3 else (256, 128)
    ends = np.asarray(off)[: e + 1]
    rows = np.diff(ends)
    nb = -(-n // rows_cta)
    items = int(sum(-(-int(r) // max_tok) for r in rows)) * nb
    grid = min(sms, nb * (-(-rows_in // max_tok) + e) * 4)
    rem, kt = items % grid, kdim // 64
    if rem == 0 or 2 * rem > grid or rem > 66:
        return 1
    return min(4, grid // rem, 1 + 66 // rem, kt)


@requires_prefill
@pytest.mark.parametrize("m,k,e,n,kdim,form", [
    (64, 2, 8, 1536, 2048, 3),  # 24 items: all in one split round (parts 3 on 132 SMs)
    (64, 2, 8, 1536, 2048, 4),  # 48 items (parts 2)
    (256, 4, 64, 2560, 512, 3),  # 320 items: two whole rounds, then 56 items in two parts
    (256, 4, 64, 2560, 512, 4),  # 640 items: a last round of 112, not split
])
@pytest.mark.parametrize("scheme", ["w4a16-mxfp4", "w4a16-int4-g128"])
def test_prefill_4bit_split_last_round_matches_cpu_and_the_whole_items(rng, monkeypatch, scheme, m, k, e, n, kdim,
                                                                     form):
    """The persistent forms split a last round that would keep at most half the CTAs busy into
    k-parts whose sums the last part adds (HUMMING_JAX_PREFILL_RS4_SPLIT, on unless 0): equal to the
    CPU, rows past off[E] zero; the same bits run after run; within rounding of the whole items'
    result (=0), and where a split happens not all the same bits (the sums run in another order)."""
    for var in (gemm_ops.ENV_PREFILL_FP4, gemm_ops.ENV_PREFILL_U4RS, gemm_ops.ENV_PREFILL_MIXED, ENV_RS4_SPLIT):
        monkeypatch.delenv(var, raising=False)
    sms = getattr(GPU, "core_count", None)
    if not sms:
        pytest.skip("the device does not report its SM count")
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_RS4_WS, str(form))
    group_k = 32 if scheme == "w4a16-mxfp4" else 128
    weight = _mixed_weight(rng, e, n, kdim, group_k) if scheme.startswith("w4a16-int4") else None
    p = _gemm_inputs(rng, scheme, m, k, e, n, kdim, "uniform", dtype=jnp.bfloat16, weight=weight)
    parts = _rs4_split_parts(p["off"], p["a"].shape[0], e, n, kdim, form, sms)
    what = f"{scheme} M={m} k={k} E={e} N={n} K={kdim} form {form} on {sms} SMs ({parts} parts)"
    got, last = _prefill_once_matches_cpu(p, what, "4-bit prefill")
    assert np.any(got[:last] != 0.0), what
    np.testing.assert_array_equal(_run_gemm(GPU, p), got, err_msg=f"{what}: not the same bits run after run")
    monkeypatch.setenv(ENV_RS4_SPLIT, "0")
    whole = _run_gemm(GPU, p)
    _assert_close(got, whole, jnp.bfloat16, what + " against the whole items", tol=2e-3)
    if parts > 1:
        assert np.any(got != whole), f"{what}: the same bits as the whole items, so no split ran"
    else:
        np.testing.assert_array_equal(got, whole, err_msg=f"{what}: no split expected, yet other bits")


_RS4_TWO_SLAB_LAUNCHES = _ffi.launch_counter("HjPrefillRs4TwoSlabLaunches") if GPU is not None else None
_RS4_ONE_SLAB_LAUNCHES = _ffi.launch_counter("HjPrefillRs4OneSlabLaunches") if GPU is not None else None


def _rs4_rule_form(rows, e, n, kdim, sms):
    """The 4-bit mainloop's default form (cuda_ffi/gemm_prefill_sm90_4bit.cu, ws_form), restated:
    3 (two slabs, 48-token tiles: items of 512 weight rows) up to 32 rows per expert where
    2 x 0.875 of its rounds cost no more than form 4's (items of 256 rows), a last partial round
    costing the fourth root of its fill; else 4 (one slab, 128-token tiles), at any size."""
    if rows > 32 * e:
        return 4

    def rounds(items):
        return items // sms + (items % sms / sms) ** 0.25

    return 3 if 2 * 0.875 * rounds(-(-n // 512) * e) <= rounds(-(-n // 256) * e) else 4


@requires_prefill
@pytest.mark.parametrize("scheme", ["w4a16-int4-g128", "w4a16-mxfp4"])
@pytest.mark.parametrize("m,k,e,n,kdim", [
    (512, 8, 128, 512, 256),  # 32 rows per expert, 128 / 256 items: two slabs on 132 SMs
    (512, 8, 128, 512, 2176),  # the same with a long K: two slabs
    (128, 2, 8, 1024, 256),  # 32 rows per expert, 16 / 32 items, both rounds far from full: one slab
    (128, 8, 32, 4096, 512),  # 32 rows per expert, 256 / 512 items (deepseek GEMM1's): two slabs
    (64, 2, 8, 4096, 512),  # 16 rows per expert, 64 / 128 items (mixtral GEMM2's): one slab
    (768, 8, 128, 512, 256),  # 48 rows per expert: one slab
    (1024, 8, 128, 512, 256),  # 64: one slab
    (1280, 1, 8, 384, 512),  # 160: two tiles an expert, one slab
])
def test_prefill_4bit_default_form_follows_the_rule(rng, monkeypatch, scheme, m, k, e, n, kdim):
    """Without HUMMING_JAX_PREFILL_RS4_WS the 4-bit mainloop takes the form its rule names (counted
    by launch), and its result equals the CPU's."""
    for var in (gemm_ops.ENV_PREFILL_FP4, gemm_ops.ENV_PREFILL_U4RS, gemm_ops.ENV_PREFILL_MIXED,
                gemm_ops.ENV_PREFILL_RS4_WS):
        monkeypatch.delenv(var, raising=False)
    sms = getattr(GPU, "core_count", None)
    if not sms:
        pytest.skip("the device does not report its SM count")
    group_k = 32 if scheme == "w4a16-mxfp4" else 128
    weight = _mixed_weight(rng, e, n, kdim, group_k) if scheme.startswith("w4a16-int4") else None
    p = _gemm_inputs(rng, scheme, m, k, e, n, kdim, "uniform", dtype=jnp.bfloat16, weight=weight)
    want = _rs4_rule_form(m * k, e, n, kdim, sms)
    what = f"{scheme} M={m} k={k} E={e} N={n} K={kdim} on {sms} SMs"
    with _LaunchCount(_RS4_TWO_SLAB_LAUNCHES) as two, _LaunchCount(_RS4_ONE_SLAB_LAUNCHES) as one:
        got, last = _prefill_once_matches_cpu(p, what, "4-bit prefill")
    assert (two.count, one.count) == ((1 if want == 3 else 0), (1 if want == 4 else 0)), (
        f"{what}: expected form {want}, launches two-slab {two.count}, one-slab {one.count}")
    assert np.any(got[:last] != 0.0), what


# Our persistent kernels ($HUMMING_JAX_PREFILL_BF16_WSP, $HUMMING_JAX_PREFILL_FP8_WSP): scheme, M,
# top-k, E, N, K, routing, bias.
WSP_CASES = [
    ("bf16", 1024, 2, 8, 768, 512, "uniform", True),  # 256 rows per expert: tiles of 128, four 192-row blocks
    # ~150 rows per expert: two tiles each (96 + 54 rows), more work items than SMs; an odd number
    # of weight blocks, the last partial (the cluster's second CTA past N on the last pair); K = 5 1/8
    # stages, so the ring's slots drift across items and the last stage reads zeros past K.
    ("bf16", 2400, 4, 64, 520, 328, "uniform", False),
    ("bf16", 1024, 4, 16, 264, 136, "tail", True),  # N, K not multiples of the tiles; rows past off[E]
    ("bf16", 2048, 8, 64, 384, 256, "zero_rows", False),  # empty experts
    ("bf16", 256, 8, 128, 512, 256, "uniform", True),  # 16 rows per expert: one-chunk tiles
    # ~1000 rows per expert: 8 tiles of 128 or 4 of 256 (8 chunks), uneven experts.
    ("bf16", 4000, 2, 8, 384, 192, "uniform", False),
    ("w8a8-fp8-block128", 1024, 2, 8, 768, 512, "uniform", True),  # four 192-row blocks (six of 128)
    # Three 192-row blocks (the cluster's second CTA past N on the last pair, the last block's
    # second 128-row scale block past N), or four of 128; K = 3 stages against a 5- or 4-stage ring.
    ("w8a8-fp8-block128", 2400, 4, 64, 512, 384, "uniform", False),
    ("w8a8-fp8-block128", 1024, 4, 16, 256, 384, "tail", True),
    ("w8a8-fp8-block128", 2048, 8, 64, 384, 256, "zero_rows", False),
    ("w8a8-fp8-block128", 256, 8, 128, 512, 256, "uniform", True),
    # ~1000 rows per expert: 8 tiles of 128 or 4 of 256; three 128-row blocks (the cluster's
    # second CTA past N on the last pair).
    ("w8a8-fp8-block128", 4000, 2, 8, 384, 256, "uniform", False),
]
_WSP = {  # scheme: the switch, the kernel's launch counter
    "bf16": (gemm_ops.ENV_PREFILL_BF16_WSP, "HjPrefillBf16WspLaunches"),
    "w8a8-fp8-block128": (gemm_ops.ENV_PREFILL_FP8_WSP, "HjPrefillFp8WspLaunches"),
}


# The switch's values: 1 / 2 tiles of up to 128 tokens (one CTA per SM / clusters of two); 3 / 4
# tiles of up to 256 tokens.
_WSP_FORMS = ("1", "2", "3", "4")


@requires_prefill
@pytest.mark.parametrize("form,scheme,m,k,e,n,kdim,kind,bias",
                         [(f, *case) for case in WSP_CASES for f in _WSP_FORMS])
def test_prefill_persistent_kernel_matches_cpu_and_cutlass(rng, monkeypatch, form, scheme, m, k, e, n, kdim, kind,
                                                           bias):
    """HUMMING_JAX_PREFILL_BF16_WSP / _FP8_WSP = 1 to 4: our persistent bf16 or fp8 block-scaled
    kernel (tiles of up to 128 tokens, or 256, in 32-token MMAs; clusters of two
    sharing the tokens by multicast) runs, equals the CPU and the CUTLASS kind up to accumulation
    order, and is deterministic."""
    env, counter_name = _WSP[scheme]
    counter = _ffi.launch_counter(counter_name)
    monkeypatch.setenv(env, "0")
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, "1")
    p = _gemm_inputs(rng, scheme, m, k, e, n, kdim, kind, bias=bias)
    what = f"{scheme} {kind} M={m} top-{k} E={e} N={n} K={kdim} bias={bias}"
    with _LaunchCount(counter) as ours:
        cutlass, _ = _prefill_once_matches_cpu(p, what + " (CUTLASS)", "prefill")
    assert ours.count == 0, "at 0, the switch must leave the call to the CUTLASS kind"
    monkeypatch.setenv(env, form)
    with _LaunchCount(counter) as ours:
        got, _ = _prefill_once_matches_cpu(p, f"{what} persistent, switch {form}", "persistent")
        again = _run_gemm(GPU, p)
    assert ours.count == 2, "the persistent kernel did not run"
    _assert_close(got, cutlass, jnp.bfloat16, what + " against the CUTLASS kind")
    np.testing.assert_array_equal(again, got, err_msg=f"{what}: not deterministic")


def _persistent_bits_agree(monkeypatch, p, form, var, values, scheme="bf16"):
    """gemm_grouped of `p` on the persistent bf16 (or fp8) kernel's form `form` once for each value
    of the environment variable `var` (None: unset), each one launch equal to the CPU, all bit for
    bit the unset run's."""
    switch, counter = _WSP[scheme]
    monkeypatch.setenv(switch, form)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, "1")
    results = {}
    for value in (None, *values):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
        with _LaunchCount(_ffi.launch_counter(counter)) as ours:
            results[value], _ = _prefill_once_matches_cpu(p, f"{scheme} form {form} {var}={value}", "persistent")
        assert ours.count == 1, "the persistent kernel did not run"
    for value, got in results.items():
        np.testing.assert_array_equal(got, results[None], err_msg=f"{var}={value} differs from unset")


@requires_prefill
@pytest.mark.parametrize("form", ["3", "4"])
def test_prefill_persistent_work_order_groups_give_one_result(rng, monkeypatch, form):
    """The persistent kernel's work order ($HUMMING_JAX_PREFILL_WSP_GROUP: tiles per group, unset:
    2 or 8 by the call's weight blocks, prefill_wsp_sm90.cuh, tile_group) only reorders the work
    items: every group size, a last group partial or not, gives the same output bit for bit,
    equal to the CPU."""
    # ~150 rows per expert over 64 experts: ~128 tiles, three 192-row blocks (an odd count: the
    # cluster's second CTA past N on the last pair).
    p = _gemm_inputs(rng, "bf16", 2400, 4, 64, 520, 328, "uniform", bias=True)
    _persistent_bits_agree(monkeypatch, p, form, "HUMMING_JAX_PREFILL_WSP_GROUP", ("1", "3", "8", "1024"))


def _gather_call(x, ids, emap, w, b, e, k):
    r = routing_ops.routing_grouped(ids, emap, e)
    return gemm_ops.gemm_grouped_gather(x, w, b, r.permutation, r.expert_first_token_offset, k, out_dtype=x.dtype), \
        r.expert_first_token_offset


@requires_prefill
@pytest.mark.parametrize("form", ["1", "2", "3", "4"])
@pytest.mark.parametrize("m,k,e,n,kdim,kind", [
    (1024, 4, 16, 264, 136, "tail"),  # N, K not multiples of the tiles; dropped ids: rows past off[E]
    (2048, 8, 64, 384, 256, "zero_rows"),  # experts without rows
    (1024, 1, 8, 256, 512, "one_expert"),  # one expert's rows over many tiles
])
def test_prefill_gathered_tokens_equal_the_permuted_copy(rng, monkeypatch, form, m, k, e, n, kdim, kind):
    """gemm_grouped_gather on the persistent bf16 kernel reads the token rows through the
    permutation ($HUMMING_JAX_PREFILL_GATHER=2: on every form): bit for bit the result of the
    permuted copy on the same kernel (=0), equal to the CPU, rows past the last offset zeros; the
    result's memory poisoned with NaN first."""
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_BF16_WSP, form)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, "1")
    w = SCHEMES["bf16"].quantize((rng.standard_normal((e, n, kdim)) / np.sqrt(kdim)).astype(np.float32), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32) * 0.1)
    x = jnp.asarray(rng.standard_normal((m, kdim)), jnp.bfloat16)
    ids, emap = _routing_ids(rng, m, k, e, kind), _expert_map(e, kind)
    args = jax.device_put((x, ids, emap, w, b), GPU)
    results = {}
    for gather in ("2", "0"):
        monkeypatch.setenv(gemm_ops.ENV_PREFILL_GATHER, gather)
        f = jax.jit(_gather_call, static_argnums=(5, 6))
        junk = jax.device_put(jnp.full((m * k, n), jnp.nan, jnp.bfloat16), GPU)
        junk.block_until_ready()
        del junk
        with _LaunchCount(_ffi.launch_counter("HjPrefillGatherLaunches")) as gathered, \
                _LaunchCount(_ffi.launch_counter("HjPrefillBf16WspLaunches")) as ours:
            c, off = jax.block_until_ready(f(*args, e, k))
        assert ours.count == 1, f"gather {gather}: the persistent kernel did not run"
        assert gathered.count == (1 if gather == "2" else 0), f"gather {gather}: {gathered.count} gathered launches"
        results[gather] = _to_np(c)
    got = results["2"]
    np.testing.assert_array_equal(got, results["0"], err_msg="gathered rows differ from the permuted copy's")
    want, _ = jax.jit(_gather_call, static_argnums=(5, 6))(*jax.device_put((x, ids, emap, w, b), CPU), e, k)
    _assert_close(got, _to_np(want), jnp.bfloat16, f"form {form} {kind}")
    last = int(np.asarray(off)[-1])
    assert last < m * k or kind != "tail"
    assert np.all(got[last:] == 0.0), "rows past the last expert must be zeros"


@requires_prefill
def test_prefill_gather_switch_picks_the_forms(rng, monkeypatch):
    """gemm_grouped_gather gathers nowhere with $HUMMING_JAX_PREFILL_GATHER unset; with =1 on the
    forms on one CTA per SM only (those on clusters of two read the permuted copy by multicast;
    cuda_ffi/gemm_prefill_sm90.cu, try_grouped)."""
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, "1")
    m, k, e, n, kdim = 1024, 2, 8, 256, 256
    w = SCHEMES["bf16"].quantize((rng.standard_normal((e, n, kdim)) / np.sqrt(kdim)).astype(np.float32), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, kdim)), jnp.bfloat16)
    args = jax.device_put((x, _routing_ids(rng, m, k, e, "uniform"), _expert_map(e, "uniform"), w, None), GPU)
    for switch, form, gathers in ((None, "3", False), ("1", "3", True), ("1", "4", False)):
        if switch is None:
            monkeypatch.delenv(gemm_ops.ENV_PREFILL_GATHER, raising=False)
        else:
            monkeypatch.setenv(gemm_ops.ENV_PREFILL_GATHER, switch)
        monkeypatch.setenv(gemm_ops.ENV_PREFILL_BF16_WSP, form)
        with _LaunchCount(_ffi.launch_counter("HjPrefillGatherLaunches")) as gathered:
            jax.block_until_ready(jax.jit(_gather_call, static_argnums=(5, 6))(*args, e, k))
        assert gathered.count == int(gathers), f"switch {switch} form {form}"


def _gated_inputs(rng, m, k, e, n, kdim, kind):
    w = SCHEMES["bf16"].quantize((rng.standard_normal((e, n, kdim)) / np.sqrt(kdim)).astype(np.float32), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32) * 0.1)
    x = jnp.asarray(rng.standard_normal((m, kdim)), jnp.bfloat16)
    return x, _routing_ids(rng, m, k, e, kind), _expert_map(e, kind), w, b


def _run_gated(args, k, activation, limit):
    """One jitted gated call on the GPU (its results' memory poisoned with NaN first): (fused, two,
    offsets) as NumPy, and the launches of the gated epilogue and of the persistent kernel."""
    junk = jax.device_put(jnp.full((args[0].shape[0] * k, args[3].n), jnp.nan, jnp.bfloat16), GPU)
    junk.block_until_ready()
    del junk
    f = jax.jit(grouped_gated_both, static_argnums=(5, 6))
    with _LaunchCount(_ffi.launch_counter("HjPrefillGatedLaunches")) as gated, \
            _LaunchCount(_ffi.launch_counter("HjPrefillBf16WspLaunches")) as ours:
        fused, two, off = jax.block_until_ready(f(*args, activation, limit))
    return (_to_np(fused), _to_np(two), np.asarray(off)), gated.count, ours.count


@requires_prefill
@pytest.mark.parametrize("form", ["3", "4"])
@pytest.mark.parametrize("activation,limit", [("silu", None), ("swigluoai", 7.0), ("gelu_tanh", None)])
@pytest.mark.parametrize("m,k,e,n,kdim,kind", [
    (1024, 4, 16, 400, 136, "tail"),  # N / 2 = 200: a last block part past it; K tail; dropped ids
    (2048, 8, 64, 400, 256, "zero_rows"),  # experts without rows; a warpgroup's columns all past N / 2
    (1024, 1, 8, 256, 512, "one_expert"),  # one expert's rows over many tiles
])
def test_prefill_gated_epilogue_equals_two_calls(rng, monkeypatch, form, activation, limit, m, k, e, n, kdim, kind):
    """gemm_grouped_gated on the persistent bf16 kernel's 256-token forms writes act(gate, up) of its
    rounded rows (each warpgroup the gate and up rows of its 32 columns: the halves layout's two
    boxes, swigluoai's interleaved rows): bit for bit gemm_grouped + the activation kernel on the
    same kernel, equal to the CPU, rows past the last offset zeros."""
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_BF16_WSP, form)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, "1")
    args = _gated_inputs(rng, m, k, e, n, kdim, kind)
    (fused, two, off), gated, ours = _run_gated(jax.device_put(args, GPU), k, activation, limit)
    assert gated == 1, f"{gated} gated launches"
    assert ours == 2, f"{ours} launches of the persistent kernel (the gated call and the plain one)"
    assert np.all(np.isfinite(fused)) and np.any(fused != 0.0)
    np.testing.assert_array_equal(fused, two, err_msg="the gated epilogue differs from GEMM + activation")
    want, _, _ = jax.jit(grouped_gated_both, static_argnums=(5, 6))(*jax.device_put(args, CPU), activation, limit)
    _assert_close(fused, _to_np(want), jnp.bfloat16, f"form {form} {activation} {kind}")
    last = int(off[-1])
    assert last < m * k or kind != "tail"
    assert np.all(fused[last:] == 0.0), "rows past the last expert must be zeros"


@requires_prefill
@pytest.mark.parametrize("form,n", [("1", 256), ("2", 256), ("3", 408), ("0", 256)])
def test_prefill_gated_call_activates_apart_where_the_epilogue_cannot(rng, monkeypatch, form, n):
    """Where the kernel has no gated epilogue (the 128-token forms, N / 2 not whole 16-byte runs, the
    CUTLASS kind) gemm_grouped_gated runs the GEMM, then the activation kernel: the same bits."""
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_BF16_WSP, form)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, "1")
    args = jax.device_put(_gated_inputs(rng, 1024, 2, 8, n, 256, "uniform"), GPU)
    (fused, two, _), gated, _ = _run_gated(args, 2, "silu", None)
    assert gated == 0, f"{gated} gated launches"
    assert np.all(np.isfinite(fused)) and np.any(fused != 0.0)
    np.testing.assert_array_equal(fused, two)


@requires_prefill
def test_grouped_layer_gates_in_gemm1_and_matches_the_reference(rng, monkeypatch):
    """The grouped class at a prefill size with $HUMMING_JAX_FUSED_ACTIVATION=2: GEMM1's kernel
    writes the activated rows (one gated launch a call), bit for bit the separate activation (=0),
    within bf16 rounding of the float reference."""
    for var in (gemm_ops.ENV_PREFILL_BF16_WSP, gemm_ops.ENV_PREFILL_GATHER, gemm_ops.ENV_PREFILL_MIN_ROWS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HUMMING_JAX_FUSED_ACTIVATION", "2")
    layer = random_layer(rng, m=1024, e=16, h=512, i=256, k=4, bias=True)
    args = jax.device_put((layer.x, layer.weights, layer.topk_weights, layer.topk_ids), GPU)
    # The switch is read when the class is traced: a fresh function each time.
    run = lambda: jax.block_until_ready(jax.jit(lambda x, w, tw, ids: hj.fused_moe(x, w, tw, ids, gemm_type="grouped"))(*args))
    with _LaunchCount(_ffi.launch_counter("HjPrefillGatedLaunches")) as gated:
        got = run()
    assert gated.count == 1, f"{gated.count} gated launches"
    monkeypatch.setenv("HUMMING_JAX_FUSED_ACTIVATION", "0")
    with _LaunchCount(_ffi.launch_counter("HjPrefillGatedLaunches")) as gated:
        apart = run()
    assert gated.count == 0
    np.testing.assert_array_equal(_to_np(got), _to_np(apart))
    from conftest import reference

    ref = reference(layer, b13=layer.weights.b13, b2=layer.weights.b2)
    assert relative_error(got, ref) < 1.2e-2


@requires_prefill
def test_grouped_layer_gathers_with_the_switch_and_matches_the_reference(rng, monkeypatch):
    """The grouped class at a prefill size with $HUMMING_JAX_PREFILL_GATHER=1: GEMM1 gathers its
    rows (one gathered launch a call), bit for bit the default's permuted rows, within bf16
    rounding of the float reference."""
    for var in (gemm_ops.ENV_PREFILL_BF16_WSP, gemm_ops.ENV_PREFILL_GATHER, gemm_ops.ENV_PREFILL_MIN_ROWS):
        monkeypatch.delenv(var, raising=False)
    layer = random_layer(rng, m=1024, e=16, h=512, i=256, k=4)  # 256 rows an expert: one CTA per SM
    args = jax.device_put((layer.x, layer.weights, layer.topk_weights, layer.topk_ids), GPU)
    # The switch is read when the class is traced: a fresh function each time.
    run = lambda: jax.block_until_ready(jax.jit(lambda x, w, tw, ids: hj.fused_moe(x, w, tw, ids, gemm_type="grouped"))(*args))
    want = run()
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_GATHER, "1")
    with _LaunchCount(_ffi.launch_counter("HjPrefillGatherLaunches")) as gathered:
        got = run()
    assert gathered.count == 1, f"{gathered.count} gathered launches"
    np.testing.assert_array_equal(_to_np(got), _to_np(want))
    from conftest import reference

    assert relative_error(got, reference(layer)) < 1.2e-2


@requires_prefill
@pytest.mark.parametrize("scheme,m,k,e,n,kdim,ours_expected", [
    # bf16: ours below 2048 rows per expert.
    ("bf16", 1024, 2, 8, 384, 256, True),  # 256 rows per expert: tiles of 256 tokens, one CTA per SM
    ("bf16", 2048, 4, 8, 384, 256, True),  # 1024 rows per expert: clusters of two
    ("bf16", 4096, 4, 8, 384, 256, False),  # 2048 rows per expert: the CUTLASS kind
    # fp8: ours for experts under 8 Mi weight elements from 32 rows per expert.
    ("w8a8-fp8-block128", 1024, 2, 8, 384, 256, True),  # 256 rows per expert, small experts
    ("w8a8-fp8-block128", 256, 2, 8, 384, 256, True),  # 64 rows per expert
    ("w8a8-fp8-block128", 128, 2, 8, 384, 256, True),  # 32 rows per expert: the rule's lower end
    ("w8a8-fp8-block128", 128, 2, 2, 8192, 1024, False),  # 8 Mi weight elements an expert: CUTLASS
])
def test_prefill_default_rule(rng, monkeypatch, scheme, m, k, e, n, kdim, ours_expected):
    """$HUMMING_JAX_PREFILL_BF16_WSP / _FP8_WSP unset: bf16 and w8a8-fp8-block128 grouped calls
    take our persistent kernel or the CUTLASS kinds by their rules (cuda_ffi/gemm_prefill_sm90.cu,
    wsp_form), equal to the CPU either way."""
    switch, counter = _WSP[scheme]
    for var in (switch, gemm_ops.ENV_PREFILL_MIN_ROWS):
        monkeypatch.delenv(var, raising=False)
    p = _gemm_inputs(rng, scheme, m, k, e, n, kdim, "uniform", bias=scheme == "bf16")
    what = f"{scheme} M={m} top-{k} E={e} N={n} K={kdim}"
    with _LaunchCount(_ffi.launch_counter(counter)) as ours:
        _prefill_once_matches_cpu(p, what, "prefill")
    assert ours.count == (1 if ours_expected else 0), f"{what}: the default rule picked the other kernel"


# Decode sizes on the prefill kinds ($HUMMING_JAX_PREFILL_MIN_ROWS=1): experts of 0-8 rows, tiles of
# 16 tokens mostly empty. scheme, M, top-k, E, N, K, routing
PREFILL_AT_DECODE_SIZES = [
    ("w4a16-int4-g128", 16, 4, 8, 256, 512, "uniform"),  # 8 rows per expert
    ("w4a16-int4-g128", 4, 4, 16, 264, 256, "uniform"),  # one row per expert on average, some empty
    ("w4a16-mxfp4", 4, 2, 8, 256, 512, "tail"),  # rows past off[E]
    ("w4a16-mxfp4", 16, 8, 64, 384, 256, "zero_rows"),
    ("bf16", 5, 2, 8, 256, 512, "uniform"),
]


@requires_prefill
@pytest.mark.parametrize("scheme,m,k,e,n,kdim,kind", PREFILL_AT_DECODE_SIZES)
def test_prefill_kinds_at_decode_sizes_match_cpu(rng, monkeypatch, scheme, m, k, e, n, kdim, kind):
    """The prefill kinds taking calls of 1-8 rows per expert on average (the run-time threshold at
    1; M * top-k >= E): one prefill launch, equal to the CPU, rows past off[E] zero."""
    for var in (gemm_ops.ENV_PREFILL_FP4, gemm_ops.ENV_PREFILL_U4RS, gemm_ops.ENV_PREFILL_MIXED):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, "1")
    weight = _mixed_weight(rng, e, n, kdim, 128) if scheme.startswith("w4a16-int4") else None
    p = _gemm_inputs(rng, scheme, m, k, e, n, kdim, kind, dtype=jnp.bfloat16, weight=weight)
    what = f"{scheme} {kind} M={m} E={e} N={n} K={kdim}"
    _prefill_once_matches_cpu(p, what, "prefill")


@requires_prefill
@pytest.mark.parametrize("m", [256, 1024])  # 64 and 256 rows per expert
def test_prefill_mxfp4_extreme_scales_match_cpu_per_column(rng, monkeypatch, m):
    """e8m0 scales at the edges of the in-register conversion: 2^-127 (s = 0, subnormal w'), the
    largest single factor (s = 128) and the two-factor case (s > 128), checked column by column
    (each output column is one weight row with its own scales)."""
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_FP4, raising=False)
    e, n, kdim = 8, 256, 256
    w = _custom_weight(rng, WeightType.FP4_E2M1, e, n, kdim, 32, np.uint8,
                       scale_values=np.array([0, 1, 100, 127, 128, 129, 140, 160], np.uint8))
    p = _gemm_inputs(rng, "w4a16-mxfp4", m, 2, e, n, kdim, "uniform", dtype=jnp.bfloat16, weight=w)
    with _LaunchCount(_PREFILL_LAUNCHES) as launched:
        got = _run_gemm(GPU, p)
    assert launched.count == 1
    want = _run_gemm(CPU, p, poison=False)
    assert np.all(np.isfinite(got))
    for col in np.nonzero(np.abs(want).max(axis=0) > 0)[0]:
        np.testing.assert_allclose(got[:, col], want[:, col], rtol=2e-2, atol=2e-2 * np.abs(want[:, col]).max(),
                                   err_msg=f"column {col}")


@requires_prefill
@pytest.mark.parametrize(
    "what,make",
    [
        ("fp16 activations", lambda rng: (SCHEMES["w4a16-int4-g128"].quantize(
            (rng.standard_normal((8, 256, 512)) / 16).astype(np.float32), jnp.float16), jnp.float16)),
        ("zero points", lambda rng: (SCHEMES["w4a16-uint4-zp-g128"].quantize(
            (rng.standard_normal((8, 256, 512)) / 16).astype(np.float32), jnp.bfloat16), jnp.bfloat16)),
        ("float32 scales", lambda rng: (random_packed_weight(rng, WeightType.UINT4, 8, 256, 512, 128,
                                                             scale_dtype=np.float32), jnp.bfloat16)),
        ("32-k groups", lambda rng: (random_packed_weight(rng, WeightType.UINT4, 8, 256, 512, 32,
                                                          scale_dtype=jnp.bfloat16), jnp.bfloat16)),
    ],
)
def test_prefill_mixed_input_declines_to_the_dequantizing_path(rng, what, make):
    """int4 calls the mixed-input kernel does not take keep the dequantizing path (its buffer is
    requested, one launch), with the CPU's result."""
    w, dtype = make(rng)
    p = _gemm_inputs(rng, "w4a16-int4-g128", 1024, 2, 8, 256, 512, "uniform", bias=True, dtype=dtype, weight=w)
    assert not gemm_ops.mixed_prefill(p["a"].shape[0], p["w"], dtype, False), what
    assert gemm_ops.dequant_buffer_bytes(p["a"].shape[0], p["w"], dtype, False) > 0, what
    with _LaunchCount(_PREFILL_LAUNCHES) as launched:
        got = _run_gemm(GPU, p)
    assert launched.count == 1, what
    _assert_close(got, _run_gemm(CPU, p, poison=False), dtype, what)


@requires_prefill
@pytest.mark.parametrize("scheme,dtype,kdim,mixed", [
    # int4 with bf16 scales and activations: the mixed-input kind's in-register w', and the
    # dequantizing path's (HUMMING_JAX_PREFILL_MIXED=0)
    ("w4a16-int4-g128", jnp.bfloat16, 256, True), ("w4a16-int4-g128", jnp.bfloat16, 256, False),
    # mxfp4 with bf16 activations: the MXFP4 kind's in-register w' (K = 3 and 4 tiles), and the
    # dequantizing path's (HUMMING_JAX_PREFILL_FP4=0)
    ("w4a16-mxfp4", jnp.bfloat16, 256, True), ("w4a16-mxfp4", jnp.bfloat16, 192, True),
    # int4 on the 4-bit mainloop (its bound lifted to the test's 256 rows per expert)
    ("w4a16-int4-g128", jnp.bfloat16, 256, "rs4"),
    # the dequantizing path: power-of-two groups (the scale column by a shift) of 16, 32, 128, K
    ("w4a16-int4-g128", jnp.float16, 256, False), ("w4a16-uint4-zp-g128", jnp.bfloat16, 256, False),
    ("w4a16-mxfp4", jnp.bfloat16, 256, False), ("w4a16-nvfp4", jnp.bfloat16, 256, False),
    ("w8a16-int8-channel", jnp.bfloat16, 256, False), ("w8a16-fp8-block128", jnp.float16, 256, False),
    ("w8a16-fp8-block128", jnp.bfloat16, 256, False),
    # K = 136: 17 runs per row (lanes past the row's end) and a group of 136 (a division)
    ("w8a16-int8-channel", jnp.float16, 136, False),
])
def test_prefill_quantized_weights_are_exact(rng, monkeypatch, scheme, dtype, kdim, mixed):
    """One-hot activation rows make each output row one column of the dequantized weights (acc = w'
    exactly, no bias): the prefill paths for quantized weights must give the CPU's w' bit for bit."""
    if not mixed:
        monkeypatch.setenv("HUMMING_JAX_PREFILL_MIXED", "0")
        monkeypatch.setenv("HUMMING_JAX_PREFILL_FP4", "0")
    monkeypatch.setenv("HUMMING_JAX_PREFILL_U4RS", "512" if mixed == "rs4" else "0")
    # 4-bit codes are dequantized from 128 rows per expert, 8-bit ones from 64.
    p = _gemm_inputs(rng, scheme, 1024 if scheme.startswith("w4") else 256, 2, 8, 256, kdim, "uniform", dtype=dtype)
    rows = p["a"].shape[0]
    assert rows >= gemm_ops.dequant_min_rows_per_expert(p["w"]) * 8
    hot = np.zeros((rows, kdim), np.float32)
    hot[np.arange(rows), (np.arange(rows) * 7 + int(rng.integers(kdim))) % kdim] = 1.0
    p["a"] = jax.device_put(jnp.asarray(hot, dtype), GPU)
    with _LaunchCount(_PREFILL_LAUNCHES) as launched:
        got = _run_gemm(GPU, p)
    assert launched.count == 1, "the prefill kernel did not run"
    want = _run_gemm(CPU, p, poison=False)
    assert np.count_nonzero(want) > want.size // 2, "the weights must not be mostly zeros"
    np.testing.assert_array_equal(got, want, err_msg=f"{scheme} {jnp.dtype(dtype).name} K={kdim}")


@requires_prefill
def test_prefill_small_experts_keep_the_generic_kernel(rng):
    p = _gemm_inputs(rng, "bf16", 64, 2, 8, 256, 256, "uniform")  # 16 rows per expert
    with _LaunchCount(_PREFILL_LAUNCHES) as launched:
        _run_gemm(GPU, p, poison=False)
    assert launched.count == 0


@requires_prefill
@pytest.mark.parametrize("scheme,tile", [("bf16", "64"), ("bf16", "128"), ("w8a8-fp8-block128", "64"),
                                         ("w8a8-fp8-block128", "128"), ("w4a16-int4-g128", "64"),
                                         ("w4a16-int4-g128", "128"), ("w4a16-int4-g128", "256")])
def test_prefill_tile_heights_agree(rng, monkeypatch, scheme, tile):
    """HUMMING_JAX_PREFILL_TILE forces one tile height: 64-row tiles on 512 rows per expert (eight
    tiles each, uneven last ones), 128- and 256-row tiles on 48 rows per expert, all as on the CPU."""
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_MIXED, raising=False)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_BF16_WSP, "0")  # the tile heights are the CUTLASS kinds'
    monkeypatch.setenv("HUMMING_JAX_PREFILL_TILE", tile)
    m = 1024 if tile == "64" else 96
    p = _gemm_inputs(rng, scheme, m, 8, 16, 384, 256, "uniform", bias=True)
    with _LaunchCount(_PREFILL_LAUNCHES) as launched:
        got = _run_gemm(GPU, p)
    assert launched.count == 1
    _assert_close(got, _run_gemm(CPU, p, poison=False), p["dtype"], f"{scheme} on {tile}-row tiles")


@requires_prefill
@pytest.mark.parametrize("scheme,m", [("bf16", 2048), ("w8a8-fp8-block128", 2048), ("bf16", 192), ("w8a8-fp8-block128", 192),
                                      ("w4a16-int4-g128", 2048), ("w4a16-int4-g128", 192)])
def test_prefill_is_deterministic(rng, scheme, m):
    p = _gemm_inputs(rng, scheme, m, 4, 16, 1024, 1024, "uniform", bias=True)
    runs = [_run_gemm(GPU, p) for _ in range(3)]
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])


@requires_prefill
# $HUMMING_JAX_PREFILL_BF16_WSP, workspace bytes, the kind named: the CUTLASS kind (its scheduler's
# scratch), our persistent kernel by its switch and by the default rule (its tile list, 656 bytes).
@pytest.mark.parametrize("switch,ws,kind", [("0", 1024, "bf16"), ("3", 512, "bf16-wsp"), (None, 512, "bf16-wsp")])
def test_prefill_rejects_a_too_small_workspace(rng, monkeypatch, switch, ws, kind):
    if switch is None:
        monkeypatch.delenv(gemm_ops.ENV_PREFILL_BF16_WSP, raising=False)
    else:
        monkeypatch.setenv(gemm_ops.ENV_PREFILL_BF16_WSP, switch)
    p = _gemm_inputs(rng, "bf16", 1024, 2, 8, 256, 256, "uniform")
    ops, attrs = gemm_ops._operands(p["a"], None, p["w"], None, 0)
    shapes = (jax.ShapeDtypeStruct((p["a"].shape[0], 256), jnp.bfloat16), jax.ShapeDtypeStruct((ws,), jnp.uint8))
    f = jax.jit(lambda *ops: _ffi.call("gemm_grouped", shapes, *ops, **attrs, a_k_order=0))
    with pytest.raises(Exception, match=rf"the {kind} prefill kernel needs \d+"):
        jax.block_until_ready(f(*ops, p["off"]))


@requires_prefill
@pytest.mark.parametrize(
    "scheme,bias,e_global",
    [("bf16", False, None), ("bf16", True, None), ("fp16", False, None), ("w8a8-fp8-block128", False, None),
     ("bf16", False, 16), ("w8a8-fp8-block128", False, 16), ("w4a16-int4-g128", True, None),
     ("w4a16-int4-g128", False, 16), ("w4a16-mxfp4", True, None), ("w4a16-mxfp4", False, 16)],
)
def test_prefill_layer_against_oracle_with_poisoned_out(rng, scheme, bias, e_global):
    layer = random_layer(rng, m=1024, e=8, h=512, i=256, k=2, scheme=scheme, bias=bias, e_global=e_global,
                         pad_frac=0.05 if e_global else 0.0)
    args = jax.device_put((layer.x, layer.weights, layer.topk_weights, layer.topk_ids), GPU)
    f = jax.jit(lambda out, x, w, tw, ids: GroupedExperts().apply(out, x, w, tw, ids))
    with _LaunchCount(_PREFILL_LAUNCHES) as launched:
        got = f(jax.device_put(nan_out(layer.x.shape, layer.x.dtype), GPU), *args)
        got = jax.block_until_ready(got)
    assert launched.count == 2, "both GEMMs of the layer should take the prefill kernel"
    quant = act_quant_params(layer.weights.act_key)
    b13, b2 = (layer.weights.b13, layer.weights.b2) if bias else (None, None)
    want = moe_reference(layer.x, layer.w13, layer.w2, layer.topk_weights, layer.topk_ids,
                         input_quant=InputQuant(*quant) if quant else None, b13=b13, b2=b2)
    tol = TOL[jnp.dtype(layer.x.dtype)] + (2.0**-4 if quant else 0.0)
    assert np.all(np.isfinite(_to_np(got)))
    err = relative_error(got, want)
    assert err <= tol, f"{scheme}: relative error {err:.2e} > {tol:.1e}"


@requires_prefill
@pytest.mark.parametrize("scheme,m", [("w4a16-mxfp4", 1024), ("w4a16-int4-g128", 512), ("w4a16-mxfp4", 128)])
def test_rs4_act_order_gives_the_natural_orders_bits(rng, monkeypatch, scheme, m):
    """The grouped class on the 4-bit mainloop with its rows written in the mainloop's k order
    (permute_rows and the activation, gemm.rs4_act_order) against the same layer with
    $HUMMING_JAX_RS4_ACT_ORDER=0 (rows copied into that order by the GEMM): the same bits, both
    GEMMs on the mainloop. Then GEMM1 as a raw call with k-ordered rows and the workspace the
    wrapper sizes for the mainloop, traced after $HUMMING_JAX_PREFILL_FP4=0 / _U4RS=0 turned the
    mainloop off (the wrapper itself only sends the order to calls the mainloop takes; a fresh trace,
    so the handler runs, command buffers or not): the handler puts the rows back in their natural
    order for the kernel that takes the call, as the CPU's natural-order call up to accumulation
    order."""
    for var in (gemm_ops.ENV_RS4_ACT_ORDER, gemm_ops.ENV_PREFILL_FP4, gemm_ops.ENV_PREFILL_U4RS,
                gemm_ops.ENV_PREFILL_MIXED):
        monkeypatch.delenv(var, raising=False)
    layer = random_layer(rng, m=m, e=8, h=512, i=256, k=2, scheme=scheme)  # 256 / 128 / 32 rows per expert
    args = jax.device_put((layer.x, layer.weights, layer.topk_weights, layer.topk_ids), GPU)
    rows = m * 2
    assert gemm_ops.rs4_act_order(rows, layer.weights.w13, jnp.bfloat16) and gemm_ops.rs4_act_order(
        rows, layer.weights.w2, jnp.bfloat16)

    def run(f):
        out = jax.device_put(nan_out(layer.x.shape, layer.x.dtype), GPU)
        return _to_np(jax.block_until_ready(f(out, *args)))

    ordered_f = jax.jit(lambda out, x, w, tw, ids: GroupedExperts().apply(out, x, w, tw, ids))
    with _LaunchCount(_RS4_TWO_SLAB_LAUNCHES) as two, _LaunchCount(_RS4_ONE_SLAB_LAUNCHES) as one:
        ordered = run(ordered_f)
    assert two.count + one.count == 2, f"{scheme}: both GEMMs on the 4-bit mainloop ({two.count} + {one.count})"
    monkeypatch.setenv(gemm_ops.ENV_RS4_ACT_ORDER, "0")
    natural = run(jax.jit(lambda out, x, w, tw, ids: GroupedExperts().apply(out, x, w, tw, ids)))
    assert np.all(np.isfinite(ordered))
    np.testing.assert_array_equal(ordered, natural, err_msg=f"{scheme} M={m}: k-ordered rows differ")
    monkeypatch.delenv(gemm_ops.ENV_RS4_ACT_ORDER)
    w = layer.weights.w13
    r = routing_ops.routing_grouped(layer.topk_ids, jnp.arange(8, dtype=jnp.int32), 8)
    a = routing_ops.permute_rows(layer.x, r, 2)
    a_ordered = jnp.asarray(_to_np(a)[:, gemm_ops.rs4_column_order(a.shape[1])], jnp.bfloat16)
    ws = gemm_ops._grouped_workspace(rows, jnp.bfloat16, None, w, jnp.bfloat16)  # with the mainloop's room
    ops, attrs = gemm_ops._operands(a_ordered, None, w, None, 0)
    shapes = (jax.ShapeDtypeStruct((rows, w.n), jnp.bfloat16), jax.ShapeDtypeStruct((ws,), jnp.uint8))
    off = r.expert_first_token_offset
    want = _run_on(CPU, lambda a, o, w: {"c": gemm_ops.gemm_grouped(a, None, w, None, o, out_dtype=jnp.bfloat16)},
                   (a, off, w))["c"]
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_FP4 if scheme == "w4a16-mxfp4" else gemm_ops.ENV_PREFILL_U4RS, "0")
    with _LaunchCount(_RS4_TWO_SLAB_LAUNCHES) as two, _LaunchCount(_RS4_ONE_SLAB_LAUNCHES) as one:
        got = _run_on(GPU, lambda *o: {"c": _ffi.call("gemm_grouped", shapes, *o, **attrs, a_k_order=1)[0]},
                      (*ops, off))["c"]
    assert two.count + one.count == 0, f"{scheme}: the 4-bit mainloop ran though switched off"
    _assert_close(got, want, jnp.bfloat16, f"{scheme} M={m}: the natural rows back from the k order")


@requires_prefill
@pytest.mark.parametrize("scheme", ["bf16", "w8a8-fp8-block128", "w4a16-int4-g128", "w4a16-mxfp4"])
def test_prefill_command_buffers_give_the_same_results(tmp_path, scheme):
    """CUDA-graph capture and replay (command buffers on) against plain execution, in fresh
    processes (so the first use of the kernel, with its one-time setup, happens under capture)."""
    results, launches = replay_both_ways(tmp_path, scheme=scheme, classes=("GroupedExperts",), e=8, h=512, i=256,
                                         k=2, m=1024, seed=11, extra_ids=2, w_scale=(22, 16),
                                         counter="HjPrefillLaunches")
    assert launches["plain"] >= 12, launches  # two GEMMs per step
    assert np.all(np.isfinite(results["graphs"]))
    np.testing.assert_array_equal(results["graphs"], results["plain"])


# ================================================================================================
# Decode: the weight-streaming GEMM (cuda_ffi/gemm_decode_sm90*). It takes gemm_indexed calls with
# block_m <= 16, gemm_grouped calls with at most 16 rows per local expert on average (64 for
# quantized weights with 16-bit activations, below the dequantizing prefill path) and
# gemm_batched calls with T <= 16, when weight and activation rows are 16-byte aligned (K a
# multiple of 8 for 16-bit weights, 16 for 8-bit, 32 for 4-bit) and the weight scale groups fit its
# lane chunks (8-bit activations: scale groups of whole 64-k / 128-k chunk columns, so
# w4a8-mxfp4-fp8 stays on the generic kernel). HUMMING_JAX_DECODE=0 turns it off.
# ================================================================================================
_DECODE_LAUNCHES = _ffi.launch_counter("HjDecodeLaunches") if GPU is not None else None

requires_decode = pytest.mark.skipif(
    _DECODE_LAUNCHES is None or not _SM90,
    reason="decode path absent: library built without HUMMING_JAX_FAST_PATHS, or not an sm_90 device",
)



# M tokens, top-k, local experts, N, K: E up to 128, k up to 8, odd and even N (not multiples of
# the 32-row warp tile), K a multiple of 128 (int4 and fp8 groups).
_DECODE_SHAPES = [(1, 8, 128, 72, 256), (3, 2, 8, 131, 384), (16, 4, 16, 96, 256), (16, 8, 32, 200, 128)]

# Every scheme at its default activation type on every shape, plus (on one shape) the paths other
# activation types select: fp16 activations with int4 (the packed path in f16) and with e2m1,
# int8 or fp8 codes (the float32 path).
_DECODE_CASES = [(s, SCHEMES[s].default_dtype, shape) for s in sorted(SCHEMES) if s != "w4a8-mxfp4-fp8"
                 for shape in _DECODE_SHAPES] + [
    (s, jnp.float16, _DECODE_SHAPES[1])
    for s in ("w4a16-int4-g128", "w4a16-uint4-zp-g128", "w4a16-mxfp4", "w4a16-nvfp4", "w8a16-int8-channel",
              "w8a16-fp8-block128")
]


def _decode_weights(rng, scheme, dtype, e, n, kdim):
    return SCHEMES[scheme].quantize((rng.standard_normal((e, n, kdim)) / np.sqrt(kdim)).astype(np.float32), dtype)


def _decode_routing(rng, m, k, e):
    """topk ids over e local experts and 2 remote ones (map -1), distinct per token, ~10% padding."""
    ids = np.argsort(rng.random((m, e + 2)), axis=1)[:, :k]
    ids = np.where(rng.random((m, k)) < 0.1, -1, ids).astype(np.int32)
    emap = np.concatenate([np.arange(e), [-1, -1]]).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(emap)


def _decode_forms(rng, w, bias, dtype, quant, m, k, t=5):
    """All decode-sized GEMM calls on one random problem (humming_jax.testing.gemm_forms) over
    _decode_routing's ids. Returns (fn, operands); operands[5] are the batched counts."""
    ids, emap = _decode_routing(rng, m, k, w.num_experts)
    return gemm_forms(rng, w, bias, dtype, quant, ids, emap, t)


def _run_on(dev, fn, operands):
    placed = jax.device_put(operands, dev)
    return {name: _to_np(v) for name, v in jax.block_until_ready(jax.jit(fn)(*placed)).items()}


def _check_decode_forms(got, want, dtype, what, counts, t):
    """GPU against CPU results of _decode_forms: every form equal up to accumulation order, every
    row that must be written finite, zero rows exactly zero."""
    np.testing.assert_array_equal(got["src"], want["src"])
    valid = want["src"].reshape(-1) >= 0  # rows of c the indexed GEMMs write
    for name in ("c1", "c2"):
        _assert_close(got[name][valid], want[name][valid], dtype, f"{what} indexed {name}")
    _assert_close(got["cg"], want["cg"], dtype, f"{what} grouped")
    last = int(want["off"][-1])
    assert np.all(got["cg"][last:] == 0.0), f"{what}: grouped rows past off[E] must be zeros"
    for name in ("cb", "cbi"):
        _assert_close(got[name], want[name], dtype, f"{what} {name}")
        for e, cnt in enumerate(np.clip(np.asarray(counts), 0, t)):
            assert np.all(got[name][e, cnt:] == 0.0), f"{what} {name}: rows past the count must be zeros"


def _decode_forms_match_cpu(rng, w, bias, dtype, quant, m, k, t, what):
    """The five decode-sized GEMM calls of one random problem run on the decode kernel on the GPU
    and agree with the CPU (_check_decode_forms)."""
    fn, ops = _decode_forms(rng, w, bias, dtype, quant, m, k, t)
    with _LaunchCount(_DECODE_LAUNCHES) as launched:
        got = _run_on(GPU, fn, ops)
    assert launched.count == 5, f"{what}: expected the five GEMM calls on the decode kernel, got {launched.count}"
    want = _run_on(CPU, fn, ops)
    _check_decode_forms(got, want, dtype, what, ops[5], t)


@requires_decode
@pytest.mark.parametrize("scheme,dtype,shape", _DECODE_CASES,
                         ids=[f"{s}-{jnp.dtype(d).name}-M{sh[0]}E{sh[2]}N{sh[3]}" for s, d, sh in _DECODE_CASES])
def test_decode_every_scheme_and_form_matches_cpu(rng, scheme, dtype, shape):
    m, k, e, n, kdim = shape
    w = _decode_weights(rng, scheme, dtype, e, n, kdim)
    bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32) * 0.1) if m == 3 else None
    quant = act_quant_params(SCHEMES[scheme].act_key)
    _decode_forms_match_cpu(rng, w, bias, dtype, quant, m, k, 5, f"{scheme}/{jnp.dtype(dtype).name} M={m}")


@requires_decode
@pytest.mark.parametrize("pre_permute", ["1", "0"])
@pytest.mark.parametrize("scheme", ["w4a16-int4-g128", "w4a16-mxfp4", "w8a8-fp8-block128", "bf16"])
def test_decode_more_items_than_resident_ctas_match_cpu(rng, monkeypatch, scheme, pre_permute):
    """More work items than CTAs resident at once: 16 slices of N = 4096 and 32 experts give ~40
    indexed blocks and 32 batched items per slice, several waves of CTAs. The items hold their
    activations whole; the 4-bit ones permute them once per item (the default) or per MMA step
    (HUMMING_JAX_DECODE_PRE_PERMUTE=0). fp8 stays on the decode kernel (its ring kernel is tested
    at such shapes in test_decode_fp8_variants_match_cpu). At 16 rows per expert the 4-bit
    formats would take their prefill mainloop (from 16 rows), so its bound is held at 32 here."""
    monkeypatch.setenv("HUMMING_JAX_DECODE_PRE_PERMUTE", pre_permute)
    _many_items_match_cpu(rng, monkeypatch, scheme, f"{scheme} many items")


def _many_items_match_cpu(rng, monkeypatch, scheme, what):
    """The decode forms of 16 slices of N = 4096 and 32 experts (~40 indexed blocks, 32 batched
    items per slice) against the CPU, on the decode kernel (fp8 too), the 4-bit formats kept off
    their prefill mainloop."""
    monkeypatch.setenv("HUMMING_JAX_DECODE_RING", "0")
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIN_ROWS, "32")
    dtype = SCHEMES[scheme].default_dtype
    e, n, kdim, m, k = 32, 4096, 256, 128, 4
    w = _decode_weights(rng, scheme, dtype, e, n, kdim)
    quant = act_quant_params(SCHEMES[scheme].act_key)
    _decode_forms_match_cpu(rng, w, None, dtype, quant, m, k, 9, what)


@requires_decode
@pytest.mark.parametrize("grid_items", ["1", "3"])
@pytest.mark.parametrize("scheme", ["w4a16-int4-g128", "w4a16-mxfp4", "w8a8-fp8-block128", "bf16"])
def test_decode_capped_grid_matches_cpu(rng, monkeypatch, scheme, grid_items):
    """HUMMING_JAX_DECODE_GRID_ITEMS caps the grid's item rows, so that each CTA runs many items in
    turn (the loop that otherwise runs only past 65535 items): the many-items problem of
    test_decode_more_items_than_resident_ctas_match_cpu against the CPU."""
    monkeypatch.setenv("HUMMING_JAX_DECODE_GRID_ITEMS", grid_items)
    _many_items_match_cpu(rng, monkeypatch, scheme, f"{scheme} grid items {grid_items}")


_DECODE_RING_LAUNCHES = _ffi.launch_counter("HjDecodeRingLaunches") if GPU is not None else None

# fp8 x fp8 on the decode kernel (HUMMING_JAX_DECODE_RING=0; its K split by the planner or forced to
# 1 or 2 warp groups, HUMMING_JAX_DECODE_WK; "staged": activations per K step instead of whole,
# HUMMING_JAX_DECODE_WHOLE_ACT=0), on the persistent ring kernel (HUMMING_JAX_DECODE_RING=1:
# TMA weights, wgmma, 128-k stages, so K = 80 is one partial stage; work units of 128 or 256 rows by
# the host's rule or forced, HUMMING_JAX_RING_ROWS; a grid of fewer CTAs than SMs where that evens
# the units' rounds, HUMMING_JAX_RING_BALANCE), or by the default choice between the two.
# Shapes: 1 row per item (B of 8 tokens), up to 16 (B of 16), K = 80 (a partial last chunk column,
# per-channel weight scales, one activation scale per token), and more work units than SMs.
_NO_RING = {"HUMMING_JAX_DECODE_RING": "0"}
_RING = {"HUMMING_JAX_DECODE_RING": "1"}
_FP8_ENV = {"default": {}, "decode": _NO_RING, "wk1": {**_NO_RING, "HUMMING_JAX_DECODE_WK": "1"},
            "wk2": {**_NO_RING, "HUMMING_JAX_DECODE_WK": "2"},
            "staged": {**_NO_RING, "HUMMING_JAX_DECODE_WHOLE_ACT": "0", "HUMMING_JAX_DECODE_WK": "2"},
            "ring": _RING, "ring-128": {**_RING, "HUMMING_JAX_RING_ROWS": "128"},
            "ring-256": {**_RING, "HUMMING_JAX_RING_ROWS": "256"},
            "ring-wide": {**_RING, "HUMMING_JAX_RING_NARROW": "0"},  # 16-token MMAs for every unit
            "ring-item": {**_RING, "HUMMING_JAX_RING_ORDER": "item"},  # an item's slices in turn
            "ring-balance": {**_RING, "HUMMING_JAX_RING_BALANCE": "1"}}  # CTAs for even rounds of units


@requires_decode
@pytest.mark.parametrize("variant", sorted(_FP8_ENV))
@pytest.mark.parametrize("scheme,m,k,e,n,kdim", [("w8a8-fp8-block128", 1, 8, 128, 264, 256),
                                                 ("w8a8-fp8-block128", 16, 4, 8, 200, 384),
                                                 ("w8a8-fp8-tensor", 6, 2, 6, 131, 512),
                                                 ("w8a8-fp8-channel", 5, 2, 6, 67, 80),
                                                 # more work units than SMs: the ring cycles units
                                                 ("w8a8-fp8-block128", 16, 8, 64, 2048, 512)])
def test_decode_fp8_variants_match_cpu(rng, monkeypatch, variant, scheme, m, k, e, n, kdim):
    for name, value in _FP8_ENV[variant].items():
        monkeypatch.setenv(name, value)
    dtype = SCHEMES[scheme].default_dtype
    if kdim % 128:
        w = _custom_weight(rng, WeightType.FP8_E4M3, e, n, kdim, kdim, np.float32)
        quant = ("fp8", 0)
    else:
        w = _decode_weights(rng, scheme, dtype, e, n, kdim)
        quant = act_quant_params(SCHEMES[scheme].act_key)
    bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32) * 0.1)
    with _LaunchCount(_DECODE_RING_LAUNCHES) as ring:
        _decode_forms_match_cpu(rng, w, bias, dtype, quant, m, k, 9, f"{scheme} {variant} M={m} K={kdim}")
    if variant != "default":  # the default takes the ring at the shape with more units than SMs
        ringed = variant.startswith("ring")
        assert ring.count == (5 if ringed else 0), f"{variant}: {ring.count} launches of the ring kernel"


def _check_fused_forms(got, fn, ops, dtype, what, exact=True, second=None):
    """GPU results of a fused-vs-separate form (humming_jax.testing.indexed_*_forms): the rows the
    routing fills finite and not all zero, the fused call's bits the separate calls' (``exact``;
    otherwise equal up to the K split's summation order), both against the CPU's run of the same
    forms.

    ``second`` (two GEMMs with 8-bit activations: ``experts_indexed_quant_forms``): the CPU's
    second GEMM as a function of the first GEMM's rows. The chain is then checked against the CPU
    stage by stage, GEMM1's rows against the CPU's, and the GPU's GEMM2 against the CPU's GEMM2 of
    the GPU's GEMM1 rows: a last-bit difference of GEMM1 (accumulation order) can move an fp8
    rounding of GEMM2's quantized input by a whole fp8 step, which the whole chain's tolerance
    cannot tell from an error."""
    valid = got["src"].reshape(-1) >= 0
    assert np.all(np.isfinite(got["fused"][valid])) and np.any(got["fused"][valid] != 0.0), what
    if exact:
        np.testing.assert_array_equal(got["fused"][valid], got["two"][valid], err_msg=f"{what}: fused != two calls")
    else:
        _assert_close(got["fused"][valid], got["two"][valid], dtype, f"{what}: fused against the two calls")
    want = _run_on(CPU, fn, ops)
    np.testing.assert_array_equal(got["src"], want["src"])
    if second is None:
        _assert_close(got["fused"][valid], want["fused"][valid], dtype, f"{what} against the CPU")
        return
    _assert_close(got["c"][valid], want["c"][valid], dtype, f"{what}: GEMM1 against the CPU")
    again = _to_np(jax.jit(second)(jax.device_put(jnp.asarray(got["c"], dtype), CPU)))
    _assert_close(got["fused"][valid], again[valid], dtype, f"{what}: GEMM2 against the CPU's of the same GEMM1 rows")


_DECODE_QUANT_LAUNCHES = _ffi.launch_counter("HjDecodeQuantLaunches") if GPU is not None else None

# gemm_indexed_quant (GEMM1 with its 16-bit input quantized in the call): the decode kernel
# quantizes the token rows itself (fp8 e4m3, 128-k groups, every item's rows held whole over K);
# "decode-unfused" (HUMMING_JAX_DECODE_QUANT=0) and the ring run the quantization kernel first.
_FUSED_QUANT_ENV = {"default": {}, "decode": _NO_RING,
                    "decode-unfused": {**_NO_RING, "HUMMING_JAX_DECODE_QUANT": "0"},
                    "decode-wk4": {**_NO_RING, "HUMMING_JAX_DECODE_WK": "4"}, "ring": _RING}


# GEMM1's form on every variant; GEMM2's (activation halves, interleaved) on the kernels that run it.
_FUSED_QUANT_CASES = [(None, None, v) for v in sorted(_FUSED_QUANT_ENV)] + [
    (a, lim, v) for a, lim in (("silu", None), ("swigluoai", 7.0)) for v in ("decode", "decode-unfused", "ring")
]


@requires_decode
@pytest.mark.parametrize("activation,limit,variant", _FUSED_QUANT_CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,k,e,n,kdim", [(1, 8, 128, 264, 256), (16, 4, 8, 200, 384),
                                          (16, 8, 64, 2048, 512), (3, 2, 6, 96, 2048)])
def test_decode_fused_input_quant_matches_two_calls_and_cpu(rng, monkeypatch, activation, limit, variant, dtype, m,
                                                            k, e, n, kdim):
    """The fused call gives the separate calls' bits on the GPU (quantization is exact: the same
    codes and scales whichever kernel quantizes) and agrees with the CPU; the counters show which
    kernel quantized. GEMM1's form, and GEMM2's with the activation (halves or interleaved)."""
    for name, value in _FUSED_QUANT_ENV[variant].items():
        monkeypatch.setenv(name, value)
    w = _decode_weights(rng, "w8a8-fp8-block128", dtype, e, n, kdim)
    bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32) * 0.1)
    ids, _ = _decode_routing(rng, m, k, e)
    ids = jnp.where(ids >= e, -1, ids)  # no expert map on this call: remote ids become padding
    fn, ops = indexed_quant_forms(rng, w, bias, dtype, ("fp8", 128), ids, activation, limit)
    what = f"{variant} {activation} {jnp.dtype(dtype).name} M={m} E={e} N={n} K={kdim}"
    with _LaunchCount(_DECODE_QUANT_LAUNCHES) as fused, _LaunchCount(_DECODE_RING_LAUNCHES) as ring:
        got = _run_on(GPU, fn, ops)
    _check_fused_forms(got, fn, ops, dtype, what)
    if variant.startswith("decode"):  # the decode kernel activates with silu only
        expect = 0 if variant == "decode-unfused" or activation not in (None, "silu") else 1
        assert (fused.count, ring.count) == (expect, 0), f"{what}: {fused.count} fused, {ring.count} ring launches"
    elif variant.startswith("ring"):
        assert (fused.count, ring.count) == (0, 2), f"{what}: {fused.count} fused, {ring.count} ring launches"


_DECODE_GATED_LAUNCHES = _ffi.launch_counter("HjDecodeGatedLaunches") if GPU is not None else None

# gemm_indexed_gated (GEMM1 writing the gated activation of its rows): the decode kernel's epilogue
# pairs gate and up rows in one CTA (swigluoai: rows 2i, 2i + 1; otherwise i, N / 2 + i, the CTA's
# warps split in two, at most 4 K groups; raw and packed variants); "unfused"
# (HUMMING_JAX_DECODE_GATED=0) and w8a16-fp8-block128 (a float32-scale variant) write c and run the
# activation kernel. Odd output widths (N / 2 = 100, 36) leave a CTA's last columns empty.
_GATED_ENV = {"default": {}, "unfused": {"HUMMING_JAX_DECODE_GATED": "0"}, "wk1": {"HUMMING_JAX_DECODE_WK": "1"},
              "wk4": {"HUMMING_JAX_DECODE_WK": "4"}, "wk8": {"HUMMING_JAX_DECODE_WK": "8"}}
_GATED_CASES = (
    [(sc, a, lim, "default") for sc in ("bf16", "fp16", "w4a16-int4-g128", "w4a16-mxfp4", "w8a16-fp8-block128")
     for a, lim in (("silu", None), ("swigluoai", 7.0))]
    + [("w4a16-int4-g128", a, lim, v) for a, lim in (("silu", None), ("swigluoai", 7.0)) for v in sorted(_GATED_ENV)
       if v != "default"]
)


@requires_decode
@pytest.mark.parametrize("scheme,activation,limit,variant", _GATED_CASES)
@pytest.mark.parametrize("m,k,e,n,kdim", [(1, 8, 128, 528, 256), (16, 4, 8, 200, 256), (5, 2, 6, 72, 1024)])
def test_decode_gated_epilogue_matches_two_calls_and_cpu(rng, monkeypatch, scheme, activation, limit, variant, m, k,
                                                         e, n, kdim):
    """GEMM1 with the activation in its epilogue gives gemm_indexed + activation's bits on the GPU and
    agrees with the CPU; the counter shows which launches activated their output pairs."""
    for name, value in _GATED_ENV[variant].items():
        monkeypatch.setenv(name, value)
    dtype = SCHEMES[scheme].default_dtype
    w = _decode_weights(rng, scheme, dtype, e, n, kdim)
    bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32) * 0.1)
    ids, _ = _decode_routing(rng, m, k, e)
    ids = jnp.where(ids >= e, -1, ids)
    fn, ops = gated_forms(rng, w, bias, dtype, ids, activation, limit)
    what = f"{scheme} {variant} {activation} M={m} E={e} N={n} K={kdim}"
    with _LaunchCount(_DECODE_GATED_LAUNCHES) as gated, _LaunchCount(_DECODE_LAUNCHES) as launches:
        got = _run_on(GPU, fn, ops)
    # The halves layout's pairing takes at most 4 K groups where the separate GEMM may take 8 (the
    # default's plan, or forced): the two then sum K in another order.
    exact = activation == "swigluoai" or variant in ("unfused", "wk1", "wk4")
    _check_fused_forms(got, fn, ops, dtype, what, exact)
    assert launches.count == 2, f"{what}: {launches.count} decode launches"
    expect = int(variant != "unfused" and scheme != "w8a16-fp8-block128")  # raw and packed variants only
    assert gated.count == expect, f"{what}: {gated.count} gated launches"


def _gated_pair(rng, monkeypatch, scheme, pdl, e, h, i):
    """HUMMING_JAX_PDL set to ``pdl`` (None: unset), then a gated layer's two random weights with
    biases: (dtype, w13 [e, 2i, h], b13, w2 [e, h, i], b2)."""
    if pdl is None:
        monkeypatch.delenv("HUMMING_JAX_PDL", raising=False)
    else:
        monkeypatch.setenv("HUMMING_JAX_PDL", pdl)
    dtype = SCHEMES[scheme].default_dtype
    w13 = _decode_weights(rng, scheme, dtype, e, 2 * i, h)
    w2 = _decode_weights(rng, scheme, dtype, e, h, i)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)).astype(np.float32) * 0.1)
    b2 = jnp.asarray(rng.standard_normal((e, h)).astype(np.float32) * 0.1)
    return dtype, w13, b13, w2, b2


@requires_decode
@pytest.mark.parametrize("scheme", ["bf16", "w4a16-int4-g128", "w4a16-mxfp4"])
@pytest.mark.parametrize("activation,limit", [("silu", None), ("swigluoai", 7.0)])
@pytest.mark.parametrize("pdl", [None, "0"])
@pytest.mark.parametrize("m,k,e,h,i", [(1, 8, 128, 512, 256), (16, 4, 8, 256, 384), (5, 2, 6, 1024, 128)])
def test_decode_experts_indexed_matches_two_calls_and_cpu(rng, monkeypatch, scheme, activation, limit, pdl, m, k, e,
                                                          h, i):
    """experts_indexed on the GPU: both GEMMs on the decode kernel (GEMM1 writing the activated
    pairs, GEMM2 launched dependent on it and reading the routing and its first weights before
    its wait), with the bits of gemm_indexed_gated then gemm_indexed in calls of their own, with
    dependent launches on (HUMMING_JAX_PDL unset) and off, and close to the CPU's values."""
    dtype, w13, b13, w2, b2 = _gated_pair(rng, monkeypatch, scheme, pdl, e, h, i)
    ids, _ = _decode_routing(rng, m, k, e)
    ids = jnp.where(ids >= e, -1, ids)
    fn, ops = experts_indexed_forms(rng, w13, b13, w2, b2, dtype, ids, activation, limit)
    what = f"{scheme} {activation} pdl={pdl} M={m} E={e} H={h} I={i}"
    with _LaunchCount(_DECODE_GATED_LAUNCHES) as gated, _LaunchCount(_DECODE_LAUNCHES) as launches:
        got = _run_on(GPU, fn, ops)
    _check_fused_forms(got, fn, ops, dtype, what, exact=True)
    assert launches.count == 4, f"{what}: {launches.count} decode launches (two per form)"
    assert gated.count == 2, f"{what}: {gated.count} gated launches (GEMM1 of each form)"


@requires_decode
@pytest.mark.parametrize("scheme", ["bf16", "w4a16-int4-g128", "w4a16-mxfp4"])
@pytest.mark.parametrize("activation,limit", [("silu", None), ("swigluoai", 7.0)])
@pytest.mark.parametrize("pdl", [None, "0"])
@pytest.mark.parametrize("m,k,e,h,i", [(1, 8, 128, 512, 256), (16, 4, 8, 256, 384), (5, 2, 6, 1024, 128)])
def test_decode_layer_indexed_matches_three_calls_and_cpu(rng, monkeypatch, scheme, activation, limit, pdl, m, k, e,
                                                          h, i):
    """layer_indexed on the GPU (the routing kernel, both GEMMs on the decode kernel, the finalize
    kernel, each launched dependent on the one before inside the call), with the bits of
    routing_indexed, experts_indexed and finalize as calls of their own into a NaN-poisoned out,
    dependent launches on and off, an expert map with remote experts, and close to the CPU's values."""
    from humming_jax.ops import finalize as fin_ops
    from humming_jax.ops import layer as layer_ops

    dtype, w13, b13, w2, b2 = _gated_pair(rng, monkeypatch, scheme, pdl, e, h, i)
    ids, emap = _decode_routing(rng, m, k, e)
    tw = jnp.asarray(rng.random((m, k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, h)), dtype)
    bm = indexed_block_m(m * k, e)

    def fn(x, ids, emap, tw, w13, b13, w2, b2):
        one = layer_ops.layer_indexed(x, w13, b13, w2, b2, ids, emap, tw, nan_out(x.shape, x.dtype), block_m=bm,
                                      activation=activation, limit=limit)
        r = routing_ops.routing_indexed(ids, emap, e, bm)
        d = gemm_ops.experts_indexed(x, w13, b13, w2, b2, r, rows=m * k, gather_div=k, block_m=bm, out_dtype=dtype,
                                     activation=activation, limit=limit)
        three = fin_ops.finalize(d, tw, r.src_rows, nan_out(x.shape, x.dtype))
        return dict(one=one, three=three)

    ops = (x, ids, emap, tw, w13, b13, w2, b2)
    what = f"{scheme} {activation} pdl={pdl} M={m} E={e} H={h} I={i}"
    with _LaunchCount(_DECODE_LAUNCHES) as launches:
        got = _run_on(GPU, fn, ops)
    assert launches.count == 4, f"{what}: {launches.count} decode launches (two per form)"
    assert np.all(np.isfinite(got["one"])) and np.any(got["one"] != 0.0), what
    np.testing.assert_array_equal(got["one"], got["three"], err_msg=f"{what}: one call != three calls")
    want = _run_on(CPU, fn, ops)
    np.testing.assert_array_equal(want["one"], want["three"], err_msg=f"{what}: CPU one call != three calls")
    _assert_close(got["one"], want["one"], dtype, f"{what}: GPU against CPU")


def _indexed_quant_case(rng, monkeypatch, scheme, activation, limit, variant, e, h, i):
    """The 8-bit-activation two-GEMM tests' set-up: the variant's environment (the ring only for fp8
    per 128), then (dtype, w13, w2, b13) drawn for e experts, hidden size h and i intermediate."""
    if variant == "ring" and scheme != "w8a8-fp8-block128":
        pytest.skip("the ring kernel runs fp8 weights and activations")
    for name, value in _FUSED_QUANT_ENV[variant].items():
        monkeypatch.setenv(name, value)
    dtype = SCHEMES[scheme].default_dtype
    gated = get_activation(activation, limit)[0].gated
    w13 = _decode_weights(rng, scheme, dtype, e, 2 * i, h)
    w2 = _decode_weights(rng, scheme, dtype, e, h, i if gated else 2 * i)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)).astype(np.float32) * 0.1)
    return dtype, w13, w2, b13


def _cpu_gemm2(ids, emap, w2, b2, dtype, quant, activation, limit):
    """GEMM2 of the 8-bit-activation chain on the CPU as a function of GEMM1's rows c: activation(c)
    quantized (quant: (kind, group)) times w2, over topk_ids' indexed routing (emap: its map or
    None). The stage-by-stage checks' CPU side (_check_fused_forms)."""
    m, k = ids.shape
    e = w2.num_experts
    bm = indexed_block_m(m * k, e)
    idc, emapc, w2c, b2c = jax.device_put((ids, emap, w2, b2), CPU)

    def gemm2(c):
        r = routing_ops.routing_indexed(idc, emapc, e, bm)
        return gemm_ops.gemm_indexed_quant(c, w2c, b2c, r, rows=m * k, gather_div=1, block_m=bm, out_dtype=dtype,
                                           quant=quant[0], act_group_k=quant[1], activation=activation, limit=limit)

    return gemm2


@requires_decode
@pytest.mark.parametrize("scheme", ["w8a8-fp8-block128", "w8a8-int8-channel"])
@pytest.mark.parametrize("activation,limit", [("silu", None), ("swigluoai", 7.0), ("gelu_no_mul", None)])
@pytest.mark.parametrize("variant", ["default", "decode", "decode-unfused", "ring"])
@pytest.mark.parametrize("m,k,e,h,i", [(1, 8, 128, 512, 256), (16, 4, 8, 256, 384), (5, 2, 6, 1024, 128)])
def test_decode_experts_indexed_quant_matches_two_calls_and_cpu(rng, monkeypatch, scheme, activation, limit, variant,
                                                                m, k, e, h, i):
    """experts_indexed_quant on the GPU: both GEMMs on the decode kernel (quantizing their rows
    themselves, or after the quantization kernel: "decode-unfused") or the fp8 ring kernel (fp8 per
    128 only), GEMM2 launched dependent on the kernel before it, with the bits of two
    gemm_indexed_quant calls and close to the CPU's values."""
    dtype, w13, w2, b13 = _indexed_quant_case(rng, monkeypatch, scheme, activation, limit, variant, e, h, i)
    b2 = jnp.asarray(rng.standard_normal((e, h)).astype(np.float32) * 0.1)
    ids, _ = _decode_routing(rng, m, k, e)
    ids = jnp.where(ids >= e, -1, ids)
    quant = act_quant_params(SCHEMES[scheme].act_key)
    fn, ops = experts_indexed_quant_forms(rng, w13, b13, w2, b2, dtype, quant, ids, activation, limit)
    what = f"{scheme} {activation} {variant} M={m} E={e} H={h} I={i}"
    with _LaunchCount(_DECODE_LAUNCHES) as launches:
        got = _run_on(GPU, fn, ops)
    second = _cpu_gemm2(ids, None, w2, b2, dtype, quant, activation, limit)
    _check_fused_forms(got, fn, ops, dtype, what, exact=True, second=second)
    assert launches.count == 4, f"{what}: {launches.count} decode launches (two per form)"


@requires_decode
@pytest.mark.parametrize("scheme", ["w8a8-fp8-block128", "w8a8-int8-channel"])
@pytest.mark.parametrize("activation,limit", [("silu", None), ("swigluoai", 7.0), ("gelu_no_mul", None)])
@pytest.mark.parametrize("variant", ["default", "decode-unfused", "ring"])
@pytest.mark.parametrize("m,k,e,h,i", [(1, 8, 128, 512, 256), (16, 4, 8, 256, 384)])
def test_decode_layer_indexed_quant_matches_three_calls_and_cpu(rng, monkeypatch, scheme, activation, limit, variant,
                                                                m, k, e, h, i):
    """layer_indexed_quant on the GPU (the routing kernel, experts_indexed_quant's kernels, the
    finalize kernel in one call) with the bits of routing_indexed, experts_indexed_quant and
    finalize as calls of their own into a NaN-poisoned out, an expert map with remote experts, and
    close to the CPU's values."""
    from humming_jax.ops import finalize as fin_ops
    from humming_jax.ops import layer as layer_ops

    dtype, w13, w2, b13 = _indexed_quant_case(rng, monkeypatch, scheme, activation, limit, variant, e, h, i)
    ids, emap = _decode_routing(rng, m, k, e)
    tw = jnp.asarray(rng.random((m, k)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, h)), dtype)
    quant, group = act_quant_params(SCHEMES[scheme].act_key)
    bm = indexed_block_m(m * k, e)

    def fn(x, ids, emap, tw, w13, b13, w2):
        one = layer_ops.layer_indexed_quant(x, w13, b13, w2, None, ids, emap, tw, nan_out(x.shape, x.dtype),
                                            block_m=bm, quant=quant, act_group_k=group, activation=activation,
                                            limit=limit)
        r = routing_ops.routing_indexed(ids, emap, e, bm)
        d = gemm_ops.experts_indexed_quant(x, w13, b13, w2, None, r, rows=m * k, gather_div=k, block_m=bm,
                                           out_dtype=dtype, quant=quant, act_group_k=group, activation=activation,
                                           limit=limit)
        three = fin_ops.finalize(d, tw, r.src_rows, nan_out(x.shape, x.dtype))
        c = gemm_ops.gemm_indexed_quant(x, w13, b13, r, rows=m * k, gather_div=k, block_m=bm, out_dtype=dtype,
                                        quant=quant, act_group_k=group)
        return dict(one=one, three=three, c=c, src=r.src_rows)

    ops = (x, ids, emap, tw, w13, b13, w2)
    what = f"{scheme} {activation} {variant} M={m} E={e} H={h} I={i}"
    got = _run_on(GPU, fn, ops)
    assert np.all(np.isfinite(got["one"])) and np.any(got["one"] != 0.0), what
    np.testing.assert_array_equal(got["one"], got["three"], err_msg=f"{what}: one call != three calls")
    want = _run_on(CPU, fn, ops)
    np.testing.assert_array_equal(want["one"], want["three"], err_msg=f"{what}: CPU one call != three calls")
    # Against the CPU stage by stage (_check_fused_forms says why): GEMM1's rows, then GEMM2 and
    # finalize on the CPU from the GPU's GEMM1 rows.
    valid = got["src"].reshape(-1) >= 0
    _assert_close(got["c"][valid], want["c"][valid], dtype, f"{what}: GEMM1 against the CPU")
    gemm2 = _cpu_gemm2(ids, emap, w2, None, dtype, (quant, group), activation, limit)
    idc, emapc, twc = jax.device_put((ids, emap, tw), CPU)

    def rest(c):
        r = routing_ops.routing_indexed(idc, emapc, e, bm)
        return fin_ops.finalize(gemm2(c), twc, r.src_rows, nan_out(x.shape, x.dtype))

    again = _to_np(jax.jit(rest)(jax.device_put(jnp.asarray(got["c"], dtype), CPU)))
    _assert_close(got["one"], again, dtype, f"{what}: GPU against the CPU's GEMM2 and finalize of the same GEMM1 rows")


def _custom_weight(rng, wtype, e, n, kdim, group_k, scale_dtype, **kw):
    """Weights with a chosen scale dtype and group size (the float32 dequantization path)."""
    return random_packed_weight(rng, wtype, e, n, kdim, group_k, scale_dtype=scale_dtype, fp8_std=2.0, **kw)


@requires_decode
@pytest.mark.parametrize(
    "wtype,kdim,group_k,scale_dtype,zero,scale2,dtype,quant",
    [
        # int4 with float32 scales, with bf16 scales under fp16 activations, with scale2
        (WeightType.UINT4, 256, 128, np.float32, True, False, jnp.bfloat16, None),
        (WeightType.UINT4, 96, 32, ml_dtypes.bfloat16, False, False, jnp.float16, None),
        (WeightType.UINT4, 128, 16, jnp.bfloat16, False, True, jnp.bfloat16, None),  # two scales per lane chunk
        # packed int4 (16-bit scales of the activation type) with groups narrower than a chunk column
        # (128 k): each lane quad of an MMA step has its own scale
        (WeightType.UINT4, 192, 32, jnp.bfloat16, True, False, jnp.bfloat16, None),
        (WeightType.UINT4, 256, 64, jnp.float16, False, False, jnp.float16, None),
        # K with a partial last chunk column (not a multiple of 32 / 64 / 128 k)
        (WeightType.FLOAT, 40, 1, jnp.bfloat16, False, False, jnp.bfloat16, None),
        (WeightType.FLOAT, 72, 1, jnp.float16, False, False, jnp.float16, None),
        (WeightType.FP8_E4M3, 80, 16, np.float32, False, True, jnp.bfloat16, None),
        (WeightType.INT8, 48, 8, np.float16, False, False, jnp.bfloat16, None),  # groups of half a lane chunk
        (WeightType.FP4_E2M1, 96, 32, ml_dtypes.float8_e4m3fn, False, True, jnp.bfloat16, None),
        (WeightType.FP4_E2M1, 160, 16, ml_dtypes.float8_e4m3fn, False, True, jnp.float16, None),
        # 8-bit activations: groups spanning K, or whole chunk columns
        (WeightType.UINT4, 256, 128, np.float32, True, False, jnp.bfloat16, ("fp8", 128)),
        (WeightType.INT8, 192, 192, np.float32, False, True, jnp.float16, ("int8", 0)),
        (WeightType.FP8_E4M3, 192, 64, np.float32, False, False, jnp.bfloat16, ("fp8", 64)),
        (WeightType.FP4_E2M1, 256, 128, np.float32, False, False, jnp.bfloat16, ("int8", 128)),
    ],
)
def test_decode_scale_types_groups_and_partial_chunks_match_cpu(rng, wtype, kdim, group_k, scale_dtype, zero,
                                                                 scale2, dtype, quant):
    e, n, m, k = 6, 67, 3, 2
    w = _custom_weight(rng, wtype, e, n, kdim, group_k, scale_dtype, zero=zero, scale2=scale2)
    _decode_forms_match_cpu(rng, w, None, dtype, quant, m, k, 9, f"{wtype.name} K={kdim} g={group_k}")


@requires_decode
def test_decode_mxfp4_extreme_scales_match_cpu_per_row(rng):
    """e8m0 scales at the edges of the packed e2m1 path: 2^-127 (s = 0, subnormal products), the
    largest single factor (s = 128) and the two-factor case (s > 128), checked row by row.

    Weights and products below float32's smallest normal (2^-126) may be flushed to zero on either
    side (the CPU runtime's denormal mode, the tensor cores' accumulation), so each output may
    differ by at most K * 2^-126 * max|x| beyond the rounding tolerance: loose for the s = 0 rows
    (whose sums are themselves ~2^-123), negligible for every other scale."""
    e, n, kdim, m, k = 4, 64, 128, 2, 2
    w = _custom_weight(rng, WeightType.FP4_E2M1, e, n, kdim, 32, np.uint8,
                       scale_values=np.array([0, 1, 100, 127, 128, 129, 140, 160], np.uint8))
    fn, ops = _decode_forms(rng, w, None, jnp.bfloat16, None, m, k, t=4)
    with _LaunchCount(_DECODE_LAUNCHES) as launched:
        got = _run_on(GPU, fn, ops)
    assert launched.count == 5
    want = _run_on(CPU, fn, ops)
    cb, wb = got["cb"].reshape(-1, n), want["cb"].reshape(-1, n)
    flush = kdim * float(np.finfo(np.float32).tiny) * float(np.abs(_to_np(ops[2])).max())
    rows = np.abs(wb).max(axis=0) > 0
    assert rows.sum() > n // 2, "most weight rows must give nonzero outputs"
    for col in np.nonzero(rows)[0]:  # each output column is one weight row with its own scales
        np.testing.assert_allclose(cb[:, col], wb[:, col], rtol=2e-2,
                                   atol=2e-2 * np.abs(wb[:, col]).max() + flush, err_msg=f"column {col}")


@requires_decode
@pytest.mark.parametrize(
    "what,scheme,weights",
    [
        ("8-bit activations with 32-k weight groups", "w4a8-mxfp4-fp8",
         lambda rng: _decode_weights(rng, "w4a8-mxfp4-fp8", SCHEMES["w4a8-mxfp4-fp8"].default_dtype, 4, 40, 256)),
        ("K not a multiple of 8 (rows not 16-byte aligned)", "bf16",
         lambda rng: _custom_weight(rng, WeightType.FLOAT, 4, 40, 36, 1, jnp.bfloat16)),
        ("int4 zero points with 16-k groups (two groups per lane chunk)", "bf16",
         lambda rng: _custom_weight(rng, WeightType.UINT4, 4, 40, 128, 16, jnp.bfloat16, zero=True)),
    ],
)
def test_decode_declines_unsupported_calls_to_the_generic_kernel(rng, what, scheme, weights):
    dtype = SCHEMES[scheme].default_dtype
    fn, ops = _decode_forms(rng, weights(rng), None, dtype, act_quant_params(SCHEMES[scheme].act_key), 2, 2, t=3)
    with _LaunchCount(_DECODE_LAUNCHES) as launched:
        got = _run_on(GPU, fn, ops)
    assert launched.count == 0, what
    _check_decode_forms(got, _run_on(CPU, fn, ops), dtype, what, ops[5], 3)


@requires_decode
@pytest.mark.skipif(_PREFILL_LAUNCHES is None, reason="needs the prefill counter too")
@pytest.mark.skipif(cuda_constant("gemm_decode_sm90.cu", "kMaxRowsPerExpertQuantGrouped") < 64 or gemm_ops.DEQUANT_MIN_ROWS_PER_EXPERT < 64,
                    reason="the acceptance check for raising kMaxRowsPerExpertQuantGrouped and the dequantizing "
                           "threshold to 64 (benchmarks/NOTES.md, v4); both are below it")
@pytest.mark.parametrize("scheme,m,k,kind", [("w4a16-int4-g128", 64, 4, "uniform"), ("w4a16-mxfp4", 96, 4, "tail"),
                                             ("w8a16-int8-channel", 240, 2, "zero_rows"),
                                             ("w4a16-uint4-zp-g128", 120, 4, "uniform"),
                                             # 4-bit codes: up to 127 rows per expert
                                             ("w4a16-mxfp4", 480, 2, "uniform"), ("w4a16-mxfp4", 1000, 1, "tail"),
                                             ("w4a16-uint4-zp-g128", 400, 2, "zero_rows")])
@pytest.mark.parametrize("item_rows", ["32", "16"])  # HUMMING_JAX_DECODE_ITEM_ROWS=16: 16-row items
def test_decode_takes_quantized_grouped_calls_below_the_dequantizing_threshold(rng, monkeypatch, scheme, m, k, kind,
                                                                             item_rows):
    """32 rows per expert on average (8 experts) up to the dequantizing threshold (64 for 8-bit
    codes, 128 for 4-bit ones) with quantized weights and 16-bit activations: no dequantization
    buffer is requested, the prefill kernel declines and the decode kernel runs items of up to 32
    rows; the result is the CPU's. (int4 with bf16 scales goes to the mixed-input prefill kernel
    unless HUMMING_JAX_PREFILL_MIXED=0, mxfp4 with bf16 activations to the MXFP4 prefill kernel unless
    HUMMING_JAX_PREFILL_FP4=0.)"""
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_MIXED, "0")
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_FP4, "0")
    monkeypatch.setenv("HUMMING_JAX_DECODE_ITEM_ROWS", item_rows)
    p = _gemm_inputs(rng, scheme, m, k, 8, 200, 256, kind, bias=kind == "uniform")  # no room for an expert either
    with _LaunchCount(_PREFILL_LAUNCHES) as prefill, _LaunchCount(_DECODE_LAUNCHES) as decode:
        got = _run_gemm(GPU, p)
    assert prefill.count == 0 and decode.count == 1, (prefill.count, decode.count)
    _assert_close(got, _run_gemm(CPU, p, poison=False), p["dtype"], f"{scheme} {kind} {m * k // 8} rows per expert")
    last = int(np.asarray(p["off"])[-1])
    assert np.all(got[last:] == 0.0), "rows past the last expert must be zeros"


@requires_decode
@pytest.mark.parametrize("scheme", ["bf16", "w4a16-int4-g128", "w8a8-fp8-block128", "w4a16-mxfp4"])
def test_decode_is_deterministic(rng, scheme):
    dtype = SCHEMES[scheme].default_dtype
    w = _decode_weights(rng, scheme, dtype, 16, 256, 512)
    bias = jnp.asarray(rng.standard_normal((16, 256)).astype(np.float32) * 0.1)
    fn, ops = _decode_forms(rng, w, bias, dtype, act_quant_params(SCHEMES[scheme].act_key), 16, 4)
    runs = [_run_on(GPU, fn, ops) for _ in range(3)]
    valid = runs[0]["src"].reshape(-1) >= 0  # the indexed GEMMs leave padding rows unwritten
    for r in runs[1:]:
        for name in ("c1", "c2"):
            np.testing.assert_array_equal(r[name][valid], runs[0][name][valid], err_msg=name)
        for name in ("cg", "cb", "cbi"):
            np.testing.assert_array_equal(r[name], runs[0][name], err_msg=name)


@requires_decode
@pytest.mark.parametrize(
    "scheme,m,k,e,n,kdim",
    [
        # Model-like expert counts and K, N cut so the host-made weights stay small.
        ("bf16", 1, 8, 128, 256, 2048),  # qwen3-30b-a3b GEMM1-like
        ("w4a16-int4-g128", 16, 8, 128, 256, 2048),
        ("w4a16-int4-g128", 1, 2, 8, 2048, 4096),  # mixtral-8x7b GEMM1-like: few experts, long N
        ("bf16", 3, 2, 8, 512, 14336),  # mixtral-8x7b GEMM2-like: long K, wide K split
        ("w8a8-fp8-block128", 4, 8, 32, 256, 7168),  # deepseek-v3-ep8 GEMM1-like
        ("w4a16-mxfp4", 16, 4, 32, 256, 2880),  # gpt-oss: K = 2880 is not a multiple of 128
        ("w4a16-nvfp4", 2, 4, 32, 256, 2048),
    ],
)
def test_decode_matches_generic_kernel_at_model_shapes(rng, monkeypatch, scheme, m, k, e, n, kdim):
    dtype = SCHEMES[scheme].default_dtype
    w = _decode_weights(rng, scheme, dtype, e, n, kdim)
    fn, ops = _decode_forms(rng, w, None, dtype, act_quant_params(SCHEMES[scheme].act_key), m, k)
    with _LaunchCount(_DECODE_LAUNCHES) as launched:
        got = _run_on(GPU, fn, ops)
    assert launched.count == 5
    monkeypatch.setenv("HUMMING_JAX_DECODE", "0")
    with _LaunchCount(_DECODE_LAUNCHES) as generic:
        want = _run_on(GPU, fn, ops)
    assert generic.count == 0, "HUMMING_JAX_DECODE=0 must leave the calls to the generic kernel"
    _check_decode_forms(got, want, dtype, f"{scheme} M={m} E={e} N={n} K={kdim}", ops[5], 5)


@requires_decode
@pytest.mark.parametrize("cls", [IndexedExperts, GroupedExperts])
@pytest.mark.parametrize("scheme", ["bf16", "fp16", "w4a16-int4-g128", "w8a8-fp8-block128", "w4a16-mxfp4",
                                    "w4a16-nvfp4"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_decode_layer_against_oracle_with_poisoned_out(rng, cls, scheme, m):
    layer = random_layer(rng, m=m, e=16, h=256, i=128, k=4, scheme=scheme, bias=m == 3, e_global=20,
                         pad_frac=0.1)
    args = jax.device_put((layer.x, layer.weights, layer.topk_weights, layer.topk_ids), GPU)
    f = jax.jit(lambda out, x, w, tw, ids: cls().apply(out, x, w, tw, ids))
    with _LaunchCount(_DECODE_LAUNCHES) as launched:
        got = jax.block_until_ready(f(jax.device_put(nan_out(layer.x.shape, layer.x.dtype), GPU), *args))
    assert launched.count == 2, "both GEMMs of the layer should take the decode kernel"
    quant = act_quant_params(layer.weights.act_key)
    b13, b2 = (layer.weights.b13, layer.weights.b2) if m == 3 else (None, None)
    want = moe_reference(layer.x, layer.w13, layer.w2, layer.topk_weights, layer.topk_ids,
                         input_quant=InputQuant(*quant) if quant else None, b13=b13, b2=b2)
    tol = layer_tolerance(layer.x.dtype, quant)
    assert np.all(np.isfinite(_to_np(got))), "every row of out must be written"
    err = relative_error(got, want)
    assert err <= tol, f"{scheme} M={m}: relative error {err:.2e} > {tol:.1e}"


@requires_decode
@pytest.mark.parametrize("cls", [IndexedExperts, GroupedExperts])
@pytest.mark.parametrize("scheme", ["bf16", "w4a16-int4-g128", "w4a16-mxfp4", "w8a8-fp8-block128"])
def test_decode_layers_in_a_chain_give_the_same_bits_with_dependent_launches(rng, monkeypatch, cls, scheme):
    """Three decode layers back to back in one jit, each one's input the output of the one before,
    so that every kernel reads what a kernel just before it on the stream wrote (routing, GEMM1,
    GEMM2, finalize, the next layer's GEMM1). Dependent launches (cuda_ffi/dependent_launch.cuh,
    HUMMING_JAX_PDL unset) give the bits of plain launches (=0), and each step agrees with the
    oracle on its own input."""
    steps, m, k, e_global = 3, 4, 4, 20
    layer = random_layer(rng, m=m, e=16, h=256, i=128, k=k, scheme=scheme, e_global=e_global, pad_frac=0.1)
    routes = [random_routing(rng, m, k, e_global, pad_frac=0.1) for _ in range(steps)]

    def chain():  # a new function each time: a new executable (and command buffer) for each setting
        def layers(x, w, routes):
            ys = []
            for tw, ids in routes:
                x = cls().apply(nan_out(x.shape, x.dtype), x, w, tw, ids)
                ys.append(x)
            return jnp.stack(ys)

        return jax.jit(layers)

    args = jax.device_put((layer.x, layer.weights, routes), GPU)
    got = {}
    for pdl in (None, "0"):
        if pdl is None:
            monkeypatch.delenv("HUMMING_JAX_PDL", raising=False)
        else:
            monkeypatch.setenv("HUMMING_JAX_PDL", pdl)
        with _LaunchCount(_DECODE_LAUNCHES) as launched:
            got[pdl] = _to_np(jax.block_until_ready(chain()(*args)))
        assert launched.count == 2 * steps, "every GEMM of the chain should take the decode kernel"
    assert np.all(np.isfinite(got[None])), "every row of every step must be written"
    np.testing.assert_array_equal(got[None], got["0"])
    quant = act_quant_params(layer.weights.act_key)
    tol = layer_tolerance(layer.x.dtype, quant)
    inputs = [layer.x] + [jnp.asarray(y, layer.x.dtype) for y in got[None][:-1]]
    for s, (x, (tw, ids)) in enumerate(zip(inputs, routes)):
        want = moe_reference(x, layer.w13, layer.w2, tw, ids, input_quant=InputQuant(*quant) if quant else None)
        err = relative_error(got[None][s], want)
        assert err <= tol, f"{scheme} step {s}: relative error {err:.2e} > {tol:.1e}"


@requires_decode
@pytest.mark.parametrize("scheme", ["bf16", "w4a16-int4-g128", "w4a16-mxfp4"])
def test_decode_used_blocks_without_valid_ids_leave_the_others_exact(rng, scheme):
    """A caller's own indexed layout (routing never makes one) with used blocks whose expert is
    valid but whose ids are all padding: the decode kernel has already issued such a block's first
    weight copies when it finds no rows (decode_kernel's early copies), takes none, and every row
    of the other blocks agrees with the CPU."""
    e, n, kdim, m, k = 8, 200, 512, 12, 2
    dtype = SCHEMES[scheme].default_dtype
    w = _decode_weights(rng, scheme, dtype, e, n, kdim)
    ids = jnp.asarray(np.argsort(rng.random((m, e)), axis=1)[:, :k].astype(np.int32))
    bm = 16
    r = jax.device_get(jax.jit(lambda i: routing_ops.routing_indexed(i, None, e, bm))(jax.device_put(ids, CPU)))
    sorted_ids, blocks = np.array(r.sorted_ids), np.array(r.block_expert_ids)
    used = int(np.array(r.num_tokens_post_padded)[0]) // bm
    emptied = rng.choice(used, size=max(1, used // 3), replace=False)
    for b in emptied:
        assert 0 <= blocks[b] < e
        sorted_ids[b * bm:(b + 1) * bm] = m * k  # padding
    routing = routing_ops.IndexedRouting(jnp.asarray(sorted_ids), jnp.asarray(blocks), r.num_tokens_post_padded,
                                         r.src_rows)
    x = jnp.asarray(rng.standard_normal((m, kdim)), dtype)
    fn = jax.jit(lambda x, w, r: gemm_ops.gemm_indexed(x, None, w, None, r, rows=m * k, gather_div=k, block_m=bm,
                                                      out_dtype=dtype))
    with _LaunchCount(_DECODE_LAUNCHES) as launched:
        got = _to_np(jax.block_until_ready(fn(*jax.device_put((x, w, routing), GPU))))
    assert launched.count == 1, "the call should take the decode kernel"
    want = _to_np(fn(*jax.device_put((x, w, routing), CPU)))
    kept = sorted_ids[sorted_ids < m * k]
    assert kept.size > 0
    _assert_close(got[kept], want[kept], dtype, f"{scheme}: rows of the blocks with ids")


@requires_decode
@pytest.mark.parametrize("scheme", ["bf16", "w4a16-int4-g128", "w8a8-fp8-block128"])
def test_decode_batched_layer_against_oracle(rng, scheme):
    e, t, h, i = 8, 12, 256, 128
    w = hj.quantize_moe_weights(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h),
                                rng.standard_normal((e, h, i)) / np.sqrt(i), scheme)
    dtype = SCHEMES[scheme].default_dtype
    x = jnp.asarray(rng.standard_normal((e, t, h)), dtype)
    counts = jnp.asarray([0, 12, 5, 99, -3, 1, 7, 12], jnp.int32)
    f = jax.jit(lambda o, x, w, c: BatchedExperts().apply(o, x, w, None, None, expert_num_tokens=c))
    with _LaunchCount(_DECODE_LAUNCHES) as launched:
        got = jax.block_until_ready(f(*jax.device_put((nan_out(x.shape, x.dtype), x, w, counts), GPU)))
    assert launched.count == 2
    w13, w2 = w.dequantize()
    quant = act_quant_params(w.act_key)
    want = batched_reference(x, w13, w2, jnp.clip(counts, 0, t), input_quant=InputQuant(*quant) if quant else None)
    tol = TOL[jnp.dtype(dtype)] + (2.0**-4 if quant else 0.0)
    got = _to_np(got)
    assert np.all(np.isfinite(got))
    assert relative_error(got, want) <= tol
    assert np.all(got[0] == 0.0) and np.all(got[4] == 0.0), "experts with no tokens give zeros"


@requires_decode
@pytest.mark.parametrize("scheme", ["bf16", "w4a16-int4-g128"])
def test_decode_command_buffers_give_the_same_results(tmp_path, scheme):
    """CUDA-graph capture and replay against plain execution, in fresh processes (the kernel's
    first use, with its shared-memory attribute setup, happens under capture)."""
    results, launches = replay_both_ways(tmp_path, scheme=scheme, classes=("IndexedExperts", "GroupedExperts"), e=32,
                                         h=512, i=256, k=4, m=4, seed=5, extra_ids=2, w_scale=(22, 16),
                                         counter="HjDecodeLaunches")
    assert launches["plain"] >= 24, launches  # two GEMMs per step, two classes
    assert launches["graphs"] >= 4, launches
    assert np.all(np.isfinite(results["graphs"]))
    np.testing.assert_array_equal(results["graphs"], results["plain"])
