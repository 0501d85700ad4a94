#!/usr/bin/env bash
# v37 call A (main + the two v36 patches): the full gpu_check first (the new tests are in it), then
# the fp8 one-call sweep and the L2-prefetch sweep at the M = 16 gap's shapes with what is left.
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s); BUDGET=${BUDGET:-585}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
HJ_PACK=1 timeout ${GC:-340} scripts/gpu_check.sh > $OUT/gpu_check.txt 2>&1; echo "gpu_check rc=$? at $(( $(date +%s) - T0 )) s"
tail -22 $OUT/gpu_check.txt
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
B=$(left); B=$(( B > 80 ? 80 : B )); [ $B -gt 30 ] && timeout $B python3 benchmarks/sweep_env.py --var HUMMING_JAX_FUSED_EXPERTS --values 0,1 --shapes qwen3-30b-a3b,deepseek-v3-ep8,mixtral-8x7b --formats w8a8-fp8-block128 --tokens 1,16 --part gemms --timer device --repeats 5 --out $OUT/sweep-fused-experts-fp8.json > $OUT/sweep-fused-experts-fp8.txt 2>&1
echo "fp8 pair sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/sweep-fused-experts-fp8.txt | tail -8
B=$(( $(left) - 4 )); [ $B -gt 30 ] && timeout $B python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_L2_AHEAD --values 0,2,4,8 --shapes deepseek-v3-ep8,mixtral-8x7b --formats w4a16-int4-g128 --tokens 16,1 --part gemms --timer device --repeats 3 --out $OUT/sweep-l2-ahead.json > $OUT/sweep-l2-ahead.txt 2>&1
echo "l2 sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/sweep-l2-ahead.txt | tail -6
