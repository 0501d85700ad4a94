#!/usr/bin/env bash
# v37 call B: memcheck with the L2 prefetch and the grid cap on, the grid-cap sweep at M = 16,
# bench_quick (the gpu_check benchmark cut by call A's limit), then the int4 matrix (README).
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s); BUDGET=${BUDGET:-560}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
HUMMING_JAX_DECODE_L2_AHEAD=4 HUMMING_JAX_DECODE_GRID_ITEMS=2 XLA_FLAGS="--xla_gpu_autotune_level=0" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 \
  "$SAN" --tool memcheck --error-exitcode 17 --print-limit 30 python3 scripts/sanitize_driver.py > $OUT/memcheck-l2-grid.log 2>&1
echo "memcheck l2/grid rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/memcheck-l2-grid.log
timeout 80 python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_GRID_ITEMS --values unset,8,16,32 --shapes deepseek-v3-ep8,mixtral-8x7b --formats w4a16-int4-g128 --tokens 16 --part gemms --timer device --repeats 3 --out $OUT/sweep-grid-items.json > $OUT/sweep-grid-items.txt 2>&1
echo "grid sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/sweep-grid-items.txt | tail -3
timeout 110 python3 benchmarks/bench_quick.py --out $OUT/bench_quick.json --samples 20 > $OUT/bench_quick.txt 2>&1
echo "bench_quick rc=$? at $(( $(date +%s) - T0 )) s"; tail -14 $OUT/bench_quick.txt
B=$(( $(left) - 5 )); [ $B -gt 60 ] && timeout $B python3 benchmarks/bench_moe.py --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats w4a16-int4-g128 --tokens 1,16,128,1024,4096 --zipf-tokens 0 --timer device --time-budget-s $(( B - 25 )) --out $OUT/matrix-int4.json > $OUT/matrix-int4.txt 2>&1
echo "int4 rc=$? at $(( $(date +%s) - T0 )) s"; tail -12 $OUT/matrix-int4.txt
