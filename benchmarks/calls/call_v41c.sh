#!/usr/bin/env bash
# v41 call C: the bf16 matrix at the three shapes and gpt-oss-120b's mxfp4 and bf16 matrices on
# main's library, M = 1 to 4096, device timer, the peers in the same process. Carry
# [".gpu", ".whl"]. RUNS picks among bf16, gpt-oss-mxfp4 and gpt-oss-bf16 (default: all three).
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s); BUDGET=${BUDGET:-420}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
run() {  # name shapes format budget-cap
  local B=$(( $(left) - 5 )); [ $B -gt 40 ] || return 0
  B=$(( B > $4 ? $4 : B ))
  timeout $B python3 benchmarks/bench_moe.py --shapes $2 --formats $3 --tokens 1,16,128,1024,4096 --zipf-tokens 0 --timer device --time-budget-s $(( B - 25 )) --out $OUT/matrix-$1.json > $OUT/matrix-$1.txt 2>&1
  echo "$1 rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "MISSED|MET|wrote" $OUT/matrix-$1.txt | cut -c1-200
}
RUNS=" ${RUNS:-bf16 gpt-oss-mxfp4 gpt-oss-bf16} "
[[ $RUNS == *" bf16 "* ]] && run bf16 deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b bf16 200
[[ $RUNS == *" gpt-oss-mxfp4 "* ]] && run gpt-oss-mxfp4 gpt-oss-120b w4a16-mxfp4 110
[[ $RUNS == *" gpt-oss-bf16 "* ]] && run gpt-oss-bf16 gpt-oss-120b bf16 110
( cd $OUT && tar czf printed.tar.gz *.txt --remove-files )
