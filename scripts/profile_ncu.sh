#!/usr/bin/env bash
# Nsight Compute profiles of one kernel per point, ours and humming-kernels', printed as text under
# $OUT (details page, per-SASS-instruction source counters and their summary by
# scripts/sass_stalls.py, NAME.stalls.txt; the binary reports are dropped).
#   scripts/profile_ncu.sh NAME KERNEL_REGEX SCRIPT ARGS...      (SCRIPT: profile_layer.py | profile_hk.py)
# NCU_SKIP=N skips the first N matching launches, NCU_COUNT=N profiles N (default 1).
# e.g. scripts/profile_ncu.sh dec_int4 decode_kernel profile_layer.py --shape mixtral-8x7b --tokens 1
set -uo pipefail
cd "$(dirname "$0")/.."
name=$1 regex=$2 script=$3
shift 3
out=${OUT:-/tmp}
ncu --clock-control none -k "regex:$regex" -s "${NCU_SKIP:-0}" -c "${NCU_COUNT:-1}" --set full --import-source yes \
  -o "$out/$name" python3 "benchmarks/$script" "$@" > "$out/$name.log" 2>&1
ncu -i "$out/$name.ncu-rep" --page details --print-details all > "$out/$name.details.txt" 2>&1
ncu -i "$out/$name.ncu-rep" --page source --print-source sass --csv > "$out/$name.sass.csv" 2> "$out/$name.sass.err"
# The instructions the warps wait at most, a few KB (a call that returns few files can drop the CSV).
python3 scripts/sass_stalls.py "$out/$name.sass.csv" > "$out/$name.stalls.txt" 2>> "$out/$name.sass.err"
rm -f "$out/$name.ncu-rep"
tail -n 2 "$out/$name.log"
