#!/usr/bin/env bash
# v38 call B: the decode kernel as 128-thread CTAs, four per SM, with a ring of three 8 KB stages
# (benchmarks/parked/decode-128-threads.patch, w128) and of four (decode-128-threads-4-stages.patch,
# w128s4), against the tree's 256-thread, two-per-SM kernel, gemms at M = 1 and 16, then
# (RUN_TESTS=1) the decode tests on w128's library. Before the call, on the development machine:
#   scripts/build_gpu_artifacts.sh
#   scripts/build_ab_library.sh --patch benchmarks/parked/decode-128-threads.patch w128
#   scripts/build_ab_library.sh --patch benchmarks/parked/decode-128-threads-4-stages.patch w128s4
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s); BUDGET=${BUDGET:-585}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
B=$(left); B=$(( ${RUN_TESTS:-0} == 1 ? B / 2 : B - 5 ))
timeout $B python3 benchmarks/ab_libraries.py --lib base=humming_jax/libhumming_jax_cuda.so --lib w128=$HJ_AB_DIR/w128.so --lib w128s4=$HJ_AB_DIR/w128s4.so \
  --rounds 2 --out $OUT/ab-w128.json -- --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b \
  --formats w4a16-int4-g128,w4a16-mxfp4,bf16 --tokens 16,1 --part gemms --timer device > $OUT/ab-w128.txt 2>&1
echo "ab rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/ab-w128.txt | tail -20
[ "${RUN_TESTS:-0}" = 1 ] || exit 0
B=$(( $(left) - 5 )); HUMMING_JAX_CUDA_LIB=$HJ_AB_DIR/w128.so XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $B \
  python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda_fast_paths.py -k "not prefill" > $OUT/tests-w128.txt 2>&1
echo "w128 decode tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/tests-w128.txt
