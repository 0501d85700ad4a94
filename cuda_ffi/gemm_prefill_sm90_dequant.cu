// Dequantization of whole experts for the prefill path (gemm_prefill_sm90.h, dequantize_experts):
// quantized weights become the 16-bit w' of the contract (the activation-type rounding of the
// float32 weight_value, as gemm_weight computes it), so the 16-bit wgmma kernel then gives the
// same products as the generic kernel. A memory-bound pass, built to keep HBM busy with few
// instructions per value (benchmarks/NOTES.md, v5: one value per thread-run with per-value scale
// loads, software rounding and two divisions ran at half the copy rate; 16-byte runs per thread
// with strided 16-byte stores were slower still):
//  * one warp per weight row: its lanes take consecutive 8-value runs, so the 4- or 8-byte code
//    loads and the 16-byte stores are contiguous across the warp; kUnroll runs per lane are
//    loaded before any is converted;
//  * expert, scale row and code row once per row; the scale column by a shift;
//  * codes become floats by exact bit tricks, pairs round in one hardware cvt (round to nearest
//    even, as float_to_bf16 / float_to_f16; a NaN keeps its NaN-ness, not its payload).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "gemm_prefill_sm90.h"
#include "moe_contract.h"

namespace hj {
namespace prefill {
namespace {

constexpr int kThreads = 256;

// Value i of a 32-bit word of codes (4-bit: 8 nibbles, even k low; 8-bit: 4 bytes) as a float,
// before any scale. Every conversion is exact.
template <WeightType WT>
__device__ __forceinline__ float code_at(uint32_t word, int i, float zf) {
  if constexpr (WT == WeightType::kUInt4) {
    // 2^23 + q exactly, minus 2^23 + z.
    return __uint_as_float(0x4B000000u | ((word >> (4 * i)) & 0xfu)) - zf;
  } else if constexpr (WT == WeightType::kFp4E2M1) {
    // Magnitude bits as a float of exponent field E and mantissa m: E > 0 gives 2^(E - 127) (1 + m/2),
    // E = 0 the subnormal m 2^-127; times 2^126 both are the e2m1 value.
    const uint32_t c = (word >> (4 * i)) & 0xfu;
    const float mag = __uint_as_float((c & 7u) << 22) * 8.507059173023462e37f;  // 2^126
    return (c & 8u) ? -mag : mag;
  } else if constexpr (WT == WeightType::kInt8) {
    // 2^23 + (b ^ 0x80) exactly, minus 2^23 + 128: the signed byte.
    return __uint_as_float(0x4B000000u | (((word >> (8 * i)) & 0xffu) ^ 0x80u)) - 8388736.0f;
  } else {
    return e4m3_to_float(static_cast<uint8_t>((word >> (8 * i)) & 0xffu));
  }
}

template <bool kBf16>
__device__ __forceinline__ uint32_t round_pair(float lo, float hi) {
  if constexpr (kBf16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// Runs of 8 values each lane has loaded before converting any.
constexpr int kUnroll = 4;

template <WeightType WT, bool kBf16>
__global__ void __launch_bounds__(kThreads) dequant_rows_kernel(WeightView w, int64_t e0, uint32_t rows,
                                                                 int gk_shift, uint4* __restrict__ out) {
  constexpr bool kFour = WT == WeightType::kUInt4 || WT == WeightType::kFp4E2M1;
  constexpr int kPerWord = kFour ? 8 : 4;  // codes per 32-bit word
  constexpr int kWords = 8 / kPerWord;    // words of one 8-value run
  const uint32_t runs = static_cast<uint32_t>(w.K / 8), N = static_cast<uint32_t>(w.N);
  const uint32_t gn = static_cast<uint32_t>(w.group_n), gk = static_cast<uint32_t>(w.group_k);
  const int64_t srows = w.scale_rows(), scols = w.scale_cols();
  const int64_t row_bytes = w.row_bytes();
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warps = gridDim.x * (kThreads / 32);
  const float* scale2 = w.scale2;
  for (uint32_t rl = (blockIdx.x * kThreads + threadIdx.x) / 32; rl < rows; rl += warps) {
    const uint32_t el = rl / N;
    const uint32_t n = rl - el * N;
    const int64_t e = e0 + el;
    const uint8_t* codes = static_cast<const uint8_t*>(w.data) + (e * w.N + n) * row_bytes;
    const int64_t srow = (e * srows + n / gn) * scols;
    const float s2 = scale2 ? scale2[e] : 1.0f;
    uint4* dst = out + static_cast<size_t>(rl) * runs;
    for (uint32_t r0 = lane; r0 < runs; r0 += 32 * kUnroll) {
      uint32_t word[kUnroll][kWords];
      float scale[kUnroll], zf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {  // every load of the kUnroll runs first
        const uint32_t r = r0 + 32 * u;
        const uint32_t rc = r < runs ? r : runs - 1;  // clamped, not predicated: in bounds
        if constexpr (kFour) {
          word[u][0] = __ldg(reinterpret_cast<const uint32_t*>(codes) + rc);
        } else {
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(codes) + rc);
          word[u][0] = v.x;
          word[u][1] = v.y;
        }
        const uint32_t k0 = rc * 8;
        const int64_t sidx = srow + (gk_shift >= 0 ? (k0 >> gk_shift) : k0 / gk);
        scale[u] = load_elem(w.scale_type, w.scale, sidx);
        zf[u] = 8388608.0f + ((WT == WeightType::kUInt4 && w.zero) ? static_cast<float>(w.zero[sidx]) : 8.0f);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const uint32_t r = r0 + 32 * u;
        if (r >= runs) break;
        uint32_t packed[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int v = 2 * j;  // values v and v + 1 of the run: one word holds both
          const uint32_t wd = word[u][v / kPerWord];
          float lo = code_at<WT>(wd, v % kPerWord, zf[u]) * scale[u];
          float hi = code_at<WT>(wd, (v + 1) % kPerWord, zf[u]) * scale[u];
          if (scale2) {  // weight_value's order: code * scale, then * scale2
            lo *= s2;
            hi *= s2;
          }
          packed[j] = round_pair<kBf16>(lo, hi);
        }
        dst[r] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      }
    }
  }
}

template <WeightType WT>
void launch(const WeightView& w, bool bf16, int64_t e0, int64_t experts, void* out, int sm_count,
            cudaStream_t stream) {
  const int64_t rows = experts * w.N;
  int gk_shift = -1;  // k >> shift for a power-of-two group_k, else a division
  for (int b = 0; b < 31; ++b)
    if (w.group_k == (int64_t{1} << b)) gk_shift = b;
  const unsigned blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((rows * 32 + kThreads - 1) / kThreads, 16LL * sm_count)));
  uint4* o = static_cast<uint4*>(out);
  if (bf16)
    dequant_rows_kernel<WT, true><<<blocks, kThreads, 0, stream>>>(w, e0, static_cast<uint32_t>(rows), gk_shift, o);
  else
    dequant_rows_kernel<WT, false><<<blocks, kThreads, 0, stream>>>(w, e0, static_cast<uint32_t>(rows), gk_shift, o);
}

}  // namespace

std::string dequantize_experts(const GemmProblem& p, int64_t e0, int64_t experts, void* out, int sm_count,
                               cudaStream_t stream) {
  const WeightView& w = p.w;
  if (p.a.type != ElemType::kBF16 && p.a.type != ElemType::kF16) return "activations must be bf16 or fp16";
  if (w.K % 8 != 0 || !(w.group_k % 8 == 0 || w.group_k >= w.K)) return "K and the scale groups must be whole 8-column runs";
  if (e0 < 0 || experts < 1 || e0 + experts > w.E) return "expert range out of bounds";
  const bool bf16 = p.a.type == ElemType::kBF16;
  const int64_t work = experts * w.N * (w.K / 8);
  if (work >= (int64_t{1} << 31) || w.N >= (int64_t{1} << 31) || w.scale_cols() * w.scale_rows() >= (int64_t{1} << 31))
    return "a dequantization chunk of 2^31 or more 8-value runs";
  switch (w.type) {
    case WeightType::kUInt4: launch<WeightType::kUInt4>(w, bf16, e0, experts, out, sm_count, stream); break;
    case WeightType::kFp4E2M1: launch<WeightType::kFp4E2M1>(w, bf16, e0, experts, out, sm_count, stream); break;
    case WeightType::kInt8: launch<WeightType::kInt8>(w, bf16, e0, experts, out, sm_count, stream); break;
    case WeightType::kFp8E4M3: launch<WeightType::kFp8E4M3>(w, bf16, e0, experts, out, sm_count, stream); break;
    default: return "16-bit weights need no dequantization";
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("launching dequant_rows_kernel: ") + cudaGetErrorString(e);
  return {};
}

}  // namespace prefill
}  // namespace hj
