// The device side of the 4-bit prefill mainloop's k order (rs4_k_order.h): the exchange by which
// permute_rows and the activation write their rows in it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "rs4_k_order.h"

namespace hj {

// The exchange behind the vectorized producers: the 8 neighbouring lanes of a 64-column tile each
// hold 8 consecutive columns (`mine`, lane c = threadIdx.x & 7 holding columns 8 c .. 8 c + 7) and
// each gets back its 16-byte chunk of the order. Chunk c holds the tile's columns
// (c & 3) + 4 (j & 1) + 8 ((c >> 2) + 2 (j >> 1)), j = 0..7 (rs4_k_of(8 c + j)): element
// (c & 3) + 4 (j & 1) of lane (c >> 2) + 2 (j >> 1). `trade` is the block's shared array, a slot a
// thread; every lane of the warp that holds a tile calls it (two __syncwarp).
__device__ __forceinline__ uint4 rs4_trade_chunk(uint4 mine, uint4* trade, bool ok) {
  if (ok) trade[threadIdx.x] = mine;
  __syncwarp();
  uint4 out{};
  if (ok) {
    const auto* t = reinterpret_cast<const uint16_t*>(trade + (threadIdx.x & ~7u));
    const unsigned c = threadIdx.x & 7u;
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)  // j = 2 i and 2 i + 1: the same lane, elements 4 apart
      w[i] = uint32_t{t[8 * ((c >> 2) + 2 * i) + (c & 3)]} | (uint32_t{t[8 * ((c >> 2) + 2 * i) + (c & 3) + 4]} << 16);
    out = make_uint4(w[0], w[1], w[2], w[3]);
  }
  __syncwarp();
  return out;
}

}  // namespace hj
