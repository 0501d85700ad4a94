"""Layer time of decode-sized points for each K split of the decode kernel (HUMMING_JAX_DECODE_WK),
against the automatic choice: the data behind the split rule in cuda_ffi/gemm_decode_sm90.cu.

Command buffers are off here (the handler must run at every call to see the variable), so each
figure is the wall time of CALLS back-to-back calls divided by CALLS (the GPU is the bottleneck at
these sizes); read the figures against each other, not against bench_moe's.

    python3 benchmarks/sweep_decode_wk.py --out sweep.json
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

SPLITS = ("auto", "1", "2", "4", "8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(ms.MATRIX_SHAPES))
    p.add_argument("--formats", default="bf16,w4a16-int4-g128,w8a8-fp8-block128,w4a16-mxfp4")
    p.add_argument("--tokens", default="1,16")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="sweep_decode_wk.json")
    args = p.parse_args()
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
                jax.block_until_ready(f(x, w, tw, ids))
                res = {}
                for wk in SPLITS:
                    if wk == "auto":
                        os.environ.pop("HUMMING_JAX_DECODE_WK", None)
                    else:
                        os.environ["HUMMING_JAX_DECODE_WK"] = wk
                    jax.block_until_ready(f(x, w, tw, ids))
                    t = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        for _ in range(args.calls):
                            out = f(x, w, tw, ids)
                        jax.block_until_ready(out)
                        t.append((time.perf_counter() - t0) / args.calls * 1e3)
                    res[wk] = float(np.median(t))
                os.environ.pop("HUMMING_JAX_DECODE_WK", None)
                best = min(res, key=res.get)
                print(f"{shape:16s} {fmt:18s} M={m:<3d} " + " ".join(f"{k}={v:.4f}" for k, v in res.items())
                      + f"  best {best} ({res['auto'] / res[best]:.2f}x auto)", flush=True)
                rows.append({"shape": shape, "format": fmt, "M": m, "ms": res})
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "calls": args.calls, "repeats": args.repeats}, fh, indent=1)


if __name__ == "__main__":
    main()
