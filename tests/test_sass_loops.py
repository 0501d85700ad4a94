"""scripts/sass_loops.py's SASS parsing, on a made-up listing in cuobjdump's layout (the tool itself
needs cuobjdump and a CUDA build, which CI lacks)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_loops.py"
spec = importlib.util.spec_from_file_location("sass_loops", SCRIPT)
sass_loops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_loops)


def listing(body_ops: list[str], name: str) -> str:
    """A function whose loop (a backward BRA to the first body instruction) holds body_ops."""
    lines = [f"\t\tFunction : {name}", "        /*0000*/                   MOV R1, c[0x0][0x28] ;"]
    start = 0x10
    for i, op in enumerate(body_ops):
        lines.append(f"        /*{start + 16 * i:04x}*/                   {op} ;")
    end = start + 16 * len(body_ops)
    lines.append(f"        /*{end:04x}*/              @P0 BRA 0x{start:x} ;")
    lines.append(f"        /*{end + 16:04x}*/                   EXIT ;")
    return "\n".join(lines)


def test_loops_and_opcode_counts_match_the_listing():
    rng = np.random.default_rng()
    pool = [("HMMA.16816.F32.BF16 R0, R4, R8, R0", "HMMA"), ("@!P1 LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT", "LOP3"),
            ("HADD2 R5, R6, R7", "HADD2"), ("LDS.128 R8, [R9]", "LDS"), ("IMAD.MOV.U32 R1, RZ, RZ, R2", "IMAD")]
    picks = rng.integers(0, len(pool), int(rng.integers(5, 40)))
    body = [pool[i][0] for i in picks]
    fns = sass_loops.functions(listing(body, "kernel_a") + "\n" + listing(["NOP"], "kernel_b"))
    assert set(fns) == {"kernel_a", "kernel_b"}
    ins = fns["kernel_a"]
    (first, last), = sass_loops.loops(ins)
    assert (first, last) == (1, len(body) + 1)  # the body and its branch
    counts = {op: sum(sass_loops.opcode(t) == op for _, t in ins[first:last + 1]) for op in ("HMMA", "LOP3", "IMAD")}
    want = {op: sum(pool[i][1] == op for i in picks) for op in counts}
    assert counts == want
    assert sass_loops.opcode("@!UP0 HMMA.16816.F32 R0, R1, R2, R3") == "HMMA"
