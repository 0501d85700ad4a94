"""scripts/cuda_src_hash.sh, the stamp of the CUDA library's sources that the build scripts write
beside each library and the device calls compare with the tree they carry. Run here on a temporary
tree of random files (no GPU)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None,
                                reason="needs bash and sha256sum")


def _tree(tmp_path, rng):
    root = tmp_path / "tree"
    (root / "scripts").mkdir(parents=True)
    (root / "cuda_ffi" / "sub").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "cuda_src_hash.sh", root / "scripts")
    for name in ("a.cu", "b.cuh", "sub/c.h"):
        (root / "cuda_ffi" / name).write_bytes(rng.bytes(int(rng.integers(1, 4096))))
    (root / "CMakeLists.txt").write_bytes(rng.bytes(512))
    (root / "README.md").write_text("outside the sources\n")
    return root


def _hash(root):
    r = subprocess.run(["bash", str(root / "scripts" / "cuda_src_hash.sh")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    h = r.stdout.strip()
    assert len(h) == 64 and all(c in "0123456789abcdef" for c in h), h
    return h


def test_the_stamp_follows_the_sources_and_nothing_else(tmp_path, rng):
    root = _tree(tmp_path, rng)
    first = _hash(root)
    assert _hash(root) == first  # deterministic
    (root / "README.md").write_text("changed\n")
    (root / "cuda_ffi" / "__pycache__").mkdir()
    (root / "cuda_ffi" / "__pycache__" / "x.pyc").write_bytes(rng.bytes(64))
    assert _hash(root) == first, "files outside the sources must not count"
    seen = {first}
    src = root / "cuda_ffi" / "b.cuh"
    data = bytearray(src.read_bytes())
    data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))  # one bit
    src.write_bytes(bytes(data))
    seen.add(_hash(root))
    (root / "cuda_ffi" / "sub" / "d.cu").write_bytes(b"")  # an empty new file
    seen.add(_hash(root))
    (root / "cuda_ffi" / "sub" / "d.cu").rename(root / "cuda_ffi" / "d.cu")  # the same file moved
    seen.add(_hash(root))
    (root / "CMakeLists.txt").write_bytes(rng.bytes(512))
    seen.add(_hash(root))
    assert len(seen) == 5, "each change of the sources must change the stamp"
