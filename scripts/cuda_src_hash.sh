#!/usr/bin/env bash
# The SHA-256 of the CUDA library's sources: every file under cuda_ffi/ (paths and contents, in
# byte order of their paths) and CMakeLists.txt, of the tree it runs in. The build scripts
# (build_gpu_artifacts.sh, build_ab_library.sh) write it beside each library they build
# (.gpu/NAME.src-sha256), so that a device call can refuse a library built from other sources than
# the tree it carries:
#   [[ $(bash scripts/cuda_src_hash.sh) == $(cat .gpu/ab/next.src-sha256) ]] || exit 1
set -euo pipefail
cd "$(dirname "$0")/.."
{ find cuda_ffi -type f -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
  sha256sum CMakeLists.txt; } | sha256sum | cut -d' ' -f1
