#!/usr/bin/env bash
# v38 call A (main + benchmarks/parked/layer-indexed.patch): the full gpu_check (its decode shards
# hold test_decode_layer_indexed_matches_three_calls_and_cpu; the sanitizer's whole indexed layers
# now run layer_indexed), then the one-call layer's sweep (HUMMING_JAX_FUSED_LAYER 0 / 1, layer
# part) at M = 1 and 16 with what is left. $OUT keeps few files so that all come back.
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s); BUDGET=${BUDGET:-585}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
HJ_PACK=1 timeout ${GC:-420} scripts/gpu_check.sh > $OUT/gpu_check.txt 2>&1; echo "gpu_check rc=$? at $(( $(date +%s) - T0 )) s"
( cd $OUT && ls *.log *.xml 2>/dev/null | grep -vx gpu_check.log | xargs -r tar czf gpu_check_files.tar.gz --remove-files )
tail -22 $OUT/gpu_check.txt
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
B=$(( $(left) - 4 )); [ $B -gt 30 ] && timeout $B python3 benchmarks/sweep_env.py --var HUMMING_JAX_FUSED_LAYER --values 0,1 --shapes qwen3-30b-a3b,deepseek-v3-ep8,mixtral-8x7b --formats w4a16-int4-g128,bf16,w8a8-fp8-block128 --tokens 1,16 --part layer --timer device --repeats 3 --out $OUT/sweep-fused-layer.json > $OUT/sweep-fused-layer.txt 2>&1
echo "layer sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/sweep-fused-layer.txt | tail -7
