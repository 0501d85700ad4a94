#!/usr/bin/env python3
"""The loops of compiled kernels, from their SASS: each backward branch's body with its instruction
count by opcode, to compare a kernel change's loop bodies on this machine before timing it on the
GPU. Static counts: a body may hold code its iterations skip (a first-iteration block behind a
branch), so compare bodies of one variant across builds, not against ideal figures.

    scripts/sass_loops.py build-gpu/cuda/CMakeFiles/humming_jax_decode_sm90.dir/cuda_ffi/gemm_decode_sm90_u4.cu.o \\
        --kernel 'ActKindE0ELNS0_3DeqE1ELb0ELb0E' --top 6

Needs cuobjdump, which the CUDA toolkit here lacks; it comes from PyPI:
    pip download --no-deps nvidia-cuda-cuobjdump -d /tmp/w && python3 -m zipfile -e /tmp/w/*.whl /opt/cuobjdump
    export PATH=/opt/cuobjdump/nvidia/cu13/bin:$PATH    # chmod +x the binary first
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys

_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_PRED = re.compile(r"^@!?U?P\w+\s+")


def opcode(text: str) -> str:
    """The instruction's opcode without predicate and modifiers (HMMA.16816.F32 -> HMMA)."""
    return _PRED.sub("", text).split()[0].split(".")[0]


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Each function's instructions as (address, text)."""
    out = {}
    for part in re.split(r"(?:^|\n)\s*Function : ", sass)[1:]:
        name = part.split("\n", 1)[0].strip()
        out[name] = [(int(m.group(1), 16), m.group(2).strip()) for m in _INS.finditer(part)]
    return out


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each backward branch's body, largest first."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    found = []
    for i, (a, text) in enumerate(ins):
        if opcode(text) != "BRA":
            continue
        m = re.search(r"0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            found.append((index[int(m.group(1), 16)], i))
    return sorted(set(found), key=lambda se: se[0] - se[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("object", help="an object file or cubin with sm_90a code")
    p.add_argument("--kernel", default="", help="substring of the mangled kernel names to show")
    p.add_argument("--top", type=int, default=8, help="largest loops per kernel")
    p.add_argument("--max-body", type=int, default=3000, help="skip bodies longer than this (the item loop)")
    args = p.parse_args()
    tool = shutil.which("cuobjdump")
    if tool is None:
        sys.exit("cuobjdump not found on PATH (see this script's docstring for where to get it)")
    sass = subprocess.run([tool, "-sass", args.object], capture_output=True, text=True, check=True).stdout
    shown = 0
    for name, ins in functions(sass).items():
        if args.kernel not in name:
            continue
        shown += 1
        print(f"{name}: {len(ins)} instructions")
        bodies = [(s, e) for s, e in loops(ins) if e - s + 1 <= args.max_body][: args.top]
        for s, e in bodies:
            ops = collections.Counter(opcode(t) for _, t in ins[s:e + 1])
            top = ", ".join(f"{k} {v}" for k, v in ops.most_common(14))
            print(f"  {ins[s][0]:#07x}-{ins[e][0]:#07x}: {e - s + 1:5d} instr, HMMA {ops.get('HMMA', 0)}: {top}")
    if not shown:
        sys.exit(f"no kernel matching {args.kernel!r} in {args.object}")


if __name__ == "__main__":
    main()
