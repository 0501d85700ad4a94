"""GEMM-only timing of the indexed expert GEMM (``gemm_indexed``, the standard decode path) at
BENCH.md's decode points: the decode kernel (a HUMMING_JAX_FAST_PATHS build,
cuda_ffi/gemm_decode_sm90*) against the generic kernel (HUMMING_JAX_DECODE=0) in the same process,
with the device-to-device copy ceiling (bytes read + written) measured in the same run.

For each shape (E, top-k, H, I), tokens M and format, both GEMMs of the layer are timed on their
own: gemm1 (N = 2I, K = H, rows gathered by id // top-k) and gemm2 (N = H, K = I, gather_div 1),
k distinct experts per token drawn uniformly, all local. Throughput counts the bytes of the experts
actually touched (codes + scales of every expert that receives a row, averaged over the steps).
Each sample is one jitted ``lax.scan`` over STEPS input sets (new activations and routing per step,
routing metadata prepared outside the timed region), divided by STEPS; the figure is the median of
SAMPLES samples after a warm-up. A row says which kernel actually ran (the decode launch counter).

    python3 benchmarks/bench_decode.py [--shapes mixtral-8x7b,...] [--tokens 1,16]
                                       [--formats bf16,int4,mxfp4,fp8] [--samples 20] [--out r.json]
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
from humming_jax.experts import indexed_block_m
from humming_jax.ops import gemm as gemm_ops
from humming_jax.ops import routing as routing_ops
from humming_jax.weights import PackedWeight
import moe_setup
from timing import copy_ceiling, median_ms

# E, top-k, H, I: BENCH.md's shapes (moe_setup), and a tiny one for smoke runs.
SHAPES = {**{s: moe_setup.SHAPES[s] for s in moe_setup.MATRIX_SHAPES}, "tiny": (8, 2, 256, 128)}
STEPS = 5


def _weights(key, fmt: str, e: int, n: int, k: int) -> tuple[PackedWeight, float]:
    """Random weights of a format, made on the device, and their bytes per expert (codes + scales)."""
    k1, k2 = jax.random.split(key)
    if fmt == "bf16":
        data = (jax.random.normal(k1, (e, n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
        return PackedWeight(data, wtype=WeightType.FLOAT, k=k), 2.0 * n * k
    if fmt == "int4":  # w4a16 int4, bf16 scales per 128 (symmetric)
        data = jax.random.randint(k1, (e, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        scale = jax.random.uniform(k2, (e, n, k // 128), jnp.float32, 0.001, 0.004).astype(jnp.bfloat16)
        return PackedWeight(data, scale=scale, wtype=WeightType.UINT4, k=k, group_n=1, group_k=128), \
            n * k / 2 + 2.0 * n * (k // 128)
    if fmt == "mxfp4":  # e2m1 codes, e8m0 scales per 32
        data = jax.random.randint(k1, (e, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        scale = jax.random.randint(k2, (e, n, k // 32), 118, 124, jnp.int32).astype(jnp.uint8)
        return PackedWeight(data, scale=scale, wtype=WeightType.FP4_E2M1, k=k, group_n=1, group_k=32), \
            n * k / 2 + 1.0 * n * (k // 32)
    # fp8: e4m3 codes with 128 x 128 block scales (w8a8: fp8 activations with 1 x 128 scales)
    data = (jax.random.normal(k1, (e, n, k), jnp.float32) * 8).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(k2, (e, -(-n // 128), -(-k // 128)), jnp.float32, 0.001, 0.004)
    return PackedWeight(data, scale=scale, wtype=WeightType.FP8_E4M3, k=k, group_n=128, group_k=128), \
        1.0 * n * k + 4.0 * (-(-n // 128)) * (-(-k // 128))


def _inputs(rng: np.random.Generator, fmt: str, m: int, e: int, topk: int, k: int, gather_div: int):
    """STEPS sets of (a, a_scale or None, routing) and the mean number of experts touched."""
    bm = indexed_block_m(m * topk, e)
    emap = jnp.arange(e, dtype=jnp.int32)
    routes, touched = [], []
    for _ in range(STEPS):
        ids = np.argsort(rng.random((m, e)), axis=1)[:, :topk].astype(np.int32)
        touched.append(len(np.unique(ids)))
        routes.append(jax.jit(lambda i: routing_ops.routing_indexed(i, emap, e, bm))(jnp.asarray(ids)))
    routing = jax.tree.map(lambda *xs: jnp.stack(xs), *routes)
    rows = m if gather_div > 1 else m * topk
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    a = jax.random.normal(key, (STEPS, rows, k), jnp.float32)
    if fmt == "fp8":
        scale = jax.random.uniform(key, (STEPS, rows, k // 128), jnp.float32, 0.001, 0.01)
        return a.astype(jnp.float8_e4m3fn), scale, routing, bm, float(np.mean(touched))
    return a.astype(jnp.bfloat16), None, routing, bm, float(np.mean(touched))


def _scan_gemm(fmt: str, rows: int, gather_div: int, bm: int):
    agk = 128 if fmt == "fp8" else 0

    def run(a, s, routing, w):
        def body(acc, xs):
            a_i, s_i, r_i = xs
            c = gemm_ops.gemm_indexed(a_i, s_i, w, None, routing_ops.IndexedRouting(*r_i), rows=rows,
                                      gather_div=gather_div, block_m=bm, out_dtype=jnp.bfloat16, act_group_k=agk)
            return acc + c[0, 0].astype(jnp.float32), None

        return jax.lax.scan(body, jnp.zeros((), jnp.float32), (a, s, tuple(routing)))[0]

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(s for s in SHAPES if s != "tiny"))
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--formats", default="bf16,int4,mxfp4,fp8")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--copy-mb", type=int, default=2048, help="buffer size of the copy ceiling")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    counter = hj._ffi.launch_counter("HjDecodeLaunches")
    if counter is None:
        print("note: CUDA library without HUMMING_JAX_FAST_PATHS (or no CUDA): only the generic kernel runs")
    rng = np.random.default_rng(0)
    ceiling = copy_ceiling(args.samples, args.copy_mb)
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    rows_out = []
    for shape in args.shapes.split(","):
        e, topk, h, i = SHAPES[shape]
        for fmt in args.formats.split(","):
            for gemm, (n, k, gdiv) in (("gemm1", (2 * i, h, topk)), ("gemm2", (h, i, 1))):
                if fmt in ("int4", "fp8") and k % 128:
                    print(f"{shape} {gemm} {fmt}: K = {k} not a multiple of 128, skipped")
                    continue
                w, per_expert = _weights(jax.random.PRNGKey(len(rows_out)), fmt, e, n, k)
                for m in (int(t) for t in args.tokens.split(",")):
                    a, s, routing, bm, touched = _inputs(rng, fmt, m, e, topk, k, gdiv)
                    nbytes = touched * per_expert
                    for kernel, env in (("decode", "1"), ("generic", "0")):
                        os.environ["HUMMING_JAX_DECODE"] = env
                        f = jax.jit(_scan_gemm(fmt, m * topk, gdiv, bm))  # a fresh executable per kernel
                        before = counter() if counter else 0
                        ms = median_ms(f, (a, s, routing, w), args.samples) / STEPS
                        ran = "decode" if counter and counter() > before else "generic"
                        if counter and kernel == "decode" and ran != "decode":
                            print(f"{shape} {fmt} {gemm} M={m}: the decode kernel did not take this problem")
                        tbps = nbytes / (ms * 1e-3) / 1e12
                        row = dict(shape=shape, format=fmt, gemm=gemm, M=m, N=n, K=k, kernel=ran, median_ms=ms,
                                   bytes=nbytes, tbps=tbps)
                        rows_out.append(row)
                        print(f"{shape:16s} {fmt:5s} {gemm} M={m:3d} {ran:8s} {ms * 1e3:9.1f} us "
                              f"{nbytes / 1e6:8.1f} MB {tbps:5.2f} TB/s ({tbps / ceiling:.0%} of copy)")
                    del a, s, routing
                del w
    os.environ.pop("HUMMING_JAX_DECODE", None)
    result = dict(ceilings=dict(copy_tbps=ceiling), rows=rows_out)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
