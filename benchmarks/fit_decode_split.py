"""The decode kernel's K-split rule against per-GEMM timings of every split: reads a
``sweep_env.py --var HUMMING_JAX_DECODE_WK --values unset,1,2,4,8 --timer device`` result (its
``launches_us``: GEMM1 and GEMM2 apart), rebuilds each GEMM's candidate splits the way
``plan()`` in cuda_ffi/gemm_decode_sm90.cu does (indexed layout, H200: 132 SMs), and reports how
far each rule's choices are above the per-GEMM best. Fits the rule's constants over a grid.

    python3 benchmarks/fit_decode_split.py benchmarks/results/h200/2026-12-03-sweep-decode-wk-per-gemm.json
    python3 benchmarks/fit_decode_split.py --gemm2-from-total SWEEP.json [SWEEP.json ...]  # one-call experts
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

import moe_setup as ms

SMS = 132                      # H200
SMEM_PER_SM = 228 * 1024       # gemm_decode_sm90.cu kSmemPerSm
SMEM_RESERVED_PER_CTA = 1024 + 768
MAX_DYNAMIC_SMEM = 227 * 1024 - 768
# The ring's stages: 3 since v30 (kStages); sweeps measured before v30 ran on 4 (--stages 4).
STAGES, W_STAGE_BYTES, WARPS, ROWS_PER_WARP, ITEM_ROWS = 3, 16 * 1024, 8, 32, 16


@dataclass
class Candidate:
    wk: int
    ctas: int
    slots: int
    cta_bytes: int  # bn weight rows + the item's expected activation rows
    w_bytes: int    # bn weight rows
    iters: int      # chunk columns per K group


def expected_distinct(e: int, draws: int) -> int:
    return math.ceil(e * (1 - (1 - 1 / e) ** draws)) if e > 0 and draws > 0 else 0


def candidates(fmt: str, n: int, k: int, e: int, rows: int, max_wk: int = WARPS,
               stages: int = STAGES) -> list[Candidate]:
    """The splits plan() may take for an indexed call of ``rows`` routed rows (block_m = 16);
    ``max_wk`` 4 for a GEMM1 that pairs gate and up halves in its epilogue (gemm_indexed_gated);
    ``stages`` the ring's depth when the sweep ran."""
    q8 = fmt.startswith("w8a8")
    four = "int4" in fmt or "mxfp4" in fmt
    raw = fmt == "bf16"
    epc = 8 if raw else (32 if four else 16)
    kw, asz = 4 * epc, 1 if q8 else 2
    row_bytes = 2 * k if raw else (k // 2 if four else k)
    max_rows, est = min(ITEM_ROWS, rows), max(1, expected_distinct(e, rows))
    want = 64 if epc * asz == 16 else 16
    nc = -(-k // kw)
    act = min(max_rows, -(-rows // est)) * k * asz
    out = []
    for wk in (1, 2, 4, 8):
        if wk > max_wk or (wk > 1 and wk > nc):
            break
        base = wk * kw * asz
        smem = stages * (W_STAGE_BYTES + max_rows * (base + ((want - base % 128) + 128) % 128))
        if smem > MAX_DYNAMIC_SMEM:
            break
        per_sm = min(2, SMEM_PER_SM // (smem + SMEM_RESERVED_PER_CTA))
        bn = WARPS // wk * ROWS_PER_WARP
        out.append(Candidate(wk, est * -(-n // bn), max(1, per_sm * SMS), bn * row_bytes + act, bn * row_bytes,
                             -(-nc // wk)))
    return out


def by_resident(cs: list[Candidate]) -> int:
    """The previous rule: the most CTAs resident at once, the smallest wk among equals."""
    return max(cs, key=lambda c: (min(c.ctas, c.slots), -c.wk)).wk


def rounds_tenths(c: Candidate, pair_tenths: int) -> int:
    """The larger of the resident waves and pair_tenths / 10 x the busiest SM's CTAs."""
    return max(10 * -(-c.ctas // c.slots), pair_tenths * -(-c.ctas // SMS))


def by_time(fixed_bytes: int = 32 << 10, pair_tenths: int = 6):
    """The v11k rule (HUMMING_JAX_DECODE_PLAN=bytes): rounds times (a CTA's weight and activation
    bytes + fixed_bytes), the smallest wk among equals."""
    def rule(cs: list[Candidate]) -> int:
        return min(cs, key=lambda c: (rounds_tenths(c, pair_tenths) * (c.cta_bytes + fixed_bytes), c.wk)).wk
    return rule


def by_time_near(fixed_bytes: int = 32 << 10, pair_tenths: int = 6, near: float = 0.05, min_iters: int = 16):
    """The rule in force: rounds times (a CTA's weight bytes + fixed_bytes); of the wk within
    ``near`` of the least estimate, the largest that leaves each K group ``min_iters`` chunk
    columns, else the least estimate's (the smallest wk among equals)."""
    def rule(cs: list[Candidate]) -> int:
        score = {c.wk: rounds_tenths(c, pair_tenths) * (c.w_bytes + fixed_bytes) for c in cs}
        least = min(cs, key=lambda c: (score[c.wk], c.wk))
        near_ones = [c.wk for c in cs
                     if c.wk > least.wk and score[c.wk] <= score[least.wk] * (1 + near) and c.iters >= min_iters]
        return max(near_ones, default=least.wk)
    return rule


# The decode-sized GEMM kernels, by the names a trace gives their launches.
GEMM_KERNELS = ("decode_kernel", "fp8_ring_kernel")


def is_gemm_launch(name: str) -> bool:
    return any(k in name for k in GEMM_KERNELS)


def per_gemm_times(sequence: list[list]) -> tuple[list[float], list[float]]:
    """GEMM1 and GEMM2 µs of one call's launches. A GEMM launch followed by another kernel (the
    activation) is a GEMM1, the rest GEMM2s (input sets may interleave); where no kernel runs
    between them (GEMM1 writing the activation itself, GEMMs quantizing their own input), the
    GEMM launches alternate GEMM1, GEMM2 set by set."""
    dec = [is_gemm_launch(name) for name, _ in sequence]
    g1, g2 = [], []
    for i, (is_dec, (_, us)) in enumerate(zip(dec, sequence)):
        if is_dec:
            (g1 if i + 1 < len(dec) and not dec[i + 1] else g2).append(us)
    if g1 and len(g1) == len(g2):
        return g1, g2
    gemm_us = [us for is_dec, (_, us) in zip(dec, sequence) if is_dec]
    return gemm_us[0::2], gemm_us[1::2]


def gemms(data: dict, stages: int = STAGES, gemm2_from_total: bool = False) -> list[dict]:
    """One entry per GEMM: its name, candidates (a ring of ``stages``) and µs per forced wk.
    ``gemm2_from_total``: GEMM2's µs is the call's median less GEMM1's, for sweeps where GEMM2's
    kernel is launched dependent on GEMM1's inside one call (experts_indexed, layer_indexed), so its
    own duration includes the time it waits on GEMM1's tail."""
    out = []
    for row in data["rows"]:
        e, topk, h, i = ms.SHAPES[row["shape"]]
        per_value = {}
        for v, seq in row["launches_us"].items():
            g1, g2 = per_gemm_times(seq)
            if len(g1) != row["sets"] or len(g2) != row["sets"]:
                raise SystemExit(f"{row['shape']} {row['format']} M={row['M']}: launches do not split into GEMMs")
            t1 = sum(g1) / len(g1)
            per_value[v] = (t1, 1000 * row["ms"][v] - t1 if gemm2_from_total else sum(g2) / len(g2))
        # A GEMM1 with 16-bit activations and no kernel after it wrote the (silu) activation of its
        # halves itself (gemm_indexed_gated): at most 4 K groups (a forced 8 falls back to the plan).
        seq = row["launches_us"]["unset"]
        follows = [is_gemm_launch(a[0]) and not is_gemm_launch(b[0]) for a, b in zip(seq, seq[1:])]
        gated = not row["format"].startswith("w8a8") and not any(follows)
        for g, (n, k) in enumerate(((2 * i, h), (h, i))):
            cs = candidates(row["format"], n, k, e, row["M"] * topk, 4 if gated and g == 0 else WARPS, stages)
            t = {c.wk: per_value[str(c.wk)][g] for c in cs}
            out.append({"name": f"{row['shape']} {row['format']} M={row['M']} GEMM{g + 1}", "cands": cs, "us": t})
    return out


def evaluate(items: list[dict], rule) -> dict:
    """Mean and worst regret against the per-GEMM best, and the total time above the best."""
    regrets = [it["us"][rule(it["cands"])] / min(it["us"].values()) - 1 for it in items]
    total = sum(it["us"][rule(it["cands"])] for it in items) / sum(min(it["us"].values()) for it in items) - 1
    return {"mean": sum(regrets) / len(regrets), "worst": max(regrets), "total": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep", nargs="+", help="sweep_env.py JSONs of HUMMING_JAX_DECODE_WK with launches_us")
    p.add_argument("--show", action="store_true", help="each GEMM's choice under both rules")
    p.add_argument("--stages", type=int, default=STAGES, choices=(3, 4),
                   help="the decode ring's stages when the sweep ran (4 before v30)")
    p.add_argument("--gemm2-from-total", action="store_true",
                   help="GEMM2 = the call's time less GEMM1's (GEMM2 launched dependent on GEMM1 in one call)")
    args = p.parse_args()
    items = []
    for path in args.sweep:
        with open(path) as fh:
            items += gemms(json.load(fh), args.stages, args.gemm2_from_total)
    fmt = "{mean:6.2%} mean, {worst:6.2%} worst, {total:6.2%} in total above the per-GEMM best"
    print(f"{len(items)} GEMMs")
    print("resident (HUMMING_JAX_DECODE_PLAN=resident):", fmt.format(**evaluate(items, by_resident)))
    print("by time (v11k, HUMMING_JAX_DECODE_PLAN=bytes):", fmt.format(**evaluate(items, by_time())))
    print("by time, near ties to the finer split (in force):", fmt.format(**evaluate(items, by_time_near())))
    grid = [(evaluate(items, by_time_near(f << 10, t, n, i)), f, t, n, i)
            for f in (16, 32, 48) for t in (5, 6, 7) for n in (0.0, 0.02, 0.05, 0.1) for i in (1, 8, 16)]
    best = min(grid, key=lambda g: g[0]["total"])
    print(f"grid best: fixed {best[1]} KB, pair {best[2] / 10:.1f}, near {best[3]:.0%}, min iters {best[4]}:",
          fmt.format(**best[0]))
    if args.show:
        old, new = by_time(), by_time_near()
        for it in items:
            a, b = old(it["cands"]), new(it["cands"])
            print(f"  {it['name']:44s} v11k wk{a} {it['us'][a]:8.2f} µs  in force wk{b} {it['us'][b]:8.2f} µs  "
                  f"best {min(it['us'].values()):8.2f}")


if __name__ == "__main__":
    main()
