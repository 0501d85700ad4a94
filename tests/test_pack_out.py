"""scripts/pack_out.sh, the last step of a device call: where more files lie under $OUT than come
back, it packs the .txt / .log files into one archive. Run here on a temporary $OUT (no GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(out, **env):
    full = dict(os.environ, **env)
    if out is not None:
        full["OUT"] = str(out)
    else:
        full.pop("OUT", None)
    return subprocess.run(["bash", str(ROOT / "scripts" / "pack_out.sh")], env=full, capture_output=True, text=True)


def _fill(out, rng, txt, json):
    """Files of random content under out: `txt` logs (.txt / .log alternating), `json` results."""
    made = {}
    for i in range(txt):
        name = f"log{i}.{'txt' if i % 2 == 0 else 'log'}"
        made[name] = rng.bytes(64 + i)
    for i in range(json):
        made[f"r{i}.json"] = rng.bytes(32)
    for name, data in made.items():
        (out / name).write_bytes(data)
    return made


def test_packs_the_logs_where_files_exceed_the_limit(tmp_path, rng):
    made = _fill(tmp_path, rng, txt=5, json=4)  # nine files: one over the eight that come back
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([n for n in made if n.endswith(".json")] + ["logs.tar.gz"])
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        packed = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert packed == {n: d for n, d in made.items() if not n.endswith(".json")}
    for n in packed:
        assert not (tmp_path / n).exists()


@pytest.mark.parametrize("count", [1, 8])
def test_leaves_up_to_the_limit_alone(tmp_path, count, rng):
    made = _fill(tmp_path, rng, txt=count, json=0)
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == made


def test_limit_is_a_setting(tmp_path, rng):
    _fill(tmp_path, rng, txt=2, json=2)
    r = _run(tmp_path, HJ_OUT_FILES="3")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tar.gz", "r0.json", "r1.json"]


def test_refuses_without_out():
    r = _run(None)
    assert r.returncode != 0
    assert "OUT is not set" in r.stderr
