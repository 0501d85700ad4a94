#!/usr/bin/env bash
# Builds, on the development machine, what the GPU machine needs to run the package from the
# working tree: the CUDA handler library (no Python inside) and the CPU nanobind module for the
# GPU machine's Python (3.12). Outputs land in .gpu/ (ignored by git; carried to the device).
#   scripts/build_gpu_artifacts.sh [python-for-the-gpu-machine]
# The CUDA library includes the sm_90a fast paths (CUTLASS prefill grouped GEMM, decode
# weight-streaming GEMM) unless HUMMING_JAX_FAST_PATHS=0; the CUTLASS headers come from
# $HUMMING_JAX_CUTLASS_DIR, else from the nvidia-cutlass wheel (installed in python3, or fetched here
# with pip download into build-gpu/).
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_PY=${1:-${HUMMING_JAX_GPU_PYTHON:-/root/.pyenv/versions/3.12.1/bin/python3.12}}
XLA_INC=$(python3 -c "from jax import ffi; print(ffi.include_dir())")
JOBS=${JOBS:-$(nproc)}

# The cache keeps options between runs: say OFF explicitly when fast paths are not wanted.
FAST=(-DHUMMING_JAX_FAST_PATHS=OFF)
if [[ "${HUMMING_JAX_FAST_PATHS:-1}" == 1 ]]; then
  CUTLASS_DIR=${HUMMING_JAX_CUTLASS_DIR:-}
  if [[ -z "$CUTLASS_DIR" ]] && ! python3 -c "import cutlass_library" 2>/dev/null; then
    CUTLASS_VERSION=${HUMMING_JAX_CUTLASS_VERSION:-4.2.0.0}
    if [[ ! -f build-gpu/cutlass/cutlass_library/source/include/cutlass/cutlass.h ]]; then
      python3 -m pip download --no-deps "nvidia-cutlass==$CUTLASS_VERSION" -d build-gpu/cutlass-wheel -q
      python3 -m zipfile -e build-gpu/cutlass-wheel/nvidia_cutlass-"$CUTLASS_VERSION"-*.whl build-gpu/cutlass
    fi
    CUTLASS_DIR=$PWD/build-gpu/cutlass/cutlass_library/source/include
  fi
  FAST=(-DHUMMING_JAX_FAST_PATHS=ON "-DHUMMING_JAX_CUTLASS_DIR=$CUTLASS_DIR" "-DPython_EXECUTABLE=$(command -v python3)")
fi

cmake -S . -B build-gpu/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DHUMMING_JAX_CUDA=ON -DHUMMING_JAX_PYTHON_MODULE=OFF "${FAST[@]}" \
  -DHUMMING_JAX_XLA_INCLUDE_DIR="$XLA_INC" -DCMAKE_CUDA_ARCHITECTURES="90a-real" >/dev/null
cmake --build build-gpu/cuda -j "$JOBS"

cmake -S . -B build-gpu/py -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DHUMMING_JAX_CUDA=OFF -DHUMMING_JAX_PYTHON_MODULE=ON \
  -DPython_EXECUTABLE="$GPU_PY" -DHUMMING_JAX_XLA_INCLUDE_DIR="$XLA_INC" >/dev/null
cmake --build build-gpu/py -j "$JOBS"

mkdir -p .gpu
# The library (~50 MB of cubins) goes compressed (~5 MB): the tree and the carried paths must stay
# under the device call's 64 MiB; scripts/device_env.sh decompresses it there.
rm -f .gpu/libhumming_jax_cuda.so
xz -T0 -6 -c build-gpu/cuda/libhumming_jax_cuda.so > .gpu/libhumming_jax_cuda.so.xz
bash scripts/cuda_src_hash.sh > .gpu/libhumming_jax_cuda.src-sha256  # the sources it was built from
cp build-gpu/py/_humming_jax_cpu*.so .gpu/
ls -la .gpu
