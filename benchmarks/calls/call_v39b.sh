#!/usr/bin/env bash
# v39 call B: first what the staged activations cost (the lever "more whole-mode rows at K = 7168"):
# every item staged (HUMMING_JAX_DECODE_WHOLE_ACT=0) against the default, where M = 4's items are all
# whole and M = 16 stages deepseek GEMM1's items above 4 rows and mixtral GEMM2's above 2. Then the
# decode points of the four formats' matrices on main's library (the v37 matrices ran with the
# L2-prefetch code compiled in and off; it is gone since), three shapes, M = 1 and 16.
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s); BUDGET=${BUDGET:-560}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
timeout ${SWEEP_S:-100} python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_WHOLE_ACT --values unset,0 --shapes deepseek-v3-ep8,mixtral-8x7b --formats w4a16-int4-g128 --tokens 4,16 --part gemms --timer device --repeats 3 --out $OUT/sweep-whole-act.json > $OUT/sweep-whole-act.txt 2>&1
echo "whole-act sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/sweep-whole-act.txt | tail -8
for f in w4a16-int4-g128 w4a16-mxfp4 w8a8-fp8-block128 bf16; do
  B=$(( $(left) - 5 )); [ $B -gt 60 ] || break
  timeout $B python3 benchmarks/bench_moe.py --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats $f --tokens 1,16 --zipf-tokens 0 --timer device --time-budget-s $(( B > 150 ? 120 : B - 25 )) --out $OUT/decode-$f.json > $OUT/decode-$f.txt 2>&1
  echo "$f rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "MISSED|MET|wrote" $OUT/decode-$f.txt | cut -c1-220
done
# At most eight files come back from $OUT: the printed tables go as one archive beside the JSONs.
( cd $OUT && tar czf printed.tar.gz *.txt --remove-files )
