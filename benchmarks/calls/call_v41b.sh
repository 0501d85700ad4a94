#!/usr/bin/env bash
# v41 call B: the full matrices of the three quantized formats on main's library (the decode
# planner's near-tie rule of v40 included), three shapes, M = 1 to 4096, device timer, the peers in
# the same process. Carry [".gpu", ".whl"]. FORMATS picks the formats; PER_FORMAT_S (default 180)
# is each format's bench budget: humming-kernels' build and NVRTC pass reach every shape from ~300.
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s); BUDGET=${BUDGET:-575}; PER_FORMAT_S=${PER_FORMAT_S:-180}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
for f in ${FORMATS:-w4a16-int4-g128 w4a16-mxfp4 w8a8-fp8-block128}; do
  B=$(( $(left) - 5 )); [ $B -gt 60 ] || break
  timeout $B python3 benchmarks/bench_moe.py --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats $f --tokens 1,16,128,1024,4096 --zipf-tokens 0 --timer device --time-budget-s $(( B > PER_FORMAT_S + 30 ? PER_FORMAT_S : B - 25 )) --out $OUT/matrix-$f.json > $OUT/matrix-$f.txt 2>&1
  echo "$f rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "MISSED|MET|wrote" $OUT/matrix-$f.txt | cut -c1-220
done
( cd $OUT && tar czf printed.tar.gz *.txt --remove-files )
