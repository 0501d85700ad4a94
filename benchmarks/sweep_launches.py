#!/usr/bin/env python3
"""Per-GEMM times of a sweep_env.py JSON recorded with the device timer (its ``launches_us``): for
each point and value, GEMM1 and GEMM2 in µs (the mean over the point's input sets) and which
kernel ran them (decode: the mma.sync decode kernel, ring: the fp8 ring kernel), beside the point's
total.

    python3 benchmarks/sweep_launches.py benchmarks/results/h200/2026-12-03-sweep-decode-fp8-ring.json
"""

from __future__ import annotations

import argparse
import json

from fit_decode_split import is_gemm_launch, per_gemm_times


def kernel_tag(name: str) -> str:
    """decode or ring, for a GEMM launch's name (is_gemm_launch)."""
    return "ring" if "ring_kernel" in name else "decode"


def summarize(data: dict) -> list[dict]:
    """One entry per point and value: GEMM1 / GEMM2 mean µs, their kernel tags, the point's ms."""
    out = []
    for row in data["rows"]:
        for value, seq in (row.get("launches_us") or {}).items():
            g1, g2 = per_gemm_times(seq)
            tags = sorted({kernel_tag(name) for name, _ in seq if is_gemm_launch(name)})
            out.append({
                "point": f"{row['shape']} {row['format']} M={row['M']}", "value": value,
                "gemm1_us": sum(g1) / len(g1) if g1 else None, "gemm2_us": sum(g2) / len(g2) if g2 else None,
                "kernels": "+".join(tags) or "-", "ms": row["ms"].get(value),
            })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep", help="sweep_env.py JSON written with --timer device")
    with open(p.parse_args().sweep) as fh:
        entries = summarize(json.load(fh))
    if not entries:
        raise SystemExit("no launches_us in this JSON (sweep_env.py --timer device records them)")

    def us(x):
        return f"{x:8.1f}" if x is not None else "       -"

    for e in entries:
        ms = f"{e['ms']:.4f}" if e["ms"] is not None else "-"
        print(f"{e['point']:42s} {e['value']:>6s}  GEMM1 {us(e['gemm1_us'])} µs  GEMM2 {us(e['gemm2_us'])} µs  "
              f"{e['kernels']:16s} {ms} ms")


if __name__ == "__main__":
    main()
