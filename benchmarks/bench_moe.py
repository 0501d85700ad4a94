#!/usr/bin/env python3
"""The peer-comparison benchmark of BENCH.md: our MoE layer against jax.lax.ragged_dot,
torch._grouped_mm and humming-kernels, in one process, with the ceilings measured in the same run.

Matrix: --shapes x --tokens x --formats (uniform top-k routing, k distinct experts per token,
fixed seed, identical for every system), plus one Zipf-skewed point per shape and format at
--zipf-tokens. Systems (--systems):
  humming_jax            fused_moe, automatic class selection
  humming_jax/indexed    fused_moe(gemm_type="indexed")
  humming_jax/grouped    fused_moe(gemm_type="grouped")
  humming_jax/batched    BatchedExperts.apply on the dispatched [E, T, H] layout (built outside)
  ragged_dot             jax.lax.ragged_dot on bf16 (dequantized) weights, rows sorted outside
  torch_grouped_mm       torch._grouped_mm, bf16, CUDA-graph replays
  humming_kernels        the PyPI package humming-kernels' own MoE GEMMs, CUDA-graph replays
Parts (--parts): "layer" (routing metadata, GEMM1, activation, GEMM2, finalize into out; the peers
have no routing kernel, so theirs starts from rows sorted outside) and "gemms" (GEMM1, activation
(+quant), GEMM2 with routing prepared outside). humming-kernels and batched have only "gemms".

Timing: jitted with XLA command buffers for fusions and custom calls (the flags below are set
before JAX starts and recorded); R input sets rotated inside one executable when one set's touched
weights would fit in the 50 MB L2; median of --repeats samples (see jax_systems / torch_peers).
On a GPU each JAX sample is timed by its GPU activity in a profiler trace (--timer device, the
default there), leaving out the GPU's waits for the host's dispatch; the wall-clock medians and the
gaps left out are kept in each row (wall_median_ms, gap_median_ms). That is the figure to set
beside the peers' CUDA events: a wall-clock sample starts from an idle GPU, which the event-timed
replays behind a full queue do not (benchmarks/NOTES.md, v9 timer check). --timer wall keeps the
host clock (the only timer on the CPU).
Units: TB/s over touched expert bytes (weights + scales) for M <= 128, TFLOP/s for M >= 1024.

Output: JSON in BENCH.md's result format (--out; default benchmarks/results/h200/
bench_moe_<utc>.json), written after every point, a PNG beside it, then a compact table and the
targets check on stdout. When $OUT is set (device runs) both files are also copied there.

  python benchmarks/bench_moe.py --shapes qwen3-30b-a3b --formats bf16,w4a16-int4-g128 --time-budget-s 480
  python benchmarks/bench_moe.py --shapes tiny --tokens 1,16 --repeats 3 --out /tmp/smoke.json   # CPU
  python benchmarks/bench_moe.py --plan --shapes all                                           # list points
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

T_START = time.monotonic()  # the time budget counts from here, imports included
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpu_state  # noqa: E402
import moe_setup as ms  # noqa: E402
import report  # noqa: E402

SERVING_XLA_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
JAX_SYSTEMS = ("humming_jax", "humming_jax/indexed", "humming_jax/grouped", "humming_jax/batched", "ragged_dot")
TORCH_SYSTEMS = ("torch_grouped_mm", "humming_kernels")
HK_MIN_REMAINING_S = 90.0  # don't start a humming-kernels build + NVRTC pass with less time left


def _csv(s: str) -> list[str]:
    return [p.strip() for p in s.split(",") if p.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="all", help=f"comma list or 'all' ({', '.join(ms.MATRIX_SHAPES)}); 'tiny' for CPU")
    p.add_argument("--tokens", default=",".join(map(str, ms.MATRIX_TOKENS)), help="M values")
    p.add_argument("--formats", default="all", help=f"comma list or 'all' ({', '.join(ms.MATRIX_FORMATS)}); also w8a8-fp8-channel")
    p.add_argument("--systems", default="all", help=f"comma list or 'all' ({', '.join(report.SYSTEMS)})")
    p.add_argument("--parts", default="layer,gemms")
    p.add_argument("--zipf-tokens", type=int, default=1024, help="M of the Zipf-routed point (0: none)")
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of expert popularity")
    p.add_argument("--ragged-dot", choices=("once", "all"), default="once",
                   help="ragged_dot on every format, or once per shape (first format of the run): its work on "
                        "dequantized bf16 weights is the same at every format, and the report uses that row for all")
    p.add_argument("--all-parts", action="store_true",
                   help="also the gemms part of humming_jax/indexed, humming_jax/grouped and ragged_dot "
                        "(by default: humming_jax layer+gemms, classes layer, batched gemms, ragged_dot layer, "
                        "torch layer+gemms, humming-kernels gemms)")
    p.add_argument("--repeats", type=int, default=20, help="timed samples per measurement (BENCH.md: >= 20)")
    p.add_argument("--timer", choices=("auto", "wall", "device"), default="auto",
                   help="JAX systems' samples: wall clock, or GPU time from a profiler trace (GPU only); "
                        "auto: device on a GPU, wall elsewhere")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls after the compiling one")
    p.add_argument("--sets", type=int, default=0, help="input sets rotated per executable (0: from the L2 rule)")
    p.add_argument("--time-budget-s", type=float, default=0.0, help="stop starting new points after this many seconds (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result JSON path")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--xla-flags", default=None, help=f"XLA flags to add instead of the serving ones ({SERVING_XLA_FLAGS})")
    p.add_argument("--ceiling-matmul-n", type=int, default=0, help="matmul ceiling size (0: 8192 on GPU, 256 on CPU)")
    p.add_argument("--ceiling-copy-mib", type=int, default=0, help="copy ceiling buffer (0: 2048 MiB on GPU, 64 on CPU)")
    p.add_argument("--hk-cache-dir", default=None, help="HUMMING_CACHE_DIR for humming-kernels' compiled kernels (carry it to skip NVRTC)")
    p.add_argument("--plan", action="store_true", help="print the points and exit")
    args = p.parse_args(argv)
    args.shape_list = list(ms.MATRIX_SHAPES) if args.shapes == "all" else _csv(args.shapes)
    args.format_list = list(ms.MATRIX_FORMATS) if args.formats == "all" else _csv(args.formats)
    args.system_list = list(report.SYSTEMS) if args.systems == "all" else _csv(args.systems)
    args.part_list = _csv(args.parts)
    args.token_list = [int(t) for t in _csv(args.tokens)]
    for name, got, known in (("shape", args.shape_list, ms.SHAPES), ("format", args.format_list, ms.FORMATS),
                             ("system", args.system_list, report.SYSTEMS), ("part", args.part_list, ("layer", "gemms"))):
        bad = [g for g in got if g not in known]
        if bad:
            p.error(f"unknown {name}(s) {bad}; known: {list(known)}")
    return args


def block_points(args) -> list[tuple[int, str]]:
    pts = [(m, "uniform") for m in args.token_list]
    if args.zipf_tokens > 0:
        pts.append((args.zipf_tokens, f"zipf{args.zipf_s:g}"))
    return pts


def plan_text(args) -> str:
    lines = []
    for shape in args.shape_list:
        for fmt in args.format_list:
            pts = ", ".join(f"{m}" + ("" if r == "uniform" else f" ({r})") for m, r in block_points(args))
            lines.append(f"{shape} {fmt}: M = {pts}")
    lines.append(f"systems: {', '.join(args.system_list)}; parts: {', '.join(args.part_list)}")
    return "\n".join(lines)


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def source_digest() -> str:
    """sha256 (first 16 hex digits) of the sources that decide what runs: cuda_ffi/, the package's
    Python files, CMakeLists.txt. Identifies the code even where the working tree is a copy whose
    git HEAD is stale or has uncommitted changes."""
    import hashlib

    root = HERE.parent
    h = hashlib.sha256()
    files = sorted([*root.glob("cuda_ffi/*"), *root.glob("humming_jax/**/*.py"), root / "CMakeLists.txt"])
    for f in files:
        if f.is_file():
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


class Run:
    """The result file being built: rows, not-run points, incremental writes."""

    def __init__(self, args, meta: dict):
        self.args = args
        self.t0 = T_START
        self.data = dict(meta)
        self.data["rows"] = []
        self.data["not_run"] = []
        self.data["blocks"] = []  # wall seconds per (shape, format): setup and each point
        self.ragged_shapes: set[str] = set()
        self.gpu = None  # gpu_state.GpuStateSampler while it samples
        self._mark = time.monotonic()
        self.path = Path(args.out)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def over_budget(self, need_s: float = 0.0) -> bool:
        b = self.args.time_budget_s
        return bool(b) and self.elapsed() + need_s > b

    def mark(self) -> None:
        """Starts the interval whose GPU state the next row records (each row ends one)."""
        self._mark = time.monotonic()

    def add(self, row: dict) -> dict:
        now = time.monotonic()
        if self.gpu is not None and row.get("median_ms"):
            state = self.gpu.window(self._mark, now)
            if state is not None:
                row["gpu_state"] = state
        self._mark = now
        self.data["rows"].append(row)
        return row

    def skip(self, what: str, why: str) -> None:
        self.data["not_run"].append({"what": what, "why": why})

    def save(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)
        out_dir = os.environ.get("OUT")  # device runs: keep a current copy where it comes back
        if out_dir and Path(out_dir).is_dir() and Path(out_dir).resolve() != self.path.parent.resolve():
            shutil.copy(self.path, Path(out_dir) / self.path.name)


def make_row(system, fmt, shape, m, part, routing, nbytes, flops, res=None, error=None, **extra) -> dict:
    row = {"system": system, "format": fmt, "shape": shape, "M": m, "part": part, "median_ms": None,
           "bytes": nbytes, "flops": flops, "routing": routing}
    if res is not None:
        s = sorted(res["samples_ms"])
        n = len(s)
        row.update(median_ms=report.median(s), p10_ms=s[int(0.1 * (n - 1))], p90_ms=s[int(0.9 * (n - 1))],
                   min_ms=s[0], samples=n, calls_per_sample=res.get("calls_per_sample"), mode=res.get("mode"))
        for key in ("wall", "gap"):
            if res.get(f"{key}_samples_ms"):
                row[f"{key}_median_ms"] = report.median(sorted(res[f"{key}_samples_ms"]))
        if res.get("device_split"):
            row["device_split"] = res["device_split"]
        if res.get("compile_s") is not None:
            row["compile_s"] = round(res["compile_s"], 3)
        if res.get("note"):
            row["note"] = res["note"]
        if row["median_ms"]:
            tp, unit = report.throughput(row)
            row["tbps" if unit == "TB/s" else "tflops"] = round(tp, 4)
    if error is not None:
        row["error"] = error
    row.update({k: v for k, v in extra.items() if v is not None})
    return row


def err_text(exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}"
    return " ".join(msg.split())[:600]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plan:
        print(plan_text(args))
        return 0

    # XLA reads its flags when the backend starts: set them before JAX is imported.
    added = args.xla_flags if args.xla_flags is not None else SERVING_XLA_FLAGS
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {added}".strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    if args.hk_cache_dir:
        os.environ["HUMMING_CACHE_DIR"] = str(Path(args.hk_cache_dir).resolve())

    import jax

    import humming_jax as hj
    import jax_systems as js
    import torch_peers as tpz

    dev = jax.devices()[0]
    on_gpu = dev.platform in ("gpu", "cuda")
    if args.timer == "auto":
        args.timer = "device" if on_gpu else "wall"
    js.TIMER = args.timer
    torch_ok, torch_reason = tpz.status() if any(s in args.system_list for s in TORCH_SYSTEMS) else (False, "not selected")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    if args.out is None:
        args.out = str(HERE / "results" / "h200" / f"bench_moe_{stamp}.json")
    meta = {
        "harness": "bench_moe",
        "version": 1,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax_version": jax.__version__,
        "humming_jax_version": hj.__version__,
        "humming_jax_cuda": bool(hj.cuda_available()),
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "source_digest": source_digest(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "env": {k: os.environ.get(k) for k in ("HUMMING_JAX_MOE_GEMM_TYPE", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                 "XLA_PYTHON_CLIENT_MEM_FRACTION", "HUMMING_CACHE_DIR") if os.environ.get(k)},
        "args": {k: v for k, v in vars(args).items() if not k.endswith("_list")},
        "method": {
            "timing": ("JAX systems: one jitted executable runs the layer on each of R input sets (out donated and "
                       "threaded through); a sample = S back-to-back calls, wall time / (S*R) after block_until_ready "
                       "(timer 'wall'), or with timer 'device' the GPU's kernel activity in a profiler trace of the "
                       "sample / (S*R), gaps over 10 us (the GPU waiting for the host) left out and reported as gap_median_ms. "
                       "torch peers: the same R-set pass captured in a CUDA graph, S replays between CUDA events. "
                       "median over `samples`."),
            "sets_rule": f"R = min({ms.MAX_SETS}, ceil(4 * {ms.L2_BYTES:.0e} B / touched bytes of one set))",
            "bytes": "experts receiving tokens x (weight + scale bytes per expert) in the system's own layout, mean over sets",
            "flops": "2*M*k*H*N1 + 2*M*k*I*H, N1 = 2I",
            "peers_layer": "ragged_dot and torch_grouped_mm 'layer' = GEMMs + silu + weighted combine on rows sorted by expert outside the timed region",
            "torch_peers": torch_reason or "used",
        },
    }
    if torch_ok:
        meta.update(tpz.versions())
    run = Run(args, meta)
    if on_gpu:
        sampler = gpu_state.GpuStateSampler()
        why = sampler.start()
        run.data["gpu_state"] = {"sampling": why or f"nvidia-smi every {sampler.period_ms} ms"}
        run.gpu = None if why else sampler
    print(f"bench_moe: {meta['device']} jax {jax.__version__}, humming_jax CUDA handlers: {meta['humming_jax_cuda']}"
          f" ({hj._ffi.backend_report()['cuda_unavailable_because'] or 'registered'}); XLA_FLAGS={meta['xla_flags']!r}; "
          f"torch peers: {torch_reason or 'yes'}", flush=True)

    # Ceilings, measured in this run.
    try:
        if torch_ok:
            run.data["ceilings"] = tpz.ceilings(args.ceiling_matmul_n or 8192, (args.ceiling_copy_mib or 2048) << 20, max(args.repeats, 20))
            import torch

            torch.cuda.empty_cache()
        else:
            run.data["ceilings"] = js.ceilings_jax(args.ceiling_matmul_n or (8192 if on_gpu else 256),
                                                   (args.ceiling_copy_mib or (2048 if on_gpu else 64)) << 20, max(args.repeats, 5))
    except Exception as exc:  # noqa: BLE001
        run.data["ceilings"] = {"copy_tbps": None, "bf16_tflops": None, "error": err_text(exc)}
    c = run.data["ceilings"]
    print(f"ceilings: copy {c.get('copy_tbps')} TB/s, bf16 matmul {c.get('bf16_tflops')} TFLOP/s", flush=True)
    run.save()

    for shape in args.shape_list:
        for fmt in args.format_list:
            if run.over_budget():
                run.skip(f"{shape} {fmt}", "time budget")
                continue
            try:
                run_block(run, args, shape, fmt, js, tpz, torch_ok, torch_reason)
            except Exception as exc:  # noqa: BLE001 - one block's failure must not lose the others
                traceback.print_exc()
                run.skip(f"{shape} {fmt}", f"block failed: {err_text(exc)}")
            run.save()
            gc.collect()

    if run.gpu is not None:
        run.gpu.stop()
        run.data["gpu_state"]["overall"] = run.gpu.overall()
    run.save()
    finish(run, args)
    return 0


def run_block(run: Run, args, shape: str, fmt: str, js, tpz, torch_ok: bool, torch_reason: str) -> None:
    e, k, h, i = ms.SHAPES[shape]
    systems = args.system_list
    parts = args.part_list
    t_block = time.monotonic()
    weights = ms.synthetic_weights(fmt, e, h, i, args.seed)
    bpe = ms.bytes_per_expert(weights)
    bf16_bpe = ms.bf16_bytes_per_expert(h, i)
    rd_w = None
    if "ragged_dot" in systems and (args.ragged_dot == "all" or shape not in run.ragged_shapes):
        rd_w = js.ragged_weights(weights)
    points = block_points(args)
    tokens_here = sorted({m for m, _ in points})

    tg = hk = None
    tg_err = hk_err = None
    if torch_ok and "torch_grouped_mm" in systems and fmt == "bf16":
        try:
            tg = tpz.GroupedMM(e, h, i, args.seed)
        except Exception as exc:  # noqa: BLE001
            tg_err = err_text(exc)
    if torch_ok and "humming_kernels" in systems:
        if run.over_budget(HK_MIN_REMAINING_S):
            hk_err = "skipped: time budget (no room for the build and NVRTC pass)"
        else:
            try:
                hk = tpz.HummingKernelsPeer(ms.FORMATS[fmt], e, k, h, i, tokens_here, args.seed)
                print(f"  humming-kernels {shape} {fmt}: build {hk.build_s:.1f}s, NVRTC pass {hk.compile_s:.1f}s"
                      + (f" ({hk.compile_error})" if hk.compile_error else ""), flush=True)
            except Exception as exc:  # noqa: BLE001
                hk_err = err_text(exc)
    block = {"shape": shape, "format": fmt, "setup_s": round(time.monotonic() - t_block, 1), "points_s": {}}
    if hk is not None:
        block.update(hk_build_s=round(hk.build_s, 1), hk_compile_s=round(hk.compile_s, 1))
    run.data["blocks"].append(block)
    print(f"[{run.elapsed():6.0f}s] {shape} {fmt}: weights {bpe * e / 1e9:.2f} GB "
          f"({block['setup_s']:.1f}s setup)", flush=True)

    for m, routing in points:
        if run.over_budget():
            run.skip(f"{shape} {fmt} M={m} {routing}", "time budget")
            continue
        point = ms.make_point(shape, m, routing, 1, args.seed)
        r_sets = ms.num_sets_for(ms.touched_bytes(point, bpe), args.sets)
        if r_sets > 1:  # small M only: cheap to redraw (set 0 comes out the same)
            point = ms.make_point(shape, m, routing, r_sets, args.seed)
        flops = ms.layer_flops(m, k, h, i)
        nb, nb16 = ms.touched_bytes(point, bpe), ms.touched_bytes(point, bf16_bpe)
        common = dict(chain=r_sets)
        t_point = time.monotonic()
        outputs = {}
        first_row = len(run.data["rows"])
        jp = js.JaxPoint(point, weights)
        run.mark()
        for system in [s for s in systems if s in JAX_SYSTEMS]:
            for part in parts_for(system, parts, args.all_parts):
                if system == "ragged_dot" and rd_w is None:
                    continue
                if run.over_budget():
                    run.skip(f"{shape} {fmt} M={m} {routing} {system} {part}", "time budget")
                    continue
                nbytes = nb16 if system == "ragged_dot" else nb
                try:
                    if system == "ragged_dot":
                        res = js.ragged(jp, rd_w[0], rd_w[1], part, args.repeats, args.warmup)
                    elif part == "layer":
                        res = js.our_layer(jp, system, args.repeats, args.warmup)
                    else:
                        res = js.our_gemms(jp, system, args.repeats, args.warmup)
                    extra = {k2: res.get(k2) for k2 in ("selected", "batched_rows")}
                    if system == "humming_jax" and part == "layer":
                        w = jp.weights
                        extra["selected"] = hj_select(w, jp.m * jp.k / jp.e)
                    if "output" in res:
                        outputs[system] = res.pop("output")
                        if system != "ragged_dot":
                            extra["check"] = js.output_check(outputs[system])
                    run.add(make_row(system, fmt, shape, m, part, routing, nbytes, flops, res, **common, **extra))
                except Exception as exc:  # noqa: BLE001
                    run.add(make_row(system, fmt, shape, m, part, routing, nbytes, flops, error=err_text(exc), **common))
        if rd_w is not None:
            run.ragged_shapes.add(shape)
        ref = outputs.get("ragged_dot")
        if ref is not None:
            for row in run.data["rows"][first_row:]:
                if row["part"] == "layer" and row["system"] in outputs and row["system"] != "ragged_dot":
                    row["rel_err_vs_ragged_dot"] = round(js.rel_err(outputs[row["system"]], ref), 5)
        del outputs, jp

        if any(s in systems for s in TORCH_SYSTEMS):
            torch_point(run, args, shape, fmt, m, routing, point, r_sets, nb16, flops, tpz, torch_ok, torch_reason,
                        tg, tg_err, hk, hk_err, systems, parts)
        block["points_s"][f"{m}" if routing == "uniform" else f"{m} {routing}"] = round(time.monotonic() - t_point, 1)
        run.save()
        print_point(run, shape, fmt, m, routing, r_sets, time.monotonic() - t_point)

    if hk is not None:
        hk.close()
    del weights, rd_w, tg, hk
    if torch_ok:
        import torch

        torch.cuda.empty_cache()


def parts_for(system: str, parts: list[str], all_parts: bool) -> list[str]:
    if system == "humming_jax/batched":
        return [p for p in parts if p == "gemms"]  # no routing or finalize in the batched format
    if system in ("humming_jax/indexed", "humming_jax/grouped", "ragged_dot") and not all_parts:
        return [p for p in parts if p == "layer"]
    return list(parts)


def hj_select(weights, rows_per_expert: float) -> str | None:
    import humming_jax as hj

    try:
        return hj.select_experts(weights.weight_key, weights.act_key, "silu",
                                 rows_per_expert=rows_per_expert).__name__
    except Exception:  # noqa: BLE001
        return None


def torch_point(run, args, shape, fmt, m, routing, point, r_sets, nb16, flops, tpz, torch_ok, torch_reason,
                tg, tg_err, hk, hk_err, systems, parts) -> None:
    if torch_ok and run.over_budget():
        run.skip(f"{shape} {fmt} M={m} {routing} torch peers", "time budget")
        return
    tp = None
    run.mark()
    if torch_ok:
        try:
            tp = tpz.TorchPoint(point)
        except Exception as exc:  # noqa: BLE001
            torch_reason = err_text(exc)
            torch_ok = False
    if "torch_grouped_mm" in systems and fmt == "bf16":
        for part in parts:
            if not torch_ok:
                run.add(make_row("torch_grouped_mm", fmt, shape, m, part, routing, nb16, flops, error=torch_reason, chain=r_sets))
            elif tg is None:
                run.add(make_row("torch_grouped_mm", fmt, shape, m, part, routing, nb16, flops, error=tg_err, chain=r_sets))
            else:
                try:
                    res = tg.measure(tp, part, args.repeats, args.warmup)
                    run.add(make_row("torch_grouped_mm", fmt, shape, m, part, routing, nb16, flops, res, chain=r_sets))
                except Exception as exc:  # noqa: BLE001
                    run.add(make_row("torch_grouped_mm", fmt, shape, m, part, routing, nb16, flops, error=err_text(exc), chain=r_sets))
    if "humming_kernels" in systems and "gemms" in parts:
        if not torch_ok:
            run.add(make_row("humming_kernels", fmt, shape, m, "gemms", routing, None, flops, error=torch_reason, chain=r_sets))
        elif hk is None:
            run.add(make_row("humming_kernels", fmt, shape, m, "gemms", routing, None, flops, error=hk_err, chain=r_sets))
        else:
            nbytes = ms.touched_bytes(point, hk.bytes_per_expert)
            try:
                res = hk.measure(tp, args.repeats, args.warmup)
                run.add(make_row("humming_kernels", fmt, shape, m, "gemms", routing, nbytes, flops, res, chain=r_sets,
                                 hk_config=res.get("hk_config"), check=res.get("check"),
                                 hk_compile_error=hk.compile_error))
            except Exception as exc:  # noqa: BLE001
                run.add(make_row("humming_kernels", fmt, shape, m, "gemms", routing, nbytes, flops, error=err_text(exc),
                                 chain=r_sets, hk_config=hk.config_summary(m) if m in hk.configs else None))
    del tp
    if torch_ok:
        import torch

        torch.cuda.empty_cache()


def print_point(run: Run, shape, fmt, m, routing, r_sets, secs) -> None:
    parts = []
    for r in run.data["rows"]:
        if (r["shape"], r["format"], r["M"], r["routing"]) != (shape, fmt, m, routing):
            continue
        tag = f"{report.SHORT[r['system']]}{'' if r['part'] == 'layer' else 'G'}"
        clock = r.get("gpu_state", {}).get("sm_mhz_median")
        at = f"@{clock:.0f}MHz" if clock else ""
        parts.append(f"{tag}={'err' if r.get('error') else format(r['median_ms'], '.4f')}{at}")
        if r.get("rel_err_vs_ragged_dot", 0) > 0.1:
            parts.append(f"[{tag} rel_err {r['rel_err_vs_ragged_dot']:.2f} vs ragged_dot!]")
        if r.get("check") not in (None, "ok"):
            parts.append(f"[{tag} {r['check']}]")
    print(f"[{run.elapsed():6.0f}s] {shape} {fmt} M={m}{'' if routing == 'uniform' else ' ' + routing} R={r_sets} "
          f"({secs:.1f}s): " + " ".join(parts), flush=True)


def finish(run: Run, args) -> None:
    data = run.data
    png = run.path.with_suffix(".png")
    why = None if args.no_plot else report.plot(data, png)
    if why:
        print(why)
        data["plot"] = why
    elif not args.no_plot:
        data["plot"] = png.name
    data["targets"] = [{k: v for k, v in t.items() if k != "points"} | {"points": len(t["points"])} for t in report.check_targets(data)]
    run.save()
    out_dir = os.environ.get("OUT")
    if out_dir and Path(out_dir).is_dir() and png.exists() and Path(out_dir).resolve() != png.parent.resolve():
        shutil.copy(png, Path(out_dir) / png.name)
    if data["not_run"]:
        print(f"not run ({len(data['not_run'])}): " + "; ".join(f"{n['what']} ({n['why']})" for n in data["not_run"][:12]))
    print(report.summary_text(data))
    overall = data.get("gpu_state", {}).get("overall")
    if overall:
        slowed = [r for r in data["rows"] if r.get("gpu_state", {}).get("slowdown_samples")]
        print(f"GPU state while busy: {gpu_state.describe(overall)}; "
              f"{len(slowed)} of {len(data['rows'])} rows timed with a slowdown reason "
              f"({overall.get('slowdown_reasons', 'none')}: power or thermal caps)")
    print(report.targets_text(report.check_targets(data)))
    print(f"wrote {run.path} ({len(data['rows'])} rows, {run.elapsed():.0f}s)")


if __name__ == "__main__":
    sys.exit(main())
