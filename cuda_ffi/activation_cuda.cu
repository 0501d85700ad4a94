// CUDA handlers of the activation, the fused activation + dynamic quantization, and the dynamic
// quantization of 16-bit activations. Element values come from moe_contract.h, as on the CPU
// (activation_cpu.cc): the activation in float32, then rounded (activation) or quantized from the
// float32 value (activation_quant) with scale = absmax / qmax per row or per group of columns.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "cuda_launch.cuh"
#include "ffi_common.h"
#include "grouped_rows.cuh"
#include "quantize_cuda.h"
#include "rs4_k_order.cuh"

namespace hj {
namespace {

// The activation of column i of row r (float32), or the plain value for the identity (quantize).
template <ElemType XT>
__device__ __forceinline__ float act_at(int act, float limit, const void* x, int64_t r, int64_t N1, int64_t I,
                                        int64_t i) {
  if (act < 0) return load_elem(XT, x, r * N1 + i);
  const Activation a = static_cast<Activation>(act);
  if (activation_is_gated(a)) {
    int64_t g, u;
    gated_columns(a, i, I, &g, &u);
    return activation_gated(a, load_elem(XT, x, r * N1 + g), load_elem(XT, x, r * N1 + u), limit);
  }
  return activation_single(a, load_elem(XT, x, r * N1 + i));
}

template <ElemType XT>
__global__ void activation_kernel(const void* __restrict__ x, void* __restrict__ y, int act, float limit, int64_t R,
                                  int64_t N1, int64_t I) {
  const int64_t n = R * I;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / I, i = idx - r * I;
    store_elem(XT, y, idx, act_at<XT>(act, limit, x, r, N1, I, i));
  }
}

// ---------------------------------------------------------------------------------------------
// Vectorized kernels: a thread owns 8 consecutive output columns of a row (16-byte loads of the
// gate and up halves, a 16-byte or 8-byte store) and keeps the activated values in registers
// between the group maximum and the codes. Taken when I % 8 == 0 and the buffers are 16-byte
// aligned (every layer shape); 32-bit indexing (the host checks R * I / 8 < 2^31). The element
// values are the scalar kernels' (the same contract functions), only the traffic differs.
// ---------------------------------------------------------------------------------------------
constexpr int kVec = 8;
constexpr int kVecThreads = 256;

template <ElemType XT>
__global__ void __launch_bounds__(kVecThreads)
    activation_vec_kernel(const uint16_t* __restrict__ x, uint16_t* __restrict__ y, int act, float limit,
                          uint32_t total, int N1, int I) {
  const uint32_t i8 = static_cast<uint32_t>(I / kVec);
  for (uint32_t idx = blockIdx.x * kVecThreads + threadIdx.x; idx < total; idx += gridDim.x * kVecThreads) {
    const uint32_t r = idx / i8, i0 = (idx - r * i8) * kVec;
    float v[kVec];
    act8<XT>(act, limit, x + static_cast<size_t>(r) * N1, I, static_cast<int>(i0), v);
    uint4 o;
    o.x = pack_half2<XT>(v[0], v[1]);
    o.y = pack_half2<XT>(v[2], v[3]);
    o.z = pack_half2<XT>(v[4], v[5]);
    o.w = pack_half2<XT>(v[6], v[7]);
    *reinterpret_cast<uint4*>(y + static_cast<size_t>(idx) * kVec) = o;
  }
}

// Scale groups of TPG * 8 columns: TPG neighbouring lanes of a warp hold one group (I is a
// multiple of the group, so groups never straddle rows and the flat index of a thread's first
// column over 8 is its group's index times TPG plus its place in it). Called by every lane of a warp
// (the shuffles and e4m3_codes8's vote); a lane with ok false carries zeros. Returns the codes of
// the 8 values v and leaves the group's scale in *scale_out. kOutline: e4m3_codes8's.
template <ElemType QT, int TPG, bool kOutline = true>
__device__ __forceinline__ uint2 group_codes8(const float (&v)[kVec], float* scale_out) {
  constexpr ActQuant kind = QT == ElemType::kE4M3 ? ActQuant::kFp8E4M3 : ActQuant::kInt8;
  float m = 0.0f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) m = fmaxf(m, fabsf(v[e]));
#pragma unroll
  for (int o = TPG / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float s = quant_scale(kind, m);
  *scale_out = s;
  if constexpr (QT == ElemType::kE4M3) {
    // The division by the group's scale without the IEEE division's per-value branch, where the
    // whole warp's values allow it (e4m3_codes8, every lane taking part in its vote); a scale
    // that is not positive codes every value 0, as quant_code_value does.
    const uint2 codes = e4m3_codes8<kOutline>(v, s);
    return s > 0.0f ? codes : make_uint2(0u, 0u);
  } else {
    return pack_codes8<QT>(v, s);
  }
}

// The loop runs warp-uniformly so every lane takes part in group_codes8; lanes past the end carry
// zeros and store nothing.
template <ElemType XT, ElemType QT, int TPG>
__global__ void __launch_bounds__(kVecThreads)
    group_quant_vec_kernel(const uint16_t* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ scale,
                           int act, float limit, uint32_t total, int N1, int K) {
  const uint32_t k8 = static_cast<uint32_t>(K / kVec);
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp_base = (blockIdx.x * kVecThreads + threadIdx.x) & ~31u;
  for (uint32_t base = warp_base; base < total; base += gridDim.x * kVecThreads) {
    const uint32_t idx = base + lane;
    const bool ok = idx < total;
    float v[kVec] = {};
    if (ok) {
      const uint32_t r = idx / k8, i0 = (idx - r * k8) * kVec;
      act8<XT>(act, limit, x + static_cast<size_t>(r) * N1, K, static_cast<int>(i0), v);
    }
    float s;
    const uint2 codes = group_codes8<QT, TPG>(v, &s);
    if (!ok) continue;
    if (idx % TPG == 0) scale[idx / TPG] = s;
    *reinterpret_cast<uint2*>(q + static_cast<size_t>(idx) * kVec) = codes;
  }
}

// quantize_permuted: permute_rows(quantize(x)) for codes and scales in one pass over x, each token
// row read once (quantize, then permute_rows of both: three launches, the codes written and read
// back, each row read top_k times). A token row's codes and scales go to its entries' positions
// where src_rows names a position below the valid rows and the permutation names the entry back
// (the routing's invariant). Every other position is then the fill loop's, a warp a row: zeros past
// the valid rows or for an id out of range, otherwise its source row quantized there (metadata
// outside the invariant), so the result is permute_rows' for any input. The two write disjoint rows.
template <ElemType XT, ElemType QT, int TPG>
__global__ void __launch_bounds__(kVecThreads)
    quant_permuted_kernel(const uint16_t* __restrict__ x, const int32_t* __restrict__ perm,
                          const int32_t* __restrict__ offsets, int64_t num_offsets, const int32_t* __restrict__ src,
                          int top_k, uint8_t* __restrict__ q, float* __restrict__ scale, uint32_t total, int K,
                          int64_t R) {
  const int64_t valid = valid_rows(offsets, num_offsets, R);
  const uint32_t k8 = static_cast<uint32_t>(K / kVec);
  const int64_t groups = K / (TPG * kVec);
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t warp_base = (blockIdx.x * kVecThreads + threadIdx.x) & ~31u;
  for (uint32_t base = warp_base; base < total; base += gridDim.x * kVecThreads) {
    const uint32_t idx = base + lane;
    const bool ok = idx < total;
    const uint32_t r = ok ? idx / k8 : 0u, c = idx - r * k8;
    float v[kVec] = {};
    if (ok) load8<XT>(x + static_cast<size_t>(r) * K + c * kVec, v);
    float s;
    const uint2 codes = group_codes8<QT, TPG, false>(v, &s);  // a call here would spill
    if (!ok) continue;
    for (int j = 0; j < top_k; ++j) {
      const int64_t e = static_cast<int64_t>(r) * top_k + j;
      const int64_t p = __ldg(src + e);
      if (p < 0 || p >= valid || __ldg(perm + p) != e) continue;
      if (c % TPG == 0) scale[p * groups + c / TPG] = s;
      *reinterpret_cast<uint2*>(q + static_cast<size_t>(p) * K + c * kVec) = codes;
    }
  }
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kVecThreads / 32);
  for (int64_t p = (static_cast<int64_t>(blockIdx.x) * kVecThreads + threadIdx.x) >> 5; p < R; p += warps) {
    const int64_t id = p < valid ? __ldg(perm + p) : -1;
    const bool in_range = id >= 0 && id < R;
    if (in_range && __ldg(src + id) == p) continue;  // the scatter's row (warp-uniform)
    const uint16_t* xr = in_range ? x + static_cast<size_t>(id / top_k) * K : nullptr;
    for (uint32_t c0 = 0; c0 < k8; c0 += 32) {
      const uint32_t c = c0 + lane;
      const bool ok = c < k8;
      float v[kVec] = {};  // zeros quantize to scale 0 and codes 0: the rows without a source
      if (ok && xr != nullptr) load8<XT>(xr + c * kVec, v);
      float s;
      const uint2 codes = group_codes8<QT, TPG, false>(v, &s);
      if (!ok) continue;
      if (c % TPG == 0) scale[p * groups + c / TPG] = s;
      *reinterpret_cast<uint2*>(q + static_cast<size_t>(p) * K + c * kVec) = codes;
    }
  }
}

// One scale per row: one block per row, two vectorized passes (maximum, then codes); the second
// pass recomputes the activation from the row just read, which the L2 still holds.
template <ElemType XT, ElemType QT>
__global__ void __launch_bounds__(kVecThreads)
    row_quant_vec_kernel(const uint16_t* __restrict__ x, uint8_t* __restrict__ q, float* __restrict__ scale, int act,
                         float limit, int N1, int K) {
  constexpr ActQuant kind = QT == ElemType::kE4M3 ? ActQuant::kFp8E4M3 : ActQuant::kInt8;
  __shared__ float s_max[kVecThreads / 32];
  const uint16_t* xr = x + static_cast<size_t>(blockIdx.x) * N1;
  uint8_t* qr = q + static_cast<size_t>(blockIdx.x) * K;
  const int k8 = K / kVec;
  float m = 0.0f;
  for (int c = threadIdx.x; c < k8; c += kVecThreads) {
    float v[kVec];
    act8<XT>(act, limit, xr, K, c * kVec, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) m = fmaxf(m, fabsf(v[e]));
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) s_max[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0.0f;
#pragma unroll
  for (int w = 0; w < kVecThreads / 32; ++w) m = fmaxf(m, s_max[w]);
  const float s = quant_scale(kind, m);
  if (threadIdx.x == 0) scale[blockIdx.x] = s;
  for (int c = threadIdx.x; c < k8; c += kVecThreads) {
    float v[kVec];
    act8<XT>(act, limit, xr, K, c * kVec, v);
    *reinterpret_cast<uint2*>(qr + c * kVec) = pack_codes8<QT>(v, s);
  }
}

// Whether the vectorized kernels apply: whole 8-column vectors, 16-byte aligned rows, 32-bit indices.
inline bool vec_ok(const void* x, const void* out, int64_t R, int64_t N1, int64_t I) {
  return I % kVec == 0 && N1 % kVec == 0 && aligned_to(x, 16) && aligned_to(out, 16) && R * (I / kVec) < INT32_MAX &&
         N1 < INT32_MAX;
}

// f(std::integral_constant<int, TPG>) for groups of group_k = 8 * TPG columns, the lanes of a warp
// that share a group (8 to 256 columns, a power of two); false for any other group.
template <typename F>
bool by_group_lanes(int64_t group_k, F&& f) {
  switch (group_k) {
    case 8: f(std::integral_constant<int, 1>{}); return true;
    case 16: f(std::integral_constant<int, 2>{}); return true;
    case 32: f(std::integral_constant<int, 4>{}); return true;
    case 64: f(std::integral_constant<int, 8>{}); return true;
    case 128: f(std::integral_constant<int, 16>{}); return true;
    case 256: f(std::integral_constant<int, 32>{}); return true;
    default: return false;
  }
}

template <ElemType XT, ElemType QT, int TPG>
void launch_group_vec(cudaStream_t stream, const void* x, void* q, float* sc, int act, float limit, int64_t R,
                      int64_t N1, int64_t K) {
  const uint32_t total = static_cast<uint32_t>(R * (K / kVec));
  group_quant_vec_kernel<XT, QT, TPG><<<grid_for(total, kVecThreads, 8192), kVecThreads, 0, stream>>>(
      static_cast<const uint16_t*>(x), static_cast<uint8_t*>(q), sc, act, limit, total, static_cast<int>(N1),
      static_cast<int>(K));
}

// The vectorized quantization for this group size, or false (scalar kernel then).
template <ElemType XT, ElemType QT>
bool launch_quant_vec(cudaStream_t stream, const void* x, void* q, float* sc, int act, float limit, int64_t R,
                      int64_t N1, int64_t K, int64_t group_k) {
  if (!vec_ok(x, q, R, N1, K)) return false;
  if (group_k == 0 || group_k >= K) {
    row_quant_vec_kernel<XT, QT><<<static_cast<unsigned>(R), kVecThreads, 0, stream>>>(
        static_cast<const uint16_t*>(x), static_cast<uint8_t*>(q), sc, act, limit, static_cast<int>(N1),
        static_cast<int>(K));
    return true;
  }
  return by_group_lanes(group_k, [&](auto tpg) {
    launch_group_vec<XT, QT, decltype(tpg)::value>(stream, x, q, sc, act, limit, R, N1, K);
  });
}


constexpr int kQuantThreads = 256;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One block per row. Whole-row scale: the block reduces the absmax; per-group scales: each warp
// takes groups in turn. The activation is recomputed in the second pass rather than stored.
template <ElemType XT, ElemType QT>
__global__ void __launch_bounds__(kQuantThreads)
    quant_kernel(const void* __restrict__ x, void* __restrict__ q, float* __restrict__ scale, int act, float limit,
                 int64_t N1, int64_t K, int64_t group_k) {
  constexpr ActQuant kind = QT == ElemType::kE4M3 ? ActQuant::kFp8E4M3 : ActQuant::kInt8;
  __shared__ float s_max[kQuantThreads / 32];
  const int64_t r = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (group_k == 0 || group_k >= K) {
    float m = 0.0f;
    for (int64_t i = threadIdx.x; i < K; i += blockDim.x) m = fmaxf(m, fabsf(act_at<XT>(act, limit, x, r, N1, K, i)));
    m = warp_max(m);
    if (lane == 0) s_max[warp] = m;
    __syncthreads();
    m = 0.0f;
    for (int w = 0; w < nwarps; ++w) m = fmaxf(m, s_max[w]);
    const float s = quant_scale(kind, m);
    if (threadIdx.x == 0) scale[r] = s;
    for (int64_t i = threadIdx.x; i < K; i += blockDim.x)
      store_elem(QT, q, r * K + i, quant_code_value(act_at<XT>(act, limit, x, r, N1, K, i), s));
    return;
  }
  const int64_t groups = K / group_k;
  for (int64_t g = warp; g < groups; g += nwarps) {
    const int64_t k0 = g * group_k;
    float m = 0.0f;
    for (int64_t i = k0 + lane; i < k0 + group_k; i += 32) m = fmaxf(m, fabsf(act_at<XT>(act, limit, x, r, N1, K, i)));
    const float s = quant_scale(kind, warp_max(m));
    if (lane == 0) scale[r * groups + g] = s;
    for (int64_t i = k0 + lane; i < k0 + group_k; i += 32)
      store_elem(QT, q, r * K + i, quant_code_value(act_at<XT>(act, limit, x, r, N1, K, i), s));
  }
}

template <ElemType XT>
Error launch_quant(const std::string& call, cudaStream_t stream, const void* x, void* q, float* sc, int act,
                   float limit, int64_t R, int64_t N1, int64_t K, int64_t group_k, ActQuant kind) {
  if (R == 0) return Error::Success();
  if (R > INT32_MAX) return invalid(call, "too many rows");
  const unsigned grid = static_cast<unsigned>(R);
  const bool vec = kind == ActQuant::kFp8E4M3
                       ? launch_quant_vec<XT, ElemType::kE4M3>(stream, x, q, sc, act, limit, R, N1, K, group_k)
                       : launch_quant_vec<XT, ElemType::kI8>(stream, x, q, sc, act, limit, R, N1, K, group_k);
  if (vec) return launch_status(call, "quant_vec_kernel");
  if (kind == ActQuant::kFp8E4M3)
    quant_kernel<XT, ElemType::kE4M3><<<grid, kQuantThreads, 0, stream>>>(x, q, sc, act, limit, N1, K, group_k);
  else
    quant_kernel<XT, ElemType::kI8><<<grid, kQuantThreads, 0, stream>>>(x, q, sc, act, limit, N1, K, group_k);
  return launch_status(call, "quant_kernel");
}

}  // namespace

Error launch_activation(const std::string& call, cudaStream_t stream, const void* x, void* y, ElemType xt, int act,
                        float limit, int64_t R, int64_t N1, int64_t I) {
  if (R * I == 0) return Error::Success();
  const bool f16 = xt == ElemType::kF16;
  if (vec_ok(x, y, R, N1, I)) {
    const uint32_t total = static_cast<uint32_t>(R * (I / kVec));
    const unsigned grid = grid_for(total, kVecThreads, 8192);
    const auto* xp = static_cast<const uint16_t*>(x);
    auto* yp = static_cast<uint16_t*>(y);
    const int n1 = static_cast<int>(N1), i = static_cast<int>(I);
    if (f16)
      activation_vec_kernel<ElemType::kF16><<<grid, kVecThreads, 0, stream>>>(xp, yp, act, limit, total, n1, i);
    else
      activation_vec_kernel<ElemType::kBF16><<<grid, kVecThreads, 0, stream>>>(xp, yp, act, limit, total, n1, i);
    return launch_status(call, "activation_vec_kernel");
  }
  const int threads = 256;
  const unsigned grid = grid_for(R * I, threads, 8192);
  if (f16)
    activation_kernel<ElemType::kF16><<<grid, threads, 0, stream>>>(x, y, act, limit, R, N1, I);
  else
    activation_kernel<ElemType::kBF16><<<grid, threads, 0, stream>>>(x, y, act, limit, R, N1, I);
  return launch_status(call, "activation_kernel");
}

namespace {

// The activation with k_order = 1 (vec_ok's buffers): a thread activates 8 consecutive columns as
// activation_vec_kernel does (16-byte loads; the same contract functions, so the same values) and
// the 8 threads of a 64-column tile trade them into the order (rs4_write_ordered, rs4_k_order.cuh).
template <ElemType XT>
__global__ void __launch_bounds__(kVecThreads)
    activation_ordered_kernel(const uint16_t* __restrict__ x, uint4* __restrict__ y, int act, float limit,
                              uint32_t total, int N1, int I) {
  const uint32_t i8 = static_cast<uint32_t>(I / kVec);
  rs4_write_ordered<kVecThreads>(y, total, [&](uint32_t idx) {
    const uint32_t r = idx / i8, i0 = (idx - r * i8) * kVec;
    float v[kVec];
    act8<XT>(act, limit, x + static_cast<size_t>(r) * N1, I, static_cast<int>(i0), v);
    return make_uint4(pack_half2<XT>(v[0], v[1]), pack_half2<XT>(v[2], v[3]), pack_half2<XT>(v[4], v[5]),
                      pack_half2<XT>(v[6], v[7]));
  });
}

Error ActivationCuda(cudaStream_t stream, AnyBuffer x, Result<AnyBuffer> y, int64_t activation, float limit,
                     int64_t k_order) {
  const std::string call = "activation";
  ActivationShape s;
  HJ_RETURN_IF_ERROR(check_activation(call, x, activation, &s));
  HJ_RETURN_IF_ERROR(check_activation_output(call, x, *y, s));
  HJ_RETURN_IF_ERROR(check_k_order(call, k_order, x.element_type(), s.I));
  if (k_order == 1) {
    if (s.R * s.I == 0) return Error::Success();
    if (!vec_ok(x.untyped_data(), y->untyped_data(), s.R, s.N1, s.I))
      return invalid(call, "k_order = 1 needs 16-byte aligned x and y and fewer than 2^31 16-byte chunks");
    const uint32_t total = static_cast<uint32_t>(s.R * (s.I / kVec));
    const unsigned grid = grid_for(total, kVecThreads, 8192);
    const auto* xp = static_cast<const uint16_t*>(x.untyped_data());
    auto* yp = static_cast<uint4*>(y->untyped_data());
    const int act = static_cast<int>(activation), n1 = static_cast<int>(s.N1), i = static_cast<int>(s.I);
    if (x.element_type() == ffi::DataType::F16)
      activation_ordered_kernel<ElemType::kF16><<<grid, kVecThreads, 0, stream>>>(xp, yp, act, limit, total, n1, i);
    else
      activation_ordered_kernel<ElemType::kBF16><<<grid, kVecThreads, 0, stream>>>(xp, yp, act, limit, total, n1, i);
    return launch_status(call, "activation_ordered_kernel");
  }
  return launch_activation(call, stream, x.untyped_data(), y->untyped_data(), elem_type_of(x.element_type()),
                           static_cast<int>(activation), limit, s.R, s.N1, s.I);
}

Error ActivationQuantCuda(cudaStream_t stream, AnyBuffer x, Result<AnyBuffer> q, Result<AnyBuffer> scale,
                          int64_t activation, float limit, int64_t group_k) {
  const std::string call = "activation_quant";
  ActivationShape s;
  HJ_RETURN_IF_ERROR(check_activation(call, x, activation, &s));
  ActQuant kind;
  HJ_RETURN_IF_ERROR(check_quant_results(call, x, *q, *scale, s.R, s.I, group_k, &kind));
  return launch_quantize(call, stream,
                         InputQuant{x.untyped_data(), elem_type_of(x.element_type()), kind, s.R, s.N1, s.I, group_k,
                                    q->untyped_data(), static_cast<float*>(scale->untyped_data()),
                                    static_cast<int>(activation), limit});
}

Error QuantizeCuda(cudaStream_t stream, AnyBuffer x, Result<AnyBuffer> q, Result<AnyBuffer> scale, int64_t group_k) {
  const std::string call = "quantize";
  int64_t R = 0, K = 0;
  HJ_RETURN_IF_ERROR(check_quantize_input(call, x, &R, &K));
  ActQuant kind;
  HJ_RETURN_IF_ERROR(check_quant_results(call, x, *q, *scale, R, K, group_k, &kind));
  return launch_quantize(call, stream,
                         InputQuant{x.untyped_data(), elem_type_of(x.element_type()), kind, R, K, K, group_k,
                                    q->untyped_data(), static_cast<float*>(scale->untyped_data())});
}

// quantize_permuted's kernel for the group's lanes (TPG = group_k / 8).
struct QuantPermuted {
  const void* x;
  const int32_t *perm, *offsets, *src;
  int64_t num_offsets, M, K, R, top_k, group_k;
  void* q;
  float* scale;
};

template <ElemType XT, ElemType QT>
void launch_quant_permuted(cudaStream_t stream, const QuantPermuted& a) {
  const uint32_t total = static_cast<uint32_t>(a.M * (a.K / kVec));
  const unsigned grid = grid_for(total, kVecThreads, 8192);
  by_group_lanes(a.group_k, [&](auto tpg) {  // check_quantize_permuted admits its groups only
    quant_permuted_kernel<XT, QT, decltype(tpg)::value><<<grid, kVecThreads, 0, stream>>>(
        static_cast<const uint16_t*>(a.x), a.perm, a.offsets, a.num_offsets, a.src, static_cast<int>(a.top_k),
        static_cast<uint8_t*>(a.q), a.scale, total, static_cast<int>(a.K), a.R);
  });
}

Error QuantizePermutedCuda(cudaStream_t stream, AnyBuffer x, AnyBuffer permutation, AnyBuffer offsets,
                           AnyBuffer src_rows, Result<AnyBuffer> q, Result<AnyBuffer> scale, int64_t group_k) {
  const std::string call = "quantize_permuted";
  QuantizePermutedShape s;
  ActQuant kind;
  HJ_RETURN_IF_ERROR(check_quantize_permuted(call, x, permutation, offsets, src_rows, *q, *scale, group_k, &s, &kind));
  if (s.R == 0 || s.K == 0) return Error::Success();
  if (s.M * (s.K / kVec) >= INT32_MAX || s.K >= INT32_MAX || s.top_k >= INT32_MAX)
    return invalid(call, "x has too many values for the kernel's 32-bit indices");
  if (!aligned_to(x.untyped_data(), 16) || !aligned_to(q->untyped_data(), 8))
    return invalid(call, "x must be 16-byte aligned and q 8-byte aligned");
  const QuantPermuted a{x.untyped_data(),
                        static_cast<const int32_t*>(permutation.untyped_data()),
                        static_cast<const int32_t*>(offsets.untyped_data()),
                        static_cast<const int32_t*>(src_rows.untyped_data()),
                        s.num_offsets, s.M, s.K, s.R, s.top_k, group_k, q->untyped_data(),
                        static_cast<float*>(scale->untyped_data())};
  const bool f16 = x.element_type() == ffi::DataType::F16, fp8 = kind == ActQuant::kFp8E4M3;
  if (f16 && fp8) launch_quant_permuted<ElemType::kF16, ElemType::kE4M3>(stream, a);
  else if (f16) launch_quant_permuted<ElemType::kF16, ElemType::kI8>(stream, a);
  else if (fp8) launch_quant_permuted<ElemType::kBF16, ElemType::kE4M3>(stream, a);
  else launch_quant_permuted<ElemType::kBF16, ElemType::kI8>(stream, a);
  return launch_status(call, "quant_permuted_kernel");
}

}  // namespace

Error launch_quantize(const std::string& call, cudaStream_t stream, const InputQuant& qin) {
  if (qin.xt == ElemType::kF16)
    return launch_quant<ElemType::kF16>(call, stream, qin.x, qin.q, qin.scale, qin.act, qin.limit, qin.rows, qin.N1,
                                        qin.K, qin.group_k, qin.kind);
  return launch_quant<ElemType::kBF16>(call, stream, qin.x, qin.q, qin.scale, qin.act, qin.limit, qin.rows, qin.N1,
                                       qin.K, qin.group_k, qin.kind);
}

}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjActivationCuda, hj::ActivationCuda, hj::bind_activation<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjActivationQuantCuda, hj::ActivationQuantCuda,
                              hj::bind_activation_quant<hj::CudaStream>(), {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjQuantizeCuda, hj::QuantizeCuda, hj::bind_quantize<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjQuantizePermutedCuda, hj::QuantizePermutedCuda,
                              hj::bind_quantize_permuted<hj::CudaStream>(), {xla::ffi::Traits::kCmdBufferCompatible});
