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

// The producers' loop over the 16-byte chunks of their rows in the order, y[0 .. total): each
// thread loads chunk idx's 8 natural columns (load(idx), a uint4) and stores its chunk of the order.
// The loop runs warp-uniformly so a tile's lanes trade together (total is a multiple of 8, so they
// are in or out together); kThreads is the block's size.
template <int kThreads, typename Load>
__device__ __forceinline__ void rs4_write_ordered(uint4* __restrict__ y, uint32_t total, Load load) {
  __shared__ uint4 trade[kThreads];
  const uint32_t warp_base = (blockIdx.x * kThreads + threadIdx.x) & ~31u;
  for (uint32_t base = warp_base; base < total; base += gridDim.x * kThreads) {
    const uint32_t idx = base + (threadIdx.x & 31u);
    const bool ok = idx < total;
    const uint4 out = rs4_trade_chunk(ok ? load(idx) : uint4{}, trade, ok);
    if (ok) y[idx] = out;
  }
}

}  // namespace hj
