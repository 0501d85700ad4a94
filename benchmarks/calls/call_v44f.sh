#!/usr/bin/env bash
# v44 call F: fp8 M = 1 with the ring kernel for every GEMM (HUMMING_JAX_DECODE_RING unset / 1),
# then under the ring its unit height (HUMMING_JAX_RING_ROWS 128 / 256), gemms, device timer.
# Call E's ncu: humming-kernels' persistent stream-K GEMM1 at deepseek M = 1 streams 4.0-4.1 TB/s
# where our decode kernel streams 3.47. Carry [".gpu", ".whl"].
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s)
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
P="--shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats w8a8-fp8-block128 --tokens 1 --part gemms --timer device --repeats 3"
timeout 150 python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_RING --values unset,1 $P --out $OUT/sweep-decode-ring.json > $OUT/sweep-decode-ring.txt 2>&1
echo "ring rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-decode-ring.txt | tail -8
HUMMING_JAX_DECODE_RING=1 timeout 130 python3 benchmarks/sweep_env.py --var HUMMING_JAX_RING_ROWS --values 128,256 $P --out $OUT/sweep-ring-rows.json > $OUT/sweep-ring-rows.txt 2>&1
echo "rows rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-ring-rows.txt | tail -8
