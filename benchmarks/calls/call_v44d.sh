#!/usr/bin/env bash
# v44 call D: fp8 decode beside humming-kernels, kernel by kernel (deepseek M = 1 and 16, the
# H200's worst fp8 points): our gemms' kernels from a trace (kernel_breakdown.py), then one ncu
# pass of duration and DRAM bytes over ours and humming-kernels' launches (no cache flush, clocks
# as they run). Carry [".gpu", ".whl"]. Its humming-kernels window (-s 20 -c 12) caught that
# library's set-up, not its GEMMs: call_v44e.sh is the form that selects them by name.
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s)
source scripts/device_env.sh > /dev/null 2>&1 || { echo device_env failed; exit 1; }
M="gpu__time_duration.sum,dram__bytes_read.sum,sm__inst_executed.sum,sm__cycles_active.avg,launch__grid_size,launch__block_size,launch__registers_per_thread"
for t in 1 16; do
  timeout 60 python3 benchmarks/kernel_breakdown.py --shape deepseek-v3-ep8 --format w8a8-fp8-block128 --tokens $t --part gemms --out $OUT/breakdown-m$t.json > $OUT/breakdown-m$t.txt 2>&1
  echo "breakdown M=$t rc=$? at $(( $(date +%s) - T0 )) s"; tail -12 $OUT/breakdown-m$t.txt
  timeout 70 ncu --clock-control none --cache-control none -s 20 -c 12 --metrics $M --csv \
    python3 benchmarks/profile_layer.py --shape deepseek-v3-ep8 --format w8a8-fp8-block128 --tokens $t > $OUT/ncu-ours-m$t.txt 2>&1
  echo "ncu ours M=$t rc=$? at $(( $(date +%s) - T0 )) s"
  timeout 110 ncu --clock-control none --cache-control none -s 20 -c 12 --metrics $M --csv \
    python3 benchmarks/profile_hk.py --shape deepseek-v3-ep8 --format w8a8-fp8-block128 --tokens $t > $OUT/ncu-hk-m$t.txt 2>&1
  echo "ncu hk M=$t rc=$? at $(( $(date +%s) - T0 )) s"
done
( cd $OUT && tar czf printed.tar.gz *.txt --remove-files )
