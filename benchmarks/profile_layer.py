"""Runs one BENCH.md point of the whole layer a few times, for a profiler to attach to (ncu,
compute-sanitizer): no timing of its own.

    ncu --clock-control none -k regex:decode_kernel -c 4 \
        python3 benchmarks/profile_layer.py --shape mixtral-8x7b --format w4a16-int4-g128 --tokens 1
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import humming_jax as hj

import moe_setup as ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="mixtral-8x7b", choices=sorted(ms.SHAPES))
    p.add_argument("--format", default="w4a16-int4-g128", choices=sorted(ms.FORMATS))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--calls", type=int, default=4)
    args = p.parse_args()
    e, k, h, i = ms.SHAPES[args.shape]
    w = ms.synthetic_weights(args.format, e, h, i, seed=0)
    point = ms.make_point(args.shape, args.tokens, "uniform", 1, seed=0)
    s = point.sets[0]
    x = jnp.asarray(s.x, w.dtype)
    tw, ids = jnp.asarray(s.topk_weights), jnp.asarray(s.topk_ids)
    f = jax.jit(lambda x, w, tw, ids: hj.fused_moe(x, w, tw, ids))
    for _ in range(args.calls):
        out = f(x, w, tw, ids)
    jax.block_until_ready(out)
    print(f"{args.shape} {args.format} M={args.tokens}: {args.calls} calls, out {out.shape} {out.dtype}")


if __name__ == "__main__":
    main()
