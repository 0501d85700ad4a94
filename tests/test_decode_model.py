"""cuda_ffi/gemm_decode_sm90_model.py, the host model of the decode kernel's lane mapping and code
conversions (lop3 / prmt / packed 16-bit arithmetic emulated bit by bit, m16n8k16 fragments
assembled lane by lane), run here on fresh random weights and activations: every weight type,
dequantization mode and token-tile count against the contract, and the packed conversions
exhaustively. The kernel itself needs a GPU; this keeps its bit tricks checked on every CPU run."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

MODEL = ROOT / "cuda_ffi" / "gemm_decode_sm90_model.py"


def test_decode_lane_model_matches_the_contract(rng):
    seed = int(rng.integers(2**31))  # HUMMING_JAX_TEST_SEED replays a run
    r = subprocess.run([sys.executable, str(MODEL), str(seed)], capture_output=True, text=True, timeout=600)
    out = r.stdout
    assert r.returncode == 0, f"seed {seed}: exit {r.returncode}\n{r.stderr[-2000:]}"
    cases = [line for line in out.splitlines() if line.startswith(("ok ", "FAIL"))]
    failed = [line for line in cases if line.startswith("FAIL")]
    assert len(cases) >= 20 and not failed, f"seed {seed}: {failed or 'too few cases'}\n{out[-3000:]}"
    for check in ("packed fp4 exhaustive", "code pairs exhaustive", "packed u4 exhaustive"):
        assert f"{check}: ok" in out, f"seed {seed}: {check} failed\n{out[-3000:]}"
    assert out.rstrip().endswith("ALL OK"), f"seed {seed}\n{out[-3000:]}"
