"""scripts/gpu_check.sh's test stages, run here with a stand-in python3 and compute-sanitizer (no GPU
needed): each long suite runs as HJ_TEST_SHARDS processes that together select every test once
(tests/conftest.py's $HUMMING_JAX_TEST_SHARD), the summary adds the shards' JUnit counts up, and
the sanitizer passes run while the test stages do, their exit statuses kept."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# Stands in for python3 on the PATH: records each pytest run (its shard and arguments) and writes
# a JUnit file of 3 tests, 1 skipped; runs the summary (python3 - OUT) with the real interpreter;
# answers every other `-c` (the CUDA check) with success.
STUB = """#!/usr/bin/env bash
if [[ $1 == -m && $2 == pytest ]]; then
  echo "shard=$HUMMING_JAX_TEST_SHARD args=${*:3}" >> "$STUB_LOG"
  for a in "$@"; do
    [[ $a == --junitxml=* ]] && echo '<testsuite tests="3" failures="0" errors="0" skipped="1"/>' > "${a#--junitxml=}"
  done
  sleep "${STUB_TEST_SECONDS:-0}"
  echo "ended $(date +%s%N)" >> "$STUB_LOG"
  echo "3 passed"
  exit 0
fi
[[ $1 == - ]] && exec "$REAL_PYTHON" "$@"
exit 0
"""
# Stands in for compute-sanitizer: records the pass and when it started; racecheck reports hazards
# (exit 17, as --error-exitcode asks), memcheck none.
SANITIZER = """#!/usr/bin/env bash
echo "sanitizer $2 started $(date +%s%N)" >> "$STUB_LOG"
if [[ $2 == racecheck ]]; then echo "========= RACECHECK SUMMARY: 2 hazards displayed"; exit 17; fi
echo "========= ERROR SUMMARY: 0 errors"
"""


def _run(tmp_path, shards, stages="cuda_tests,fast_tests,tests", test_seconds=0):
    root = tmp_path / "tree"
    (root / "scripts").mkdir(parents=True)
    (root / "humming_jax").mkdir()
    (root / ".gpu").mkdir()
    shutil.copy(ROOT / "scripts" / "gpu_check.sh", root / "scripts")
    shutil.copy(ROOT / "scripts" / "device_env.sh", root / "scripts")
    (root / ".gpu" / "_humming_jax_cpu.cpython-312-x86_64-linux-gnu.so").write_bytes(b"cpu module")
    (root / ".gpu" / "libhumming_jax_cuda.so").write_bytes(b"cuda library")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python3", STUB), ("compute-sanitizer", SANITIZER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "stub.log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), STUB_LOG=str(log),
               REAL_PYTHON=sys.executable, HJ_STAGES=stages, HJ_AB_DIR=str(tmp_path / "ab"),
               STUB_TEST_SECONDS=str(test_seconds))
    if shards is not None:
        env["HJ_TEST_SHARDS"] = str(shards)
    res = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)
    return res, log.read_text().splitlines(), (out / "gpu_check.log").read_text()


@pytest.mark.parametrize("shards", [None, 3])
def test_long_suites_run_as_shards_and_the_summary_adds_them(tmp_path, shards):
    res, runs, summary = _run(tmp_path, shards)
    assert res.returncode == 0, res.stdout + res.stderr
    n = shards or 2
    for suite, selects in (("fast_prefill", "-k prefill"), ("fast_decode", "-k not prefill"),
                           ("tests", "--ignore=tests/test_cuda_fast_paths.py")):
        junit = f"junit_{suite}_"
        got = sorted(r.split()[0] for r in runs if junit in r)
        assert got == [f"shard={i}/{n}" for i in range(n)], runs
        assert all(selects in r for r in runs if junit in r)
        assert f"junit_{suite}.xml".ljust(24) + f" tests={3 * n} failures=0 errors=0 skipped={n} ({n} shards)" \
            in summary, summary
    cuda = [r for r in runs if "junit_cuda.xml" in r]
    assert cuda == [f"shard= args=-q -p no:cacheprovider -rf --junitxml={tmp_path}/out/junit_cuda.xml "
                    "tests/test_cuda_backend.py"], runs
    assert "junit_cuda.xml           tests=3 failures=0 errors=0 skipped=1\n" in summary


def test_sanitizer_passes_run_beside_the_test_stages(tmp_path):
    res, runs, summary = _run(tmp_path, 2, "cuda_tests,fast_tests,tests,memcheck,racecheck", test_seconds=2)
    assert res.returncode == 0, res.stdout + res.stderr
    started = {r.split()[1]: int(r.split()[3]) for r in runs if r.startswith("sanitizer ")}
    assert sorted(started) == ["memcheck", "racecheck"], runs
    assert started["memcheck"] <= started["racecheck"], "the passes run one after the other"
    last_test = max(int(r.split()[1]) for r in runs if r.startswith("ended "))
    assert max(started.values()) < last_test, "a sanitizer pass waited for the test stages"
    assert "stage memcheck: exit 0" in summary and "stage racecheck: exit 17" in summary, summary
    assert "ERROR SUMMARY: 0 errors" in summary and "RACECHECK SUMMARY: 2 hazards" in summary, summary
    assert not list((tmp_path / "out").glob("*.rc"))
