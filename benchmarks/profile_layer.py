"""Runs BENCH.md points of the whole layer a few times each, for a profiler to attach to (ncu,
compute-sanitizer): no timing of its own. Shapes, formats and tokens are comma lists; every
combination runs, in order, in one process.

    ncu --clock-control none -k regex:decode_kernel -c 4 \
        python3 benchmarks/profile_layer.py --shape mixtral-8x7b --format w4a16-int4-g128 --tokens 1
    ncu --clock-control none -k regex:decode_kernel --metrics gpu__time_duration.sum \
        python3 benchmarks/profile_layer.py --shape mixtral-8x7b,qwen3-30b-a3b --format w4a16-mxfp4 --tokens 1,16
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import humming_jax as hj

import moe_setup as ms


def _list(choices):
    def parse(text: str) -> list[str]:
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {sorted(choices)}")
        return items

    return parse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=_list(ms.SHAPES), default=["mixtral-8x7b"])
    p.add_argument("--format", type=_list(ms.FORMATS), default=["w4a16-int4-g128"])
    p.add_argument("--tokens", type=lambda t: [int(x) for x in t.split(",") if x], default=[1])
    p.add_argument("--calls", type=int, default=4)
    args = p.parse_args()
    f = jax.jit(lambda x, w, tw, ids: hj.fused_moe(x, w, tw, ids))
    for shape in args.shape:
        e, k, h, i = ms.SHAPES[shape]
        for fmt in args.format:
            w = ms.synthetic_weights(fmt, e, h, i, seed=0)
            for m in args.tokens:
                s = ms.make_point(shape, m, "uniform", 1, seed=0).sets[0]
                x = jnp.asarray(s.x, w.dtype)
                tw, ids = jnp.asarray(s.topk_weights), jnp.asarray(s.topk_ids)
                for _ in range(args.calls):
                    out = f(x, w, tw, ids)
                jax.block_until_ready(out)
                print(f"{shape} {fmt} M={m}: {args.calls} calls, out {out.shape} {out.dtype}", flush=True)
            del w


if __name__ == "__main__":
    main()
