"""Reading bench_moe.py results: throughput, same-run ratios against the peers, the BENCH.md
targets check, the README table, the plot and the compact summary printed after a run.

Every ratio is peer time / our time at the same (shape, format, M, routing) inside ONE result
file (one process run), so a ratio above 1 means we are faster; figures from different runs are
never divided by each other.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Iterable

SYSTEMS = (
    "humming_jax",
    "humming_jax/indexed",
    "humming_jax/grouped",
    "humming_jax/batched",
    "ragged_dot",
    "torch_grouped_mm",
    "humming_kernels",
)
SHORT = {
    "humming_jax": "hj",
    "humming_jax/indexed": "idx",
    "humming_jax/grouped": "grp",
    "humming_jax/batched": "bat",
    "ragged_dot": "rdot",
    "torch_grouped_mm": "torch",
    "humming_kernels": "hk",
}
OURS = "humming_jax"
REQUIRED_ROW_KEYS = ("system", "format", "shape", "M", "part", "median_ms", "bytes", "flops")


def load(path: str | Path) -> dict:
    with open(path) as f:
        return json.load(f)


def ok(row: dict | None) -> bool:
    return row is not None and row.get("median_ms") is not None and not row.get("error")


def throughput(row: dict) -> tuple[float, str]:
    """TB/s over touched expert bytes for M <= 128, TFLOP/s for larger M (BENCH.md's units)."""
    s = row["median_ms"] * 1e-3
    if row["M"] <= 128:
        return row["bytes"] / s / 1e12, "TB/s"
    return row["flops"] / s / 1e12, "TFLOP/s"


def fmt_tp(row: dict | None) -> str:
    if not ok(row):
        return "—"
    v, unit = throughput(row)
    return f"{v:.2f} {unit}" if unit == "TB/s" else f"{v:.0f} {unit}"


class Index:
    """Rows of one result file by (system, format, shape, M, part, routing)."""

    def __init__(self, data: dict):
        self.data = data
        self.rows: dict[tuple, dict] = {}
        for r in data.get("rows", []):
            self.rows[(r["system"], r["format"], r["shape"], r["M"], r["part"], r.get("routing", "uniform"))] = r

    def get(self, system: str, fmt: str, shape: str, m: int, part: str, routing: str = "uniform") -> dict | None:
        return self.rows.get((system, fmt, shape, m, part, routing))

    def peer(self, system: str, fmt: str, shape: str, m: int, part: str, routing: str) -> tuple[dict | None, str]:
        """A peer's row at this point and the format it ran: torch is a bf16 peer; ragged_dot,
        when not run at this format, is taken from the format it ran at in this run (identical
        work: dequantized bf16 weights), bf16 first."""
        if system == "torch_grouped_mm":
            return self.get(system, "bf16", shape, m, part, routing), "bf16"
        row = self.get(system, fmt, shape, m, part, routing)
        if row is None and system == "ragged_dot":
            cands = [r for (s, f, sh, mm, p, rt), r in self.rows.items()
                     if (s, sh, mm, p, rt) == (system, shape, m, part, routing)]
            cands.sort(key=lambda r: r["format"] != "bf16")
            if cands:
                return cands[0], cands[0]["format"]
        return row, fmt

    def points(self) -> list[tuple[str, str, int, str]]:
        """(shape, format, M, routing) of our rows, in run order."""
        seen: dict[tuple, None] = {}
        for r in self.data.get("rows", []):
            if r["system"].startswith("humming_jax"):
                seen[(r["shape"], r["format"], r["M"], r.get("routing", "uniform"))] = None
        return list(seen)


def ratio(peer: dict | None, ours: dict | None) -> float | None:
    if not (ok(peer) and ok(ours)):
        return None
    return peer["median_ms"] / ours["median_ms"]


def fmt_ratio(peer: dict | None, ours: dict | None) -> str:
    r = ratio(peer, ours)
    if r is not None:
        return f"{r:.2f}×"
    if peer is not None and peer.get("error") and ok(ours):
        return "skipped" if peer["error"].startswith("skipped") else "peer error"
    if ours is not None and ours.get("error"):
        return "error"
    return "—"


def fmt_ms(row: dict | None) -> str:
    if row is None:
        return "—"
    if not ok(row):
        return "error"
    ms = row["median_ms"]
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


# --- targets ------------------------------------------------------------------------------------
def check_targets(data: dict) -> list[dict]:
    """BENCH.md's targets, each met / missed / not measured, with its figures from this run."""
    ix = Index(data)
    ceil = data.get("ceilings") or {}
    copy_tbps, mm_tflops = ceil.get("copy_tbps"), ceil.get("bf16_tflops")
    targets = []

    def add(name: str, checks: list[dict]) -> None:
        if not checks:
            status = "not measured"
        else:
            status = "met" if all(c["met"] for c in checks) else "missed"
        worst = min(checks, key=lambda c: c["margin"]) if checks else None
        targets.append({"target": name, "status": status, "points": checks, "worst": worst})

    def point(shape, fmt, m, routing, value, threshold, figure, higher_is_better=True):
        margin = (value / threshold) if higher_is_better else (threshold / max(value, 1e-12))
        return {
            "shape": shape, "format": fmt, "M": m, "routing": routing, "value": value,
            "threshold": threshold, "figure": figure, "met": margin >= 1.0, "margin": margin,
        }

    t1, t2, t3, t4, t5, t6 = [], [], [], [], [], []
    for shape, fmt, m, routing in ix.points():
        L = ix.get(OURS, fmt, shape, m, "layer", routing)
        G = ix.get(OURS, fmt, shape, m, "gemms", routing)
        hk = ix.get("humming_kernels", fmt, shape, m, "gemms", routing)
        if ok(hk) and ok(G):
            r = ratio(hk, G)
            rl = ratio(hk, L)
            extra = f"; its gemms vs our whole layer {rl:.2f}×" if rl is not None else ""
            t1.append(point(shape, fmt, m, routing, r, 1.0, f"gemms {G['median_ms']:.4f} ms vs {hk['median_ms']:.4f} ms = {r:.2f}×{extra}"))
        if fmt == "bf16":
            for part in ("layer", "gemms"):
                tg = ix.get("torch_grouped_mm", "bf16", shape, m, part, routing)
                ours = L if part == "layer" else G
                if ok(tg) and ok(ours):
                    r = ratio(tg, ours)
                    t2.append(point(shape, fmt, m, routing, r, 1.0, f"{part} {ours['median_ms']:.4f} ms vs {tg['median_ms']:.4f} ms = {r:.2f}×"))
        if routing == "uniform" and m <= 16 and ok(L) and copy_tbps:
            need = 0.9 if "fp8" in fmt else 0.8
            tb, _ = throughput(L)
            gtxt = ""
            if ok(G):
                gtb, _ = throughput(G)
                gtxt = f"; gemms {gtb:.2f} TB/s = {gtb / copy_tbps:.0%}"
            t3.append(point(shape, fmt, m, routing, tb / copy_tbps, need, f"layer {tb:.2f} TB/s = {tb / copy_tbps:.0%} of copy {copy_tbps:.2f} (need {need:.0%}){gtxt}"))
        if routing == "uniform" and m >= 4096 and ok(L):
            tf = L["flops"] / (L["median_ms"] * 1e-3) / 1e12
            if fmt == "bf16" and mm_tflops:
                t4.append(point(shape, fmt, m, routing, tf / mm_tflops, 0.75, f"layer {tf:.0f} TFLOP/s = {tf / mm_tflops:.0%} of matmul {mm_tflops:.0f} (need 75%)"))
            elif fmt == "w8a8-fp8-block128":
                t4.append(point(shape, fmt, m, routing, tf, 1000.0, f"layer {tf:.0f} TFLOP/s (need 1000)"))
        rd, rd_fmt = ix.peer("ragged_dot", fmt, shape, m, "layer", routing)
        if ok(rd) and ok(L):
            r = ratio(rd, L)
            note = "" if rd_fmt == fmt else f" (ragged_dot {rd_fmt} row)"
            t5.append(point(shape, fmt, m, routing, r, 5.0, f"layer {L['median_ms']:.4f} ms vs {rd['median_ms']:.4f} ms = {r:.1f}×{note}"))
        if m in (1, 4096) and routing == "uniform" and ok(L) and ok(G):
            share = max(0.0, (L["median_ms"] - G["median_ms"]) / L["median_ms"])
            limit = 0.15 if m == 4096 else 0.30
            t6.append(point(shape, fmt, m, routing, share, limit, f"routing+activation+finalize {share:.0%} of layer (limit {limit:.0%})", higher_is_better=False))
    add("faster than humming-kernels at every point it runs (gemms vs gemms)", t1)
    add("faster than torch._grouped_mm for bf16 at every point", t2)
    add("decode M<=16: touched-weight bandwidth >= 80% of copy (bf16, w4a16), >= 90% (fp8)", t3)
    add("prefill M>=4096: bf16 >= 75% of bf16 matmul; fp8 block >= 1000 TFLOP/s", t4)
    add("every point >= 5x ragged_dot (layer)", t5)
    add("around the GEMMs: <= 15% of layer at M=4096, <= 30% at M=1", t6)
    return targets


def targets_text(targets: list[dict], detail: bool = False) -> str:
    lines = []
    for t in targets:
        n = len(t["points"])
        bad = [p for p in t["points"] if not p["met"]]
        head = f"{t['status'].upper():12s} {t['target']}"
        if n:
            w = t["worst"]
            head += f" — {n - len(bad)}/{n} points; worst {w['shape']} {w['format']} M={w['M']}{'' if w['routing'] == 'uniform' else ' ' + w['routing']}: {w['figure']}"
        lines.append(head)
        if detail:
            for p in t["points"]:
                mark = "ok  " if p["met"] else "MISS"
                lines.append(f"    {mark} {p['shape']} {p['format']} M={p['M']} {p['routing']}: {p['figure']}")
    return "\n".join(lines)


# --- tables ---------------------------------------------------------------------------------
def rejected_blocks(data: dict) -> dict[tuple[str, str], str]:
    """(shape, format) blocks whose every row of ours failed one input check (a ``ValueError``,
    raised before any kernel runs: e.g. a group size that does not divide K), with its message."""
    errors: dict[tuple[str, str], set[str]] = {}
    for r in data.get("rows", []):
        if r["system"].startswith(OURS):
            errors.setdefault((r["shape"], r["format"]), set()).add(str(r.get("error") or ""))
    only = {k: next(iter(e)) for k, e in errors.items() if len(e) == 1}
    return {k: msg.removeprefix("ValueError: ") for k, msg in only.items() if msg.startswith("ValueError: ")}


def markdown_table(results: Iterable[tuple[str, dict]]) -> str:
    """The README table: one line per (run, shape, format, M, routing), ratios within the run."""
    out = [
        "| run | shape | format | M | humming_jax layer (ms) | throughput | gemms (ms) | vs humming-kernels (gemms) | vs torch._grouped_mm bf16 (layer) | vs ragged_dot (layer) | classes: indexed / grouped / batched (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, data in results:
        ix = Index(data)
        rejected, shown = rejected_blocks(data), set()
        for shape, fmt, m, routing in ix.points():
            if (shape, fmt) in rejected:
                # Our input checks refused the shape at every point: one line with their reason.
                if (shape, fmt) not in shown:
                    shown.add((shape, fmt))
                    out.append(f"| {name} | {shape} | {fmt} | all | not supported: {rejected[shape, fmt]} "
                               "| — | — | — | — | — | — |")
                continue
            L = ix.get(OURS, fmt, shape, m, "layer", routing)
            G = ix.get(OURS, fmt, shape, m, "gemms", routing)
            hk = ix.get("humming_kernels", fmt, shape, m, "gemms", routing)
            tg, _ = ix.peer("torch_grouped_mm", fmt, shape, m, "layer", routing)
            rd, rd_fmt = ix.peer("ragged_dot", fmt, shape, m, "layer", routing)
            classes = " / ".join(
                fmt_ms(ix.get(s, fmt, shape, m, p, routing))
                for s, p in (("humming_jax/indexed", "layer"), ("humming_jax/grouped", "layer"), ("humming_jax/batched", "gemms"))
            )
            mlabel = str(m) if routing == "uniform" else f"{m} ({routing})"
            rd_txt = fmt_ratio(rd, L) + ("" if rd_fmt == fmt or rd is None else f" ({rd_fmt} row)")
            out.append(
                f"| {name} | {shape} | {fmt} | {mlabel} | {fmt_ms(L)} | {fmt_tp(L)} | {fmt_ms(G)} | "
                f"{fmt_ratio(hk, G)} | {fmt_ratio(tg, L)} | {rd_txt} | {classes} |"
            )
    return "\n".join(out)


def ceilings_line(name: str, data: dict) -> str:
    c = data.get("ceilings") or {}
    dev = data.get("device", "?")
    if not c:
        return f"- `{name}`: {dev}, ceilings not measured"
    return (
        f"- `{name}`: {dev}, jax {data.get('jax_version', '?')}, torch {data.get('torch_version', '—')}, "
        f"humming-kernels {data.get('humming_kernels_version', '—')}; copy {c['copy_tbps']:.2f} TB/s, "
        f"bf16 matmul {c['bf16_tflops']:.0f} TFLOP/s; {timing_words(data)}"
    )


def jax_timed_rows(data: dict) -> tuple[list[dict], list[dict]]:
    """(rows of the JAX systems, those among them timed on the device)."""
    rows = [r for r in data.get("rows", []) if str(r.get("mode", "")).startswith("jax_jit")]
    return rows, [r for r in rows if r["mode"] == "jax_jit_device"]


def timing_words(data: dict) -> str:
    """How the run timed its JAX systems (bench_moe --timer; runs before the option: wall clock)."""
    rows, device_rows = jax_timed_rows(data)
    device = len(device_rows)
    if not device:
        return "JAX systems timed by the wall clock"
    if device == len(rows):
        return "JAX systems timed by their GPU activity in a profiler trace"
    return f"JAX systems timed by their GPU activity in a profiler trace ({len(rows) - device} of {len(rows)} rows by the wall clock)"


def summary_text(data: dict) -> str:
    """Compact table printed at the end of a run (the device tool returns only the output's tail)."""
    ix = Index(data)
    cols = [("hj", OURS, "layer"), ("hjG", OURS, "gemms"), ("idx", "humming_jax/indexed", "layer"),
            ("grp", "humming_jax/grouped", "layer"), ("batG", "humming_jax/batched", "gemms"),
            ("rdot", "ragged_dot", "layer"), ("trch", "torch_grouped_mm", "layer"),
            ("trchG", "torch_grouped_mm", "gemms"), ("hkG", "humming_kernels", "gemms")]
    head = f"{'shape':15s} {'format':17s} {'M':>6s} " + " ".join(f"{c[0]:>7s}" for c in cols) + "   ×hk(G)  ×trch  ×rdot"
    lines = ["median ms per layer (G = gemms part); ×peer = peer ms / our ms in this run", head]
    for shape, fmt, m, routing in ix.points():
        vals = []
        for _, sysname, part in cols:
            if sysname == "torch_grouped_mm":
                row = ix.get(sysname, "bf16", shape, m, part, routing) if fmt == "bf16" else None
            else:
                row = ix.get(sysname, fmt, shape, m, part, routing)
            vals.append(("err" if not ok(row) else f"{row['median_ms']:.4f}"[:7]) if row is not None else "-")
        L, G = ix.get(OURS, fmt, shape, m, "layer", routing), ix.get(OURS, fmt, shape, m, "gemms", routing)
        hk = ix.get("humming_kernels", fmt, shape, m, "gemms", routing)
        tg, _ = ix.peer("torch_grouped_mm", fmt, shape, m, "layer", routing)
        rd, _ = ix.peer("ragged_dot", fmt, shape, m, "layer", routing)
        rs = [ratio(hk, G), ratio(tg, L), ratio(rd, L)]
        rtxt = " ".join(f"{r:6.2f}" if r is not None else "     -" for r in rs)
        mlab = str(m) if routing == "uniform" else f"{m}z"
        lines.append(f"{shape[:15]:15s} {fmt[:17]:17s} {mlab:>6s} " + " ".join(f"{v:>7s}" for v in vals) + f"   {rtxt}")
    errors: dict[str, list[str]] = {}
    for r in data.get("rows", []):
        if r.get("error"):
            key = f"{r['system']}: {r['error'][:160]}"
            errors.setdefault(key, []).append(f"{r['shape']}/{r['format']}/M={r['M']}/{r['part']}")
    if errors:
        lines.append("errors (system: message -> points):")
        for k, pts in list(errors.items())[:15]:
            more = f" (+{len(pts) - 3} more)" if len(pts) > 3 else ""
            lines.append(f"  {k} -> {', '.join(pts[:3])}{more}")
        if len(errors) > 15:
            lines.append(f"  ... {len(errors) - 15} more distinct errors in the JSON")
    eager = [r for r in data.get("rows", []) if r.get("mode") == "eager"]
    if eager:
        note = next((r.get("note") for r in eager if r.get("note")), "")
        pts = ", ".join(f"{SHORT[r['system']]} {r['shape']}/{r['format']}/M={r['M']}" for r in eager[:4])
        lines.append(f"timed eagerly, not as graph replays ({len(eager)} rows: {pts}{' ...' if len(eager) > 4 else ''}): {note[:200]}")
    jax_rows, device_rows = jax_timed_rows(data)
    if device_rows:
        fell_back = [r for r in jax_rows if r["mode"] != "jax_jit_device"]
        lines.append(f"JAX systems timed on the device: {len(device_rows)}/{len(jax_rows)} rows"
                     + (f"; wall clock for {len(fell_back)} ({fell_back[0].get('note', '')[:160]})" if fell_back else ""))
    c = data.get("ceilings") or {}
    if c.get("copy_tbps") is not None and c.get("bf16_tflops") is not None:
        lines.append(f"ceilings: copy {c['copy_tbps']:.2f} TB/s, bf16 matmul {c['bf16_tflops']:.1f} TFLOP/s")
    elif c:
        lines.append(f"ceilings not measured: {c.get('error', 'no figures')}")
    return "\n".join(lines)


# --- plot -----------------------------------------------------------------------------------
def plot(data: dict, path: str | Path) -> str | None:
    """Throughput vs tokens, one line per system, one panel per (shape, format): TB/s over the
    format's touched bytes (left axis) for M <= 128, TFLOP/s (right axis) for M >= 1024, so a
    higher point is a faster system at that point. Our classes and the peers use their layer
    rows; systems with only a gemms part (batched, humming-kernels) are dashed. Returns None, or
    why no plot was made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"no plot: matplotlib unavailable ({type(exc).__name__})"
    ix = Index(data)
    panels: dict[tuple[str, str], None] = {}
    for shape, fmt, _, routing in ix.points():
        if routing == "uniform":
            panels[(shape, fmt)] = None
    if not panels:
        return "no plot: no uniform-routing rows"
    shapes = list(dict.fromkeys(s for s, _ in panels))
    fmts = list(dict.fromkeys(f for _, f in panels))
    fig, axes = plt.subplots(len(shapes), len(fmts), figsize=(4.6 * len(fmts), 3.4 * len(shapes)), squeeze=False)
    colors = dict(zip(SYSTEMS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    ceil = data.get("ceilings") or {}
    handles = {}
    for a, shape in enumerate(shapes):
        for b, fmt in enumerate(fmts):
            ax = axes[a][b]
            ax2 = ax.twinx()
            ax.set_xscale("log", base=2)
            ax.set_title(f"{shape} · {fmt}", fontsize=9)
            ax.set_xlabel("tokens M", fontsize=8)
            ax.set_ylabel("TB/s of this format's touched bytes (M ≤ 128)", fontsize=7)
            ax2.set_ylabel("TFLOP/s (M ≥ 1024)", fontsize=8)
            if (shape, fmt) not in panels:
                continue
            ms_here = sorted({m for sh, f, m, rt in ix.points() if (sh, f, rt) == (shape, fmt, "uniform")})
            for system in SYSTEMS:
                part = "gemms" if system in ("humming_jax/batched", "humming_kernels") else "layer"
                rows = []
                for m in ms_here:
                    if system in ("ragged_dot", "torch_grouped_mm"):
                        row, _ = ix.peer(system, fmt, shape, m, part, "uniform")
                    else:
                        row = ix.get(system, fmt, shape, m, part, "uniform")
                    if ok(row):
                        rows.append(row)
                rows.sort(key=lambda r: r["M"])
                style = "--" if part == "gemms" else "-"
                for axis, sel in ((ax, [r for r in rows if r["M"] <= 128]), (ax2, [r for r in rows if r["M"] > 128])):
                    if sel:
                        ys = [_effective(ix, r, shape, fmt) for r in sel]
                        (h,) = axis.plot([r["M"] for r in sel], ys, style, marker="o",
                                         ms=3, color=colors[system], label=f"{system}{' (gemms)' if part == 'gemms' else ''}")
                        handles.setdefault(h.get_label(), h)
            if ceil.get("copy_tbps") and ms_here:
                small = [m for m in ms_here if m <= 128]
                large = [m for m in ms_here if m > 128]
                if small:
                    ax.hlines(ceil["copy_tbps"], min(small), max(small), color="grey", ls=":", lw=1)
                if large:
                    ax2.hlines(ceil["bf16_tflops"], min(large), max(large), color="black", ls=":", lw=1)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"MoE experts on {data.get('device', '?')} — dotted: copy TB/s (M ≤ 128), bf16 matmul TFLOP/s (M ≥ 1024)", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend and title are wider than one column of panels
    plt.close(fig)
    return None


def _effective(ix: Index, row: dict, shape: str, fmt: str) -> float:
    """A row's throughput over THIS panel's format bytes (peers running bf16 weights are plotted
    by the time they take to do the same layer, not by the bytes they chose to stream)."""
    ref = ix.get(OURS, fmt, shape, row["M"], "layer", row.get("routing", "uniform")) or \
        ix.get(OURS, fmt, shape, row["M"], "gemms", row.get("routing", "uniform"))
    nbytes = ref["bytes"] if ref is not None and ref.get("bytes") else row["bytes"]
    v, unit = throughput(dict(row, bytes=nbytes))
    return v


def check_schema(data: dict) -> list[str]:
    """Problems with a result file's shape (empty list: it follows BENCH.md's result format)."""
    problems = []
    c = data.get("ceilings")
    if not isinstance(c, dict) or not {"copy_tbps", "bf16_tflops"} <= set(c):
        problems.append("ceilings must hold copy_tbps and bf16_tflops")
    rows = data.get("rows")
    if not isinstance(rows, list):
        return problems + ["rows must be a list"]
    for n, r in enumerate(rows):
        missing = [k for k in REQUIRED_ROW_KEYS if k not in r]
        if missing:
            problems.append(f"row {n} lacks {missing}")
            continue
        if r["system"] not in SYSTEMS:
            problems.append(f"row {n}: unknown system {r['system']!r}")
        if r["part"] not in ("layer", "gemms"):
            problems.append(f"row {n}: part {r['part']!r}")
        if r["median_ms"] is None and not r.get("error"):
            problems.append(f"row {n}: no median_ms and no error")
    return problems


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def bench_files(folder: str | Path) -> list[Path]:
    """bench_moe result files in a folder, oldest first."""
    out = []
    for p in sorted(Path(folder).glob("*.json")):
        try:
            if load(p).get("harness") == "bench_moe":
                out.append(p)
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda p: (load(p).get("created", ""), p.name))
