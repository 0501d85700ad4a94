// The row permutation of the grouped format on the host: permute_rows' CPU handler
// (routing_cpu.cc) and gemm_grouped_gather's (gemm_cpu.cc), which permutes into a buffer of its own.
#pragma once

#include <cstdint>
#include <cstring>

namespace hj {

// y[p] = x[perm[p] / top_k] (rows of row_bytes) for p below last_offset (clamped into [0, R]) and an
// id in [0, R); zeros elsewhere.
inline void permute_rows_cpu(const void* x, const int32_t* perm, int64_t last_offset, int64_t R, size_t row_bytes,
                             int64_t top_k, void* y) {
  const int64_t valid = last_offset < 0 ? 0 : (last_offset > R ? R : last_offset);
  const char* xs = static_cast<const char*>(x);
  char* ys = static_cast<char*>(y);
  for (int64_t p = 0; p < R; ++p) {
    const int64_t id = p < valid ? perm[p] : -1;
    if (id >= 0 && id < R)
      std::memcpy(ys + p * row_bytes, xs + (id / top_k) * row_bytes, row_bytes);
    else
      std::memset(ys + p * row_bytes, 0, row_bytes);
  }
}

}  // namespace hj
