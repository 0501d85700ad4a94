#!/usr/bin/env bash
# v44 call E: call D's ncu pass over humming-kernels' GEMMs, chosen by name: they come after its
# set-up and torch's routing kernels (call D's window of 12 launches, and a first try of 90 without
# a filter, caught only those). Carry [".gpu", ".whl"].
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s)
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
M="gpu__time_duration.sum,dram__bytes_read.sum,sm__inst_executed.sum,sm__cycles_active.avg,launch__grid_size,launch__block_size,launch__registers_per_thread"
for t in 1 16; do
  timeout 120 ncu --clock-control none --cache-control none -k regex:humming -c 6 --metrics $M --csv \
    python3 benchmarks/profile_hk.py --shape deepseek-v3-ep8 --format w8a8-fp8-block128 --tokens $t > $OUT/ncu-hk-m$t.txt 2>&1
  echo "ncu hk M=$t rc=$? at $(( $(date +%s) - T0 )) s"
done
( cd $OUT && tar czf printed.tar.gz *.txt --remove-files )
