#!/usr/bin/env bash
# v45 call A, on a library built with benchmarks/parked/fp8-ring-grouped-32-row-items.patch (the ring
# rule from 15/16 of the SMs' units, and grouped fp8 x fp8 calls above 16 rows per expert on the ring
# in 32-row items where the prefill kinds decline): the fp8 decode tests with the new ones, then
# sweeps, gemms part, device timer:
#   1. HUMMING_JAX_DECODE_RING unset / 1 at M = 1 and 16 (the rule: unset should read the ring's
#      time at deepseek M = 1 and stay put elsewhere);
#   2. HUMMING_JAX_PREFILL_MIN_ROWS unset / 256 at deepseek and mixtral M = 128 / 256 (32 / 64 rows
#      per expert) and qwen3 M = 512 / 1024: the prefill kinds against the ring's 32-row items;
#   3. HUMMING_JAX_DECODE_ITEM_ROWS unset / 16 with the prefill kinds held off: 32- against 16-row
#      items at deepseek and mixtral M = 128.
# Carry [".gpu", ".whl"]. TK / TT narrow the tests (pytest -k, timeout).
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s)
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
timeout ${TT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_fast_paths.py -k "${TK:-decode_fp8_variants or experts_indexed_quant or default_takes_ring or grouped_wide_items}" > $OUT/tests.txt 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/tests.txt; grep -m5 "^FAILED" $OUT/tests.txt
G="--formats w8a8-fp8-block128 --part gemms --timer device --repeats 3"
timeout 100 python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_RING --values unset,1 --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --tokens 1,16 $G --out $OUT/sweep-decode-ring-rule.json > $OUT/sweep-decode-ring-rule.txt 2>&1
echo "ring-rule sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-decode-ring-rule.txt | tail -6
timeout 150 python3 benchmarks/sweep_env.py --var HUMMING_JAX_PREFILL_MIN_ROWS --values unset,256 --shapes deepseek-v3-ep8,mixtral-8x7b --tokens 128,256 $G --out $OUT/sweep-fp8-min-rows.json > $OUT/sweep-fp8-min-rows.txt 2>&1
echo "min-rows sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-fp8-min-rows.txt | tail -4
timeout 100 python3 benchmarks/sweep_env.py --var HUMMING_JAX_PREFILL_MIN_ROWS --values unset,256 --shapes qwen3-30b-a3b --tokens 512,1024 $G --out $OUT/sweep-fp8-min-rows-qwen3.json > $OUT/sweep-fp8-min-rows-qwen3.txt 2>&1
echo "qwen3 min-rows sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-fp8-min-rows-qwen3.txt | tail -2
HUMMING_JAX_PREFILL_MIN_ROWS=256 timeout 80 python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_ITEM_ROWS --values unset,16 --shapes deepseek-v3-ep8,mixtral-8x7b --tokens 128 $G --out $OUT/sweep-fp8-item-rows.json > $OUT/sweep-fp8-item-rows.txt 2>&1
echo "item-rows sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-fp8-item-rows.txt | tail -2
