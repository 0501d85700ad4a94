"""Time of decode- and prefill-sized points for each value of one of the kernels' environment
switches, all in one process: the A/B harness for a kernel change that carries a switch
(HUMMING_JAX_DECODE_WK, HUMMING_JAX_DECODE_WHOLE_ACT, HUMMING_JAX_QUANT_DECODE_ROWS, ...).

The CUDA handlers read their switches on the host when they launch, which under command buffers
is when XLA records a graph. So each value gets its own executable, compiled, warmed and re-run
with the variable set to that value (a re-recorded graph reads the same value again), and the
serving flags (command buffers on) keep the host's dispatch out of the figures, as bench_moe does.
A sample is a burst of calls sized to ~10 ms (sampling.py); the values are sampled in turn, so slow
drifts of the machine fall on all of them alike. Part "gemms" times GEMM1 -> activation -> GEMM2
with the routing prepared outside (bench_moe's gemms part), "layer" the whole fused_moe. The value
"unset" removes the variable (the built-in default). ``--timer device`` reads each sample's time
from a profiler trace of the GPU's kernels instead of the wall clock (device_timer.py), for points
short enough that the host's dispatch can set the wall-clock figure; it also records each launch's
median µs within a call ("launches_us": GEMM1 and GEMM2 apart, for a per-GEMM choice such as the
decode K split).

    python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_WK --values unset,1,2,4,8 --out sweep.json
    python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_WHOLE_ACT --values 1,0 --tokens 1,16
    python3 benchmarks/sweep_env.py --var HUMMING_JAX_PDL --values unset,0 --part layer \\
        --xla-flags=--xla_gpu_enable_command_buffer=     # stream execution, no CUDA graphs
"""

from __future__ import annotations

import argparse
import os

from bench_moe import SERVING_XLA_FLAGS


def _added_xla_flags() -> str:
    """--xla-flags from the command line (read before jax is imported), else the serving flags."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--xla-flags", default=None)
    known, _ = pre.parse_known_args()
    return SERVING_XLA_FLAGS if known.xla_flags is None else known.xla_flags


os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_added_xla_flags()}".strip()

import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import humming_jax as hj  # noqa: E402

import gpu_state  # noqa: E402
import jax_systems as js  # noqa: E402
import moe_setup as ms  # noqa: E402
from device_timer import device_time_per_call  # noqa: E402
from sampling import calls_per_sample  # noqa: E402


def set_var(name: str, value: str) -> None:
    if value == "unset":
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def burst_s(step, calls: int) -> float:
    """Wall seconds of ``calls`` back-to-back calls of ``step``, synchronized once at the end."""
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        out = step()
    jax.block_until_ready(out)
    return time.perf_counter() - t0


def launch_medians(seqs: list[list[tuple[str, float]]]) -> list[list] | None:
    """[kernel name, median µs] per launch position over samples; None if the samples' kernels differ."""
    names = [n for n, _ in seqs[0]]
    if any([n for n, _ in s] != names for s in seqs[1:]):
        return None
    return [[n, float(np.median([s[p][1] for s in seqs]))] for p, n in enumerate(names)]


def make_step(jp: js.JaxPoint, part: str):
    """A fresh executable (its own recorded graphs) running the part once per input set."""
    if part == "layer":
        # bench_moe's layer: the sets chained through one donated out.
        step, state = js.layer_step(jp), {"out": jp.out()}

        def run():
            state["out"] = step(state["out"])
            return state["out"]
        return run
    cls = hj.select_experts(jp.weights.weight_key, jp.weights.act_key, "silu", rows_per_expert=jp.m * jp.k / jp.e)
    layouts = js.routing_layouts(jp, cls.gemm_type)

    def chain(w, xs, ids, layouts):
        outs = []
        for r in range(jp.R):
            ind, grp, perm = layouts[r]
            with js._fixed_routing(ind, grp, perm):
                outs.append(cls()._experts(xs[r], w, ids[r], jp.emap, "silu", None)[0])
        return tuple(outs)

    step = jax.jit(chain)
    return lambda: step(jp.weights, jp.xs, jp.ids, layouts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--var", default="HUMMING_JAX_DECODE_WK", help="the environment variable to vary")
    p.add_argument("--values", default="unset,1,2,4,8", help='comma list; "unset" removes the variable')
    p.add_argument("--shapes", default=",".join(ms.MATRIX_SHAPES))
    p.add_argument("--formats", default="bf16,w4a16-int4-g128,w8a8-fp8-block128,w4a16-mxfp4")
    p.add_argument("--tokens", default="1,16")
    p.add_argument("--part", choices=("gemms", "layer"), default="gemms")
    p.add_argument("--repeats", type=int, default=7, help="samples per value")
    p.add_argument("--timer", choices=("wall", "device"), default="wall",
                   help="wall clock around each sample, or the GPU's kernel activity in a trace of it")
    p.add_argument("--out", default="sweep_env.json")
    p.add_argument("--xla-flags", default=None,
                   help=f'XLA flags to add instead of the serving ones ({SERVING_XLA_FLAGS}); "" adds none, and '
                        '"--xla_gpu_enable_command_buffer=" runs without command buffers')
    args = p.parse_args()
    values = [v for v in args.values.split(",") if v]
    before = os.environ.get(args.var)
    rows = []
    trace_lines: list[str] = []
    # Values are timed in turn, so a power-capped card slows whichever runs later in a round: each
    # value's rows say under which clocks its samples ran.
    sampler = gpu_state.GpuStateSampler()
    sampling = sampler.start() if jax.devices()[0].platform in ("gpu", "cuda") else "not a GPU"

    def sample_ms(step, calls: int, sets: int, launches: list) -> float:
        """One sample's ms per input set; with the device timer, appends its launch sequence."""
        if args.timer == "wall":
            return burst_s(step, calls) / (calls * sets) * 1e3
        res = device_time_per_call(step, calls)
        if res is None:
            raise SystemExit("--timer device: the trace has no GPU plane (this backend has no device timeline)")
        trace_lines[:] = res["lines"]
        if res["sequence"] is not None:
            launches.append(res["sequence"])
        return res["ms"] / sets

    for shape in args.shapes.split(","):
        e, k, h, i = ms.SHAPES[shape]
        for fmt in args.formats.split(","):
            try:
                w = ms.synthetic_weights(fmt, e, h, i, seed=0)
            except ValueError as err:  # a format that does not fit the shape (e.g. K % 128)
                print(f"{shape:16s} {fmt:18s} skipped: {err}", flush=True)
                continue
            bpe = ms.bytes_per_expert(w)
            for m in map(int, args.tokens.split(",")):
                point = ms.make_point(shape, m, "uniform", 1, 0)
                sets = ms.num_sets_for(ms.touched_bytes(point, bpe), None)
                if sets > 1:
                    point = ms.make_point(shape, m, "uniform", sets, 0)
                jp = js.JaxPoint(point, w)
                try:
                    steps, calls = {}, {}
                    for v in values:  # compile, record and warm each value's executable
                        set_var(args.var, v)
                        steps[v] = make_step(jp, args.part)
                        jax.block_until_ready(steps[v]())
                        calls[v] = calls_per_sample(burst_s(steps[v], js.PROBE_CALLS) / js.PROBE_CALLS)
                except Exception as exc:  # noqa: BLE001  (e.g. a format the activation quantizer declines)
                    print(f"{shape:16s} {fmt:18s} M={m:<5d} failed: {str(exc).splitlines()[0]}", flush=True)
                    continue
                samples: dict[str, list[float]] = {v: [] for v in values}
                seqs: dict[str, list] = {v: [] for v in values}
                spans: dict[str, list[tuple[float, float]]] = {v: [] for v in values}
                for _ in range(args.repeats):
                    for v in values:
                        set_var(args.var, v)
                        t0 = time.monotonic()
                        samples[v].append(sample_ms(steps[v], calls[v], jp.R, seqs[v]))
                        spans[v].append((t0, time.monotonic()))
                res = {v: float(np.median(t)) for v, t in samples.items()}
                best = min(res, key=res.get)
                print(f"{shape:16s} {fmt:18s} M={m:<5d} " + " ".join(f"{v}={ms_:.4f}" for v, ms_ in res.items())
                      + f"  best {best} ({res[values[0]] / res[best]:.2f}x {values[0]})", flush=True)
                row = {"shape": shape, "format": fmt, "M": m, "sets": jp.R, "ms": res, "samples_ms": samples}
                if all(seqs.values()):
                    row["launches_us"] = {v: launch_medians(s) for v, s in seqs.items()}
                if sampler.running:
                    row["gpu_state"] = {v: sampler.windows(sp) for v, sp in spans.items()}
                    clocks = {v: (st or {}).get("sm_mhz_median") for v, st in row["gpu_state"].items()}
                    print("    SM clock while busy (median MHz): " + " ".join(f"{v}={c}" for v, c in clocks.items()),
                          flush=True)
                rows.append(row)
                del steps, jp
            del w
    set_var(args.var, before if before is not None else "unset")
    sampler.stop()
    with open(args.out, "w") as fh:
        json.dump({"var": args.var, "values": values, "part": args.part, "timer": args.timer,
                   "trace_lines": trace_lines, "rows": rows, "repeats": args.repeats,
                   "gpu_state": sampling or f"nvidia-smi every {sampler.period_ms} ms",
                   "xla_flags": os.environ["XLA_FLAGS"], "device": str(jax.devices()[0]),
                   "backends": hj._ffi.backend_report()}, fh, indent=1)


if __name__ == "__main__":
    main()
