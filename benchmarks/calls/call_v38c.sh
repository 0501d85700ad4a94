#!/usr/bin/env bash
# v38 call C, for a session with one call's device time left (main + the layer patch, .gpu/ab
# holding w128 and w128s4): gpu_check's test and sanitizer stages (no benchmark), then a short
# HUMMING_JAX_FUSED_LAYER sweep (layer part, M = 1 and 16), then the A/B of the 128-thread decode
# variants against the tree's kernel (gemms, M = 16 and 1) with what is left.
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s); BUDGET=${BUDGET:-585}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
HJ_PACK=1 HJ_STAGES=report,cuda_tests,fast_tests,tests,memcheck,racecheck timeout ${GC:-345} scripts/gpu_check.sh > $OUT/gpu_check.txt 2>&1
echo "gpu_check rc=$? at $(( $(date +%s) - T0 )) s"
( cd $OUT && ls *.log *.xml 2>/dev/null | grep -vx gpu_check.log | xargs -r tar czf gpu_check_files.tar.gz --remove-files )
tail -14 $OUT/gpu_check.txt
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
B=$(( $(left) / 2 )); [ $B -gt 100 ] && B=100
[ $B -gt 30 ] && timeout $B python3 benchmarks/sweep_env.py --var HUMMING_JAX_FUSED_LAYER --values 0,1 --shapes qwen3-30b-a3b,deepseek-v3-ep8 --formats w4a16-int4-g128,w8a8-fp8-block128 --tokens 1,16 --part layer --timer device --repeats 3 --out $OUT/sweep-fused-layer.json > $OUT/sweep-fused-layer.txt 2>&1
echo "layer sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/sweep-fused-layer.txt | tail -9
B=$(( $(left) - 4 ))
LIBS="--lib base=humming_jax/libhumming_jax_cuda.so --lib w128=$HJ_AB_DIR/w128.so"
[ $B -gt 150 ] && LIBS="$LIBS --lib w128s4=$HJ_AB_DIR/w128s4.so"
[ $B -gt 40 ] && timeout $B python3 benchmarks/ab_libraries.py $LIBS --rounds 1 --out $OUT/ab-w128.json -- \
  --shapes deepseek-v3-ep8,mixtral-8x7b --formats w4a16-int4-g128,w4a16-mxfp4 --tokens 16,1 --part gemms --timer device --repeats 3 > $OUT/ab-w128.txt 2>&1
echo "ab rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/ab-w128.txt | tail -12
