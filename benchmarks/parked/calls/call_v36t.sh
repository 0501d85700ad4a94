#!/usr/bin/env bash
# v36 one call (experts-pair-quant's library): the fp8 one-call sweep, the L2-prefetch sweep at the
# M = 16 gap's shapes, the new code's GPU tests, memcheck with the prefetch and the grid cap on.
#   BUDGET=<s> (default 500); L2_SHAPES / L2_FORMATS widen the L2 sweep (e.g. all three shapes and
#   w4a16-mxfp4; TESTS=0 then leaves the tests and memcheck out, for a sweeps-only call).
cd "$(dirname "$0")/.."
T0=$(date +%s); BUDGET=${BUDGET:-500}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
python3 -c 'import humming_jax, sys; print(humming_jax._ffi.backend_report()); sys.exit(0 if humming_jax.cuda_available() else 1)' || exit 2
timeout 85 python3 benchmarks/sweep_env.py --var HUMMING_JAX_FUSED_EXPERTS --values 0,1 --shapes qwen3-30b-a3b,deepseek-v3-ep8,mixtral-8x7b --formats w8a8-fp8-block128 --tokens 1,16 --part gemms --timer device --repeats 5 --out $OUT/sweep-fused-experts-fp8.json > $OUT/sweep-fused-experts-fp8.txt 2>&1
echo "fp8 pair sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/sweep-fused-experts-fp8.txt | tail -8
LT=$(( $(left) - 30 )); [ "${TESTS:-1}" = 0 ] || LT=$(( LT > 110 ? 110 : LT )); timeout $LT python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_L2_AHEAD --values 0,2,4,8 --shapes ${L2_SHAPES:-deepseek-v3-ep8,mixtral-8x7b} --formats ${L2_FORMATS:-w4a16-int4-g128} --tokens 16,1 --part gemms --timer device --repeats 3 --out $OUT/sweep-l2-ahead.json > $OUT/sweep-l2-ahead.txt 2>&1
echo "l2 sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep -v "SM clock" $OUT/sweep-l2-ahead.txt | tail -6
[ "${TESTS:-1}" = 0 ] && exit 0
TL=$(( $(left) - 8 )); TL=$(( TL > 170 ? 170 : TL )); [ $TL -lt 20 ] && exit 0
t() { local name=$1; shift; ( XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $TL python3 -m pytest -q -p no:cacheprovider -rf "$@" > $OUT/tests-$name.txt 2>&1; echo "rc=$?" >> $OUT/tests-$name.txt ) & }
t pq tests/test_cuda_fast_paths.py -k experts_indexed_quant
t l2 tests/test_cuda_fast_paths.py -k "l2_prefetch or capped_grid"
t layer tests/test_experts_indexed.py tests/test_quantization.py
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
HUMMING_JAX_DECODE_L2_AHEAD=4 HUMMING_JAX_DECODE_GRID_ITEMS=2 XLA_FLAGS="--xla_gpu_autotune_level=0" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $TL \
  "$SAN" --tool memcheck --error-exitcode 17 --print-limit 30 python3 scripts/sanitize_driver.py > $OUT/memcheck-l2-grid.log 2>&1
echo "memcheck l2/grid rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/memcheck-l2-grid.log
wait
echo "tests at $(( $(date +%s) - T0 )) s"; for n in pq l2 layer; do echo "== $n"; grep -E "^(FAILED|ERROR)|passed|failed|^rc=" $OUT/tests-$n.txt | tail -8; done
