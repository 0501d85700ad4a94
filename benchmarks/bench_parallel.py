"""Expert and tensor parallelism on several GPUs against the single-GPU layer.

For each shape, format and M (default 16 and 4096) it times, jitted, median of --iters runs
after warm-up, rotating among --sets input sets:
- ``humming_jax``: single-device ``fused_moe`` on the first GPU (the baseline);
- ``humming_jax/ep_allgather``, ``humming_jax/ep_all_to_all`` (no-drop capacity M*k),
  ``humming_jax/ep_all_to_all_cap`` (expert_capacity = M: no drop, because the routing
  has k distinct experts per token), ``humming_jax/ep_all_to_all_grouped`` (the received rows
  as one ragged list through the grouped GEMMs) and ``humming_jax/tp``, over all --devices GPUs;
and, for each parallel mode, a program running only that mode's collectives with the same
shapes and dtypes, whose time over the layer time is reported as the collective share (an
estimate: it ignores any overlap of collectives with compute). Each parallel result is
compared with the baseline (all_to_all: bitwise; the others: relative error).

Rows follow BENCH.md's result format with extra fields (``devices``, ``collective_ms``,
``collective_share``, ``max_abs_diff``, ``rel_err``); the JSON lands in
benchmarks/results/h200/ unless --out says otherwise.

    python benchmarks/bench_parallel.py                       # 2 GPUs, M = 16 and 4096
    python benchmarks/bench_parallel.py --smoke               # tiny shapes on 2 CPU host devices
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import moe_setup

# E, k, H, I: BENCH.md's shapes (moe_setup, which needs no JAX), and a tiny one for --smoke.
SHAPES = {**{s: moe_setup.SHAPES[s] for s in moe_setup.MATRIX_SHAPES}, "tiny": (8, 2, 128, 256)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--formats", default="bf16,w4a16-int4-g128", help="scheme names of quantize_moe_weights")
    p.add_argument("--ms", default="16,4096")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sets", type=int, default=3, help="input sets to rotate among")
    p.add_argument("--modes", default="allgather,all_to_all,all_to_all_cap,all_to_all_grouped,tp")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/h200/parallel_<time>.json)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU host devices (checks the script)")
    args = p.parse_args()
    if args.smoke:
        args.shapes, args.formats, args.ms = "tiny", "bf16,w4a16-int4-g128", "16,64"
        args.iters, args.warmup, args.sets = 3, 1, 2
    return args


def main() -> None:
    args = parse_args()
    if args.smoke:  # before JAX starts
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import humming_jax as hj
    from humming_jax import parallel as par

    devices = jax.devices()[: args.devices]
    if len(devices) < 2 or len(devices) < args.devices:
        sys.exit(f"bench_parallel needs {args.devices} devices (>= 2); JAX sees {len(jax.devices())}: {jax.devices()}")
    if devices[0].platform != "cpu" and not hj.cuda_available():
        sys.exit(f"the CUDA backend is not available: {hj._ffi.backend_report()}")
    n = len(devices)
    axis = "x"
    mesh = Mesh(np.array(devices), (axis,))
    dev0 = devices[0]
    modes = args.modes.split(",")

    def timeit(fn: Callable[..., Any], sets: list[tuple[Any, ...]]) -> float:
        for i in range(args.warmup):
            jax.block_until_ready(fn(*sets[i % len(sets)]))
        times = []
        for i in range(args.iters):
            a = sets[i % len(sets)]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def routing(rng: np.random.Generator, m: int, e: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.argsort(rng.random((m, e)), axis=1)[:, :k].astype(np.int32)  # k distinct, uniform
        w = rng.random((m, k)).astype(np.float32) + 0.1
        return w / w.sum(axis=1, keepdims=True), ids

    def collective_program(mode: str, m: int, k: int, h: int, dtype: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """Only the collectives of ``mode`` (same shapes and dtypes as the layer), inputs placed."""
        m_loc = -(-m // n)
        rdt = par._reduce_dtype(n, dtype)
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P(axis)))  # noqa: E731
        sm = lambda f, ins, outs: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs, check_vma=False))  # noqa: E731
        tok = P(axis)
        if mode == "allgather":
            def f(x, tw, ids, part):
                g = (jax.lax.all_gather(a, axis, tiled=True) for a in (x, tw, ids))
                return (*g, jax.lax.psum_scatter(part, axis, scatter_dimension=0, tiled=True))
            ins = (put(jnp.ones((n * m_loc, h), dtype)), put(jnp.ones((n * m_loc, k), jnp.float32)),
                   put(jnp.ones((n * m_loc, k), jnp.int32)), put(jnp.ones((n * n * m_loc, h), rdt)))
            return sm(f, (tok,) * 4, (P(),) * 3 + (tok,)), ins
        if mode.startswith("all_to_all"):
            c1 = m_loc * k
            def f(send, slot):
                recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)
                s = jax.lax.all_to_all(slot, axis, 0, 0, tiled=True)
                return jax.lax.all_to_all(recv, axis, 0, 0, tiled=True), s
            ins = (put(jnp.ones((n * n, c1, h), dtype)), put(jnp.ones((n * n, c1), jnp.int32)))
            return sm(f, (tok, tok), (tok, tok)), ins
        def f(part):  # tp
            return jax.lax.psum(part, axis)
        return sm(f, (tok,), tok), (put(jnp.ones((n * m, h), rdt)),)

    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        e, k, h, i = SHAPES[shape]
        for fmt in args.formats.split(","):
            rng = np.random.default_rng(0)
            w13 = rng.standard_normal((e, 2 * i, h), dtype=np.float32) / np.float32(np.sqrt(h))
            w2 = rng.standard_normal((e, h, i), dtype=np.float32) / np.float32(np.sqrt(i))
            weights = hj.quantize_moe_weights(w13, w2, fmt)
            del w13, w2
            dtype = weights.dtype
            w_single = jax.device_put(weights, dev0)
            w_ep = par.shard_moe_weights(weights, mesh, axis)
            w_tp = par.shard_moe_weights_tp(weights, mesh, axis, activation="silu")
            per_expert = weights.nbytes / e
            del weights
            for m in (int(s) for s in args.ms.split(",")):
                sets = []
                for s in range(args.sets):
                    r = np.random.default_rng(1000 + s)
                    tw, ids = routing(r, m, e, k)
                    x = r.standard_normal((m, h), dtype=np.float32)
                    sets.append((jnp.asarray(x, dtype), jnp.asarray(tw), jnp.asarray(ids)))
                touched = len(np.unique(np.asarray(sets[0][2])))
                common = dict(format=fmt, shape=shape, M=m, part="layer", bytes=int(touched * per_expert),
                              flops=int(2 * m * k * h * 2 * i + 2 * m * k * i * h))

                single = jax.jit(lambda x, w, tw, ids: hj.fused_moe(x, w, tw, ids))
                s_sets = [jax.device_put((x, w_single, tw, ids), dev0) for x, tw, ids in sets]
                base_ms = timeit(single, s_sets)
                base_out = np.asarray(single(*s_sets[0]).astype(jnp.float32))
                rows.append(dict(system="humming_jax", devices=1, median_ms=base_ms, **common))
                print(f"{shape} {fmt} M={m}: single {base_ms:.3f} ms", flush=True)

                for mode in modes:
                    if mode == "tp":
                        fn = jax.jit(lambda x, w, tw, ids: par.tp_moe(x, w, tw, ids, mesh=mesh, axis=axis))
                        wts = w_tp
                    else:
                        kw = {"all_to_all_cap": dict(mode="all_to_all", expert_capacity=m),
                              "all_to_all_grouped": dict(mode="all_to_all", expert_layout="grouped")}.get(mode, dict(mode=mode))
                        fn = jax.jit(lambda x, w, tw, ids, kw=kw: par.ep_moe(x, w, tw, ids, mesh=mesh, axis=axis, **kw))
                        wts = w_ep
                    p_sets = [(x, wts, tw, ids) for x, tw, ids in sets]
                    try:
                        ms = timeit(fn, p_sets)
                        got = np.asarray(fn(*p_sets[0]).astype(jnp.float32))
                        coll, coll_in = collective_program(mode, m, k, h, dtype)
                        coll_ms = timeit(coll, [coll_in])
                    except Exception as err:  # e.g. out of memory at the no-drop capacity
                        print(f"  {mode}: failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
                        rows.append(dict(system=f"humming_jax/{mode}", devices=n, error=str(err)[:500], **common))
                        continue
                    diff = float(np.max(np.abs(got - base_out))) if m else 0.0
                    rel = hj.reference.relative_error(got, base_out) if m else 0.0
                    rows.append(dict(system=f"humming_jax/{mode}", devices=n, median_ms=ms, collective_ms=coll_ms,
                                     collective_share=coll_ms / ms, max_abs_diff=diff, rel_err=rel, **common))
                    print(f"  {mode:18s} {ms:8.3f} ms  ({base_ms / ms:4.2f}x single)  collectives {coll_ms:7.3f} ms "
                          f"({100 * coll_ms / ms:4.1f}%)  max|diff| {diff:.3g} rel {rel:.2e}", flush=True)

    out = Path(args.out) if args.out else (
        Path(__file__).resolve().parent / "results" / "h200" / f"parallel_{dt.datetime.now():%Y%m%d_%H%M%S}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(devices=[str(d) for d in devices], jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
                backends=hj._ffi.backend_report(), smoke=args.smoke)
    # No ceilings are measured here: the rows compare layouts with the single-device layer.
    out.write_text(json.dumps(dict(ceilings={}, meta=meta, rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
