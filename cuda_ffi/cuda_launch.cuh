// Host-side helpers of the CUDA handlers: the stream context, launch checks and grid sizing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "ffi_common.h"

namespace hj {

using CudaStream = ffi::PlatformStream<cudaStream_t>;

// The error of the launch just made (cudaGetLastError), as an ffi::Error naming call and kernel.
inline Error launch_status(const std::string& call, const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return Error::Internal("humming_jax." + call + ": launching " + kernel + " failed: " + cudaGetErrorName(e) +
                           " (" + cudaGetErrorString(e) + ")");
  return Error::Success();
}

// A run-time switch read from the environment at each call (so tests and A/B timings can flip it
// in one process): `unset` when absent or empty, off for exactly "0", on for anything else.
inline bool env_flag(const char* name, bool unset) {
  const char* v = std::getenv(name);
  if (!v || !*v) return unset;
  return !(v[0] == '0' && v[1] == '\0');
}

// A run-time count read from the environment at each call: `unset` when absent or empty, the number
// when the whole value is one (optional leading blanks and sign, then digits: the spellings
// humming_jax/ops/gemm.py's _env_int accepts), else `malformed`.
inline int64_t env_count(const char* name, int64_t unset, int64_t malformed) {
  const char* v = std::getenv(name);
  if (!v || !*v) return unset;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return end != v && *end == '\0' ? n : malformed;
}

// Blocks for a grid-stride loop over `work` items: enough to fill the device, never zero work.
inline unsigned grid_for(int64_t work, int threads, int64_t max_blocks = 4096) {
  int64_t b = (work + threads - 1) / threads;
  if (b > max_blocks) b = max_blocks;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

inline bool aligned_to(const void* p, size_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// permute_rows' kernel (routing_cuda.cu) into y [R, row_bytes]: y[p] = x[perm[p] / top_k] for p
// below offsets[num_offsets - 1] and an id in [0, R), zeros elsewhere.
Error permute_rows_into(const std::string& call, cudaStream_t stream, const void* x, const int32_t* perm,
                        const int32_t* offsets, int64_t num_offsets, int64_t R, int64_t row_bytes, int64_t top_k,
                        void* y);

}  // namespace hj
