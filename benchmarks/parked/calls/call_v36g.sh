#!/usr/bin/env bash
# v36 full check (experts-pair-quant's library): gpu_check, then memcheck with the L2 prefetch and the grid cap on.
cd "$(dirname "$0")/.."
T0=$(date +%s); BUDGET=${BUDGET:-420}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
HJ_PACK=1 timeout 345 scripts/gpu_check.sh > $OUT/gpu_check.txt 2>&1; echo "gpu_check rc=$? at $(( $(date +%s) - T0 )) s"
tail -24 $OUT/gpu_check.txt
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
B=$(left); [ $B -gt 40 ] && HUMMING_JAX_DECODE_L2_AHEAD=4 HUMMING_JAX_DECODE_GRID_ITEMS=2 XLA_FLAGS="--xla_gpu_autotune_level=0" timeout $(( B - 3 )) \
  "$SAN" --tool memcheck --error-exitcode 17 --print-limit 30 python3 scripts/sanitize_driver.py > $OUT/memcheck-l2-grid.log 2>&1
echo "memcheck l2/grid rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/memcheck-l2-grid.log
