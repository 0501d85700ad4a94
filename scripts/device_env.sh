# Sourced at the start of a GPU-machine call (`source scripts/device_env.sh`): makes the working
# tree runnable there from what the call carried.
#  - .whl/*.whl (packages the machine lacks, e.g. humming-kernels) installed into /tmp/site;
#  - .gpu/ (scripts/build_gpu_artifacts.sh): the CPU module and the CUDA library copied into
#    humming_jax/, the library from libhumming_jax_cuda.so or, compressed to fit the carry limit,
#    libhumming_jax_cuda.so.xz;
#  - .gpu/ab/NAME.so.xz (scripts/build_ab_library.sh): other builds of the library, decompressed to
#    $HJ_AB_DIR/NAME.so (default /tmp/hj_ab) for A/B runs (HUMMING_JAX_CUDA_LIB=$HJ_AB_DIR/NAME.so
#    selects one).
# Exports PYTHONPATH (the tree, benchmarks/, /tmp/site), PYTHONUNBUFFERED and
# XLA_PYTHON_CLIENT_PREALLOCATE=false. Returns non-zero, saying why, when something is missing.
# Then `hj_use_lib NAME` points the call at the A/B build NAME (HUMMING_JAX_CUDA_LIB), only where
# its stamp (.gpu/ab/NAME.src-sha256, scripts/cuda_src_hash.sh at its build) matches the carried
# tree's cuda_ffi/: a library built from other sources would be measured as this tree's.
hj_unxz() {  # SRC.xz DST (python3's lzma: no xz binary needed on the GPU machine)
  python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as f, open(sys.argv[2], "wb") as g: shutil.copyfileobj(f, g)' "$1" "$2"
}
hj_device_env() {
  local root f
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  if compgen -G "$root/.whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$root"/.whl/*.whl || { echo "device_env: installing .whl/ failed"; return 1; }
  fi
  export PYTHONPATH=/tmp/site:$root:$root/benchmarks PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
  compgen -G "$root/.gpu/_humming_jax_cpu*.so" > /dev/null || { echo "device_env: no CPU module in .gpu/"; return 1; }
  cp "$root"/.gpu/_humming_jax_cpu*.so "$root/humming_jax/"
  if [[ -f $root/.gpu/libhumming_jax_cuda.so ]]; then
    cp "$root/.gpu/libhumming_jax_cuda.so" "$root/humming_jax/"
  elif [[ -f $root/.gpu/libhumming_jax_cuda.so.xz ]]; then
    hj_unxz "$root/.gpu/libhumming_jax_cuda.so.xz" "$root/humming_jax/libhumming_jax_cuda.so" || return 1
  else
    echo "device_env: no CUDA library in .gpu/ (run scripts/build_gpu_artifacts.sh)"; return 1
  fi
  export HJ_AB_DIR=${HJ_AB_DIR:-/tmp/hj_ab}
  if compgen -G "$root/.gpu/ab/*.so.xz" > /dev/null; then
    mkdir -p "$HJ_AB_DIR"
    for f in "$root"/.gpu/ab/*.so.xz; do
      hj_unxz "$f" "$HJ_AB_DIR/$(basename "${f%.xz}")" || return 1
    done
  fi
}
hj_use_lib() {  # NAME
  local root lib
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  lib=$HJ_AB_DIR/$1.so
  [[ -f $lib ]] || { echo "device_env: no $lib (scripts/build_ab_library.sh builds .gpu/ab/$1.so.xz)"; return 1; }
  [[ "$(bash "$root/scripts/cuda_src_hash.sh")" == "$(cat "$root/.gpu/ab/$1.src-sha256" 2>/dev/null)" ]] ||
    { echo "device_env: $1.so was built from other sources than this tree's cuda_ffi/ (or has no stamp): rebuild it"; return 1; }
  export HUMMING_JAX_CUDA_LIB=$lib
}
hj_device_env
