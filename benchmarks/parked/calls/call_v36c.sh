#!/usr/bin/env bash
# v36 call 3: the int4 and mxfp4 matrices of the three shapes (README), same library as call 2.
cd "$(dirname "$0")/.."
T0=$(date +%s); BUDGET=${BUDGET:-585}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
[ -n "${L2:-}" ] && export HUMMING_JAX_DECODE_L2_AHEAD=$L2  # the prefetch distance, once measured
B=$(( $(left) / 2 )); timeout $B python3 benchmarks/bench_moe.py --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats w4a16-int4-g128 --tokens 1,16,128,1024,4096 --zipf-tokens 0 --timer device --time-budget-s $(( B - 25 )) --out $OUT/matrix-int4.json > $OUT/matrix-int4.txt 2>&1
echo "int4 rc=$? at $(( $(date +%s) - T0 )) s"; tail -12 $OUT/matrix-int4.txt
B=$(( $(left) - 5 )); timeout $B python3 benchmarks/bench_moe.py --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats w4a16-mxfp4 --tokens 1,16,128,1024,4096 --zipf-tokens 0 --timer device --time-budget-s $(( B - 25 )) --out $OUT/matrix-mxfp4.json > $OUT/matrix-mxfp4.txt 2>&1
echo "mxfp4 rc=$? at $(( $(date +%s) - T0 )) s"; tail -12 $OUT/matrix-mxfp4.txt
