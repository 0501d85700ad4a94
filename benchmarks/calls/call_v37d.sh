#!/usr/bin/env bash
# v37 call D: qwen3's bf16 matrix (call C ran out of time before it), then gpt-oss-120b's mxfp4 and
# bf16 matrices, as far as the budget reaches (README).
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s); BUDGET=${BUDGET:-240}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
run() {  # name shape format tokens budget-cap
  local B=$(( $(left) - 5 )); [ $B -gt 40 ] || return 0
  B=$(( B > $5 ? $5 : B ))
  timeout $B python3 benchmarks/bench_moe.py --shapes $2 --formats $3 --tokens $4 --zipf-tokens 0 --timer device --time-budget-s $(( B - 25 )) --out $OUT/matrix-$1.json > $OUT/matrix-$1.txt 2>&1
  echo "$1 rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "MISSED|MET|wrote" $OUT/matrix-$1.txt | cut -c1-200
}
run qwen3-bf16 qwen3-30b-a3b bf16 1,16,128,1024,4096 90
run gpt-oss-mxfp4 gpt-oss-120b w4a16-mxfp4 1,16,128,1024,4096 100
run gpt-oss-bf16 gpt-oss-120b bf16 1,16,128,1024,4096 100
