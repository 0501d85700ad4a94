// The dynamic quantization of 16-bit activation rows on the GPU, shared by the quantize handler
// (activation_cuda.cu) and the GEMM that quantizes its own input (gemm_indexed_quant): the launch,
// and the device conversion of one value, so that every kernel that quantizes writes the same codes.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi_common.h"

namespace hj {

// 16-bit rows x [rows, N1], each activated (act: an Activation code; -1: none, N1 = K) into K
// columns and quantized into q [rows, K] (fp8 e4m3 or int8 codes) and scale [rows, groups] (scale =
// absmax / qmax per group of group_k columns, 0: per row): the quantize or activation_quant call.
struct InputQuant {
  const void* x;
  ElemType xt;  // kBF16 or kF16
  ActQuant kind;
  int64_t rows, N1, K, group_k;
  void* q;
  float* scale;
  int act = -1;
  float limit = 0.0f;
};

// gemm_indexed_gated: the GEMM's output rows activated in pairs into y [rows, N / 2] (y = act(gate,
// up) of each row's rounded values: rows 2i, 2i + 1 for swigluoai, else i, N / 2 + i).
struct GatedOut {
  int act;  // a gated Activation code
  float limit;
  void* y;
};

// Launches the quantization of qin (moe_contract.h's values, bit for bit as on the CPU).
Error launch_quantize(const std::string& call, cudaStream_t stream, const InputQuant& qin);

// Launches the activation of the 16-bit rows x [R, N1] of type xt (act: an Activation code) into
// y [R, I], rounded to xt: the activation call, and gemm_indexed_gated where its GEMM wrote the rows.
Error launch_activation(const std::string& call, cudaStream_t stream, const void* x, void* y, ElemType xt, int act,
                        float limit, int64_t R, int64_t N1, int64_t I);

#if defined(__CUDACC__)
// One 16-bit value (the low half of h) of type XT (kBF16 or kF16) as float32.
template <ElemType XT>
__device__ __forceinline__ float half_to_float(uint32_t h) {
  if constexpr (XT == ElemType::kBF16)
    return __uint_as_float(h << 16);
  else
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}

// 8 consecutive 16-bit values of type XT at p (16-byte aligned, read through the read-only cache)
// as float32.
template <ElemType XT>
__device__ __forceinline__ void load8(const uint16_t* p, float (&v)[8]) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    v[2 * q] = half_to_float<XT>(w[q] & 0xffffu);
    v[2 * q + 1] = half_to_float<XT>(w[q] >> 16);
  }
}

// Two float32 values rounded to XT (kBF16 or kF16), packed low | high << 16.
template <ElemType XT>
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  if constexpr (XT == ElemType::kBF16)
    return static_cast<uint32_t>(float_to_bf16(lo)) | (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
  else
    return static_cast<uint32_t>(float_to_f16(lo)) | (static_cast<uint32_t>(float_to_f16(hi)) << 16);
}

// The activation A of 8 values (gate and up, or one input): A is a compile-time constant, so the
// contract functions' switch folds away and the 8 values' arithmetic forms one block the compiler
// can interleave (with the activation a run-time value, each value had its own switch and
// branches, one value's expf and division after another's).
template <Activation A>
__device__ __forceinline__ void gated8(const float (&g)[8], const float (&u)[8], float limit, float (&v)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = activation_gated(A, g[e], u[e], limit);
}
template <Activation A>
__device__ __forceinline__ void single8(float (&v)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = activation_single(A, v[e]);
}

// Output columns i0 .. i0 + 7 of the row starting at xr (N1 columns): activated, in float32.
template <ElemType XT>
__device__ __forceinline__ void act8(int act, float limit, const uint16_t* xr, int I, int i0, float (&v)[8]) {
  if (act < 0) {
    load8<XT>(xr + i0, v);
    return;
  }
  const Activation a = static_cast<Activation>(act);
  if (!activation_is_gated(a)) {
    load8<XT>(xr + i0, v);
    switch (a) {
      case Activation::kSiluNoMul: single8<Activation::kSiluNoMul>(v); break;
      case Activation::kGeluNoMul: single8<Activation::kGeluNoMul>(v); break;
      case Activation::kGeluTanhNoMul: single8<Activation::kGeluTanhNoMul>(v); break;
      case Activation::kRelu2NoMul: single8<Activation::kRelu2NoMul>(v); break;
      default:
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = activation_single(a, v[e]);  // the contract's value (NaN)
    }
    return;
  }
  float g[8], u[8];
  if (a == Activation::kSwigluOai) {  // interleaved: gate 2i, up 2i + 1
    float p0[8], p1[8];
    load8<XT>(xr + 2 * i0, p0);
    load8<XT>(xr + 2 * i0 + 8, p1);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      g[e] = p0[2 * e];
      u[e] = p0[2 * e + 1];
      g[e + 4] = p1[2 * e];
      u[e + 4] = p1[2 * e + 1];
    }
  } else {  // halves: gate i, up I + i
    load8<XT>(xr + i0, g);
    load8<XT>(xr + I + i0, u);
  }
  switch (a) {
    case Activation::kSilu: gated8<Activation::kSilu>(g, u, limit, v); break;
    case Activation::kGelu: gated8<Activation::kGelu>(g, u, limit, v); break;
    case Activation::kGeluTanh: gated8<Activation::kGeluTanh>(g, u, limit, v); break;
    default: gated8<Activation::kSwigluOai>(g, u, limit, v);  // the one gated activation left
  }
}

// The code byte of the quotient c = v / s: the hardware conversion (round to nearest even,
// saturating to +-448 for e4m3) equals float_to_e4m3 bit for bit except for NaN, which
// float_to_e4m3 writes as 0x7f whatever its sign (test_cuda_backend.py:
// test_e4m3_codes_match_cpu_bit_for_bit).
template <ElemType QT>
__device__ __forceinline__ uint32_t code_of(float c) {
  if constexpr (QT == ElemType::kE4M3) {
    const uint32_t hw = __nv_cvt_float_to_fp8(c, __NV_SATFINITE, __NV_E4M3);
    return c == c ? hw : 0x7fu;
  } else {
    float r = rintf(c);
    r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
    return static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(r)));
  }
}

// The code byte of v at scale s.
template <ElemType QT>
__device__ __forceinline__ uint32_t code_byte(float v, float s) {
  return code_of<QT>(quant_code_value(v, s));
}

// Division by one scale without the IEEE division's per-value slow-path branch, which keeps a
// warp's divisions from overlapping: the reciprocal of s refined once, then per value the quotient
// and its fma correction, the instructions of the division's own fast path, so v / s bit for bit
// where that path is exact: every operand and intermediate normal, which scale_div_ok checks
// (with wide margins; a caller takes the plain division where it fails).
__device__ __forceinline__ float scale_rcp(float s) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(s));
  return fmaf(r, fmaf(r, -s, 1.0f), r);
}
__device__ __forceinline__ bool scale_div_ok(float v, float s) {
  const float a = fabsf(v);  // zeros (rows of zeros too, whose scale is 0) keep their sign either way
  return a == 0.0f || (s >= 0x1p-60f && s <= 0x1p60f && a >= 0x1p-90f && a >= s * 0x1p-60f);
}
__device__ __forceinline__ float scale_div(float v, float s, float rcp) {
  const float q = v * rcp;
  const float c = fmaf(rcp, fmaf(q, -s, v), q);
  return v == 0.0f ? v : c;  // +-0 / s = +-0 (the correction would give +0 for -0)
}

// The codes of 8 consecutive values, first value in the lowest byte (one 8-byte store).
template <ElemType QT>
__device__ __forceinline__ uint2 pack_codes8(const float (&v)[8], float s) {
  uint2 o;
  o.x = code_byte<QT>(v[0], s) | (code_byte<QT>(v[1], s) << 8) | (code_byte<QT>(v[2], s) << 16) |
        (code_byte<QT>(v[3], s) << 24);
  o.y = code_byte<QT>(v[4], s) | (code_byte<QT>(v[5], s) << 8) | (code_byte<QT>(v[6], s) << 16) |
        (code_byte<QT>(v[7], s) << 24);
  return o;
}

// pack_codes8 for e4m3 (values outside scale_div_ok's range) out of line, so the callers'
// unrolled loops share one copy of its code.
static __device__ __noinline__ uint2 e4m3_codes8_exact(float v0, float v1, float v2, float v3, float v4, float v5,
                                                       float v6, float v7, float s) {
  const float v[8] = {v0, v1, v2, v3, v4, v5, v6, v7};
  return pack_codes8<ElemType::kE4M3>(v, s);
}

// The e4m3 codes of 8 consecutive values at scale s, first value in the lowest byte: the
// branch-free division where the whole warp's values allow it, else the plain one (kOutline: out
// of line, one copy for unrolled callers; inline where a call's saved registers would spill).
// Called by every lane of the warp together.
template <bool kOutline = true>
__device__ __forceinline__ uint2 e4m3_codes8(const float (&v)[8], float s) {
  bool fast = true;
#pragma unroll
  for (int i = 0; i < 8; ++i) fast = fast && scale_div_ok(v[i], s);
  if (!__all_sync(0xffffffffu, fast)) {
    if constexpr (kOutline) return e4m3_codes8_exact(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], s);
    else return pack_codes8<ElemType::kE4M3>(v, s);
  }
  const float rcp = scale_rcp(s);
  uint2 c = make_uint2(0u, 0u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    c.x |= code_of<ElemType::kE4M3>(scale_div(v[i], s, rcp)) << (8 * i);
    c.y |= code_of<ElemType::kE4M3>(scale_div(v[4 + i], s, rcp)) << (8 * i);
  }
  return c;
}
#endif

}  // namespace hj
