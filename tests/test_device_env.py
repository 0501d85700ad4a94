"""scripts/device_env.sh, the first step of every GPU-machine call: it installs what the call
carried (.gpu/ libraries, plain or xz-compressed, and A/B builds) and refuses to go on without
them. Run here on fake files in a temporary tree (no GPU needed)."""

from __future__ import annotations

import lzma
import os
import shutil
import subprocess

import numpy as np
import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _tree(tmp_path):
    root = tmp_path / "tree"
    (root / "scripts").mkdir(parents=True)
    (root / "humming_jax").mkdir()
    (root / ".gpu" / "ab").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "device_env.sh", root / "scripts")
    (root / ".gpu" / "_humming_jax_cpu.cpython-312-x86_64-linux-gnu.so").write_bytes(b"cpu module")
    return root


def _source(root, ab_dir):
    env = dict(os.environ, HJ_AB_DIR=str(ab_dir))
    cmd = 'source scripts/device_env.sh && echo "PYTHONPATH=$PYTHONPATH"'
    return subprocess.run(["bash", "-c", cmd], cwd=root, env=env, capture_output=True, text=True, timeout=60)


def test_compressed_libraries_are_installed(tmp_path, rng):
    root = _tree(tmp_path)
    lib, other = rng.bytes(1 << 16), rng.bytes(1 << 15)
    (root / ".gpu" / "libhumming_jax_cuda.so.xz").write_bytes(lzma.compress(lib))
    (root / ".gpu" / "ab" / "old.so.xz").write_bytes(lzma.compress(other))
    res = _source(root, tmp_path / "ab")
    assert res.returncode == 0, res.stdout + res.stderr
    assert (root / "humming_jax" / "libhumming_jax_cuda.so").read_bytes() == lib
    assert (tmp_path / "ab" / "old.so").read_bytes() == other
    assert (root / "humming_jax" / "_humming_jax_cpu.cpython-312-x86_64-linux-gnu.so").read_bytes() == b"cpu module"
    assert f"PYTHONPATH=/tmp/site:{root}:{root}/benchmarks" in res.stdout


def test_plain_library_wins_and_nothing_is_left_out(tmp_path, rng):
    root = _tree(tmp_path)
    lib = rng.bytes(4096)
    (root / ".gpu" / "libhumming_jax_cuda.so").write_bytes(lib)
    (root / ".gpu" / "libhumming_jax_cuda.so.xz").write_bytes(lzma.compress(np.zeros(8, np.uint8).tobytes()))
    assert _source(root, tmp_path / "ab").returncode == 0
    assert (root / "humming_jax" / "libhumming_jax_cuda.so").read_bytes() == lib


@pytest.mark.parametrize("missing", ["cuda", "cpu"])
def test_a_missing_library_stops_the_call(tmp_path, missing):
    root = _tree(tmp_path)
    if missing == "cpu":
        (root / ".gpu" / "_humming_jax_cpu.cpython-312-x86_64-linux-gnu.so").unlink()
        (root / ".gpu" / "libhumming_jax_cuda.so").write_bytes(b"lib")
    res = _source(root, tmp_path / "ab")
    assert res.returncode != 0
    assert ("no CUDA library" if missing == "cuda" else "no CPU module") in res.stdout
    assert not (root / "humming_jax" / "libhumming_jax_cuda.so").exists()


def _use_lib(root, ab_dir, name):
    env = dict(os.environ, HJ_AB_DIR=str(ab_dir))
    env.pop("HUMMING_JAX_CUDA_LIB", None)
    cmd = f'source scripts/device_env.sh && hj_use_lib {name} && echo "LIB=$HUMMING_JAX_CUDA_LIB"'
    return subprocess.run(["bash", "-c", cmd], cwd=root, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("case", ["stamped", "other_sources", "no_stamp", "no_library"])
def test_an_ab_library_is_used_only_with_the_trees_stamp(tmp_path, rng, case):
    """hj_use_lib NAME exports HUMMING_JAX_CUDA_LIB only where .gpu/ab/NAME.src-sha256 matches
    scripts/cuda_src_hash.sh of the carried tree; otherwise the call stops, saying why."""
    root = _tree(tmp_path)
    shutil.copy(ROOT / "scripts" / "cuda_src_hash.sh", root / "scripts")
    (root / "cuda_ffi").mkdir()
    (root / "cuda_ffi" / "k.cu").write_bytes(rng.bytes(256))
    (root / "CMakeLists.txt").write_bytes(rng.bytes(64))
    (root / ".gpu" / "libhumming_jax_cuda.so").write_bytes(b"lib")
    if case != "no_library":
        (root / ".gpu" / "ab" / "next.so.xz").write_bytes(lzma.compress(rng.bytes(1024)))
    stamp = subprocess.run(["bash", "scripts/cuda_src_hash.sh"], cwd=root, capture_output=True, text=True).stdout
    if case != "no_stamp":
        (root / ".gpu" / "ab" / "next.src-sha256").write_text(stamp)
    if case == "other_sources":
        (root / "cuda_ffi" / "k.cu").write_bytes(rng.bytes(256))
    res = _use_lib(root, tmp_path / "ab", "next")
    if case == "stamped":
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"LIB={tmp_path / 'ab' / 'next.so'}" in res.stdout
    else:
        assert res.returncode != 0
        assert "LIB=" not in res.stdout
        assert ("no " if case == "no_library" else "other sources") in res.stdout
