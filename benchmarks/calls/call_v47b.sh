#!/usr/bin/env bash
# The checks of benchmarks/parked/fp8-ring-grouped-64-row-items.patch (the ring rule from
# 15/16 of the SMs' units; grouped fp8 x fp8 calls above 16 rows per expert on the ring in items of
# up to 64 rows) on a library built from a patch that holds it, ${LIB:-next}:
#   scripts/build_ab_library.sh --patch benchmarks/parked/decode-next.patch next
# (the union with decode-u4-fold.patch, so that call_v47a.sh runs on the same library and tree in
# the next call). Apply that patch to the working tree before the call (`git apply`; the call
# copies the uncommitted tree: the patches' tests and README), carry [".gpu", ".whl"], and
# `git checkout -- .` after. Its tests (the fp8 decode variants, the ring rule's, the wide items'
# against the CPU); gemms sweeps, device timer: HUMMING_JAX_PREFILL_MIN_ROWS
# unset / 256 at deepseek and mixtral M = 128 / 256, HUMMING_JAX_DECODE_ITEM_ROWS unset / 32 with
# the prefill kinds held off at M = 128, ncu of the ring's DRAM bytes (64- against 32-row items),
# HUMMING_JAX_DECODE_RING unset / 1 at M = 1 / 16.
# TK / TT narrow the tests (pytest -k, timeout). Eight files at most come back (scripts/pack_out.sh).
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s)
# A step's timeout: its cap, or what is left of ${BUDGET:-570} s less a margin for the packing.
cap() { local left=$(( ${BUDGET:-570} - ($(date +%s) - T0) - 10 )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo $1; }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
grep -q kRingItemRows cuda_ffi/gemm_decode_sm90.cuh || { echo "the tree lacks the 64-row patch: apply decode-next.patch before the call"; exit 1; }
hj_use_lib ${LIB:-next} || exit 1  # built from this tree's sources (the patch as applied here)
timeout $(cap ${TT:-240}) python3 -m pytest -q -p no:cacheprovider tests/test_cuda_fast_paths.py -k "${TK:-grouped_wide_items or default_takes_ring or (decode_fp8_variants and default)}" > $OUT/tests.txt 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/tests.txt; grep -m5 "^FAILED" $OUT/tests.txt
G="--formats w8a8-fp8-block128 --part gemms --timer device --repeats 3"
timeout $(cap 120) python3 benchmarks/sweep_env.py --var HUMMING_JAX_PREFILL_MIN_ROWS --values unset,256 --shapes deepseek-v3-ep8,mixtral-8x7b --tokens 128,256 $G --out $OUT/sweep-fp8-min-rows.json > $OUT/sweep-fp8-min-rows.txt 2>&1
echo "min-rows sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-fp8-min-rows.txt | tail -4
HUMMING_JAX_PREFILL_MIN_ROWS=256 timeout $(cap 60) python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_ITEM_ROWS --values unset,32 --shapes deepseek-v3-ep8,mixtral-8x7b --tokens 128 $G --out $OUT/sweep-fp8-item-rows.json > $OUT/sweep-fp8-item-rows.txt 2>&1
echo "item-rows sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-fp8-item-rows.txt | tail -2
# 3. ncu, the ring's GEMMs at deepseek M = 128 with the prefill kinds held off, 64- and 32-row items:
#    DRAM bytes read against the experts' 940 + 470 MB (v45.2's reading: 32-row items re-read them).
M="gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,launch__grid_size"
for rows in 64 32; do
  HUMMING_JAX_PREFILL_MIN_ROWS=256 HUMMING_JAX_DECODE_ITEM_ROWS=$rows timeout $(cap 90) ncu --clock-control none \
    --cache-control none -k regex:fp8_ring -c 2 --metrics $M --csv python3 benchmarks/profile_layer.py \
    --shape deepseek-v3-ep8 --format w8a8-fp8-block128 --tokens 128 > $OUT/ncu-ring-m128-rows$rows.txt 2>&1
  echo "ncu rows=$rows rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "dram__bytes_read|gpu__time" $OUT/ncu-ring-m128-rows$rows.txt | cut -c1-200 | tail -4
done
timeout $(cap 100) python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_RING --values unset,1 --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --tokens 1,16 $G --out $OUT/sweep-decode-ring-rule.json > $OUT/sweep-decode-ring-rule.txt 2>&1
echo "ring-rule sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-decode-ring-rule.txt | tail -6
bash scripts/pack_out.sh  # more than eight files: the logs into one archive
