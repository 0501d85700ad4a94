#!/usr/bin/env python3
"""Where a profiled kernel's warps wait: the SASS instructions with the most stall samples in an
Nsight Compute source page (scripts/profile_ncu.sh writes NAME.sass.csv), each with its main stall
reasons, and the kernel's samples by reason. A few kilobytes of text in place of the megabytes of
CSV, for device calls that return few files.

  python3 scripts/sass_stalls.py NAME.sass.csv [--top 40]
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from typing import Iterable

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(lines: Iterable[str]) -> tuple[str, list[dict[str, str]]]:
    """(kernel name, rows) of an `ncu --page source --print-source sass --csv` listing."""
    rows = list(csv.reader(lines))
    kernel = ""
    while rows and rows[0] and rows[0][0] == "Kernel Name":
        kernel = rows[0][1] if len(rows[0]) > 1 else ""
        rows.pop(0)
    if not rows or SAMPLES not in rows[0]:
        raise ValueError(f"no {SAMPLES!r} column: not an ncu SASS source page")
    header = rows[0]
    return kernel, [dict(zip(header, r)) for r in rows[1:] if len(r) == len(header)]


def summarize(kernel: str, rows: list[dict[str, str]], top: int) -> str:
    reasons = [c for c in (rows[0].keys() if rows else []) if c.startswith("stall_") and "(Not Issued)" not in c]
    total = sum(_number(r[SAMPLES]) for r in rows)
    out = [f"kernel: {kernel}", f"instructions: {len(rows)}, stall samples: {total:.0f}"]
    by_reason = Counter({c[len("stall_"):]: sum(_number(r[c]) for r in rows) for c in reasons})
    out.append("by reason: " + ", ".join(f"{k} {v / max(total, 1):.1%}" for k, v in by_reason.most_common() if v))
    base = int(rows[0]["Address"], 16) if rows and rows[0]["Address"].startswith("0x") else 0
    out.append(f"{'offset':>8} {'samples':>8} {'share':>6}  instruction  [main reasons]")
    ranked = sorted(range(len(rows)), key=lambda i: -_number(rows[i][SAMPLES]))[:top]
    for i in sorted(ranked):
        r = rows[i]
        n = _number(r[SAMPLES])
        if n <= 0:
            continue
        main = Counter({c[len("stall_"):]: _number(r[c]) for c in reasons}).most_common(3)
        why = ", ".join(f"{k} {v:.0f}" for k, v in main if v)
        offset = int(r["Address"], 16) - base if r["Address"].startswith("0x") else i
        out.append(f"{offset:8x} {n:8.0f} {n / max(total, 1):6.1%}  {r['Source'].strip()}  [{why}]")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="NAME.sass.csv of scripts/profile_ncu.sh")
    p.add_argument("--top", type=int, default=40, help="instructions listed (in address order)")
    a = p.parse_args(argv)
    with open(a.csv, newline="") as f:
        kernel, rows = read(f)
    print(summarize(kernel, rows, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
