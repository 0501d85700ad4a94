"""The README's usage examples run, and are exactly the scripts in examples/.

Each ``<!-- example: examples/NAME.py -->`` block of README.md must equal that file, and each file
is executed here (tiny shapes, whatever backend JAX picks), so neither can rot. The documented
command-line entries (``demo`` with its decode block, ``bench``) are run too.
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from humming_jax import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- example: (\S+) -->\n```python\n(.*?)```\n<!-- /example -->", re.S)
EXPECTED = ("examples/serving_step.py", "examples/flax_model.py", "examples/checkpoint_conversion.py")
NEEDS = {"examples/flax_model.py": ("flax",), "examples/checkpoint_conversion.py": ("flax", "safetensors")}


def readme_examples() -> dict[str, str]:
    return {path: body for path, body in BLOCK.findall(README.read_text())}


def test_readme_blocks_are_the_example_files():
    blocks = readme_examples()
    assert set(EXPECTED) <= set(blocks), f"README lacks example blocks for {set(EXPECTED) - set(blocks)}"
    for path, body in blocks.items():
        assert (ROOT / path).read_text() == body, f"README's block for {path} differs from the file"


@pytest.mark.parametrize("path", EXPECTED)
def test_example_runs(path, capsys):
    for module in NEEDS.get(path, ()):
        pytest.importorskip(module)
    runpy.run_path(str(ROOT / path), run_name="__main__")


def test_demo_runs_layer_and_decode_block(capsys):
    pytest.importorskip("flax")
    rc = cli.main(["demo", "--scheme", "w4a16-int4-g128", "--tokens", "8", "--repeats", "1", "--block-steps", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "MoE block decode" in out and "block outputs match the oracle" in out


def test_bench_without_script_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_bench_script", lambda: None)
    assert cli.main(["bench"]) == 2
    assert "benchmarks/bench_moe.py was not found" in capsys.readouterr().err


def test_bench_passes_arguments_on(monkeypatch, tmp_path):
    script = tmp_path / "bench_moe.py"
    script.write_text("import sys, pathlib\npathlib.Path(sys.argv[0]).with_suffix('.args').write_text(' '.join(sys.argv[1:]))\n")
    monkeypatch.setattr(cli, "_bench_script", lambda: script)
    assert cli.main(["bench", "--smoke", "--out", "x.json"]) == 0
    assert script.with_suffix(".args").read_text() == "--smoke --out x.json"
