#!/usr/bin/env python3
"""Checks the device timer (device_timer.traced_samples) against the timings it would replace or
stand beside, on the GPU, before bench_moe.py --timer device is used for a matrix:

- torch._grouped_mm's CUDA-graph replays timed by CUDA events (as bench_moe times the peers) and
  by the profiler trace of the same replays: the trace's busy time should match the events;
- our layer and gemms parts timed by the wall clock (continuous samples) and by the trace.

Each point runs the four timings in turn, ``--rounds`` times, so that drift shows. Writes a JSON of
every sample and prints one line per point and timing (median ms, and the ratio to the reference:
events for torch, wall for ours).

  python benchmarks/timer_check.py --points qwen3-30b-a3b:1,qwen3-30b-a3b:4096,gpt-oss-120b:16384 --out timer_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_moe import SERVING_XLA_FLAGS  # noqa: E402

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SERVING_XLA_FLAGS}".strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_systems as js  # noqa: E402
import moe_setup as ms  # noqa: E402
import torch_peers as tpz  # noqa: E402
from device_timer import traced_samples  # noqa: E402


def torch_both(gm: tpz.GroupedMM, tp: tpz.TorchPoint, repeats: int) -> dict:
    """torch._grouped_mm (gemms part) by events (time_torch) and by a trace of its replays."""
    import torch

    run, _ = gm.prepare(tp, "gemms")
    events = tpz.time_torch(run, repeats=repeats, warmup=3, chain=tp.R)
    fn, mode, _, g = tpz.capture(run)
    calls = events["calls_per_sample"]

    def sample():
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()

    try:  # the JAX profiler sees torch's kernels only if its CUPTI tracing covers the whole process
        traced, err = traced_samples(sample, repeats, calls * tp.R), None
    except RuntimeError as exc:
        traced, err = None, str(exc)[:300]
    del g
    return {"events": events["samples_ms"], "trace": traced["samples_ms"] if traced else None, "mode": mode,
            "trace_error": err}


def ours_both(jp: js.JaxPoint, system: str, part: str, repeats: int) -> dict:
    run = js.our_layer if part == "layer" else js.our_gemms
    wall = run(jp, system, repeats, 3)
    before, js.TIMER = js.TIMER, "device"
    try:
        dev = run(jp, system, repeats, 3)
    finally:
        js.TIMER = before
    return {"wall": wall["samples_ms"], "device": dev["samples_ms"], "device_mode": dev["mode"],
            "device_wall": dev.get("wall_samples_ms"), "device_note": dev.get("note")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="qwen3-30b-a3b:1,qwen3-30b-a3b:16,qwen3-30b-a3b:4096,mixtral-8x7b:4096,gpt-oss-120b:16384",
                   help="comma list of shape:M (bf16 weights)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="timer_check.json")
    args = p.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("timer_check.py compares GPU timings: run it on the GPU machine")
    ok, why = tpz.status()
    rows = []
    for spec in args.points.split(","):
        shape, m = spec.split(":")
        m = int(m)
        e, k, h, i = ms.SHAPES[shape]
        w = ms.synthetic_weights("bf16", e, h, i, seed=0)
        point = ms.make_point(shape, m, "uniform", 1, 0)
        sets = ms.num_sets_for(ms.touched_bytes(point, ms.bytes_per_expert(w)), None)
        point = ms.make_point(shape, m, "uniform", sets, 0)
        jp = js.JaxPoint(point, w)
        gm = tpz.GroupedMM(e, h, i, seed=0) if ok else None
        tp = tpz.TorchPoint(point) if ok else None
        for rnd in range(args.rounds):
            if gm is not None:
                t = torch_both(gm, tp, args.repeats)
                rows.append({"point": spec, "round": rnd, "system": "torch_grouped_mm", "part": "gemms", **t})
            for part in ("gemms", "layer"):
                o = ours_both(jp, "humming_jax", part, args.repeats)
                rows.append({"point": spec, "round": rnd, "system": "humming_jax", "part": part, **o})
        for r in rows[-(3 if gm is not None else 2) * args.rounds:]:
            ref_key, alt_key = ("events", "trace") if r["system"] == "torch_grouped_mm" else ("wall", "device")
            ref, alt = r[ref_key], r.get(alt_key)
            line = f"{spec:22s} round {r['round']} {r['system']:17s} {r['part']:5s} {ref_key}={np.median(ref):.4f}"
            if alt:
                line += f" {alt_key}={np.median(alt):.4f} ({np.median(alt) / np.median(ref):.3f}x)"
            print(line, flush=True)
        del jp, w, gm, tp
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "torch": why or "used", "repeats": args.repeats, "device": str(jax.devices()[0]),
                   "xla_flags": os.environ["XLA_FLAGS"]}, fh, indent=1)
    print(f"wrote {args.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
