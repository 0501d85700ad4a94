"""scripts/sass_stalls.py on a made-up Nsight Compute SASS source page (the real one needs ncu and a
GPU): the instructions ranked by stall samples, their main reasons, the kernel's share by reason."""

from __future__ import annotations

import csv
import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_stalls.py"
spec = importlib.util.spec_from_file_location("sass_stalls", SCRIPT)
sass_stalls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_stalls)

REASONS = ("barrier", "long_sb", "short_sb", "wait")


def page(samples: np.ndarray) -> str:
    """A source page: one instruction per row of `samples` [n, reasons] (all-samples columns, then
    the not-issued ones, which must not count twice)."""
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    w.writerow(["Kernel Name", "void k<(int)256>(P)"])
    cols = [f"stall_{r}" for r in REASONS] + [f"stall_{r} (Not Issued)" for r in REASONS]
    w.writerow(["Address", "Source", sass_stalls.SAMPLES, "# Samples"] + cols)
    for i, row in enumerate(samples):
        w.writerow([hex(0x7F0000 + 16 * i), f"      OP{i} R{i}", str(int(row.sum())), str(int(row.sum()))]
                   + [str(int(v)) for v in row] + [str(int(v) // 2) for v in row])
    return buf.getvalue()


def test_ranks_instructions_and_reasons():
    rng = np.random.default_rng()
    samples = rng.integers(0, 50, (30, len(REASONS)))
    hot = int(rng.integers(0, 30))
    samples[hot] = [0, 900, 5, 0]  # one instruction waiting on a long scoreboard
    kernel, rows = sass_stalls.read(io.StringIO(page(samples)))
    assert kernel == "void k<(int)256>(P)" and len(rows) == 30
    text = sass_stalls.summarize(kernel, rows, top=5)
    listed = [line for line in text.splitlines() if "  OP" in line]
    total = samples.sum()
    want = sorted(np.argsort(-samples.sum(1), kind="stable")[:5])
    assert [int(line.split("OP")[1].split()[0]) for line in listed] == want
    hot_line = next(line for line in listed if f"OP{hot} " in line)
    assert hot_line.split()[0] == f"{16 * hot:x}" and "[long_sb 900, short_sb 5]" in hot_line
    share = samples[:, REASONS.index("long_sb")].sum() / total
    assert f"long_sb {share:.1%}" in text and f"stall samples: {total}" in text


def test_rejects_a_page_without_samples():
    with pytest.raises(ValueError, match="not an ncu SASS source page"):
        sass_stalls.read(io.StringIO('"Address","Source"\n"0x0","NOP"\n'))
