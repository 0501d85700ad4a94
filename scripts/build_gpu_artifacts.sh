#!/usr/bin/env bash
# Builds, on the development machine, what the GPU machine needs to run the package from the
# working tree: the CUDA handler library (no Python inside) and the CPU nanobind module for the
# GPU machine's Python (3.12). Outputs land in .gpu/ (ignored by git; carried to the device).
#   scripts/build_gpu_artifacts.sh [python-for-the-gpu-machine]
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_PY=${1:-${HUMMING_JAX_GPU_PYTHON:-/root/.pyenv/versions/3.12.1/bin/python3.12}}
XLA_INC=$(python3 -c "from jax import ffi; print(ffi.include_dir())")
JOBS=$(nproc)

cmake -S . -B build-gpu/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DHUMMING_JAX_CUDA=ON -DHUMMING_JAX_PYTHON_MODULE=OFF \
  -DHUMMING_JAX_XLA_INCLUDE_DIR="$XLA_INC" -DCMAKE_CUDA_ARCHITECTURES="90a-real" >/dev/null
cmake --build build-gpu/cuda -j "$JOBS"

cmake -S . -B build-gpu/py -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DHUMMING_JAX_CUDA=OFF -DHUMMING_JAX_PYTHON_MODULE=ON \
  -DPython_EXECUTABLE="$GPU_PY" -DHUMMING_JAX_XLA_INCLUDE_DIR="$XLA_INC" >/dev/null
cmake --build build-gpu/py -j "$JOBS"

mkdir -p .gpu
cp build-gpu/cuda/libhumming_jax_cuda.so .gpu/
cp build-gpu/py/_humming_jax_cpu*.so .gpu/
ls -la .gpu
