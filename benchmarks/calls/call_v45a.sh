#!/usr/bin/env bash
# v45 call A: call_v44g.sh (the fp8 ring rule from 15/16 of the SMs' units: its tests and the
# HUMMING_JAX_DECODE_RING sweep), then the fp8 ring against the CUTLASS 64-row kind at 32-64 rows
# per expert: HUMMING_JAX_PREFILL_MIN_ROWS=96 sends deepseek / mixtral M = 128 / 256's grouped
# GEMMs to the decode launch (grouped items of 16 rows, the ring where its units fill the SMs);
# then qwen3 at M = 512 / 1024 the same way.
# Carry [".gpu", ".whl"], .gpu/ built with benchmarks/parked/fp8-ring-from-15-16-of-sms.patch.
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s)
bash benchmarks/calls/call_v44g.sh
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
P="--shapes deepseek-v3-ep8,mixtral-8x7b --formats w8a8-fp8-block128 --tokens ${TOK2:-128,256} --part gemms --timer device --repeats 3"
timeout 200 python3 benchmarks/sweep_env.py --var HUMMING_JAX_PREFILL_MIN_ROWS --values unset,96 $P --out $OUT/sweep-fp8-min-rows.json > $OUT/sweep-fp8-min-rows.txt 2>&1
echo "min-rows sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-fp8-min-rows.txt | tail -8
# qwen3 at 32 / 64 rows per expert (M = 512 / 1024), where our persistent fp8 kind starts.
P="--shapes qwen3-30b-a3b --formats w8a8-fp8-block128 --tokens ${TOK3:-512,1024} --part gemms --timer device --repeats 3"
timeout 150 python3 benchmarks/sweep_env.py --var HUMMING_JAX_PREFILL_MIN_ROWS --values unset,96 $P --out $OUT/sweep-fp8-min-rows-qwen3.json > $OUT/sweep-fp8-min-rows-qwen3.txt 2>&1
echo "qwen3 min-rows sweep rc=$? at $(( $(date +%s) - T0 )) s"; grep "M=" $OUT/sweep-fp8-min-rows-qwen3.txt | tail -4
