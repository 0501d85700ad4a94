#!/usr/bin/env bash
# The int4 decode loop with its scale after the MMAs (benchmarks/parked/decode-u4-scale-after-mma.patch,
# NOTES v45.5) against main: build its library first here,
#   scripts/build_ab_library.sh --patch benchmarks/parked/decode-u4-scale-after-mma.patch u4post
# then carry [".gpu", ".whl"]. The int4 decode tests on that library (HUMMING_JAX_CUDA_LIB), then
# an A/B of the two libraries, gemms, device timer, int4 at M = 1 / 16 / 4 on the three shapes.
# TK / TT narrow the tests (pytest -k, timeout).
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s)
cap() { local left=$(( ${BUDGET:-570} - ($(date +%s) - T0) - 10 )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo $1; }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
HUMMING_JAX_CUDA_LIB=$HJ_AB_DIR/u4post.so timeout $(cap ${TT:-240}) python3 -m pytest -q -p no:cacheprovider \
  tests/test_cuda_fast_paths.py -k "${TK:-decode and int4}" > $OUT/tests-u4post.txt 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/tests-u4post.txt; grep -m5 "^FAILED" $OUT/tests-u4post.txt
timeout $(cap 300) python3 benchmarks/ab_libraries.py --lib main=humming_jax/libhumming_jax_cuda.so \
  --lib post=$HJ_AB_DIR/u4post.so --rounds 2 --out $OUT/ab-u4post.json -- --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b \
  --formats w4a16-int4-g128 --tokens 1,4,16 --part gemms --timer device --repeats 3 > $OUT/ab-u4post.txt 2>&1
echo "A/B rc=$? at $(( $(date +%s) - T0 )) s"; grep -A12 "^shape" $OUT/ab-u4post.txt
bash scripts/pack_out.sh
