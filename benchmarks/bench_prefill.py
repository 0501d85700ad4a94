"""GEMM-only timing of the grouped expert GEMM (``gemm_grouped``) at BENCH.md's prefill points:
the prefill kernel (a HUMMING_JAX_FAST_PATHS build, cuda_ffi/gemm_prefill_sm90*) against the
generic kernel (HUMMING_JAX_PREFILL=0) in the same process, with the bf16 matmul ceiling measured
in the same run.

For each shape (E, top-k, H, I), tokens M and format, both GEMMs of the layer are timed on their
own: gemm1 (N = 2I, K = H) and gemm2 (N = H, K = I), R = M * top-k rows routed uniformly at random
(k distinct experts per token, all local). FLOPs = 2 * R * N * K. Each sample is one jitted
``lax.scan`` over STEPS input sets (new activations and routing per step, so activations do not
sit in L2), divided by STEPS; the figure is the median of SAMPLES samples after a warm-up. A row
says which kernel actually ran (the prefill launch counter of the CUDA library).

    python3 benchmarks/bench_prefill.py [--shapes mixtral-8x7b,...] [--tokens 1024,4096]
                                        [--formats bf16,fp8] [--samples 20] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import humming_jax as hj
from humming_jax._abi import WeightType
from humming_jax.ops import gemm as gemm_ops
from humming_jax.weights import PackedWeight
import moe_setup
from timing import matmul_ceiling, median_ms

# E, top-k, H, I: BENCH.md's shapes (moe_setup), and a tiny one for smoke runs.
SHAPES = {**{s: moe_setup.SHAPES[s] for s in moe_setup.MATRIX_SHAPES}, "tiny": (8, 2, 256, 128)}
STEPS = 5


def _weights(key, fmt: str, e: int, n: int, k: int) -> PackedWeight:
    if fmt == "bf16":
        data = (jax.random.normal(key, (e, n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
        return PackedWeight(data, wtype=WeightType.FLOAT, k=k)
    k1, k2 = jax.random.split(key)
    data = jax.random.normal(k1, (e, n, k), jnp.float32).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(k2, (e, -(-n // 128), -(-k // 128)), jnp.float32, 0.001, 0.004)
    return PackedWeight(data, scale=scale, wtype=WeightType.FP8_E4M3, k=k, group_n=128, group_k=128)


def _inputs(rng: np.random.Generator, fmt: str, m: int, e: int, topk: int, k: int):
    """STEPS sets of (a [R, K], a_scale or None, offsets [E + 1]) with uniform routing."""
    rows = m * topk
    offs = []
    for _ in range(STEPS):
        ids = np.argsort(rng.random((m, e)), axis=1)[:, :topk]
        counts = np.bincount(ids.reshape(-1), minlength=e)
        offs.append(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    a = jax.random.normal(key, (STEPS, rows, k), jnp.float32)
    if fmt == "bf16":
        return a.astype(jnp.bfloat16), None, jnp.asarray(np.stack(offs))
    scale = jax.random.uniform(key, (STEPS, rows, k // 128), jnp.float32, 0.001, 0.01)
    return a.astype(jnp.float8_e4m3fn), scale, jnp.asarray(np.stack(offs))


def _scan_gemm(w: PackedWeight, fmt: str):
    agk = 128 if fmt == "fp8" else 0

    def run(a, s, off, w):
        def body(acc, xs):
            a_i, s_i, off_i = xs
            c = gemm_ops.gemm_grouped(a_i, s_i, w, None, off_i, out_dtype=jnp.bfloat16, act_group_k=agk)
            return acc + c[0, 0].astype(jnp.float32), None

        return jax.lax.scan(body, jnp.zeros((), jnp.float32), (a, s, off))[0]

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(s for s in SHAPES if s != "tiny"))
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--matmul-n", type=int, default=8192, help="size of the square matmul ceiling")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    counter = hj._ffi.launch_counter("HjPrefillLaunches")
    if counter is None:
        print("note: CUDA library without HUMMING_JAX_FAST_PATHS (or no CUDA): only the generic kernel runs")
    rng = np.random.default_rng(0)
    ceiling = matmul_ceiling(args.samples, args.matmul_n)
    print(f"bf16 matmul ceiling: {ceiling:.0f} TFLOP/s")
    rows = []
    for shape in args.shapes.split(","):
        e, topk, h, i = SHAPES[shape]
        for fmt in args.formats.split(","):
            for gemm, (n, k) in (("gemm1", (2 * i, h)), ("gemm2", (h, i))):
                if fmt == "fp8" and (n % 128 or k % 128):
                    print(f"{shape} {gemm} fp8: N = {n}, K = {k} not whole 128-blocks, skipped")
                    continue
                w = _weights(jax.random.PRNGKey(len(rows)), fmt, e, n, k)
                for m in (int(t) for t in args.tokens.split(",")):
                    a, s, off = _inputs(rng, fmt, m, e, topk, k)
                    flops = 2.0 * m * topk * n * k
                    for kernel, env in (("prefill", "1"), ("generic", "0")):
                        os.environ["HUMMING_JAX_PREFILL"] = env
                        f = jax.jit(_scan_gemm(w, fmt))  # a fresh executable per kernel (graphs capture once)
                        before = counter() if counter else 0
                        ms = median_ms(f, (a, s, off, w), args.samples) / STEPS
                        ran = "prefill" if counter and counter() > before else "generic"
                        if counter and kernel == "prefill" and ran != "prefill":
                            print(f"{shape} {fmt} {gemm} M={m}: the prefill kernel did not take this problem")
                        row = dict(shape=shape, format=fmt, gemm=gemm, M=m, N=n, K=k, kernel=ran,
                                   median_ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
                        rows.append(row)
                        print(f"{shape:16s} {fmt:5s} {gemm} M={m:6d} {ran:8s} {ms:8.3f} ms "
                              f"{row['tflops']:7.1f} TFLOP/s ({row['tflops'] / ceiling:.0%} of matmul)")
                    del a, s, off
                del w
    os.environ.pop("HUMMING_JAX_PREFILL", None)
    result = dict(ceilings=dict(bf16_tflops=ceiling), rows=rows)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
