// CPU handlers of the activation, the fused activation + dynamic quantization, and the dynamic
// quantization of 16-bit activations (fp8 e4m3 or int8, per row or per group of columns).
#include <cmath>
#include <vector>

#include "cpu_parallel.h"
#include "ffi_common.h"
#include "permute_rows_cpu.h"
#include "quantize_cpu.h"

namespace hj {
namespace {

// Fills v[0, I) with the activation of row r of x in float32.
void activation_row(Activation act, float limit, ElemType xt, const void* x, int64_t r, int64_t N1, int64_t I,
                    float* v) {
  const bool gated = activation_is_gated(act);
  for (int64_t i = 0; i < I; ++i) {
    if (gated) {
      int64_t g, u;
      gated_columns(act, i, I, &g, &u);
      v[i] = activation_gated(act, load_elem(xt, x, r * N1 + g), load_elem(xt, x, r * N1 + u), limit);
    } else {
      v[i] = activation_single(act, load_elem(xt, x, r * N1 + i));
    }
  }
}

// Quantizes v[0, K) of row r into q/scale with groups of group_k columns (0: the whole row).
void quantize_row(ActQuant kind, const float* v, int64_t K, int64_t group_k, int64_t r, void* q, float* scale) {
  const int64_t gk = group_k > 0 ? group_k : K;
  if (gk == 0) {  // K = 0: one empty group, scale 0
    scale[r] = 0.0f;
    return;
  }
  const int64_t groups = K / gk;
  const ElemType qt = kind == ActQuant::kFp8E4M3 ? ElemType::kE4M3 : ElemType::kI8;
  for (int64_t g = 0; g < groups; ++g) {
    float absmax = 0.0f;
    for (int64_t k = g * gk; k < (g + 1) * gk; ++k) absmax = std::fmax(absmax, std::fabs(v[k]));
    const float s = quant_scale(kind, absmax);
    scale[r * groups + g] = s;
    for (int64_t k = g * gk; k < (g + 1) * gk; ++k) store_elem(qt, q, r * K + k, quant_code_value(v[k], s));
  }
}

Error ActivationCpu(AnyBuffer x, Result<AnyBuffer> y, int64_t activation, float limit, int64_t k_order) {
  const std::string call = "activation";
  ActivationShape s;
  HJ_RETURN_IF_ERROR(check_activation(call, x, activation, &s));
  HJ_RETURN_IF_ERROR(check_activation_output(call, x, *y, s));
  HJ_RETURN_IF_ERROR(check_k_order(call, k_order, x.element_type(), s.I));
  activate_rows_cpu(elem_type_of(x.element_type()), x.untyped_data(), s.R, s.N1, s.I, static_cast<int>(activation),
                    limit, y->untyped_data());
  if (k_order == 1) rs4_order_rows_in_place(static_cast<uint16_t*>(y->untyped_data()), s.R, s.I);
  return Error::Success();
}

Error ActivationQuantCpu(AnyBuffer x, Result<AnyBuffer> q, Result<AnyBuffer> scale, int64_t activation,
                         float limit, int64_t group_k) {
  const std::string call = "activation_quant";
  ActivationShape s;
  HJ_RETURN_IF_ERROR(check_activation(call, x, activation, &s));
  ActQuant kind;
  HJ_RETURN_IF_ERROR(check_quant_results(call, x, *q, *scale, s.R, s.I, group_k, &kind));
  quantize_rows_cpu(elem_type_of(x.element_type()), x.untyped_data(), s.R, s.N1, s.I, static_cast<int>(activation),
                    limit, group_k, kind, q->untyped_data(), static_cast<float*>(scale->untyped_data()));
  return Error::Success();
}

Error QuantizeCpu(AnyBuffer x, Result<AnyBuffer> q, Result<AnyBuffer> scale, int64_t group_k) {
  const std::string call = "quantize";
  int64_t R = 0, K = 0;
  HJ_RETURN_IF_ERROR(check_quantize_input(call, x, &R, &K));
  ActQuant kind;
  HJ_RETURN_IF_ERROR(check_quant_results(call, x, *q, *scale, R, K, group_k, &kind));
  quantize_rows_cpu(elem_type_of(x.element_type()), x.untyped_data(), R, K, K, -1, 0.0f, group_k, kind,
                    q->untyped_data(), static_cast<float*>(scale->untyped_data()));
  return Error::Success();
}

// permute_rows of quantize(x), codes and scales: the M token rows quantized into buffers of their
// own, then permuted as permute_rows does (the CUDA kernel stores each row at its positions instead).
Error QuantizePermutedCpu(AnyBuffer x, AnyBuffer permutation, AnyBuffer offsets, AnyBuffer src_rows,
                          Result<AnyBuffer> q, Result<AnyBuffer> scale, int64_t group_k) {
  const std::string call = "quantize_permuted";
  QuantizePermutedShape s;
  ActQuant kind;
  HJ_RETURN_IF_ERROR(check_quantize_permuted(call, x, permutation, offsets, src_rows, *q, *scale, group_k, &s, &kind));
  const int64_t groups = s.K / group_k;
  std::vector<uint8_t> tq(static_cast<size_t>(s.M * s.K));
  std::vector<float> ts(static_cast<size_t>(s.M * groups));
  quantize_rows_cpu(elem_type_of(x.element_type()), x.untyped_data(), s.M, s.K, s.K, -1, 0.0f, group_k, kind,
                    tq.data(), ts.data());
  const auto* perm = static_cast<const int32_t*>(permutation.untyped_data());
  const int64_t last = static_cast<const int32_t*>(offsets.untyped_data())[s.num_offsets - 1];
  permute_rows_cpu(tq.data(), perm, last, s.R, static_cast<size_t>(s.K), s.top_k, q->untyped_data());
  permute_rows_cpu(ts.data(), perm, last, s.R, static_cast<size_t>(groups) * sizeof(float), s.top_k,
                   scale->untyped_data());
  return Error::Success();
}

}  // namespace

void quantize_rows_cpu(ElemType xt, const void* x, int64_t R, int64_t N1, int64_t K, int act, float limit,
                       int64_t group_k, ActQuant kind, void* q, float* scale) {
  parallel_for(R, N1 * 8, [&](int64_t r) {
    std::vector<float> v(static_cast<size_t>(K));
    if (act >= 0)
      activation_row(static_cast<Activation>(act), limit, xt, x, r, N1, K, v.data());
    else
      for (int64_t k = 0; k < K; ++k) v[k] = load_elem(xt, x, r * K + k);
    quantize_row(kind, v.data(), K, group_k, r, q, scale);
  });
}

void activate_rows_cpu(ElemType xt, const void* x, int64_t R, int64_t N1, int64_t K, int act, float limit, void* y) {
  parallel_for(R, N1 * 8, [&](int64_t r) {
    std::vector<float> v(static_cast<size_t>(K));
    activation_row(static_cast<Activation>(act), limit, xt, x, r, N1, K, v.data());
    for (int64_t i = 0; i < K; ++i) store_elem(xt, y, r * K + i, v[i]);
  });
}
}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjActivationCpu, hj::ActivationCpu, hj::bind_activation<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjActivationQuantCpu, hj::ActivationQuantCpu,
                              hj::bind_activation_quant<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjQuantizeCpu, hj::QuantizeCpu, hj::bind_quantize<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjQuantizePermutedCpu, hj::QuantizePermutedCpu, hj::bind_quantize_permuted<void>());
