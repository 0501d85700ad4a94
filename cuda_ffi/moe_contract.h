// The numeric contract shared by the CPU and CUDA handlers: element decoding, weight
// dequantization, activations, dynamic quantization and the expert-id rule. Every function
// here compiles for host and device, so the two backends compute element values with the
// same code and cannot disagree on the semantics.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__CUDACC__)
#define HJ_HD __host__ __device__ __forceinline__
#else
#define HJ_HD inline
#endif

namespace hj {

// ----------------------------------------------------------------------------------------
// Enumerations passed from Python as integer attributes (kept in step with humming_jax/_abi.py).
// ----------------------------------------------------------------------------------------
enum class WeightType : int32_t {
  kFloat = 0,    // bf16 / fp16 / f32 values, no scale
  kUInt4 = 1,    // two 4-bit codes per byte (low nibble = even k); w = (q - zero) * scale
  kInt8 = 2,     // int8 codes; w = q * scale
  kFp8E4M3 = 3,  // float8_e4m3fn codes; w = q * scale
  kFp4E2M1 = 4,  // two e2m1 codes per byte (low nibble = even k); w = q * scale (* scale2)
};

// Storage element types (scales, activations, outputs).
enum class ElemType : int32_t {
  kF32 = 0,
  kBF16 = 1,
  kF16 = 2,
  kE8M0 = 3,  // uint8 power-of-two scale: 2^(s - 127)
  kE4M3 = 4,  // float8_e4m3fn
  kI8 = 5,
  kU8 = 6,
  kInvalid = -1,
};

enum class Activation : int32_t {
  kSilu = 0,
  kGelu = 1,
  kGeluTanh = 2,
  kSwigluOai = 3,
  kSiluNoMul = 4,
  kGeluNoMul = 5,
  kGeluTanhNoMul = 6,
  kRelu2NoMul = 7,
};
constexpr int32_t kNumActivations = 8;

enum class ActQuant : int32_t { kNone = 0, kFp8E4M3 = 1, kInt8 = 2 };

HJ_HD bool activation_is_gated(Activation a) {
  return a == Activation::kSilu || a == Activation::kGelu || a == Activation::kGeluTanh ||
         a == Activation::kSwigluOai;
}

// ----------------------------------------------------------------------------------------
// Scalar conversions (bit exact, round to nearest even).
// ----------------------------------------------------------------------------------------
HJ_HD float bits_to_float(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}
HJ_HD uint32_t float_to_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

HJ_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

HJ_HD uint16_t float_to_bf16(float f) {
  uint32_t b = float_to_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);  // quiet NaN
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

HJ_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    // zero or subnormal: man * 2^-24, exact in float32
    float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

HJ_HD uint16_t float_to_f16(float f) {
  const uint32_t b = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t abs = b & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;                // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;               // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                     // below the smallest normal 2^-14
    // subnormal: round(|f| * 2^24) to nearest even; exact scaling by a power of two.
    const float scaled = bits_to_float(abs) * 16777216.0f;
    const float r = rintf(scaled);
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

HJ_HD float e4m3_to_float(uint8_t v) {
  const uint32_t sign = v & 0x80u;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t man = v & 0x7u;
  float r;
  if (exp == 0xf && man == 0x7) return bits_to_float(0x7fc00000u | (sign << 24));
  if (exp == 0)
    r = static_cast<float>(man) * 0.001953125f;  // man * 2^-9
  else
    r = bits_to_float(((exp + 120u) << 23) | (man << 20));
  return sign ? -r : r;
}

// Saturating (to +-448) round-to-nearest-even conversion; NaN stays NaN.
HJ_HD uint8_t float_to_e4m3(float f) {
  const uint32_t b = float_to_bits(f);
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  const float a = bits_to_float(b & 0x7fffffffu);
  if (!(a == a)) return 0x7f;
  if (a >= 448.0f) return sign | 0x7e;
  int e = static_cast<int>((float_to_bits(a) >> 23) & 0xff) - 127;  // floor(log2 a) for normals
  if (e < -6) e = -6;                                                // subnormal quantum 2^-9
  // a / 2^(e-3) is exact (power-of-two scaling) and lies in [0, 16].
  const float m = rintf(a * bits_to_float(static_cast<uint32_t>(127 - (e - 3)) << 23));
  // Subnormals (e == -6, m < 8) land on codes 0..7 by the same formula.
  int code = ((e + 7) << 3) + static_cast<int>(m) - 8;
  if (code > 0x7e) code = 0x7e;
  return sign | static_cast<uint8_t>(code);
}

HJ_HD float e2m1_to_float(uint8_t nibble) {
  // e2m1: 1 sign, 2 exponent, 1 mantissa bit; values 0, .5, 1, 1.5, 2, 3, 4, 6.
  const uint8_t mag = nibble & 0x7u;
  const float v = (mag < 2) ? 0.5f * mag : bits_to_float(static_cast<uint32_t>(126 + (mag >> 1)) << 23) *
                                                (1.0f + 0.5f * static_cast<float>(mag & 1u));
  return (nibble & 0x8u) ? -v : v;
}

HJ_HD float e8m0_to_float(uint8_t s) {
  if (s == 0xff) return bits_to_float(0x7fc00000u);
  if (s == 0) return bits_to_float(0x00400000u);  // 2^-127 (subnormal)
  return bits_to_float(static_cast<uint32_t>(s) << 23);
}

HJ_HD float load_elem(ElemType t, const void* p, int64_t i) {
  switch (t) {
    case ElemType::kF32: return static_cast<const float*>(p)[i];
    case ElemType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case ElemType::kF16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    case ElemType::kE8M0: return e8m0_to_float(static_cast<const uint8_t*>(p)[i]);
    case ElemType::kE4M3: return e4m3_to_float(static_cast<const uint8_t*>(p)[i]);
    case ElemType::kI8: return static_cast<float>(static_cast<const int8_t*>(p)[i]);
    case ElemType::kU8: return static_cast<float>(static_cast<const uint8_t*>(p)[i]);
    default: return bits_to_float(0x7fc00000u);
  }
}

// Rounds v to the precision of a 16-bit output type (identity for f32).
HJ_HD float round_to(ElemType t, float v) {
  if (t == ElemType::kBF16) return bf16_to_float(float_to_bf16(v));
  if (t == ElemType::kF16) return f16_to_float(float_to_f16(v));
  return v;
}

HJ_HD void store_elem(ElemType t, void* p, int64_t i, float v) {
  switch (t) {
    case ElemType::kF32: static_cast<float*>(p)[i] = v; break;
    case ElemType::kBF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
    case ElemType::kF16: static_cast<uint16_t*>(p)[i] = float_to_f16(v); break;
    case ElemType::kE4M3: static_cast<uint8_t*>(p)[i] = float_to_e4m3(v); break;
    case ElemType::kI8: {
      float r = rintf(v);
      r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
      static_cast<int8_t*>(p)[i] = static_cast<int8_t>(r);
      break;
    }
    default: break;
  }
}

// ----------------------------------------------------------------------------------------
// Expert ids: a global id maps to a local slot, or to -1 ("skip"). Ids are data, so this is
// the only gate between a routed id and any address computed from it. An empty map
// (num_global == 0) is the identity over the local experts, what a caller without a map means:
// ids in [0, num_local) are their own slots, every other id is skipped.
// ----------------------------------------------------------------------------------------
HJ_HD int32_t local_expert(int32_t id, const int32_t* expert_map, int64_t num_global,
                           int64_t num_local) {
  if (num_global == 0) return (id >= 0 && id < num_local) ? id : -1;
  if (id < 0 || id >= num_global) return -1;
  const int32_t l = expert_map[id];
  return (l >= 0 && l < num_local) ? l : -1;
}

// Rows of the padded, expert-sorted id list of the indexed format.
HJ_HD int64_t indexed_padded_rows(int64_t entries, int64_t num_local, int64_t block_m) {
  const int64_t worst = entries + num_local * (block_m - 1);
  return ((worst + block_m - 1) / block_m) * block_m;
}

// ----------------------------------------------------------------------------------------
// Weights in kernel format: data [E, N, K(/2 for 4-bit)], scale [E, ceil(N/gn), ceil(K/gk)],
// optional zero points (same grid, uint8) and optional per-expert second scale (f32).
// ----------------------------------------------------------------------------------------
struct WeightView {
  WeightType type;
  ElemType data_type;  // kFloat: the float type of data
  const void* data;
  ElemType scale_type;
  const void* scale;
  const uint8_t* zero;   // nullptr: symmetric (4-bit codes centred on 8)
  const float* scale2;   // nullptr: none
  const float* bias;     // [E, N] or nullptr
  int64_t E, N, K;
  int64_t group_n, group_k;

  HJ_HD int64_t scale_rows() const { return (N + group_n - 1) / group_n; }
  HJ_HD int64_t scale_cols() const { return (K + group_k - 1) / group_k; }
  HJ_HD int64_t row_bytes() const {
    return (type == WeightType::kUInt4 || type == WeightType::kFp4E2M1) ? K / 2 : K;
  }
};

// The float32 value of weight (e, n, k) before any rounding to the activation type.
HJ_HD float weight_value(const WeightView& w, int64_t e, int64_t n, int64_t k) {
  const int64_t row = e * w.N + n;
  if (w.type == WeightType::kFloat) return load_elem(w.data_type, w.data, row * w.K + k);
  const int64_t sidx = (e * w.scale_rows() + n / w.group_n) * w.scale_cols() + k / w.group_k;
  const uint8_t* bytes = static_cast<const uint8_t*>(w.data) + row * w.row_bytes();
  float v;
  switch (w.type) {
    case WeightType::kUInt4: {
      const uint8_t byte = bytes[k >> 1];
      const int q = (k & 1) ? (byte >> 4) : (byte & 0xf);
      const int z = w.zero ? static_cast<int>(w.zero[sidx]) : 8;
      v = static_cast<float>(q - z);
      break;
    }
    case WeightType::kInt8: v = static_cast<float>(static_cast<const int8_t*>(w.data)[row * w.K + k]); break;
    case WeightType::kFp8E4M3: v = e4m3_to_float(bytes[k]); break;
    case WeightType::kFp4E2M1: {
      const uint8_t byte = bytes[k >> 1];
      v = e2m1_to_float((k & 1) ? (byte >> 4) : (byte & 0xf));
      break;
    }
    default: return bits_to_float(0x7fc00000u);
  }
  v = v * load_elem(w.scale_type, w.scale, sidx);
  if (w.scale2) v = v * w.scale2[e];
  return v;
}

// Activations entering a GEMM: 16-bit values, or 8-bit codes with f32 scales per row and
// per group of group_k columns.
struct ActView {
  ElemType type;
  const void* data;
  const float* scale;  // [rows, ceil(K/group_k)] for 8-bit types
  int64_t K;
  int64_t group_k;
  HJ_HD bool quantized() const { return type == ElemType::kE4M3 || type == ElemType::kI8; }
  HJ_HD int64_t scale_cols() const { return (K + group_k - 1) / group_k; }
};

HJ_HD float act_value(const ActView& a, int64_t r, int64_t k) {
  const float v = load_elem(a.type, a.data, r * a.K + k);
  return a.quantized() ? v * a.scale[r * a.scale_cols() + k / a.group_k] : v;
}

// ----------------------------------------------------------------------------------------
// Activations and dynamic quantization.
// ----------------------------------------------------------------------------------------
HJ_HD float silu(float x) { return x / (1.0f + expf(-x)); }
HJ_HD float gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
HJ_HD float gelu_tanh(float x) {
  return 0.5f * x * (1.0f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
}

// A gated activation of (gate, up); `limit` < 0 means no clamp.
HJ_HD float activation_gated(Activation a, float g, float u, float limit) {
  switch (a) {
    case Activation::kSilu:
      if (limit >= 0.f) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
      }
      return silu(g) * u;
    case Activation::kGelu: return gelu_erf(g) * u;
    case Activation::kGeluTanh: return gelu_tanh(g) * u;
    case Activation::kSwigluOai: {
      g = fminf(g, limit);
      u = fminf(fmaxf(u, -limit), limit);
      return (u + 1.0f) * g / (1.0f + expf(-1.702f * g));
    }
    default: return bits_to_float(0x7fc00000u);
  }
}

HJ_HD float activation_single(Activation a, float x) {
  switch (a) {
    case Activation::kSiluNoMul: return silu(x);
    case Activation::kGeluNoMul: return gelu_erf(x);
    case Activation::kGeluTanhNoMul: return gelu_tanh(x);
    case Activation::kRelu2NoMul: {
      const float r = x > 0.f ? x : 0.f;
      return r * r;
    }
    default: return bits_to_float(0x7fc00000u);
  }
}

// Gate and up columns of output column i for a gated activation over N1 = 2 * I columns.
HJ_HD void gated_columns(Activation a, int64_t i, int64_t I, int64_t* gate, int64_t* up) {
  if (a == Activation::kSwigluOai) {
    *gate = 2 * i;
    *up = 2 * i + 1;
  } else {
    *gate = i;
    *up = I + i;
  }
}

HJ_HD float quant_max(ActQuant q) { return q == ActQuant::kFp8E4M3 ? 448.0f : 127.0f; }

// scale = absmax / qmax; a zero group gets scale 0 and codes 0.
HJ_HD float quant_scale(ActQuant q, float absmax) { return absmax / quant_max(q); }
HJ_HD float quant_code_value(float v, float scale) { return scale > 0.f ? v / scale : 0.f; }

}  // namespace hj
