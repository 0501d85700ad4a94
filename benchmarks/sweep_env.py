"""Layer time of decode- and prefill-sized points for each value of one of the kernels' environment
switches, all in one process: the A/B harness for a kernel change that carries a switch
(HUMMING_JAX_DECODE_WK, HUMMING_JAX_DECODE_WHOLE_ACT, HUMMING_JAX_PREFILL_MIXED, ...).

The CUDA handlers read their switches on the host at every call, so command buffers are off here
(a replayed graph would keep the first call's choice). Each sample is CALLS back-to-back calls
(the GPU is the bottleneck at these sizes) and the values are sampled in turn, so slow drifts of
the machine fall on all of them alike; read the figures against each other, not against
bench_moe's. The value "unset" removes the variable (the built-in default).

    python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_WK --values unset,1,2,4,8 --out sweep.json
    python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_WHOLE_ACT --values 1,0 --tokens 1,16
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import humming_jax as hj  # noqa: E402

import moe_setup as ms  # noqa: E402


def set_var(name: str, value: str) -> None:
    if value == "unset":
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--var", default="HUMMING_JAX_DECODE_WK", help="the environment variable to vary")
    p.add_argument("--values", default="unset,1,2,4,8", help='comma list; "unset" removes the variable')
    p.add_argument("--shapes", default=",".join(ms.MATRIX_SHAPES))
    p.add_argument("--formats", default="bf16,w4a16-int4-g128,w8a8-fp8-block128,w4a16-mxfp4")
    p.add_argument("--tokens", default="1,16")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="sweep_env.json")
    args = p.parse_args()
    values = [v for v in args.values.split(",") if v]
    before = os.environ.get(args.var)
    rows = []
    for shape in args.shapes.split(","):
        e, k, h, i = ms.SHAPES[shape]
        for fmt in args.formats.split(","):
            try:
                w = ms.synthetic_weights(fmt, e, h, i, seed=0)
            except ValueError as err:  # a format that does not fit the shape (e.g. K % 128)
                print(f"{shape:16s} {fmt:18s} skipped: {err}", flush=True)
                continue
            f = jax.jit(lambda x, w, tw, ids: hj.fused_moe(x, w, tw, ids))
            for m in map(int, args.tokens.split(",")):
                s = ms.make_point(shape, m, "uniform", 1, seed=0).sets[0]
                x, tw, ids = jnp.asarray(s.x, w.dtype), jnp.asarray(s.topk_weights), jnp.asarray(s.topk_ids)
                samples: dict[str, list[float]] = {v: [] for v in values}
                for v in values:  # warm every setting once
                    set_var(args.var, v)
                    jax.block_until_ready(f(x, w, tw, ids))
                for _ in range(args.repeats):
                    for v in values:
                        set_var(args.var, v)
                        t0 = time.perf_counter()
                        for _ in range(args.calls):
                            out = f(x, w, tw, ids)
                        jax.block_until_ready(out)
                        samples[v].append((time.perf_counter() - t0) / args.calls * 1e3)
                res = {v: float(np.median(t)) for v, t in samples.items()}
                best = min(res, key=res.get)
                print(f"{shape:16s} {fmt:18s} M={m:<5d} " + " ".join(f"{v}={ms_:.4f}" for v, ms_ in res.items())
                      + f"  best {best} ({res[values[0]] / res[best]:.2f}x {values[0]})", flush=True)
                rows.append({"shape": shape, "format": fmt, "M": m, "ms": res, "samples_ms": samples})
            del w
    set_var(args.var, before if before is not None else "unset")
    with open(args.out, "w") as fh:
        json.dump({"var": args.var, "values": values, "rows": rows, "calls": args.calls, "repeats": args.repeats,
                   "device": str(jax.devices()[0])}, fh, indent=1)


if __name__ == "__main__":
    main()
