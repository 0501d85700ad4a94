// The k order of the 4-bit prefill mainloop (gemm_prefill_sm90_4bit.cu) within each 64-column
// tile: logical column L = 16 j + 8 s + 2 t + h of a tile holds physical column
// 16 t + 8 (j >> 1) + 2 (j & 1) + s + 4 h. permute_rows and activation write their 16-bit rows in
// this order when asked (k_order = 1), so that a gemm_grouped call told so (a_k_order = 1) reads its
// activations as they are instead of copying them into it first.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "moe_contract.h"

namespace hj {

constexpr int64_t kRs4OrderTile = 64;  // columns per tile; rows in this order have a multiple of it

// Physical column (within a tile) of the value logical column L holds.
HJ_HD constexpr int rs4_k_of(int L) {
  return 16 * ((L >> 1) & 3) + 8 * (L >> 5) + 2 * ((L >> 4) & 1) + ((L >> 3) & 1) + 4 * (L & 1);
}

// A row of `cols` 16-bit values (cols % kRs4OrderTile == 0) into the order (dst[L] = src[k(L)]) or
// back from it (dst[k(L)] = src[L]); src and dst apart.
inline void rs4_order_row(const uint16_t* src, uint16_t* dst, int64_t cols, bool to_order) {
  for (int64_t t = 0; t < cols; t += kRs4OrderTile)
    for (int L = 0; L < kRs4OrderTile; ++L) {
      if (to_order)
        dst[t + L] = src[t + rs4_k_of(L)];
      else
        dst[t + rs4_k_of(L)] = src[t + L];
    }
}

// R rows of `cols` 16-bit values into the order in place (the CPU handlers' k_order = 1).
inline void rs4_order_rows_in_place(uint16_t* rows, int64_t R, int64_t cols) {
  std::vector<uint16_t> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < R; ++r) {
    std::copy(rows + r * cols, rows + (r + 1) * cols, row.begin());
    rs4_order_row(row.data(), rows + r * cols, cols, /*to_order=*/true);
  }
}

}  // namespace hj
