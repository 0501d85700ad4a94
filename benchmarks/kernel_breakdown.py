"""Where a layer's device time goes: the kernels of one BENCH.md point, from a profiler trace
(device_timer.py), as launches and µs per call, with the span of the GPU's activity per call.

    python3 benchmarks/kernel_breakdown.py --shape qwen3-30b-a3b --format w8a8-fp8-block128 --tokens 4096
    python3 benchmarks/kernel_breakdown.py --shape mixtral-8x7b --format w4a16-int4-g128 --tokens 1 --part gemms
"""

from __future__ import annotations

import argparse
import json
import time

import jax

import gpu_state
import jax_systems as js
import moe_setup as ms
from device_timer import busy_time_ns, kernel_table, launch_sequence, trace_calls
from sweep_env import make_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(ms.SHAPES))
    p.add_argument("--format", default="w8a8-fp8-block128", choices=sorted(ms.FORMATS))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--part", choices=("gemms", "layer"), default="layer")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--max-gap-us", type=float, default=10.0)
    p.add_argument("--out", default=None, help="JSON of the table")
    args = p.parse_args()
    e, k, h, i = ms.SHAPES[args.shape]
    w = ms.synthetic_weights(args.format, e, h, i, seed=0)
    point = ms.make_point(args.shape, args.tokens, "uniform", 1, 0)
    jp = js.JaxPoint(point, w)  # one input set: a breakdown, not an L2-free bandwidth figure
    step = make_step(jp, args.part)
    for _ in range(3):  # compile, record the graphs, warm
        jax.block_until_ready(step())
    sampler = gpu_state.GpuStateSampler()
    sampling = sampler.start()
    t0 = time.monotonic()
    found = trace_calls(step, args.calls)
    state = sampler.window(t0, time.monotonic())
    sampler.stop()
    if found is None:
        raise SystemExit("the trace has no GPU plane: this backend has no device timeline")
    events, lines = found
    span_ms = busy_time_ns(((s, t) for _, s, t in events), args.max_gap_us * 1e3) / args.calls / 1e6
    table = kernel_table(events, args.calls)
    print(f"{args.shape} {args.format} M={args.tokens} {args.part}: {span_ms * 1e3:.1f} µs of GPU activity per call "
          f"({sum(r[2] for r in table):.1f} µs in kernels); lines: {', '.join(lines)}")
    if state and state.get("samples"):
        print(f"  GPU while tracing: {gpu_state.describe(state)}, slowdown {state.get('slowdown_reasons', 'none')}")
    for name, n, us in table:
        print(f"  {us:9.1f} µs  {n:5.1f}x  {name[:110]}")
    seq = launch_sequence(events, args.calls)
    if seq is not None:
        print("  in launch order:")
        for p, (name, us) in enumerate(seq):
            print(f"  {p:3d} {us:9.1f} µs  {name[:110]}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"shape": args.shape, "format": args.format, "M": args.tokens, "part": args.part,
                       "span_ms": span_ms, "lines": lines, "gpu_state": state or sampling,
                       "kernels": [{"name": n, "launches": c, "us": u} for n, c, u in table],
                       "sequence": None if seq is None else [{"name": n, "us": u} for n, u in seq]}, fh, indent=1)


if __name__ == "__main__":
    main()
