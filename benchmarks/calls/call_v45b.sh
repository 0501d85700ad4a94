#!/usr/bin/env bash
# v45 call B: the ring rule's GPU check alone, on a library built with
# benchmarks/parked/fp8-ring-from-15-16-of-sms.patch: the rule's own test and the fp8 decode
# variants (both kernels against the CPU). Carry [".gpu", ".whl"]; TK / TT narrow it.
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s)
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
timeout ${TT:-400} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_fast_paths.py -k "${TK:-default_takes_ring or decode_fp8_variants}" > $OUT/tests.txt 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/tests.txt; grep -m5 "^FAILED" $OUT/tests.txt
