"""A short benchmark of the whole MoE layer (routing, GEMM1, activation, GEMM2, finalize into out)
against ``jax.lax.ragged_dot`` in the same process: bf16 and w4a16 (int4, group 128) for the
qwen3-30b-a3b and mixtral-8x7b shapes at M = 1, 16, 1024.

Timing: each sample is one jitted ``lax.scan`` over STEPS layers, each step on its own random
inputs and routing (so activations are not served from L2), divided by STEPS; the figure is the
median of SAMPLES samples after a warm-up. Weights are random (never zeros), made on the device.
The ragged_dot peer gets its preferred weight layout ([E, K, N], transposed once, outside the
timing) and, for w4a16, the dequantized bf16 weights.

    python3 benchmarks/bench_quick.py [--out results.json] [--samples 20]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import humming_jax as hj
from humming_jax._abi import WeightType
from humming_jax.experts import GroupedExperts, IndexedExperts
from humming_jax.quantize import W_BF16, W_INT4_G128
from humming_jax.weights import MoEWeights, PackedWeight

import moe_setup
from timing import copy_ceiling, matmul_ceiling

SHAPES = {**{s: moe_setup.SHAPES[s] for s in ("qwen3-30b-a3b", "mixtral-8x7b")}, "tiny": (8, 2, 256, 128)}
DEFAULT_SHAPES = "qwen3-30b-a3b,mixtral-8x7b"
FORMATS = ("bf16", "w4a16")
TOKENS = (1, 16, 1024)
STEPS = 10


def make_weight(key, fmt: str, e: int, n: int, k: int) -> PackedWeight:
    if fmt == "bf16":
        data = (jax.random.normal(key, (e, n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
        return PackedWeight(data, wtype=WeightType.FLOAT, k=k)
    k1, k2 = jax.random.split(key)
    data = jax.random.randint(k1, (e, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    scale = (jax.random.uniform(k2, (e, n, k // 128), jnp.float32, 0.001, 0.004)).astype(jnp.bfloat16)
    return PackedWeight(data, scale=scale, wtype=WeightType.UINT4, k=k, group_n=1, group_k=128)


def make_weights(fmt: str, e: int, h: int, i: int, seed: int = 0) -> MoEWeights:
    k13, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return MoEWeights(
        w13=make_weight(k13, fmt, e, 2 * i, h),
        w2=make_weight(k2, fmt, e, h, i),
        weight_key=W_BF16 if fmt == "bf16" else W_INT4_G128,
        act_key=None,
        scheme="bf16" if fmt == "bf16" else "w4a16-int4-g128",
        dtype=jnp.bfloat16,
    )


def make_inputs(rng: np.random.Generator, steps: int, m: int, e: int, k: int, h: int):
    ids = np.argsort(rng.random((steps, m, e)), axis=-1)[..., :k].astype(np.int32)  # k distinct experts
    tw = rng.random((steps, m, k)).astype(np.float32)
    tw /= tw.sum(-1, keepdims=True)
    x = jnp.asarray(rng.standard_normal((steps, m, h)).astype(np.float32), jnp.bfloat16)
    return x, jnp.asarray(tw), jnp.asarray(ids)


def ragged_layer(x, w13t, w2t, tw, ids):
    """The same layer with jax.lax.ragged_dot: w13t [E, H, N1], w2t [E, I, H] (bf16)."""
    m, k = ids.shape
    e = w13t.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    gu = jax.lax.ragged_dot(x[order // k], w13t, sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    i = gu.shape[1] // 2
    a = (jax.nn.silu(gu[:, :i].astype(jnp.float32)) * gu[:, i:].astype(jnp.float32)).astype(x.dtype)
    d = jax.lax.ragged_dot(a, w2t, sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    y = jnp.zeros_like(d).at[order].set(d).reshape(m, k, -1).astype(jnp.float32)
    return jnp.einsum("mkh,mk->mh", y, tw).astype(x.dtype)


def scan_of(layer):
    """A jitted loop applying `layer` to each of the stacked input sets; `out` is carried."""

    def run(out, weights, xs, tws, idss):
        def body(out, inp):
            x, tw, ids = inp
            return layer(out, weights, x, tw, ids), None

        out, _ = jax.lax.scan(body, out, (xs, tws, idss))
        return out

    return jax.jit(run, donate_argnums=0)


def median_ms(fn, out, *args, samples: int) -> tuple[float, jax.Array]:
    out = jax.block_until_ready(fn(out, *args))  # compile and warm up
    out = jax.block_until_ready(fn(out, *args))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(out, *args))
        times.append((time.perf_counter() - t0) / STEPS * 1e3)
    return float(np.median(times)), out


def touched_bytes(w: MoEWeights, ids: np.ndarray) -> int:
    used = len(np.unique(ids[ids >= 0]))
    return int(w.nbytes * used // w.num_experts)


def ceilings() -> dict[str, float]:
    """Copy bandwidth over 1 GiB and the 8192-square bf16 matmul, 10 samples each."""
    return {"copy_tbps": round(copy_ceiling(10, 1024), 3), "bf16_tflops": round(matmul_ceiling(10, 8192), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_quick.json")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = ap.parse_args()
    print(f"backend: {jax.default_backend()} {jax.devices()[0]}; humming_jax: {hj._ffi.backend_report()}", flush=True)
    result = {"ceilings": {} if args.no_ceilings else ceilings(), "rows": [], "method": __doc__.split("\n\n")[1]}
    print(f"ceilings: {result['ceilings']}", flush=True)
    systems = {
        "humming_jax": lambda out, w, x, tw, ids: hj.fused_moe(x, w, tw, ids, out=out),
        "humming_jax/indexed": lambda out, w, x, tw, ids: IndexedExperts().apply(out, x, w, tw, ids),
        "humming_jax/grouped": lambda out, w, x, tw, ids: GroupedExperts().apply(out, x, w, tw, ids),
    }
    rng = np.random.default_rng(1234)
    for shape in args.shapes.split(","):
        e, k, h, i = SHAPES[shape]
        for fmt in FORMATS:
            w = make_weights(fmt, e, h, i)
            w13, w2 = w.dequantize()  # the ragged_dot peer's bf16 weights, in its layout
            w13t = jnp.swapaxes(w13, 1, 2).astype(jnp.bfloat16)
            w2t = jnp.swapaxes(w2, 1, 2).astype(jnp.bfloat16)
            del w13, w2
            for m in map(int, args.tokens.split(",")):
                xs, tws, idss = make_inputs(rng, STEPS, m, e, k, h)
                flops = 2 * m * k * h * 2 * i + 2 * m * k * i * h
                nbytes = touched_bytes(w, np.asarray(idss[0]))
                outs = {}
                for name, layer in systems.items():
                    ms, outs[name] = median_ms(scan_of(layer), jnp.zeros((m, h), jnp.bfloat16), w, xs, tws, idss,
                                               samples=args.samples)
                    result["rows"].append(dict(system=name, format=fmt, shape=shape, M=m, part="layer", median_ms=ms,
                                               bytes=nbytes, flops=flops))
                rag = lambda out, ws, x, tw, ids: ragged_layer(x, ws[0], ws[1], tw, ids)
                ms, outs["ragged_dot"] = median_ms(scan_of(rag), jnp.zeros((m, h), jnp.bfloat16), (w13t, w2t), xs, tws,
                                                   idss, samples=args.samples)
                result["rows"].append(dict(system="ragged_dot", format=fmt, shape=shape, M=m, part="layer", median_ms=ms,
                                           bytes=nbytes, flops=flops))
                # The last step's outputs of every system agree (a sanity check, not a test).
                ref = np.asarray(outs["ragged_dot"].astype(jnp.float32), np.float64)
                for name in systems:
                    got = np.asarray(outs[name].astype(jnp.float32), np.float64)
                    rel = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
                    result["rows"][-1 - len(systems) + list(systems).index(name)]["rel_diff_vs_ragged_dot"] = float(rel)
                row = {r["system"]: r["median_ms"] for r in result["rows"][-1 - len(systems):]}
                print(f"{shape:14s} {fmt:6s} M={m:5d}  " + "  ".join(f"{s}={v:.3f}ms" for s, v in row.items()), flush=True)
            del w, w13t, w2t
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\nshape          format     M  humming_jax ms  ragged_dot ms  speedup  TB/s(ours)  TFLOP/s(ours)")
    rows = result["rows"]
    for r in rows:
        if r["system"] != "humming_jax":
            continue
        peer = next(p for p in rows if p["system"] == "ragged_dot" and (p["shape"], p["format"], p["M"]) ==
                    (r["shape"], r["format"], r["M"]))
        print(f"{r['shape']:14s} {r['format']:6s} {r['M']:5d}  {r['median_ms']:13.3f}  {peer['median_ms']:13.3f}  "
              f"{peer['median_ms'] / r['median_ms']:6.2f}x  {r['bytes'] / r['median_ms'] / 1e9:9.2f}  "
              f"{r['flops'] / r['median_ms'] / 1e9:12.1f}")


if __name__ == "__main__":
    main()
