#!/usr/bin/env bash
# v44 call G: the fp8 ring rule from 15/16 of the SMs' units (cuda_ffi/gemm_decode_sm90.cu): the
# fp8 decode tests, then HUMMING_JAX_DECODE_RING unset / 1 at M = 1 and 16 (the default should now
# equal the ring at deepseek M = 1 and stay as it was elsewhere). Carry [".gpu", ".whl"], .gpu/
# built with benchmarks/parked/fp8-ring-from-15-16-of-sms.patch applied. TK / TT / TOK narrow the
# call (pytest -k, its timeout, the sweep's tokens).
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s)
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
timeout ${TT:-120} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_fast_paths.py -k "${TK:-decode_fp8_variants or experts_indexed_quant or default_takes_ring}" > $OUT/tests.txt 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/tests.txt
P="--shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats w8a8-fp8-block128 --tokens ${TOK:-1,16} --part gemms --timer device --repeats 3"
timeout 100 python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_RING --values unset,1 $P --out $OUT/sweep-decode-ring-rule.json > $OUT/sweep-decode-ring-rule.txt 2>&1
echo "sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-decode-ring-rule.txt | tail -8
