"""A/B of two or more builds of the CUDA library on the same points.

A process loads one build (``$HUMMING_JAX_CUDA_LIB``, read at import), so each build runs
``sweep_env.py`` in processes of its own: the builds in turn, round after round, so that a slow
drift of the machine falls on all of them alike. The result is one table with, per point, each
build's median over its rounds, the spread of those rounds and the ratio to the first build; the
JSON keeps every run as sweep_env.py wrote it. A run whose process loaded another library than the
one named is an error (the library path is checked in its backend report).

    python3 benchmarks/ab_libraries.py --lib old=$HJ_AB_DIR/old.so \\
        --lib new=humming_jax/libhumming_jax_cuda.so --rounds 2 --out ab.json -- \\
        --shapes qwen3-30b-a3b --formats w4a16-int4-g128 --tokens 1,16,128 --timer device

(``scripts/build_ab_library.sh`` builds another revision's library; ``scripts/device_env.sh``
unpacks it on the GPU machine into ``$HJ_AB_DIR``. A build older than one of the tree's custom
calls loads without that call's CUDA handler; the backend report names it, and a point that uses
it fails there.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VAR = "HUMMING_JAX_CUDA_LIB"


def parse_libs(items: list[str]) -> dict[str, str]:
    libs: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lib {item!r}: expected NAME=PATH")
        if name in libs:
            raise SystemExit(f"--lib: the name {name!r} is given twice")
        if not Path(path).is_file():
            raise SystemExit(f"--lib {name}: {path} is not a file")
        libs[name] = str(Path(path).resolve())
    if len(libs) < 2:
        raise SystemExit("give at least two --lib NAME=PATH")
    return libs


def run_one(path: str, sweep_args: list[str], out: Path) -> dict:
    """One sweep_env.py process on the library at ``path``; its JSON, checked to come from it."""
    cmd = [sys.executable, str(HERE / "sweep_env.py"), "--var", VAR, "--values", path, *sweep_args, "--out", str(out)]
    res = subprocess.run(cmd, env={**os.environ, VAR: path}, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"sweep_env.py failed on {path}:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    data = json.loads(out.read_text())
    loaded = (data.get("backends") or {}).get("cuda")
    on_gpu = "cuda" in data.get("device", "").lower()
    if (loaded is not None or on_gpu) and (loaded is None or str(Path(loaded).resolve()) != path):
        raise SystemExit(f"the process meant for {path} loaded {loaded!r}")
    return data


def summarize(libs: dict[str, str], runs: dict[str, list[dict]]) -> list[dict]:
    """Per point: each build's median time per round, their mean, spread and ratio to the first."""
    points: dict[tuple, dict[str, list[float]]] = {}
    for name, datas in runs.items():
        for data in datas:
            for row in data["rows"]:
                key = (row["shape"], row["format"], row["M"])
                points.setdefault(key, {}).setdefault(name, []).append(row["ms"][libs[name]])
    first = next(iter(libs))
    out = []
    for (shape, fmt, m), per in points.items():
        if set(per) != set(libs):
            continue  # a point some build did not run (e.g. a failed format)
        mean = {n: sum(v) / len(v) for n, v in per.items()}
        out.append({"shape": shape, "format": fmt, "M": m, "rounds_ms": per, "ms": mean,
                    "spread": {n: max(v) / min(v) - 1.0 for n, v in per.items()},
                    "vs_first": {n: mean[n] / mean[first] for n in per}})
    return out


def main() -> None:
    argv = sys.argv[1:]
    rest: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", action="append", default=[], help="NAME=PATH of a build (two or more)")
    p.add_argument("--rounds", type=int, default=2, help="processes per build, the builds in turn")
    p.add_argument("--out", default="ab_libraries.json")
    args = p.parse_args(argv)
    if any(a in ("--var", "--values", "--out") for a in rest):
        raise SystemExit("the sweep arguments after -- must not set --var, --values or --out")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    libs = parse_libs(args.lib)
    runs: dict[str, list[dict]] = {n: [] for n in libs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, path in libs.items():
                runs[name].append(run_one(path, rest, Path(tmp) / f"{name}{r}.json"))
                print(f"round {r + 1}: {name} done", flush=True)
                # Written after every build's run, so that a run cut short keeps what it measured.
                write(libs, runs, r, rest, args.out)
            # Each whole round is reported.
            report(libs, runs, r + 1, rest, args.out)


def report(libs: dict[str, str], runs: dict[str, list[dict]], rounds: int, sweep_args: list[str], out: str) -> None:
    """The table of the rounds done so far, printed and written to ``out`` as JSON."""
    points = summarize(libs, runs)
    names = list(libs)
    print(f"after round {rounds}:")
    print(f"{'shape':16s} {'format':18s} {'M':>5s} " + " ".join(f"{n:>10s}" for n in names)
          + " " + " ".join(f"{n + '/' + names[0]:>12s}" for n in names[1:]) + "  max spread")
    for pt in points:
        print(f"{pt['shape']:16s} {pt['format']:18s} {pt['M']:5d} " + " ".join(f"{pt['ms'][n]:10.4f}" for n in names)
              + " " + " ".join(f"{pt['vs_first'][n]:12.3f}" for n in names[1:])
              + f"  {max(pt['spread'].values()):.1%}", flush=True)
    write(libs, runs, rounds, sweep_args, out, points)
    print(f"wrote {out}", flush=True)


def write(libs: dict[str, str], runs: dict[str, list[dict]], rounds: int, sweep_args: list[str], out: str,
          points: list[dict] | None = None) -> None:
    """The JSON of ``rounds`` whole rounds and every run so far (a later round's builds may have
    more runs than ``rounds``)."""
    with open(out, "w") as fh:
        json.dump({"libs": libs, "rounds": rounds, "sweep_args": sweep_args, "order": "builds in turn per round",
                   "points": summarize(libs, runs) if points is None else points, "runs": runs}, fh, indent=1)


if __name__ == "__main__":
    main()
