#!/usr/bin/env bash
# v36 sweeps (experts-pair-quant's library): one-call fp8 GEMMs against two, the L2 prefetch distance.
cd "$(dirname "$0")/.."
T0=$(date +%s); BUDGET=${BUDGET:-280}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
python3 -c 'import humming_jax, sys; print(humming_jax._ffi.backend_report()); sys.exit(0 if humming_jax.cuda_available() else 1)' || exit 2
timeout 90 python3 benchmarks/sweep_env.py --var HUMMING_JAX_FUSED_EXPERTS --values 0,1 --shapes qwen3-30b-a3b,deepseek-v3-ep8,mixtral-8x7b --formats w8a8-fp8-block128 --tokens 1,16 --part gemms --timer device --repeats 5 --out $OUT/sweep-fused-experts-fp8.json > $OUT/sweep-fused-experts-fp8.txt 2>&1
echo "fp8 pair sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/sweep-fused-experts-fp8.txt | tail -8
B=$(left); [ $B -gt 30 ] && timeout $(( B - 3 )) python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_L2_AHEAD --values 0,2,4,8 --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats w4a16-int4-g128,w4a16-mxfp4 --tokens 16,1 --part gemms --timer device --repeats 3 --out $OUT/sweep-l2-ahead.json > $OUT/sweep-l2-ahead.txt 2>&1
echo "l2 sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/sweep-l2-ahead.txt | tail -14
