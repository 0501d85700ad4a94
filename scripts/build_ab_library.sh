#!/usr/bin/env bash
# Builds the CUDA handler library of another revision's cuda_ffi/ for an A/B run against the
# working tree's, compressed into .gpu/ab/NAME.so.xz (scripts/device_env.sh decompresses it on the
# GPU machine to $HJ_AB_DIR/NAME.so; HUMMING_JAX_CUDA_LIB points a process at it). Reuses
# build-gpu/cuda (scripts/build_gpu_artifacts.sh ran first), so only the files that differ are
# recompiled, then rebuilds the working tree's library there again.
# Or of HEAD's cuda_ffi/ with a patch applied (a variant parked in benchmarks/parked/):
#   scripts/build_ab_library.sh REV NAME
#   scripts/build_ab_library.sh --patch FILE NAME
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# == 2 || ($# == 3 && $1 == --patch) ]] || { echo "usage: $0 REV NAME | $0 --patch FILE NAME"; exit 2; }
PATCH="" REV=""
if [[ $1 == --patch ]]; then PATCH=$2 NAME=$3; else REV=$1 NAME=$2; fi
[[ -f build-gpu/cuda/build.ninja ]] || { echo "build-gpu/cuda missing: run scripts/build_gpu_artifacts.sh first"; exit 2; }
[[ -z $(git status --porcelain -- cuda_ffi) ]] || { echo "cuda_ffi/ has uncommitted or untracked changes: commit or stash them first"; exit 2; }
if [[ -n $PATCH ]]; then
  git apply --check --include='cuda_ffi/*' "$PATCH" || { echo "$PATCH does not apply to HEAD's cuda_ffi/"; exit 2; }
else
  git rev-parse --verify -q "$REV^{commit}" > /dev/null || { echo "no such revision: $REV"; exit 2; }
fi
# Back to HEAD's cuda_ffi/: unstage what REV brought, restore the tracked files, drop REV-only files.
restore() { git reset -q -- cuda_ffi; git checkout -q -- cuda_ffi; git clean -q -f -- cuda_ffi; }
trap restore EXIT
if [[ -n $PATCH ]]; then
  git apply --include='cuda_ffi/*' "$PATCH"
else
  git checkout -q "$REV" -- cuda_ffi
  # Files the working tree has and REV lacks would still be compiled by the tree's CMake lists.
  git diff --quiet "$REV" HEAD -- CMakeLists.txt || echo "note: CMakeLists.txt differs at $REV; the tree's is used"
fi
cmake --build build-gpu/cuda -j "$(nproc)"
mkdir -p .gpu/ab
xz -T0 -6 -c build-gpu/cuda/libhumming_jax_cuda.so > ".gpu/ab/$NAME.so.xz"
bash scripts/cuda_src_hash.sh > ".gpu/ab/$NAME.src-sha256"  # the sources it was built from
restore
trap - EXIT
cmake --build build-gpu/cuda -j "$(nproc)" > /dev/null
ls -la ".gpu/ab/$NAME.so.xz"
