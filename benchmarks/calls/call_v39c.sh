#!/usr/bin/env bash
# v39 call C: the decode planner's near-tie rule (the tree's plan(); HUMMING_JAX_DECODE_PLAN=bytes
# keeps the v11k rule in the same library) timed against the v11k rule in one process, gemms,
# four formats, three shapes, M = 1, 4, 16; the splits it logs; then the decode tests on the new rule in
# the time left.
# .gpu/ holds the tree's build (carry [".gpu", ".whl"]).
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s); BUDGET=${BUDGET:-260}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
timeout ${SWEEP_S:-110} python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_PLAN --values unset,bytes \
  --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats w4a16-int4-g128,w4a16-mxfp4,bf16,w8a8-fp8-block128 \
  --tokens 1,4,16 --part gemms --timer device --repeats 3 --out $OUT/sweep-plan-near.json > $OUT/sweep-plan-near.txt 2>&1
echo "plan sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/sweep-plan-near.txt | tail -36
# The splits the library took (HUMMING_JAX_DECODE_LOG), to hold against fit_decode_split.py's mirror
# of plan() (by_time_near) in the test of the fit.
HUMMING_JAX_DECODE_LOG=1 timeout 60 python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_PLAN --values unset \
  --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats w4a16-int4-g128,bf16 --tokens 1,16 --part gemms \
  --repeats 1 --out /tmp/plans.json 2>&1 | grep "decode:" | sed 's/^.*decode: //' | sort | uniq -c > $OUT/plans.txt
cat $OUT/plans.txt
B=$(( $(left) - 8 ))
if [ $B -gt 40 ]; then
  for i in 0 1; do (HUMMING_JAX_TEST_SHARD=$i/2 timeout $B python3 -m pytest -q -p no:cacheprovider -x -rf \
    tests/test_cuda_fast_paths.py -k "decode and not prefill" > $OUT/decode_tests_$i.log 2>&1; echo "shard $i rc=$?"; tail -n 3 $OUT/decode_tests_$i.log) & done
  wait
fi
