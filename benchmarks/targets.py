#!/usr/bin/env python3
"""BENCH.md's targets checked against bench_moe.py results: each met / missed / not measured, with
the figure and the same-run ratio or ceiling behind it.

  python benchmarks/targets.py RESULT.json [...] [--detail] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="result JSON files (default: all bench_moe results)")
    p.add_argument("--results", default=str(HERE / "results" / "h200"))
    p.add_argument("--detail", action="store_true", help="every point, not only the worst")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    args = p.parse_args(argv)
    files = [Path(f) for f in args.files] if args.files else report.bench_files(args.results)
    out = {}
    for f in files:
        targets = report.check_targets(report.load(f))
        if args.json:
            out[str(f)] = targets
        else:
            print(f"== {f}")
            print(report.targets_text(targets, detail=args.detail))
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
