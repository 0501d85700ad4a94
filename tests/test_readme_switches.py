"""README.md's environment-switch table names every HUMMING_JAX_* variable that the package, its
build or its kernels read, and nothing else."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"HUMMING_JAX_[A-Z0-9_]+")
SOURCES = ("humming_jax", "cuda_ffi", "build_backend", "CMakeLists.txt", "pyproject.toml")
SOURCE_SUFFIXES = (".py", ".cc", ".cu", ".cuh", ".h")  # the files read inside SOURCES' folders


def read_by_code() -> set[str]:
    names: set[str] = set()
    for src in SOURCES:
        path = ROOT / src
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.suffix in SOURCE_SUFFIXES]
        for f in files:
            names |= set(NAME.findall(f.read_text(errors="replace")))
    return names


def in_switch_table() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Environment switches", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `HUMMING_JAX_")]
    return {n for cell in rows for n in NAME.findall(cell)}


def test_every_variable_read_is_in_the_switch_table():
    code, table = read_by_code(), in_switch_table()
    assert len(code) > 30, "the scan found too few variables: the sources moved?"
    assert code - table == set(), f"read by the code, missing from README's switch table: {sorted(code - table)}"
    assert table - code == set(), f"in README's switch table, read nowhere: {sorted(table - code)}"
