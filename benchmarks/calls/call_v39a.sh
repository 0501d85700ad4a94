#!/usr/bin/env bash
# v39 call A (main after v38): the full gpu_check, which holds the two test mends of NOTES v38.2
# (the donation test's entry check; the fp8 two-GEMM chains against the CPU stage by stage) and
# the one-call layer as the default, with its benchmark stage. Carry [".gpu", ".whl"]; .gpu/ is
# main's build unless cuda_ffi/ changed since (then scripts/build_gpu_artifacts.sh first).
cd "$(dirname "$0")/../.."  # the repository root
T0=$(date +%s)
HJ_PACK=1 timeout ${GC:-560} scripts/gpu_check.sh > $OUT/gpu_check.txt 2>&1; echo "gpu_check rc=$? at $(( $(date +%s) - T0 )) s"
( cd $OUT && ls *.log *.xml 2>/dev/null | grep -vx gpu_check.log | xargs -r tar czf gpu_check_files.tar.gz --remove-files )
tail -30 $OUT/gpu_check.txt
