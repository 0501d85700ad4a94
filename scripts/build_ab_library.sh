#!/usr/bin/env bash
# Builds the CUDA handler library of another revision's cuda_ffi/ for an A/B run against the
# working tree's, compressed into .gpu/ab/NAME.so.xz (scripts/device_env.sh decompresses it on the
# GPU machine to $HJ_AB_DIR/NAME.so; HUMMING_JAX_CUDA_LIB points a process at it). Reuses
# build-gpu/cuda (scripts/build_gpu_artifacts.sh ran first), so only the files that differ are
# recompiled, then rebuilds the working tree's library there again.
#   scripts/build_ab_library.sh REV NAME
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# == 2 ]] || { echo "usage: $0 REV NAME"; exit 2; }
REV=$1 NAME=$2
[[ -f build-gpu/cuda/build.ninja ]] || { echo "build-gpu/cuda missing: run scripts/build_gpu_artifacts.sh first"; exit 2; }
[[ -z $(git status --porcelain -- cuda_ffi) ]] || { echo "cuda_ffi/ has uncommitted or untracked changes: commit or stash them first"; exit 2; }
git rev-parse --verify -q "$REV^{commit}" > /dev/null || { echo "no such revision: $REV"; exit 2; }
# Back to HEAD's cuda_ffi/: unstage what REV brought, restore the tracked files, drop REV-only files.
restore() { git reset -q -- cuda_ffi; git checkout -q -- cuda_ffi; git clean -q -f -- cuda_ffi; }
trap restore EXIT
git checkout -q "$REV" -- cuda_ffi
# Files the working tree has and REV lacks would still be compiled by the tree's CMake lists.
git diff --quiet "$REV" HEAD -- CMakeLists.txt || echo "note: CMakeLists.txt differs at $REV; the tree's is used"
cmake --build build-gpu/cuda -j "$(nproc)"
mkdir -p .gpu/ab
xz -T0 -6 -c build-gpu/cuda/libhumming_jax_cuda.so > ".gpu/ab/$NAME.so.xz"
restore
trap - EXIT
cmake --build build-gpu/cuda -j "$(nproc)" > /dev/null
ls -la ".gpu/ab/$NAME.so.xz"
