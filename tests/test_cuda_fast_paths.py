"""GPU checks of the fast GEMM paths (libraries built with HUMMING_JAX_FAST_PATHS=ON): each path
against the CPU handler, the generic CUDA kernel or the oracle at the shapes it serves, and proof
that the path actually ran.

Skipped unless the CUDA handlers are registered; each path's tests also skip when the library was
built without it. Sections: prefill (CUTLASS grouped GEMM, cuda_ffi/gemm_prefill_sm90*).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOL, nan_out, random_layer

import humming_jax as hj
from humming_jax import _ffi
from humming_jax.experts import GroupedExperts
from humming_jax.ops import activation as act_ops
from humming_jax.ops import gemm as gemm_ops
from humming_jax.ops import routing as routing_ops
from humming_jax.quantize import SCHEMES, act_quant_params
from humming_jax.reference import InputQuant, moe_reference, relative_error

CPU = jax.devices("cpu")[0]
GPU = jax.devices("cuda")[0] if hj.cuda_available() else None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPU is None, reason="CUDA backend not available (humming_jax.cuda_available() is False)"),
]


def _cuda_symbol(name: str):
    """A C function exported by the loaded CUDA library, or None."""
    path = _ffi.backend_report()["cuda"]
    if path is None:
        return None
    fn = getattr(ctypes.CDLL(path), name, None)
    if fn is not None:
        fn.restype = ctypes.c_uint64
        fn.argtypes = []
    return fn


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
# kMinRowsPerExpert = 64 rows per local expert on average; HUMMING_JAX_PREFILL=0 turns it off.
# ================================================================================================
_PREFILL_LAUNCHES = _cuda_symbol("HjPrefillLaunches") if GPU is not None else None
_SM90 = GPU is not None and str(getattr(GPU, "compute_capability", "")) == "9.0"

requires_prefill = pytest.mark.skipif(
    _PREFILL_LAUNCHES is None or not _SM90,
    reason="prefill path absent: library built without HUMMING_JAX_FAST_PATHS, or not an sm_90 device",
)


class _Launches:
    """Counts prefill GEMM launches made inside the block (host-side launches)."""

    def __enter__(self):
        self.start = _PREFILL_LAUNCHES()
        return self

    def __exit__(self, *exc):
        self.count = _PREFILL_LAUNCHES() - self.start
        return False


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


def _gemm_inputs(rng, scheme, m, k, e, n, kdim, kind, bias=False):
    """GEMM operands built on the GPU: permuted (and for fp8, quantized) activations, offsets,
    weights, bias; returned as host-independent jax arrays on the GPU."""
    spec = SCHEMES[scheme]
    dtype = spec.default_dtype
    quant = act_quant_params(spec.act_key)
    w = spec.quantize((rng.standard_normal((e, n, kdim)) / np.sqrt(kdim)).astype(np.float32), dtype)
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


PREFILL_CASES = [
    # scheme, M tokens, top-k, E, N, K, routing
    ("bf16", 1024, 2, 8, 768, 512, "uniform"),
    ("fp16", 1024, 2, 8, 512, 256, "uniform"),
    ("bf16", 2048, 8, 64, 384, 256, "zero_rows"),
    ("bf16", 1024, 1, 8, 256, 512, "one_expert"),
    ("bf16", 1024, 4, 16, 264, 136, "tail"),  # N, K multiples of 8 but not of the tiles
    ("w8a8-fp8-block128", 1024, 2, 8, 768, 512, "uniform"),
    ("w8a8-fp8-block128", 2048, 8, 64, 384, 256, "zero_rows"),
    ("w8a8-fp8-block128", 1024, 1, 8, 256, 512, "one_expert"),
    ("w8a8-fp8-block128", 1024, 4, 16, 256, 384, "tail"),
]


@requires_prefill
@pytest.mark.parametrize("scheme,m,k,e,n,kdim,kind", PREFILL_CASES)
def test_prefill_grouped_gemm_matches_cpu(rng, scheme, m, k, e, n, kdim, kind):
    p = _gemm_inputs(rng, scheme, m, k, e, n, kdim, kind, bias=kind == "uniform")
    with _Launches() as launched:
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
    ],
)
def test_prefill_matches_generic_kernel_at_model_shapes(rng, monkeypatch, scheme, m, k, e, n, kdim):
    p = _gemm_inputs(rng, scheme, m, k, e, n, kdim, "uniform")
    with _Launches() as launched:
        got = _run_gemm(GPU, p)
    assert launched.count == 1
    monkeypatch.setenv("HUMMING_JAX_PREFILL", "0")
    with _Launches() as generic:
        want = _run_gemm(GPU, p, poison=False)
    assert generic.count == 0, "HUMMING_JAX_PREFILL=0 must leave the call to the generic kernel"
    _assert_close(got, want, p["dtype"], f"{scheme} M={m} E={e} N={n} K={kdim}")


@requires_prefill
def test_prefill_small_experts_keep_the_generic_kernel(rng):
    p = _gemm_inputs(rng, "bf16", 64, 2, 8, 256, 256, "uniform")  # 16 rows per expert
    with _Launches() as launched:
        _run_gemm(GPU, p, poison=False)
    assert launched.count == 0


@requires_prefill
@pytest.mark.parametrize("scheme", ["bf16", "w8a8-fp8-block128"])
def test_prefill_is_deterministic(rng, scheme):
    p = _gemm_inputs(rng, scheme, 2048, 4, 16, 1024, 1024, "uniform", bias=True)
    runs = [_run_gemm(GPU, p) for _ in range(3)]
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])


@requires_prefill
def test_prefill_rejects_a_too_small_workspace(rng):
    p = _gemm_inputs(rng, "bf16", 1024, 2, 8, 256, 256, "uniform")
    ops, attrs = gemm_ops._operands(p["a"], None, p["w"], None, 0)
    shapes = (jax.ShapeDtypeStruct((p["a"].shape[0], 256), jnp.bfloat16), jax.ShapeDtypeStruct((1024,), jnp.uint8))
    f = jax.jit(lambda *ops: _ffi.call("gemm_grouped", shapes, *ops, **attrs))
    with pytest.raises(Exception, match=r"prefill kernel needs \d+"):
        jax.block_until_ready(f(*ops, p["off"]))


@requires_prefill
@pytest.mark.parametrize(
    "scheme,bias,e_global",
    [("bf16", False, None), ("bf16", True, None), ("fp16", False, None), ("w8a8-fp8-block128", False, None),
     ("bf16", False, 16), ("w8a8-fp8-block128", False, 16)],
)
def test_prefill_layer_against_oracle_with_poisoned_out(rng, scheme, bias, e_global):
    layer = random_layer(rng, m=1024, e=8, h=512, i=256, k=2, scheme=scheme, bias=bias, e_global=e_global,
                         pad_frac=0.05 if e_global else 0.0)
    args = jax.device_put((layer.x, layer.weights, layer.topk_weights, layer.topk_ids), GPU)
    f = jax.jit(lambda out, x, w, tw, ids: GroupedExperts().apply(out, x, w, tw, ids))
    with _Launches() as launched:
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


_PREFILL_GRAPH_SCRIPT = textwrap.dedent(
    """
    import ctypes, sys
    import jax, jax.numpy as jnp, numpy as np
    import humming_jax as hj
    from humming_jax.experts import GroupedExperts
    assert hj.cuda_available(), hj._ffi.backend_report()
    launches = getattr(ctypes.CDLL(hj._ffi.backend_report()["cuda"]), "HjPrefillLaunches")
    launches.restype = ctypes.c_uint64
    rng = np.random.default_rng(11)
    e, h, i, k, m = 8, 512, 256, 2, 1024
    w = hj.quantize_moe_weights(rng.standard_normal((e, 2 * i, h)) / 22, rng.standard_normal((e, h, i)) / 16,
                                sys.argv[2])
    f = jax.jit(lambda o, x, w, tw, ids: GroupedExperts().apply(o, x, w, tw, ids), donate_argnums=0)
    out = jnp.full((m, h), jnp.nan, jnp.bfloat16)
    results = []
    for step in range(6):  # replays with changing routing and inputs
        x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
        ids = jnp.asarray(np.argsort(rng.random((m, e + 2)), axis=1)[:, :k].astype(np.int32))
        tw = jnp.asarray(rng.random((m, k)).astype(np.float32))
        out = f(out, x, w, tw, ids)
        results.append(np.asarray(out.astype(jnp.float32)))
    np.save(sys.argv[1], np.stack(results))
    print("launches", launches())
    """
)


@requires_prefill
@pytest.mark.parametrize("scheme", ["bf16", "w8a8-fp8-block128"])
def test_prefill_command_buffers_give_the_same_results(tmp_path, scheme):
    """CUDA-graph capture and replay (command buffers on) against plain execution, in fresh
    processes (so the first use of the kernel, with its one-time setup, happens under capture)."""
    script = tmp_path / "prefill_graph_run.py"
    script.write_text(_PREFILL_GRAPH_SCRIPT)
    results, launches = {}, {}
    for name, flags in {
        "graphs": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
        "plain": "--xla_gpu_enable_command_buffer=",
    }.items():
        env = dict(os.environ, XLA_FLAGS=flags)
        path = tmp_path / f"{name}.npy"
        proc = subprocess.run([sys.executable, str(script), str(path), scheme], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[name] = np.load(path)
        launches[name] = int(proc.stdout.split("launches")[-1])
    assert launches["plain"] >= 12, launches  # two GEMMs per step
    assert np.all(np.isfinite(results["graphs"]))
    np.testing.assert_array_equal(results["graphs"], results["plain"])
