"""Runs one BENCH.md point of humming-kernels' two GEMMs a few times, for a profiler to attach to
(ncu): no timing of its own. The peer is driven exactly as bench_moe.py drives it.

    ncu --clock-control none -k regex:humming -c 4 \
        python3 benchmarks/profile_hk.py --shape mixtral-8x7b --format w4a16-int4-g128 --tokens 1
"""

from __future__ import annotations

import argparse

import moe_setup as ms
import torch_peers as tpz


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="mixtral-8x7b", choices=sorted(ms.SHAPES))
    p.add_argument("--format", default="w4a16-int4-g128", choices=sorted(ms.FORMATS))
    p.add_argument("--tokens", type=int, default=1)
    args = p.parse_args()
    e, k, h, i = ms.SHAPES[args.shape]
    hk = tpz.HummingKernelsPeer(ms.FORMATS[args.format], e, k, h, i, [args.tokens], seed=0)
    tp = tpz.TorchPoint(ms.make_point(args.shape, args.tokens, "uniform", 1, seed=0))
    res = hk.measure(tp, repeats=3, warmup=1)
    print(f"{args.shape} {args.format} M={args.tokens}: {res.get('median_ms')} ms, config {res.get('hk_config')}")


if __name__ == "__main__":
    main()
