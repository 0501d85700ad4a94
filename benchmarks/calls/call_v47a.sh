#!/usr/bin/env bash
# The int4 decode fold (benchmarks/parked/decode-u4-fold.patch, NOTES v46.2) on a library that
# holds it, ${LIB:-next}, built here first:
#   scripts/build_ab_library.sh --patch benchmarks/parked/decode-next.patch next   (with the 64-row
#       fp8 ring patch: call_v47b.sh checks that one on the same library and tree)
#   scripts/build_ab_library.sh --patch benchmarks/parked/decode-u4-fold.patch u4fold   (LIB=u4fold)
# then apply the same patch to the working tree here (`git apply`; the call copies the tree with
# its uncommitted changes: the patch's tests, README and Python) and carry [".gpu", ".whl"];
# `git checkout -- .` after the call. Every step runs on that library:
#   1. the int4 decode tests: the fold's own, the scale-group cases (packed int4 at 32 / 64 k
#      included), every scheme and form;
#   2. gemms sweep HUMMING_JAX_DECODE_U4_FOLD unset / 0 / exact, int4 at M = 1 / 16 on the three shapes
#      (device timer);
#   3. bench_moe, int4 at M = 1 / 16 against the peers (the humming-kernels ratio of issue 5).
# TK / TT narrow the tests (pytest -k, timeout). Eight files at most come back (scripts/pack_out.sh).
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s)
# A step's timeout: its cap, or what is left of ${BUDGET:-570} s less a margin for the packing.
cap() { local left=$(( ${BUDGET:-570} - ($(date +%s) - T0) - 10 )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo $1; }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
grep -q kPackedU4Fold cuda_ffi/gemm_decode_sm90.cuh || { echo "the tree lacks the fold: apply decode-next.patch or decode-u4-fold.patch before the call"; exit 1; }
hj_use_lib ${LIB:-next} || exit 1  # built from this tree's sources (the patch as applied here)
timeout $(cap ${TT:-220}) python3 -m pytest -q -p no:cacheprovider tests/test_cuda_fast_paths.py \
  -k "${TK:-u4_fold or scale_types_groups or (decode_every_scheme and int4)}" > $OUT/tests.txt 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/tests.txt; grep -m5 "^FAILED" $OUT/tests.txt
timeout $(cap 170) python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_U4_FOLD --values unset,0,exact \
  --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --tokens 1,16 --formats w4a16-int4-g128 --part gemms \
  --timer device --repeats 3 --out $OUT/sweep-u4-fold.json > $OUT/sweep-u4-fold.txt 2>&1
echo "fold sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-u4-fold.txt | tail -12
B=$(cap 160)
timeout $B python3 benchmarks/bench_moe.py --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats w4a16-int4-g128 \
  --tokens 1,16 --zipf-tokens 0 --timer device --time-budget-s $(( B > 40 ? B - 25 : 15 )) --no-plot \
  --out $OUT/decode-int4.json > $OUT/decode-int4.txt 2>&1
echo "bench rc=$? at $(( $(date +%s) - T0 )) s"; grep -iE "humming_kernels|ratio" $OUT/decode-int4.txt | tail -8
bash scripts/pack_out.sh  # more than eight files: the logs into one archive
