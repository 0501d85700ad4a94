// Host-side pieces shared by the CPU and CUDA handlers: the operand lists of every custom call
// (one binding template per call, instantiated once per platform), shape checks, and the rule
// that no result overlaps an operand unless the call declares that alias.
#pragma once

#include <cstdint>
#include <climits>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "moe_contract.h"
#include "rs4_k_order.h"
#include "xla/ffi/api/ffi.h"

namespace hj {

namespace ffi = xla::ffi;

using ffi::AnyBuffer;
using ffi::Error;
using ffi::Result;

#define HJ_RETURN_IF_ERROR(expr)          \
  do {                                    \
    ::xla::ffi::Error _hj_err = (expr);   \
    if (!_hj_err.success()) return _hj_err; \
  } while (0)

inline Error invalid(const std::string& call, const std::string& what) {
  return Error::InvalidArgument("humming_jax." + call + ": " + what);
}

inline std::string dims_str(const AnyBuffer& b) {
  std::string s = "[";
  bool first = true;
  for (int64_t d : b.dimensions()) {
    if (!first) s += ", ";
    s += std::to_string(d);
    first = false;
  }
  return s + "]";
}

inline int64_t dim(const AnyBuffer& b, size_t i) { return b.dimensions()[i]; }
inline size_t rank(const AnyBuffer& b) { return b.dimensions().size(); }

inline Error expect_rank(const std::string& call, const char* name, const AnyBuffer& b, size_t r) {
  if (rank(b) != r)
    return invalid(call, std::string(name) + " must have rank " + std::to_string(r) + ", got " + dims_str(b));
  return Error::Success();
}

inline Error expect_shape(const std::string& call, const char* name, const AnyBuffer& b,
                          std::initializer_list<int64_t> shape) {
  bool ok = rank(b) == shape.size();
  size_t i = 0;
  for (int64_t d : shape) {
    if (!ok) break;
    ok = dim(b, i++) == d;
  }
  if (!ok) {
    std::string want = "[";
    bool first = true;
    for (int64_t d : shape) {
      if (!first) want += ", ";
      want += std::to_string(d);
      first = false;
    }
    return invalid(call, std::string(name) + " must have shape " + want + "], got " + dims_str(b));
  }
  return Error::Success();
}

inline ElemType elem_type_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return ElemType::kF32;
    case ffi::DataType::BF16: return ElemType::kBF16;
    case ffi::DataType::F16: return ElemType::kF16;
    case ffi::DataType::F8E4M3FN: return ElemType::kE4M3;
    case ffi::DataType::S8: return ElemType::kI8;
    case ffi::DataType::U8: return ElemType::kU8;
    default: return ElemType::kInvalid;
  }
}

inline bool is_16bit_float(ElemType t) { return t == ElemType::kBF16 || t == ElemType::kF16; }

inline Error expect_16bit(const std::string& call, const char* name, const AnyBuffer& b) {
  if (!is_16bit_float(elem_type_of(b.element_type())))
    return invalid(call, std::string(name) + " must be bfloat16 or float16");
  return Error::Success();
}

inline Error expect_s32(const std::string& call, const char* name, const AnyBuffer& b) {
  if (b.element_type() != ffi::DataType::S32) return invalid(call, std::string(name) + " must be int32");
  return Error::Success();
}

// --- The workspace rule (SPEC §5): results never overlap operands they do not alias. -----
struct Span {
  const char* name;
  const void* ptr;
  size_t bytes;
};

inline Span span_of(const char* name, const AnyBuffer& b) { return {name, b.untyped_data(), b.size_bytes()}; }

inline bool overlaps(const Span& a, const Span& b) {
  if (a.bytes == 0 || b.bytes == 0) return false;
  const auto a0 = reinterpret_cast<uintptr_t>(a.ptr), b0 = reinterpret_cast<uintptr_t>(b.ptr);
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

// Checks every (result, operand) pair and every pair of results.
inline Error check_no_overlap(const std::string& call, std::initializer_list<Span> results,
                              std::initializer_list<Span> operands) {
  for (const Span& r : results) {
    for (const Span& o : operands)
      if (overlaps(r, o))
        return Error::Internal("humming_jax." + call + ": result '" + r.name + "' overlaps operand '" +
                               o.name + "', which the call does not alias");
    for (const Span& r2 : results)
      if (&r != &r2 && overlaps(r, r2))
        return Error::Internal("humming_jax." + call + ": results '" + r.name + "' and '" + r2.name +
                               "' overlap");
  }
  return Error::Success();
}

// ----------------------------------------------------------------------------------------
// Weights: parsed once, the same way for both platforms.
// ----------------------------------------------------------------------------------------
struct WeightAttrs {
  int64_t weight_type, group_n, group_k, has_zero, has_scale2, has_bias;
};

// qweight [E, N, Kb], scale [E, ceil(N/gn), ceil(K/gk)] (or [1] for float weights),
// zero (same grid, uint8, or [1]), scale2 [E] f32 (or [1]), bias [E, N] f32 (or [1]).
inline Error parse_weights(const std::string& call, const AnyBuffer& qweight, const AnyBuffer& scale,
                           const AnyBuffer& zero, const AnyBuffer& scale2, const AnyBuffer& bias,
                           const WeightAttrs& at, int64_t K, WeightView* w) {
  HJ_RETURN_IF_ERROR(expect_rank(call, "qweight", qweight, 3));
  w->type = static_cast<WeightType>(at.weight_type);
  w->E = dim(qweight, 0);
  w->N = dim(qweight, 1);
  w->K = K;
  w->group_n = at.group_n;
  w->group_k = at.group_k;
  w->data = qweight.untyped_data();
  w->data_type = elem_type_of(qweight.element_type());
  w->scale = nullptr;
  w->scale_type = ElemType::kInvalid;
  w->zero = nullptr;
  w->scale2 = nullptr;
  w->bias = nullptr;
  switch (w->type) {
    case WeightType::kFloat:
      if (!is_16bit_float(w->data_type) && w->data_type != ElemType::kF32)
        return invalid(call, "float weights must be bfloat16, float16 or float32");
      break;
    case WeightType::kUInt4:
    case WeightType::kFp4E2M1:
      if (w->data_type != ElemType::kU8) return invalid(call, "4-bit weights must be packed as uint8");
      if (K % 2) return invalid(call, "4-bit weights need an even K");
      break;
    case WeightType::kInt8:
      if (w->data_type != ElemType::kI8) return invalid(call, "int8 weights must be int8");
      break;
    case WeightType::kFp8E4M3:
      if (w->data_type != ElemType::kE4M3 && w->data_type != ElemType::kU8)
        return invalid(call, "fp8 weights must be float8_e4m3fn");
      break;
    default: return invalid(call, "unknown weight_type " + std::to_string(at.weight_type));
  }
  if (dim(qweight, 2) != w->row_bytes())
    return invalid(call, "qweight " + dims_str(qweight) + " does not hold K = " + std::to_string(K) +
                             " per row");
  if (w->type != WeightType::kFloat) {
    if (at.group_n <= 0 || at.group_k <= 0) return invalid(call, "group sizes must be positive");
    HJ_RETURN_IF_ERROR(expect_shape(call, "scale", scale, {w->E, w->scale_rows(), w->scale_cols()}));
    w->scale = scale.untyped_data();
    w->scale_type = elem_type_of(scale.element_type());
    if (w->scale_type == ElemType::kU8) w->scale_type = ElemType::kE8M0;
    if (w->scale_type == ElemType::kInvalid || w->scale_type == ElemType::kI8)
      return invalid(call, "unsupported scale dtype");
    if (at.has_zero) {
      if (w->type != WeightType::kUInt4) return invalid(call, "zero points apply to 4-bit integer weights only");
      HJ_RETURN_IF_ERROR(expect_shape(call, "zero", zero, {w->E, w->scale_rows(), w->scale_cols()}));
      if (zero.element_type() != ffi::DataType::U8) return invalid(call, "zero points must be uint8");
      w->zero = static_cast<const uint8_t*>(zero.untyped_data());
    }
    if (at.has_scale2) {
      HJ_RETURN_IF_ERROR(expect_shape(call, "scale2", scale2, {w->E}));
      if (scale2.element_type() != ffi::DataType::F32) return invalid(call, "scale2 must be float32");
      w->scale2 = static_cast<const float*>(scale2.untyped_data());
    }
  }
  if (at.has_bias) {
    HJ_RETURN_IF_ERROR(expect_shape(call, "bias", bias, {w->E, w->N}));
    if (bias.element_type() != ffi::DataType::F32) return invalid(call, "bias must be float32");
    w->bias = static_cast<const float*>(bias.untyped_data());
  }
  return Error::Success();
}

// a [..., K] (16-bit, or fp8/int8 codes with a_scale [rows, ceil(K/group_k)] f32).
inline Error parse_activations(const std::string& call, const AnyBuffer& a, const AnyBuffer& a_scale,
                               int64_t act_group_k, int64_t rows, ActView* v) {
  v->type = elem_type_of(a.element_type());
  v->data = a.untyped_data();
  v->K = dim(a, rank(a) - 1);
  v->group_k = act_group_k > 0 ? act_group_k : v->K;
  v->scale = nullptr;
  if (v->quantized()) {
    if (a_scale.element_type() != ffi::DataType::F32) return invalid(call, "a_scale must be float32");
    HJ_RETURN_IF_ERROR(expect_shape(call, "a_scale", a_scale, {rows, v->scale_cols()}));
    v->scale = static_cast<const float*>(a_scale.untyped_data());
  } else if (!is_16bit_float(v->type)) {
    return invalid(call, "activations must be bfloat16, float16, float8_e4m3fn or int8");
  }
  return Error::Success();
}

// A GEMM problem: c[r, n] = round_c(sum_k a'(r, k) * w'(e, n, k) + bias[e, n]), where a' is
// the activation value (dequantized for 8-bit codes) and w' the weight value, rounded to the
// activation type when the activations are 16-bit.
struct GemmProblem {
  ActView a;
  WeightView w;
  ElemType c_type;
  void* c;
  int64_t N, K;
  // gemm_grouped with a_k_order = 1: a's 16-bit rows are in the 4-bit prefill mainloop's k order
  // (rs4_k_order.h), which only that mainloop (and the CPU handler) reads.
  bool a_k_order = false;
};

struct GemmAttrs {
  WeightAttrs weights;
  int64_t act_group_k;
};

// The GEMM attributes in the order every gemm_* binding declares them (HJ_GEMM_ATTRS).
inline GemmAttrs gemm_attrs(int64_t wt, int64_t gn, int64_t gk, int64_t hz, int64_t hs2, int64_t hb,
                            int64_t agk) {
  return GemmAttrs{WeightAttrs{wt, gn, gk, hz, hs2, hb}, agk};
}

inline Error parse_gemm(const std::string& call, const AnyBuffer& a, const AnyBuffer& a_scale,
                        const AnyBuffer& qweight, const AnyBuffer& scale, const AnyBuffer& zero,
                        const AnyBuffer& scale2, const AnyBuffer& bias, const GemmAttrs& at,
                        const AnyBuffer& c, GemmProblem* p) {
  if (rank(a) < 2) return invalid(call, "a must have rank 2 or 3, got " + dims_str(a));
  if (rank(c) != rank(a)) return invalid(call, "c must have the rank of a");
  int64_t a_rows = 1;
  for (size_t i = 0; i + 1 < rank(a); ++i) {
    a_rows *= dim(a, i);
  }
  HJ_RETURN_IF_ERROR(parse_activations(call, a, a_scale, at.act_group_k, a_rows, &p->a));
  p->K = p->a.K;
  HJ_RETURN_IF_ERROR(parse_weights(call, qweight, scale, zero, scale2, bias, at.weights, p->K, &p->w));
  p->N = p->w.N;
  p->c_type = elem_type_of(c.element_type());
  if (!is_16bit_float(p->c_type)) return invalid(call, "c must be bfloat16 or float16");
  if (dim(c, rank(c) - 1) != p->N)
    return invalid(call, "c " + dims_str(c) + " must have N = " + std::to_string(p->N) + " columns");
  if (p->w.type == WeightType::kFloat && p->w.data_type != p->a.type)
    return invalid(call, "16-bit weights must have the activations' dtype");
  p->c = c.untyped_data();
  return check_no_overlap(call, {span_of("c", c)},
                          {span_of("a", a), span_of("a_scale", a_scale), span_of("qweight", qweight),
                           span_of("scale", scale), span_of("zero", zero), span_of("scale2", scale2),
                           span_of("bias", bias)});
}

// The weight value a GEMM multiplies with (see GemmProblem).
HJ_HD float gemm_weight(const GemmProblem& p, int64_t e, int64_t n, int64_t k) {
  const float v = weight_value(p.w, e, n, k);
  return p.a.quantized() ? v : round_to(p.a.type, v);
}

struct IndexedLayout {
  const int32_t* sorted_ids;
  const int32_t* block_expert_ids;
  const int32_t* num_tokens_post_padded;
  int64_t padded_rows, num_blocks, block_m, gather_div, a_rows, c_rows;
};

inline Error check_indexed_layout(const std::string& call, const AnyBuffer& a, const AnyBuffer& c,
                                  const AnyBuffer& sorted_ids, const AnyBuffer& block_expert_ids,
                                  const AnyBuffer& ntpp, int64_t gather_div, int64_t block_m,
                                  IndexedLayout* l) {
  if (rank(a) != 2) return invalid(call, "a must be [rows, K]");
  HJ_RETURN_IF_ERROR(expect_rank(call, "sorted_ids", sorted_ids, 1));
  HJ_RETURN_IF_ERROR(expect_s32(call, "sorted_ids", sorted_ids));
  HJ_RETURN_IF_ERROR(expect_rank(call, "block_expert_ids", block_expert_ids, 1));
  HJ_RETURN_IF_ERROR(expect_s32(call, "block_expert_ids", block_expert_ids));
  HJ_RETURN_IF_ERROR(expect_shape(call, "num_tokens_post_padded", ntpp, {1}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "num_tokens_post_padded", ntpp));
  if (block_m <= 0 || gather_div <= 0) return invalid(call, "block_m and gather_div must be positive");
  l->padded_rows = dim(sorted_ids, 0);
  l->num_blocks = dim(block_expert_ids, 0);
  if (l->padded_rows != l->num_blocks * block_m)
    return invalid(call, "sorted_ids must hold block_m rows per entry of block_expert_ids");
  l->sorted_ids = static_cast<const int32_t*>(sorted_ids.untyped_data());
  l->block_expert_ids = static_cast<const int32_t*>(block_expert_ids.untyped_data());
  l->num_tokens_post_padded = static_cast<const int32_t*>(ntpp.untyped_data());
  l->block_m = block_m;
  l->gather_div = gather_div;
  l->a_rows = dim(a, 0);
  l->c_rows = dim(c, 0);
  return check_no_overlap(call, {span_of("c", c)},
                          {span_of("sorted_ids", sorted_ids), span_of("block_expert_ids", block_expert_ids),
                           span_of("num_tokens_post_padded", ntpp)});
}

inline Error check_grouped_layout(const std::string& call, const AnyBuffer& a, const AnyBuffer& c,
                                  const AnyBuffer& offsets, int64_t num_experts) {
  if (rank(a) != 2) return invalid(call, "a must be [rows, K]");
  if (dim(c, 0) != dim(a, 0)) return invalid(call, "c must have the rows of a");
  HJ_RETURN_IF_ERROR(expect_shape(call, "expert_first_token_offset", offsets, {num_experts + 1}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "expert_first_token_offset", offsets));
  return check_no_overlap(call, {span_of("c", c)}, {span_of("expert_first_token_offset", offsets)});
}

// gemm_grouped's workspace: a uint8 vector, a result like c, so it overlaps neither c nor any
// operand (SPEC §5). Its size is the wrapper's bound; the kernel that uses it checks it is enough.
inline Error check_grouped_workspace(const std::string& call, const AnyBuffer& workspace, const AnyBuffer& c,
                                     const AnyBuffer& a, const AnyBuffer& a_scale, const AnyBuffer& qweight,
                                     const AnyBuffer& scale, const AnyBuffer& zero, const AnyBuffer& scale2,
                                     const AnyBuffer& bias, const AnyBuffer& offsets) {
  HJ_RETURN_IF_ERROR(expect_rank(call, "workspace", workspace, 1));
  if (workspace.element_type() != ffi::DataType::U8) return invalid(call, "workspace must be uint8");
  return check_no_overlap(call, {span_of("workspace", workspace), span_of("c", c)},
                          {span_of("a", a), span_of("a_scale", a_scale), span_of("qweight", qweight),
                           span_of("scale", scale), span_of("zero", zero), span_of("scale2", scale2),
                           span_of("bias", bias), span_of("expert_first_token_offset", offsets)});
}

// Everything a gemm_grouped handler checks before it runs, on either platform.
inline Error parse_gemm_grouped(const std::string& call, const AnyBuffer& a, const AnyBuffer& a_scale,
                                const AnyBuffer& qweight, const AnyBuffer& scale, const AnyBuffer& zero,
                                const AnyBuffer& scale2, const AnyBuffer& bias, const AnyBuffer& offsets,
                                const GemmAttrs& at, const AnyBuffer& c, const AnyBuffer& workspace,
                                GemmProblem* p) {
  HJ_RETURN_IF_ERROR(parse_gemm(call, a, a_scale, qweight, scale, zero, scale2, bias, at, c, p));
  HJ_RETURN_IF_ERROR(check_grouped_layout(call, a, c, offsets, p->w.E));
  return check_grouped_workspace(call, workspace, c, a, a_scale, qweight, scale, zero, scale2, bias, offsets);
}

// A k-order attribute (`name`): 0, or 1 for 16-bit rows (`rows`: what they are called in the message)
// whose `cols` columns are a multiple of the order's tile (`cols_name`).
inline Error check_order_attr(const std::string& call, const char* name, int64_t value, bool sixteen_bit,
                              const char* rows, int64_t cols, const char* cols_name) {
  const std::string attr(name);
  if (value != 0 && value != 1) return invalid(call, attr + " must be 0 or 1, got " + std::to_string(value));
  if (value == 1 && !sixteen_bit) return invalid(call, attr + " = 1 needs " + rows);
  if (value == 1 && cols % kRs4OrderTile)
    return invalid(call, attr + " = 1 needs " + cols_name + " a multiple of " + std::to_string(kRs4OrderTile) +
                             ", got " + std::to_string(cols));
  return Error::Success();
}

// a_k_order of gemm_grouped: 0, or 1 for 16-bit activations (no scales) whose K is a multiple of the
// order's tile.
inline Error check_a_k_order(const std::string& call, int64_t a_k_order, GemmProblem* p) {
  const bool sixteen_bit = !p->a.quantized() && (p->a.type == ElemType::kBF16 || p->a.type == ElemType::kF16);
  HJ_RETURN_IF_ERROR(check_order_attr(call, "a_k_order", a_k_order, sixteen_bit,
                                      "16-bit activations without scales", p->K, "K"));
  p->a_k_order = a_k_order == 1;
  return Error::Success();
}

// gemm_grouped_gated: the grouped GEMM into c, then y [R, N / 2] = the gated activation of c's rows.
// A gated call's activation code: a gated Activation.
inline Error check_gated_activation(const std::string& call, int64_t activation) {
  if (activation < 0 || activation >= kNumActivations || !activation_is_gated(static_cast<Activation>(activation)))
    return invalid(call, "activation " + std::to_string(activation) + " is not a gated activation");
  return Error::Success();
}

// A gated call's y: [rows of c, N / 2] of c's dtype for an even N, apart from the GEMM's operands.
inline Error check_gated_y(const std::string& call, const AnyBuffer& y, const AnyBuffer& c, int64_t N,
                           std::initializer_list<Span> operands) {
  if (N % 2) return invalid(call, "a gated activation needs an even number of weight rows, got N = " +
                                  std::to_string(N));
  HJ_RETURN_IF_ERROR(expect_shape(call, "y", y, {dim(c, 0), N / 2}));
  if (y.element_type() != c.element_type()) return invalid(call, "y must have c's dtype");
  return check_no_overlap(call, {span_of("y", y)}, operands);
}

inline Error parse_gemm_grouped_gated(const std::string& call, const AnyBuffer& a, const AnyBuffer& a_scale,
                                      const AnyBuffer& qweight, const AnyBuffer& scale, const AnyBuffer& zero,
                                      const AnyBuffer& scale2, const AnyBuffer& bias, const AnyBuffer& offsets,
                                      const GemmAttrs& at, int64_t activation, const AnyBuffer& y, const AnyBuffer& c,
                                      const AnyBuffer& workspace, GemmProblem* p) {
  HJ_RETURN_IF_ERROR(check_gated_activation(call, activation));
  HJ_RETURN_IF_ERROR(parse_gemm_grouped(call, a, a_scale, qweight, scale, zero, scale2, bias, offsets, at, c,
                                        workspace, p));
  return check_gated_y(call, y, c, p->N,
                       {span_of("a", a), span_of("a_scale", a_scale), span_of("qweight", qweight),
                        span_of("scale", scale), span_of("zero", zero), span_of("scale2", scale2),
                        span_of("bias", bias), span_of("expert_first_token_offset", offsets), span_of("c", c),
                        span_of("workspace", workspace)});
}

// gemm_grouped_gather's room for the permuted rows at the end of its workspace (a path that does
// not gather permutes x there first): R x K values of `elem_bytes`, plus the slack for aligning its
// start (humming_jax/ops/gemm.py, gather_copy_bytes).
constexpr int64_t kGatherCopyAlign = 256;
inline int64_t gather_copy_bytes(int64_t R, int64_t K, int64_t elem_bytes) { return R * K * elem_bytes + kGatherCopyAlign; }

// gemm_grouped_gather: x [M, K] 16-bit, permutation [R = M * top_k] int32, c [R, N]; row r of the
// problem is x[permutation[r] / top_k] (below the last offset and for an id in [0, R); zeros
// elsewhere, as permute_rows makes them). *R: the problem's rows.
inline Error parse_gemm_grouped_gather(const std::string& call, const AnyBuffer& x, const AnyBuffer& a_scale,
                                       const AnyBuffer& qweight, const AnyBuffer& scale, const AnyBuffer& zero,
                                       const AnyBuffer& scale2, const AnyBuffer& bias, const AnyBuffer& permutation,
                                       const AnyBuffer& offsets, const GemmAttrs& at, int64_t top_k,
                                       const AnyBuffer& c, const AnyBuffer& workspace, GemmProblem* p, int64_t* R) {
  if (rank(x) != 2) return invalid(call, "x must be [M, K], got " + dims_str(x));
  HJ_RETURN_IF_ERROR(expect_16bit(call, "x", x));
  HJ_RETURN_IF_ERROR(parse_gemm(call, x, a_scale, qweight, scale, zero, scale2, bias, at, c, p));
  if (top_k <= 0) return invalid(call, "top_k must be positive");
  HJ_RETURN_IF_ERROR(expect_rank(call, "permutation", permutation, 1));
  HJ_RETURN_IF_ERROR(expect_s32(call, "permutation", permutation));
  *R = dim(permutation, 0);
  if (*R != dim(x, 0) * top_k) return invalid(call, "permutation must have M * top_k entries");
  if (dim(c, 0) != *R) return invalid(call, "c must have M * top_k rows");
  HJ_RETURN_IF_ERROR(expect_shape(call, "expert_first_token_offset", offsets, {p->w.E + 1}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "expert_first_token_offset", offsets));
  HJ_RETURN_IF_ERROR(check_no_overlap(call, {span_of("c", c)},
                                      {span_of("permutation", permutation),
                                       span_of("expert_first_token_offset", offsets)}));
  HJ_RETURN_IF_ERROR(check_grouped_workspace(call, workspace, c, x, a_scale, qweight, scale, zero, scale2, bias,
                                             offsets));
  return check_no_overlap(call, {span_of("workspace", workspace)}, {span_of("permutation", permutation)});
}

inline Error check_batched_layout(const std::string& call, const AnyBuffer& a, const AnyBuffer& c,
                                  const AnyBuffer& counts, int64_t num_experts) {
  if (rank(a) != 3) return invalid(call, "a must be [E, T, K]");
  if (dim(a, 0) != num_experts) return invalid(call, "a must have one slab per local expert");
  if (dim(c, 0) != dim(a, 0) || dim(c, 1) != dim(a, 1)) return invalid(call, "c must be [E, T, N]");
  HJ_RETURN_IF_ERROR(expect_shape(call, "expert_num_tokens", counts, {num_experts}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "expert_num_tokens", counts));
  return check_no_overlap(call, {span_of("c", c)}, {span_of("expert_num_tokens", counts)});
}

// ----------------------------------------------------------------------------------------
// Operand lists, one per custom call, written once for both platforms. `PlatformCtx` is the platform
// context (void on CPU, PlatformStream<cudaStream_t> on CUDA). Bindings cannot be moved, so each
// list is one expression that starts from bind_base.
// ----------------------------------------------------------------------------------------
template <typename PlatformCtx>
auto bind_base() {
  if constexpr (std::is_void_v<PlatformCtx>) {
    return ffi::Ffi::Bind();
  } else {
    return ffi::Ffi::Bind().template Ctx<PlatformCtx>();
  }
}

// a, a_scale, qweight, scale, zero, scale2, bias
#define HJ_GEMM_OPERANDS                                                                    \
  .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()            \
      .template Arg<AnyBuffer>().template Arg<AnyBuffer>().template Arg<AnyBuffer>()        \
      .template Arg<AnyBuffer>()

#define HJ_GEMM_ATTRS                                                                         \
  .template Attr<int64_t>("weight_type").template Attr<int64_t>("group_n")                    \
      .template Attr<int64_t>("group_k").template Attr<int64_t>("has_zero")                   \
      .template Attr<int64_t>("has_scale2").template Attr<int64_t>("has_bias")                \
      .template Attr<int64_t>("act_group_k")

// gemm_indexed(a, a_scale, w..., sorted_ids, block_expert_ids, num_tokens_post_padded) -> c
template <typename PlatformCtx>
auto bind_gemm_indexed() {
  return bind_base<PlatformCtx>() HJ_GEMM_OPERANDS
      .template Arg<AnyBuffer>()  // sorted_ids
      .template Arg<AnyBuffer>()  // block_expert_ids
      .template Arg<AnyBuffer>()  // num_tokens_post_padded
      .template Ret<AnyBuffer>()  // c [M * top_k, N]
      HJ_GEMM_ATTRS
      .template Attr<int64_t>("gather_div")
      .template Attr<int64_t>("block_m");
}

// gemm_indexed_quant(x, (unused), w..., sorted_ids, block_expert_ids, num_tokens_post_padded)
//   -> c, q, q_scale: gemm_indexed of quantize(x), or of activation_quant(x, activation, limit)
//   when activation >= 0 (the codes and scales also land in q / q_scale, except where a kernel
//   quantizes as it loads: then their contents are unspecified)
template <typename PlatformCtx>
auto bind_gemm_indexed_quant() {
  return bind_base<PlatformCtx>() HJ_GEMM_OPERANDS
      .template Arg<AnyBuffer>()  // sorted_ids
      .template Arg<AnyBuffer>()  // block_expert_ids
      .template Arg<AnyBuffer>()  // num_tokens_post_padded
      .template Ret<AnyBuffer>()  // c [M * top_k, N]
      .template Ret<AnyBuffer>()  // q [M, K]: fp8 e4m3 or int8 codes of (the activation of) x
      .template Ret<AnyBuffer>()  // q_scale [M, groups] f32
      HJ_GEMM_ATTRS
      .template Attr<int64_t>("gather_div")
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("activation")  // -1: none
      .template Attr<float>("limit");
}

// gemm_indexed_gated(a, a_scale, w..., sorted_ids, block_expert_ids, num_tokens_post_padded)
//   -> y, c: activation(gemm_indexed(a), activation, limit) for a gated activation, y [M * top_k,
//   N / 2] (c [M * top_k, N] holds the GEMM's rows where a kernel needs them; otherwise its
//   contents are unspecified)
template <typename PlatformCtx>
auto bind_gemm_indexed_gated() {
  return bind_base<PlatformCtx>() HJ_GEMM_OPERANDS
      .template Arg<AnyBuffer>()  // sorted_ids
      .template Arg<AnyBuffer>()  // block_expert_ids
      .template Arg<AnyBuffer>()  // num_tokens_post_padded
      .template Ret<AnyBuffer>()  // y [M * top_k, N / 2]
      .template Ret<AnyBuffer>()  // c [M * top_k, N]
      HJ_GEMM_ATTRS
      .template Attr<int64_t>("gather_div")
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("activation")
      .template Attr<float>("limit");
}

// The first operands of the experts_* and layer_* calls: x, then w13's and w2's qweight,
// scale, zero, scale2 and bias.
#define HJ_EXPERTS_X_AND_WEIGHTS                                                                 \
  .template Arg<AnyBuffer>()                      /* x [M, H] */                                 \
      .template Arg<AnyBuffer>()                  /* w13: qweight */                             \
      .template Arg<AnyBuffer>()                  /*      scale */                               \
      .template Arg<AnyBuffer>()                  /*      zero */                                \
      .template Arg<AnyBuffer>()                  /*      scale2 */                              \
      .template Arg<AnyBuffer>()                  /*      bias */                                \
      .template Arg<AnyBuffer>()                  /* w2: qweight */                              \
      .template Arg<AnyBuffer>()                  /*     scale */                                \
      .template Arg<AnyBuffer>()                  /*     zero */                                 \
      .template Arg<AnyBuffer>()                  /*     scale2 */                               \
      .template Arg<AnyBuffer>()                  /*     bias */

// The operands of the experts_* calls: x and the weights, then the routing's sorted_ids,
// block_expert_ids and num_tokens_post_padded.
#define HJ_EXPERTS_OPERANDS                                                                      \
  HJ_EXPERTS_X_AND_WEIGHTS                                                                       \
      .template Arg<AnyBuffer>()                  /* sorted_ids */                               \
      .template Arg<AnyBuffer>()                  /* block_expert_ids */                         \
      .template Arg<AnyBuffer>()                  /* num_tokens_post_padded */

// GEMM1's weight attributes under gemm_indexed's names, GEMM2's with the prefix down_.
#define HJ_EXPERTS_WEIGHT_ATTRS                                                                  \
  .template Attr<int64_t>("weight_type").template Attr<int64_t>("group_n")                       \
      .template Attr<int64_t>("group_k").template Attr<int64_t>("has_zero")                      \
      .template Attr<int64_t>("has_scale2").template Attr<int64_t>("has_bias")                   \
      .template Attr<int64_t>("down_weight_type").template Attr<int64_t>("down_group_n")         \
      .template Attr<int64_t>("down_group_k").template Attr<int64_t>("down_has_zero")            \
      .template Attr<int64_t>("down_has_scale2").template Attr<int64_t>("down_has_bias")

// The results of experts_indexed; layer_indexed returns them after out.
#define HJ_EXPERTS_INDEXED_RESULTS                                                               \
  .template Ret<AnyBuffer>()                  /* d [M * top_k, H] */                             \
      .template Ret<AnyBuffer>()              /* y [M * top_k, I] */                             \
      .template Ret<AnyBuffer>()              /* c [M * top_k, 2 I] */

// The results of experts_indexed_quant; layer_indexed_quant returns them after out.
#define HJ_EXPERTS_INDEXED_QUANT_RESULTS                                                         \
  .template Ret<AnyBuffer>()                  /* d [M * top_k, H] */                             \
      .template Ret<AnyBuffer>()              /* c [M * top_k, N1] */                            \
      .template Ret<AnyBuffer>()              /* q1 [M, H] */                                    \
      .template Ret<AnyBuffer>()              /* q1_scale [M, groups] f32 */                     \
      .template Ret<AnyBuffer>()              /* q2 [M * top_k, I] */                            \
      .template Ret<AnyBuffer>()              /* q2_scale [M * top_k, groups] f32 */

// The results of routing_indexed; the layer_* calls return them last.
#define HJ_ROUTING_INDEXED_RESULTS                                                               \
  .template Ret<AnyBuffer>()                  /* sorted_ids [P] */                               \
      .template Ret<AnyBuffer>()              /* block_expert_ids [P / block_m] */               \
      .template Ret<AnyBuffer>()              /* num_tokens_post_padded [1] */                   \
      .template Ret<AnyBuffer>()              /* src_rows [M, top_k] */

// experts_indexed(x, w13..., w2..., sorted_ids, block_expert_ids, num_tokens_post_padded)
//   -> d, y, c: the indexed layer's two GEMMs with a gated activation between them in one call,
//   y = gemm_indexed_gated(x, w13) [M * top_k, I] and d = gemm_indexed(y, w2) [M * top_k, H]
//   (c as in gemm_indexed_gated); 16-bit activations.
template <typename PlatformCtx>
auto bind_experts_indexed() {
  return bind_base<PlatformCtx>() HJ_EXPERTS_OPERANDS HJ_EXPERTS_INDEXED_RESULTS HJ_EXPERTS_WEIGHT_ATTRS
      .template Attr<int64_t>("gather_div")
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("activation")
      .template Attr<float>("limit");
}

// experts_indexed_quant(x, w13..., w2..., sorted_ids, block_expert_ids, num_tokens_post_padded)
//   -> d, c, q1, q1_scale, q2, q2_scale: the indexed layer's two GEMMs with 8-bit activations in
//   one call, c = gemm_indexed_quant(x, w13) [M * top_k, N1] and d = gemm_indexed_quant(c, w2,
//   activation) [M * top_k, H]; q1 / q1_scale [M, H] and q2 / q2_scale [M * top_k, I] as those
//   calls' q / q_scale (unspecified where a kernel quantizes as it loads). Both quantize with
//   act_group_k (0: per row); activation is any (-1: none, then N1 = I).
template <typename PlatformCtx>
auto bind_experts_indexed_quant() {
  return bind_base<PlatformCtx>() HJ_EXPERTS_OPERANDS HJ_EXPERTS_INDEXED_QUANT_RESULTS HJ_EXPERTS_WEIGHT_ATTRS
      .template Attr<int64_t>("act_group_k")
      .template Attr<int64_t>("gather_div")
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("activation")  // -1: none
      .template Attr<float>("limit");
}

// The operands of the layer_* calls: x and the weights, then topk_ids, the expert map (or a
// stand-in), topk_weights and out (operand 14, aliased to result 0).
#define HJ_LAYER_OPERANDS                                                                        \
  HJ_EXPERTS_X_AND_WEIGHTS                                                                       \
      .template Arg<AnyBuffer>()                  /* topk_ids [M, top_k] int32 */                \
      .template Arg<AnyBuffer>()                  /* expert_map [num_global] int32 */            \
      .template Arg<AnyBuffer>()                  /* topk_weights [M, top_k] f32 */              \
      .template Arg<AnyBuffer>()                  /* out [M, H] */

// layer_indexed(x, w13..., w2..., topk_ids, expert_map, topk_weights, out)
//   -> out (aliased to operand 14), d, y, c, sorted_ids, block_expert_ids, num_tokens_post_padded,
//   src_rows: the indexed layer in one call, routing_indexed(topk_ids, expert_map), then
//   experts_indexed over that routing (gather_div = top_k), then finalize(d, topk_weights,
//   src_rows, out); 16-bit activations, a gated activation. Every result but out is the call's
//   scratch. identity_map as routing_indexed's; num_local_experts is the weights' E.
template <typename PlatformCtx>
auto bind_layer_indexed() {
  return bind_base<PlatformCtx>() HJ_LAYER_OPERANDS
      .template Ret<AnyBuffer>()  // out
      HJ_EXPERTS_INDEXED_RESULTS HJ_ROUTING_INDEXED_RESULTS HJ_EXPERTS_WEIGHT_ATTRS
      .template Attr<int64_t>("num_local_experts")
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("identity_map")
      .template Attr<int64_t>("activation")
      .template Attr<float>("limit");
}

// layer_indexed_quant(x, w13..., w2..., topk_ids, expert_map, topk_weights, out)
//   -> out (aliased to operand 14), d, c, q1, q1_scale, q2, q2_scale, sorted_ids, block_expert_ids,
//   num_tokens_post_padded, src_rows: layer_indexed for 8-bit activations, experts_indexed_quant
//   over the routing (any activation; act_group_k as that call's) between routing_indexed and finalize.
template <typename PlatformCtx>
auto bind_layer_indexed_quant() {
  return bind_base<PlatformCtx>() HJ_LAYER_OPERANDS
      .template Ret<AnyBuffer>()  // out
      HJ_EXPERTS_INDEXED_QUANT_RESULTS HJ_ROUTING_INDEXED_RESULTS HJ_EXPERTS_WEIGHT_ATTRS
      .template Attr<int64_t>("act_group_k")
      .template Attr<int64_t>("num_local_experts")
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("identity_map")
      .template Attr<int64_t>("activation")  // -1: none
      .template Attr<float>("limit");
}

// gemm_grouped(a, a_scale, w..., expert_first_token_offset) -> c, workspace; a_k_order = 1: a's
// rows are in the 4-bit prefill mainloop's k order (rs4_k_order.h; check_a_k_order)
template <typename PlatformCtx>
auto bind_gemm_grouped() {
  return bind_base<PlatformCtx>() HJ_GEMM_OPERANDS
      .template Arg<AnyBuffer>()  // expert_first_token_offset [E + 1]
      .template Ret<AnyBuffer>()  // c [R, N]
      .template Ret<AnyBuffer>()  // workspace [bytes] uint8: scratch of the CUDA prefill kernel
      HJ_GEMM_ATTRS
      .template Attr<int64_t>("a_k_order");
}

// gemm_grouped_gated(a, a_scale, w..., expert_first_token_offset) -> y, c, workspace:
// activation(gemm_grouped(a), activation, limit) for a gated activation, y [R, N / 2] (c [R, N]
// holds the GEMM's rows where a kernel needs them; otherwise its contents are unspecified)
template <typename PlatformCtx>
auto bind_gemm_grouped_gated() {
  return bind_base<PlatformCtx>() HJ_GEMM_OPERANDS
      .template Arg<AnyBuffer>()  // expert_first_token_offset [E + 1]
      .template Ret<AnyBuffer>()  // y [R, N / 2]
      .template Ret<AnyBuffer>()  // c [R, N]
      .template Ret<AnyBuffer>()  // workspace [bytes] uint8
      HJ_GEMM_ATTRS
      .template Attr<int64_t>("activation")
      .template Attr<float>("limit");
}

// gemm_grouped_gather(x, a_scale, w..., permutation, expert_first_token_offset) -> c, workspace:
// gemm_grouped of permute_rows(x, permutation, offsets, top_k), the rows gathered where a kernel
// can (the workspace then also holds room for the permuted rows, R x K, where one cannot)
template <typename PlatformCtx>
auto bind_gemm_grouped_gather() {
  return bind_base<PlatformCtx>() HJ_GEMM_OPERANDS
      .template Arg<AnyBuffer>()  // permutation [R]
      .template Arg<AnyBuffer>()  // expert_first_token_offset [E + 1]
      .template Ret<AnyBuffer>()  // c [R, N]
      .template Ret<AnyBuffer>()  // workspace [bytes] uint8
      HJ_GEMM_ATTRS
      .template Attr<int64_t>("top_k");
}

// gemm_batched(a, a_scale, w..., expert_num_tokens) -> c
template <typename PlatformCtx>
auto bind_gemm_batched() {
  return bind_base<PlatformCtx>() HJ_GEMM_OPERANDS
      .template Arg<AnyBuffer>()  // expert_num_tokens [E]
      .template Ret<AnyBuffer>()  // c [E, T, N]
      HJ_GEMM_ATTRS;
}

// gemm_batched_into(a, a_scale, w..., expert_num_tokens, out) -> out (aliased)
template <typename PlatformCtx>
auto bind_gemm_batched_into() {
  return bind_base<PlatformCtx>() HJ_GEMM_OPERANDS
      .template Arg<AnyBuffer>()  // expert_num_tokens [E]
      .template Arg<AnyBuffer>()  // out, aliased to the result
      .template Ret<AnyBuffer>()  // out [E, T, N]
      HJ_GEMM_ATTRS;
}

// routing_indexed(topk_ids, expert_map) -> sorted_ids, block_expert_ids, num_tokens_post_padded, src_rows.
// identity_map = 1: no map; ids in [0, num_local_experts) are their own slots, every other id is
// skipped, and the expert_map operand is a stand-in (the wrapper passes topk_ids) that is not read.
template <typename PlatformCtx>
auto bind_routing_indexed() {
  return bind_base<PlatformCtx>()
      .template Arg<AnyBuffer>()  // topk_ids [M, top_k]
      .template Arg<AnyBuffer>()  // expert_map [num_global]
      HJ_ROUTING_INDEXED_RESULTS
      .template Attr<int64_t>("num_local_experts")
      .template Attr<int64_t>("block_m")
      .template Attr<int64_t>("identity_map");
}

// routing_grouped(topk_ids, expert_map) -> permutation, expert_first_token_offset, src_rows
// (identity_map as routing_indexed's).
template <typename PlatformCtx>
auto bind_routing_grouped() {
  return bind_base<PlatformCtx>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Attr<int64_t>("num_local_experts")
      .template Attr<int64_t>("identity_map");
}

// permute_rows(x, permutation, expert_first_token_offset) -> y [M * top_k, cols]; k_order = 1: y's
// rows in the 4-bit prefill mainloop's k order (rs4_k_order.h; check_k_order)
template <typename PlatformCtx>
auto bind_permute_rows() {
  return bind_base<PlatformCtx>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Attr<int64_t>("top_k")
      .template Attr<int64_t>("k_order");
}

// activation(x) -> y; k_order as permute_rows'
template <typename PlatformCtx>
auto bind_activation() {
  return bind_base<PlatformCtx>()
      .template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Attr<int64_t>("activation")
      .template Attr<float>("limit")
      .template Attr<int64_t>("k_order");
}

// activation_quant(x) -> q, scale
template <typename PlatformCtx>
auto bind_activation_quant() {
  return bind_base<PlatformCtx>()
      .template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Attr<int64_t>("activation")
      .template Attr<float>("limit")
      .template Attr<int64_t>("group_k");
}

// quantize(x) -> q, scale
template <typename PlatformCtx>
auto bind_quantize() {
  return bind_base<PlatformCtx>()
      .template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Attr<int64_t>("group_k");
}

// quantize_permuted(x, permutation, expert_first_token_offset, src_rows) -> q, scale
template <typename PlatformCtx>
auto bind_quantize_permuted() {
  return bind_base<PlatformCtx>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Ret<AnyBuffer>()
      .template Attr<int64_t>("group_k");
}

// finalize(d, topk_weights, src_rows, out) -> out (aliased)
template <typename PlatformCtx>
auto bind_finalize() {
  return bind_base<PlatformCtx>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .template Arg<AnyBuffer>()
      .template Ret<AnyBuffer>();
}

// ----------------------------------------------------------------------------------------
// Shape checks shared by both platforms.
// ----------------------------------------------------------------------------------------
struct RoutingShape {
  int64_t M, top_k, num_global, num_local;
};

inline Error check_routing_inputs(const std::string& call, const AnyBuffer& topk_ids,
                                  const AnyBuffer& expert_map, int64_t num_local, int64_t identity_map,
                                  RoutingShape* s) {
  HJ_RETURN_IF_ERROR(expect_rank(call, "topk_ids", topk_ids, 2));
  HJ_RETURN_IF_ERROR(expect_s32(call, "topk_ids", topk_ids));
  if (identity_map != 0 && identity_map != 1) return invalid(call, "identity_map must be 0 or 1");
  if (!identity_map) {
    HJ_RETURN_IF_ERROR(expect_rank(call, "expert_map", expert_map, 1));
    HJ_RETURN_IF_ERROR(expect_s32(call, "expert_map", expert_map));
  }
  if (num_local <= 0) return invalid(call, "num_local_experts must be positive");
  s->M = dim(topk_ids, 0);
  s->top_k = dim(topk_ids, 1);
  s->num_global = identity_map ? 0 : dim(expert_map, 0);  // 0: local_expert's identity
  s->num_local = num_local;
  return Error::Success();
}

// Activation call shapes: x [R, N1] -> y [R, I].
struct ActivationShape {
  int64_t R, N1, I;
};

inline Error check_activation(const std::string& call, const AnyBuffer& x, int64_t act,
                              ActivationShape* s) {
  HJ_RETURN_IF_ERROR(expect_rank(call, "x", x, 2));
  HJ_RETURN_IF_ERROR(expect_16bit(call, "x", x));
  if (act < 0 || act >= kNumActivations) return invalid(call, "unknown activation " + std::to_string(act));
  s->R = dim(x, 0);
  s->N1 = dim(x, 1);
  const bool gated = activation_is_gated(static_cast<Activation>(act));
  if (gated && s->N1 % 2) return invalid(call, "a gated activation needs an even number of columns");
  s->I = gated ? s->N1 / 2 : s->N1;
  return Error::Success();
}

inline Error check_quant_outputs(const std::string& call, const AnyBuffer& q, const AnyBuffer& scale,
                                 int64_t R, int64_t K, int64_t group_k, ActQuant* kind) {
  HJ_RETURN_IF_ERROR(expect_shape(call, "q", q, {R, K}));
  const ElemType qt = elem_type_of(q.element_type());
  if (qt == ElemType::kE4M3) *kind = ActQuant::kFp8E4M3;
  else if (qt == ElemType::kI8) *kind = ActQuant::kInt8;
  else return invalid(call, "quantized output must be float8_e4m3fn or int8");
  if (group_k < 0 || (group_k > 0 && K % group_k))
    return invalid(call, "group_k must divide K = " + std::to_string(K));
  const int64_t groups = group_k > 0 ? K / group_k : 1;
  HJ_RETURN_IF_ERROR(expect_shape(call, "scale", scale, {R, groups}));
  if (scale.element_type() != ffi::DataType::F32) return invalid(call, "scale must be float32");
  return Error::Success();
}

inline Error check_finalize(const std::string& call, const AnyBuffer& d, const AnyBuffer& w,
                            const AnyBuffer& src_rows, const AnyBuffer& out) {
  HJ_RETURN_IF_ERROR(expect_rank(call, "d", d, 2));
  HJ_RETURN_IF_ERROR(expect_16bit(call, "d", d));
  HJ_RETURN_IF_ERROR(expect_rank(call, "out", out, 2));
  if (out.element_type() != d.element_type()) return invalid(call, "out must have the dtype of d");
  if (dim(out, 1) != dim(d, 1)) return invalid(call, "out and d must have the same number of columns");
  HJ_RETURN_IF_ERROR(expect_rank(call, "topk_weights", w, 2));
  if (w.element_type() != ffi::DataType::F32) return invalid(call, "topk_weights must be float32");
  if (dim(w, 0) != dim(out, 0)) return invalid(call, "topk_weights rows must match out rows");
  HJ_RETURN_IF_ERROR(expect_shape(call, "src_rows", src_rows, {dim(w, 0), dim(w, 1)}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "src_rows", src_rows));
  return Error::Success();
}


// --- Result checks shared by both platforms (each handler runs them before touching memory). --

// routing_indexed: sorted_ids [P], block_expert_ids [P / block_m], num_tokens_post_padded [1],
// src_rows [M, k], all int32 and apart from the inputs. Entry ids and padded row counts must fit
// int32, since the ids are stored as int32.
inline Error check_routing_indexed_outputs(const std::string& call, const RoutingShape& s, int64_t block_m,
                                           const AnyBuffer& topk_ids, const AnyBuffer& expert_map,
                                           const AnyBuffer& sorted_ids, const AnyBuffer& block_expert_ids,
                                           const AnyBuffer& ntpp, const AnyBuffer& src_rows, int64_t* padded) {
  if (block_m <= 0) return invalid(call, "block_m must be positive");
  const int64_t entries = s.M * s.top_k;
  const int64_t P = indexed_padded_rows(entries, s.num_local, block_m);
  if (P > INT32_MAX) return invalid(call, "M * top_k plus per-expert padding exceeds int32 row ids");
  HJ_RETURN_IF_ERROR(expect_shape(call, "sorted_ids", sorted_ids, {P}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "sorted_ids", sorted_ids));
  HJ_RETURN_IF_ERROR(expect_shape(call, "block_expert_ids", block_expert_ids, {P / block_m}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "block_expert_ids", block_expert_ids));
  HJ_RETURN_IF_ERROR(expect_shape(call, "num_tokens_post_padded", ntpp, {1}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "num_tokens_post_padded", ntpp));
  HJ_RETURN_IF_ERROR(expect_shape(call, "src_rows", src_rows, {s.M, s.top_k}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "src_rows", src_rows));
  *padded = P;
  return check_no_overlap(
      call,
      {span_of("sorted_ids", sorted_ids), span_of("block_expert_ids", block_expert_ids),
       span_of("num_tokens_post_padded", ntpp), span_of("src_rows", src_rows)},
      {span_of("topk_ids", topk_ids), span_of("expert_map", expert_map)});
}

// routing_grouped: permutation [M * k], expert_first_token_offset [E + 1], src_rows [M, k].
inline Error check_routing_grouped_outputs(const std::string& call, const RoutingShape& s,
                                           const AnyBuffer& topk_ids, const AnyBuffer& expert_map,
                                           const AnyBuffer& permutation, const AnyBuffer& offsets,
                                           const AnyBuffer& src_rows) {
  const int64_t entries = s.M * s.top_k;
  if (entries > INT32_MAX) return invalid(call, "M * top_k exceeds int32 positions");
  HJ_RETURN_IF_ERROR(expect_shape(call, "permutation", permutation, {entries}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "permutation", permutation));
  HJ_RETURN_IF_ERROR(expect_shape(call, "expert_first_token_offset", offsets, {s.num_local + 1}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "expert_first_token_offset", offsets));
  HJ_RETURN_IF_ERROR(expect_shape(call, "src_rows", src_rows, {s.M, s.top_k}));
  HJ_RETURN_IF_ERROR(expect_s32(call, "src_rows", src_rows));
  return check_no_overlap(
      call,
      {span_of("permutation", permutation), span_of("expert_first_token_offset", offsets),
       span_of("src_rows", src_rows)},
      {span_of("topk_ids", topk_ids), span_of("expert_map", expert_map)});
}

// The grouped layout's operands of the calls that permute rows: permutation [R] and
// expert_first_token_offset [E + 1], int32.
inline Error check_permutation_operands(const std::string& call, const AnyBuffer& permutation,
                                        const AnyBuffer& offsets) {
  HJ_RETURN_IF_ERROR(expect_rank(call, "permutation", permutation, 1));
  HJ_RETURN_IF_ERROR(expect_s32(call, "permutation", permutation));
  HJ_RETURN_IF_ERROR(expect_rank(call, "expert_first_token_offset", offsets, 1));
  HJ_RETURN_IF_ERROR(expect_s32(call, "expert_first_token_offset", offsets));
  if (dim(offsets, 0) < 1) return invalid(call, "expert_first_token_offset must not be empty");
  return Error::Success();
}

// permute_rows: x [M, cols], permutation [R = M * top_k], offsets [E + 1] -> y [R, cols].
struct PermuteShape {
  int64_t M, cols, R, num_offsets;
};

inline Error check_permute_rows(const std::string& call, const AnyBuffer& x, const AnyBuffer& permutation,
                                const AnyBuffer& offsets, const AnyBuffer& y, int64_t top_k, PermuteShape* s) {
  HJ_RETURN_IF_ERROR(expect_rank(call, "x", x, 2));
  HJ_RETURN_IF_ERROR(check_permutation_operands(call, permutation, offsets));
  if (top_k <= 0) return invalid(call, "top_k must be positive");
  s->M = dim(x, 0);
  s->cols = dim(x, 1);
  s->R = dim(permutation, 0);
  s->num_offsets = dim(offsets, 0);
  if (s->R != s->M * top_k) return invalid(call, "permutation must have M * top_k entries");
  HJ_RETURN_IF_ERROR(expect_shape(call, "y", y, {s->R, s->cols}));
  if (y.element_type() != x.element_type()) return invalid(call, "y must have the dtype of x");
  return check_no_overlap(call, {span_of("y", y)},
                          {span_of("x", x), span_of("permutation", permutation),
                           span_of("expert_first_token_offset", offsets)});
}

// k_order of permute_rows and activation: 0, or 1 for 16-bit rows whose columns are a multiple of
// the order's tile.
inline Error check_k_order(const std::string& call, int64_t k_order, ffi::DataType type, int64_t cols) {
  return check_order_attr(call, "k_order", k_order, type == ffi::DataType::BF16 || type == ffi::DataType::F16,
                          "16-bit rows", cols, "the columns");
}

// activation: y [R, I] in x's dtype, apart from x.
inline Error check_activation_output(const std::string& call, const AnyBuffer& x, const AnyBuffer& y,
                                     const ActivationShape& s) {
  HJ_RETURN_IF_ERROR(expect_shape(call, "y", y, {s.R, s.I}));
  if (y.element_type() != x.element_type()) return invalid(call, "y must have the dtype of x");
  return check_no_overlap(call, {span_of("y", y)}, {span_of("x", x)});
}

// activation_quant / quantize: q [R, K] and scale [R, groups], apart from x and from each other.
inline Error check_quant_results(const std::string& call, const AnyBuffer& x, const AnyBuffer& q,
                                 const AnyBuffer& scale, int64_t R, int64_t K, int64_t group_k, ActQuant* kind) {
  HJ_RETURN_IF_ERROR(check_quant_outputs(call, q, scale, R, K, group_k, kind));
  return check_no_overlap(call, {span_of("q", q), span_of("scale", scale)}, {span_of("x", x)});
}

// quantize: x [R, K] 16-bit.
inline Error check_quantize_input(const std::string& call, const AnyBuffer& x, int64_t* R, int64_t* K) {
  HJ_RETURN_IF_ERROR(expect_rank(call, "x", x, 2));
  HJ_RETURN_IF_ERROR(expect_16bit(call, "x", x));
  *R = dim(x, 0);
  *K = dim(x, 1);
  return Error::Success();
}

// quantize_permuted: x [M, K] 16-bit, permutation [R = M * top_k], offsets [E + 1], src_rows
// [M, top_k] int32 -> q [R, K], scale [R, K / group_k]: permute_rows of quantize(x), scales too.
// Groups of 8 to 256 columns (a power of two) only: the one kernel's lanes share a group.
struct QuantizePermutedShape {
  int64_t M, K, R, top_k, num_offsets;
};

inline bool quantize_permuted_group_ok(int64_t group_k, int64_t K) {
  return group_k >= 8 && group_k <= 256 && (group_k & (group_k - 1)) == 0 && K % group_k == 0;
}

inline Error check_quantize_permuted(const std::string& call, const AnyBuffer& x, const AnyBuffer& permutation,
                                     const AnyBuffer& offsets, const AnyBuffer& src_rows, const AnyBuffer& q,
                                     const AnyBuffer& scale, int64_t group_k, QuantizePermutedShape* s,
                                     ActQuant* kind) {
  HJ_RETURN_IF_ERROR(check_quantize_input(call, x, &s->M, &s->K));
  HJ_RETURN_IF_ERROR(check_permutation_operands(call, permutation, offsets));
  HJ_RETURN_IF_ERROR(expect_rank(call, "src_rows", src_rows, 2));
  HJ_RETURN_IF_ERROR(expect_s32(call, "src_rows", src_rows));
  if (dim(src_rows, 0) != s->M) return invalid(call, "src_rows must have one row per row of x");
  s->top_k = dim(src_rows, 1);
  if (s->top_k <= 0) return invalid(call, "src_rows must have top_k > 0 columns");
  s->R = dim(permutation, 0);
  s->num_offsets = dim(offsets, 0);
  if (s->R != s->M * s->top_k) return invalid(call, "permutation must have M * top_k entries");
  if (!quantize_permuted_group_ok(group_k, s->K))
    return invalid(call, "group_k must be a power of two from 8 to 256 dividing K = " + std::to_string(s->K) +
                             " (other groupings: quantize, then permute_rows)");
  HJ_RETURN_IF_ERROR(check_quant_outputs(call, q, scale, s->R, s->K, group_k, kind));
  return check_no_overlap(call, {span_of("q", q), span_of("scale", scale)},
                          {span_of("x", x), span_of("permutation", permutation),
                           span_of("expert_first_token_offset", offsets), span_of("src_rows", src_rows)});
}

// gemm_indexed: the GEMM of a over the routing's layout (the CPU and CUDA handlers' one parse).
inline Error parse_gemm_indexed(const std::string& call, const AnyBuffer& a, const AnyBuffer& a_scale,
                                const AnyBuffer& qweight, const AnyBuffer& scale, const AnyBuffer& zero,
                                const AnyBuffer& scale2, const AnyBuffer& bias, const AnyBuffer& sorted_ids,
                                const AnyBuffer& block_expert_ids, const AnyBuffer& ntpp, const GemmAttrs& at,
                                int64_t gather_div, int64_t block_m, const AnyBuffer& c, GemmProblem* p,
                                IndexedLayout* l) {
  HJ_RETURN_IF_ERROR(parse_gemm(call, a, a_scale, qweight, scale, zero, scale2, bias, at, c, p));
  return check_indexed_layout(call, a, c, sorted_ids, block_expert_ids, ntpp, gather_div, block_m, l);
}

// gemm_indexed_gated: the indexed GEMM into c, then y = the gated activation of c's rows.
inline Error parse_gemm_indexed_gated(const std::string& call, const AnyBuffer& a, const AnyBuffer& a_scale,
                                      const AnyBuffer& qweight, const AnyBuffer& scale, const AnyBuffer& zero,
                                      const AnyBuffer& scale2, const AnyBuffer& bias, const AnyBuffer& sorted_ids,
                                      const AnyBuffer& block_expert_ids, const AnyBuffer& ntpp, const GemmAttrs& at,
                                      int64_t activation, int64_t gather_div, int64_t block_m, const AnyBuffer& y,
                                      const AnyBuffer& c, GemmProblem* p, IndexedLayout* l) {
  HJ_RETURN_IF_ERROR(check_gated_activation(call, activation));
  HJ_RETURN_IF_ERROR(parse_gemm_indexed(call, a, a_scale, qweight, scale, zero, scale2, bias, sorted_ids,
                                        block_expert_ids, ntpp, at, gather_div, block_m, c, p, l));
  return check_gated_y(call, y, c, p->N,
                       {span_of("a", a), span_of("a_scale", a_scale), span_of("qweight", qweight),
                        span_of("scale", scale), span_of("zero", zero), span_of("scale2", scale2),
                        span_of("bias", bias)});
}

// experts_indexed: GEMM1 (gemm_indexed_gated over x, gather_div) into y / c, then GEMM2
// (gemm_indexed over y, one row per id) into d, over the same routing. The weights of both GEMMs
// are apart from every result.
struct ExpertsIndexedCall {
  GemmProblem up, down;
  IndexedLayout up_l, down_l;
};
inline Error parse_experts_indexed(const std::string& call, const AnyBuffer& x, const AnyBuffer* w13,
                                   const AnyBuffer* w2, const AnyBuffer& sorted_ids,
                                   const AnyBuffer& block_expert_ids, const AnyBuffer& ntpp, const WeightAttrs& up,
                                   const WeightAttrs& down, int64_t activation, int64_t gather_div, int64_t block_m,
                                   const AnyBuffer& d, const AnyBuffer& y, const AnyBuffer& c,
                                   ExpertsIndexedCall* out) {
  // x stands in for the absent activation scales (16-bit activations: act_group_k 0, never read).
  HJ_RETURN_IF_ERROR(parse_gemm_indexed_gated(call, x, x, w13[0], w13[1], w13[2], w13[3], w13[4], sorted_ids,
                                              block_expert_ids, ntpp, GemmAttrs{up, 0}, activation, gather_div,
                                              block_m, y, c, &out->up, &out->up_l));
  HJ_RETURN_IF_ERROR(parse_gemm_indexed(call, y, y, w2[0], w2[1], w2[2], w2[3], w2[4], sorted_ids,
                                        block_expert_ids, ntpp, GemmAttrs{down, 0}, 1, block_m, d, &out->down,
                                        &out->down_l));
  if (out->down.N != dim(x, 1))
    return invalid(call, "w2 must have H = " + std::to_string(dim(x, 1)) + " rows (x's columns), got " +
                             std::to_string(out->down.N));
  return check_no_overlap(call, {span_of("d", d), span_of("y", y), span_of("c", c)},
                          {span_of("w13", w13[0]), span_of("w13 scale", w13[1]), span_of("w13 zero", w13[2]),
                           span_of("w13 scale2", w13[3]), span_of("w13 bias", w13[4]), span_of("w2", w2[0]),
                           span_of("w2 scale", w2[1]), span_of("w2 zero", w2[2]), span_of("w2 scale2", w2[3]),
                           span_of("w2 bias", w2[4]), span_of("x", x),
                           span_of("sorted_ids", sorted_ids), span_of("block_expert_ids", block_expert_ids),
                           span_of("num_tokens_post_padded", ntpp)});
}

// gemm_indexed_quant: x [M, N1] 16-bit, activated when activation >= 0 (else N1 = K), quantized
// into q / q_scale [M, K] (act_group_k: the group, 0 per row), then the indexed GEMM of those
// codes over the routing's layout.
struct IndexedQuantCall {
  GemmProblem p;      // the GEMM over q / q_scale
  ActQuant kind;      // q's codes
  ActivationShape s;  // x's rows (R) and columns (N1), K (I)
  IndexedLayout l;
};
inline Error parse_gemm_indexed_quant(const std::string& call, const AnyBuffer& x, const AnyBuffer& qweight,
                                      const AnyBuffer& scale, const AnyBuffer& zero, const AnyBuffer& scale2,
                                      const AnyBuffer& bias, const AnyBuffer& sorted_ids,
                                      const AnyBuffer& block_expert_ids, const AnyBuffer& ntpp, const GemmAttrs& at,
                                      int64_t activation, int64_t gather_div, int64_t block_m, const AnyBuffer& c,
                                      const AnyBuffer& q, const AnyBuffer& q_scale, IndexedQuantCall* out) {
  ActivationShape& s = out->s;
  if (activation >= 0) {
    HJ_RETURN_IF_ERROR(check_activation(call, x, activation, &s));
  } else {
    if (activation != -1) return invalid(call, "unknown activation " + std::to_string(activation));
    HJ_RETURN_IF_ERROR(check_quantize_input(call, x, &s.R, &s.N1));
    s.I = s.N1;
  }
  HJ_RETURN_IF_ERROR(check_quant_results(call, x, q, q_scale, s.R, s.I, at.act_group_k, &out->kind));
  HJ_RETURN_IF_ERROR(parse_gemm_indexed(call, q, q_scale, qweight, scale, zero, scale2, bias, sorted_ids,
                                        block_expert_ids, ntpp, at, gather_div, block_m, c, &out->p, &out->l));
  return check_no_overlap(call, {span_of("c", c)}, {span_of("x", x)});
}

// experts_indexed_quant: GEMM1 (gemm_indexed_quant of x over gather_div, no activation) into c,
// then GEMM2 (gemm_indexed_quant of activation(c), one row per id) into d, over the same routing.
// Every result is apart from every operand.
struct ExpertsIndexedQuantCall {
  IndexedQuantCall up, down;
};
inline Error parse_experts_indexed_quant(const std::string& call, const AnyBuffer& x, const AnyBuffer* w13,
                                         const AnyBuffer* w2, const AnyBuffer& sorted_ids,
                                         const AnyBuffer& block_expert_ids, const AnyBuffer& ntpp,
                                         const WeightAttrs& up, const WeightAttrs& down, int64_t act_group_k,
                                         int64_t activation, int64_t gather_div, int64_t block_m,
                                         const AnyBuffer& d, const AnyBuffer& c, const AnyBuffer& q1,
                                         const AnyBuffer& q1_scale, const AnyBuffer& q2, const AnyBuffer& q2_scale,
                                         ExpertsIndexedQuantCall* out) {
  HJ_RETURN_IF_ERROR(parse_gemm_indexed_quant(call, x, w13[0], w13[1], w13[2], w13[3], w13[4], sorted_ids,
                                              block_expert_ids, ntpp, GemmAttrs{up, act_group_k}, -1, gather_div,
                                              block_m, c, q1, q1_scale, &out->up));
  HJ_RETURN_IF_ERROR(parse_gemm_indexed_quant(call, c, w2[0], w2[1], w2[2], w2[3], w2[4], sorted_ids,
                                              block_expert_ids, ntpp, GemmAttrs{down, act_group_k}, activation, 1,
                                              block_m, d, q2, q2_scale, &out->down));
  if (out->down.p.N != dim(x, 1))
    return invalid(call, "w2 must have H = " + std::to_string(dim(x, 1)) + " rows (x's columns), got " +
                             std::to_string(out->down.p.N));
  return check_no_overlap(call,
                          {span_of("d", d), span_of("c", c), span_of("q1", q1), span_of("q1_scale", q1_scale),
                           span_of("q2", q2), span_of("q2_scale", q2_scale)},
                          {span_of("w13", w13[0]), span_of("w13 scale", w13[1]), span_of("w13 zero", w13[2]),
                           span_of("w13 scale2", w13[3]), span_of("w13 bias", w13[4]), span_of("w2", w2[0]),
                           span_of("w2 scale", w2[1]), span_of("w2 zero", w2[2]), span_of("w2 scale2", w2[3]),
                           span_of("w2 bias", w2[4]), span_of("x", x), span_of("sorted_ids", sorted_ids),
                           span_of("block_expert_ids", block_expert_ids), span_of("num_tokens_post_padded", ntpp)});
}

// layer_indexed / layer_indexed_quant: the checks of their three steps (routing_indexed's, the
// experts call's with gather_div = top_k, finalize's), x's rows those of topk_ids, num_local_experts
// the weights' E, and every result apart from every other result and from every operand but out
// (result 0's alias).
struct LayerRouting {
  RoutingShape s;
  int64_t padded_rows;  // sorted_ids' length
};
struct LayerIndexedCall : LayerRouting {
  ExpertsIndexedCall g;
};
struct LayerIndexedQuantCall : LayerRouting {
  ExpertsIndexedQuantCall g;
};
inline Error check_finalize_result(const std::string& call, const AnyBuffer& d, const AnyBuffer& w,
                                   const AnyBuffer& src_rows, const AnyBuffer& out, const AnyBuffer& result);
// The routing's checks and x's rows, before the experts call's parse.
inline Error parse_layer_routing(const std::string& call, const AnyBuffer& x, const AnyBuffer& topk_ids,
                                 const AnyBuffer& expert_map, int64_t num_local_experts, int64_t block_m,
                                 int64_t identity_map, const AnyBuffer& d, const AnyBuffer& c,
                                 const AnyBuffer& sorted_ids, const AnyBuffer& block_expert_ids,
                                 const AnyBuffer& ntpp, const AnyBuffer& src_rows, LayerRouting* r) {
  RoutingShape& s = r->s;
  HJ_RETURN_IF_ERROR(check_routing_inputs(call, topk_ids, expert_map, num_local_experts, identity_map, &s));
  HJ_RETURN_IF_ERROR(check_routing_indexed_outputs(call, s, block_m, topk_ids, expert_map, sorted_ids,
                                                   block_expert_ids, ntpp, src_rows, &r->padded_rows));
  HJ_RETURN_IF_ERROR(expect_rank(call, "x", x, 2));
  if (dim(x, 0) != s.M)
    return invalid(call, "x has " + std::to_string(dim(x, 0)) + " rows, topk_ids " + std::to_string(s.M));
  if (s.top_k <= 0) return invalid(call, "topk_ids must have at least one column");
  HJ_RETURN_IF_ERROR(expect_shape(call, "d", d, {s.M * s.top_k, dim(x, 1)}));
  HJ_RETURN_IF_ERROR(expect_rank(call, "c", c, 2));
  if (dim(c, 0) != s.M * s.top_k) return invalid(call, "c must have M * top_k rows");
  return Error::Success();
}
// After the experts call's parse: the weights' E, finalize's checks and the results apart.
inline Error check_layer_rest(const std::string& call, int64_t experts, int64_t num_local_experts,
                              const AnyBuffer& x, const AnyBuffer* w13, const AnyBuffer* w2,
                              const AnyBuffer& topk_ids, const AnyBuffer& expert_map, const AnyBuffer& topk_weights,
                              const AnyBuffer& out, const AnyBuffer& result, const AnyBuffer& d,
                              const AnyBuffer& src_rows, std::initializer_list<Span> results) {
  if (experts != num_local_experts)
    return invalid(call, "num_local_experts = " + std::to_string(num_local_experts) + " but the weights have " +
                             std::to_string(experts) + " experts");
  HJ_RETURN_IF_ERROR(check_finalize_result(call, d, topk_weights, src_rows, out, result));
  return check_no_overlap(
      call, results,
      {span_of("x", x), span_of("w13", w13[0]), span_of("w13 scale", w13[1]), span_of("w13 zero", w13[2]),
       span_of("w13 scale2", w13[3]), span_of("w13 bias", w13[4]), span_of("w2", w2[0]), span_of("w2 scale", w2[1]),
       span_of("w2 zero", w2[2]), span_of("w2 scale2", w2[3]), span_of("w2 bias", w2[4]),
       span_of("topk_ids", topk_ids), span_of("expert_map", expert_map), span_of("topk_weights", topk_weights)});
}
inline Error parse_layer_indexed(const std::string& call, const AnyBuffer& x, const AnyBuffer* w13,
                                 const AnyBuffer* w2, const AnyBuffer& topk_ids, const AnyBuffer& expert_map,
                                 const AnyBuffer& topk_weights, const AnyBuffer& out, const WeightAttrs& up,
                                 const WeightAttrs& down, int64_t num_local_experts, int64_t block_m,
                                 int64_t identity_map, int64_t activation, const AnyBuffer& result,
                                 const AnyBuffer& d, const AnyBuffer& y, const AnyBuffer& c,
                                 const AnyBuffer& sorted_ids, const AnyBuffer& block_expert_ids,
                                 const AnyBuffer& ntpp, const AnyBuffer& src_rows, LayerIndexedCall* L) {
  HJ_RETURN_IF_ERROR(parse_layer_routing(call, x, topk_ids, expert_map, num_local_experts, block_m, identity_map, d,
                                         c, sorted_ids, block_expert_ids, ntpp, src_rows, L));
  HJ_RETURN_IF_ERROR(parse_experts_indexed(call, x, w13, w2, sorted_ids, block_expert_ids, ntpp, up, down, activation,
                                           L->s.top_k, block_m, d, y, c, &L->g));
  return check_layer_rest(call, L->g.up.w.E, num_local_experts, x, w13, w2, topk_ids, expert_map, topk_weights, out,
                          result, d, src_rows,
                          {span_of("out", result), span_of("d", d), span_of("y", y), span_of("c", c),
                           span_of("sorted_ids", sorted_ids), span_of("block_expert_ids", block_expert_ids),
                           span_of("num_tokens_post_padded", ntpp), span_of("src_rows", src_rows)});
}
inline Error parse_layer_indexed_quant(const std::string& call, const AnyBuffer& x, const AnyBuffer* w13,
                                       const AnyBuffer* w2, const AnyBuffer& topk_ids, const AnyBuffer& expert_map,
                                       const AnyBuffer& topk_weights, const AnyBuffer& out, const WeightAttrs& up,
                                       const WeightAttrs& down, int64_t act_group_k, int64_t num_local_experts,
                                       int64_t block_m, int64_t identity_map, int64_t activation,
                                       const AnyBuffer& result, const AnyBuffer& d, const AnyBuffer& c,
                                       const AnyBuffer& q1, const AnyBuffer& q1_scale, const AnyBuffer& q2,
                                       const AnyBuffer& q2_scale, const AnyBuffer& sorted_ids,
                                       const AnyBuffer& block_expert_ids, const AnyBuffer& ntpp,
                                       const AnyBuffer& src_rows, LayerIndexedQuantCall* L) {
  HJ_RETURN_IF_ERROR(parse_layer_routing(call, x, topk_ids, expert_map, num_local_experts, block_m, identity_map, d,
                                         c, sorted_ids, block_expert_ids, ntpp, src_rows, L));
  HJ_RETURN_IF_ERROR(parse_experts_indexed_quant(call, x, w13, w2, sorted_ids, block_expert_ids, ntpp, up, down,
                                                 act_group_k, activation, L->s.top_k, block_m, d, c, q1, q1_scale, q2,
                                                 q2_scale, &L->g));
  return check_layer_rest(call, L->g.up.p.w.E, num_local_experts, x, w13, w2, topk_ids, expert_map, topk_weights,
                          out, result, d, src_rows,
                          {span_of("out", result), span_of("d", d), span_of("c", c), span_of("q1", q1),
                           span_of("q1_scale", q1_scale), span_of("q2", q2), span_of("q2_scale", q2_scale),
                           span_of("sorted_ids", sorted_ids), span_of("block_expert_ids", block_expert_ids),
                           span_of("num_tokens_post_padded", ntpp), span_of("src_rows", src_rows)});
}

// finalize: the result has out's shape and is apart from d, topk_weights and src_rows (it may
// share out's buffer: that is the declared alias).
inline Error check_finalize_result(const std::string& call, const AnyBuffer& d, const AnyBuffer& w,
                                   const AnyBuffer& src_rows, const AnyBuffer& out, const AnyBuffer& result) {
  HJ_RETURN_IF_ERROR(check_finalize(call, d, w, src_rows, out));
  HJ_RETURN_IF_ERROR(expect_shape(call, "result", result, {dim(out, 0), dim(out, 1)}));
  if (result.element_type() != out.element_type()) return invalid(call, "result must have the dtype of out");
  return check_no_overlap(call, {span_of("result", result)},
                          {span_of("d", d), span_of("topk_weights", w), span_of("src_rows", src_rows)});
}

// gemm_batched_into: the aliased operand `out` matches the result exactly.
inline Error check_batched_into_out(const std::string& call, const AnyBuffer& out, const AnyBuffer& c) {
  if (out.dimensions().size() != c.dimensions().size() || out.element_type() != c.element_type() ||
      out.size_bytes() != c.size_bytes())
    return invalid(call, "out must match the result in shape and dtype");
  for (size_t i = 0; i < out.dimensions().size(); ++i)
    if (out.dimensions()[i] != c.dimensions()[i]) return invalid(call, "out must match the result in shape and dtype");
  return Error::Success();
}

}  // namespace hj
