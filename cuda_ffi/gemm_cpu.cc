// CPU handlers of the expert GEMM in its three forms (indexed gather, grouped contiguous,
// batched masked). Each dequantizes a weight row once per group of activation rows that share
// an expert and accumulates in float32 in increasing k.
#include <vector>

#include "cpu_parallel.h"
#include "ffi_common.h"
#include "layer_steps_cpu.h"
#include "permute_rows_cpu.h"
#include "quantize_cpu.h"

namespace hj {
namespace {

// A run of rows that use one expert: a_rows[i] of A produce c_rows[i] of C.
struct RowRun {
  int64_t expert;
  std::vector<int64_t> a_rows, c_rows;
};

void gemm_runs(const GemmProblem& p, const std::vector<RowRun>& runs) {
  const int64_t K = p.K, N = p.N;
  for (const RowRun& run : runs) {
    const int64_t rows = static_cast<int64_t>(run.a_rows.size());
    if (rows == 0) continue;
    std::vector<float> a(static_cast<size_t>(rows * K));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t k = 0; k < K; ++k) a[i * K + k] = act_value(p.a, run.a_rows[i], k);
    parallel_for(N, rows * K + K, [&](int64_t n) {
      std::vector<float> wrow(static_cast<size_t>(K));
      for (int64_t k = 0; k < K; ++k) wrow[k] = gemm_weight(p, run.expert, n, k);
      const float b = p.w.bias ? p.w.bias[run.expert * N + n] : 0.0f;
      for (int64_t i = 0; i < rows; ++i) {
        const float* ar = &a[i * K];
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k) acc += ar[k] * wrow[k];
        store_elem(p.c_type, p.c, run.c_rows[i] * N + n, acc + b);
      }
    });
  }
}

void zero_rows(const GemmProblem& p, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r)
    for (int64_t n = 0; n < p.N; ++n) store_elem(p.c_type, p.c, r * p.N + n, 0.0f);
}

// The indexed GEMM over the used blocks of a checked layout.
void gemm_indexed_runs(const GemmProblem& p, const IndexedLayout& l) {
  int64_t used = *l.num_tokens_post_padded;
  used = used < 0 ? 0 : (used > l.padded_rows ? l.padded_rows : used);
  std::vector<RowRun> runs;
  for (int64_t b = 0; b * l.block_m < used; ++b) {
    const int64_t e = l.block_expert_ids[b];
    if (e < 0 || e >= p.w.E) continue;  // never address weights with an invalid id
    RowRun run{e, {}, {}};
    for (int64_t i = b * l.block_m; i < (b + 1) * l.block_m; ++i) {
      const int64_t id = l.sorted_ids[i];
      if (id < 0 || id >= l.c_rows || id / l.gather_div >= l.a_rows) continue;  // padding
      run.a_rows.push_back(id / l.gather_div);
      run.c_rows.push_back(id);
    }
    runs.push_back(std::move(run));
  }
  gemm_runs(p, runs);
}

// gemm_indexed_gated's work: the indexed GEMM into c, then y = the gated activation of c's rows.
void gemm_indexed_gated_runs(const GemmProblem& p, const IndexedLayout& l, const AnyBuffer& c, void* y,
                             int64_t activation, float limit) {
  gemm_indexed_runs(p, l);
  activate_rows_cpu(p.c_type, c.untyped_data(), dim(c, 0), p.N, p.N / 2, static_cast<int>(activation), limit, y);
}

Error GemmIndexedCpu(AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale, AnyBuffer zero,
                     AnyBuffer scale2, AnyBuffer bias, AnyBuffer sorted_ids, AnyBuffer block_expert_ids,
                     AnyBuffer ntpp, Result<AnyBuffer> c, int64_t weight_type, int64_t group_n,
                     int64_t group_k, int64_t has_zero, int64_t has_scale2, int64_t has_bias,
                     int64_t act_group_k, int64_t gather_div, int64_t block_m) {
  const std::string call = "gemm_indexed";
  GemmProblem p;
  IndexedLayout l;
  HJ_RETURN_IF_ERROR(parse_gemm_indexed(
      call, a, a_scale, qweight, scale, zero, scale2, bias, sorted_ids, block_expert_ids, ntpp,
      gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2, has_bias, act_group_k), gather_div, block_m,
      *c, &p, &l));
  gemm_indexed_runs(p, l);
  return Error::Success();
}

// gemm_indexed_quant's two steps over a parsed call: x (activated when activation >= 0) quantized
// into q / q_scale, then the indexed GEMM of those codes.
void gemm_indexed_quant_runs(const IndexedQuantCall& g, const AnyBuffer& x, int64_t activation, float limit,
                             int64_t act_group_k, AnyBuffer& q, AnyBuffer& q_scale) {
  quantize_rows_cpu(elem_type_of(x.element_type()), x.untyped_data(), g.s.R, g.s.N1, g.s.I,
                    static_cast<int>(activation), limit, act_group_k, g.kind, q.untyped_data(),
                    static_cast<float*>(q_scale.untyped_data()));
  gemm_indexed_runs(g.p, g.l);
}

Error GemmIndexedQuantCpu(AnyBuffer x, AnyBuffer /*unused*/, AnyBuffer qweight, AnyBuffer scale, AnyBuffer zero,
                          AnyBuffer scale2, AnyBuffer bias, AnyBuffer sorted_ids, AnyBuffer block_expert_ids,
                          AnyBuffer ntpp, Result<AnyBuffer> c, Result<AnyBuffer> q, Result<AnyBuffer> q_scale,
                          int64_t weight_type, int64_t group_n, int64_t group_k, int64_t has_zero,
                          int64_t has_scale2, int64_t has_bias, int64_t act_group_k, int64_t gather_div,
                          int64_t block_m, int64_t activation, float limit) {
  IndexedQuantCall g;
  HJ_RETURN_IF_ERROR(parse_gemm_indexed_quant(
      "gemm_indexed_quant", x, qweight, scale, zero, scale2, bias, sorted_ids, block_expert_ids, ntpp,
      gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2, has_bias, act_group_k), activation, gather_div,
      block_m, *c, *q, *q_scale, &g));
  gemm_indexed_quant_runs(g, x, activation, limit, act_group_k, *q, *q_scale);
  return Error::Success();
}

Error GemmIndexedGatedCpu(AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale, AnyBuffer zero,
                          AnyBuffer scale2, AnyBuffer bias, AnyBuffer sorted_ids, AnyBuffer block_expert_ids,
                          AnyBuffer ntpp, Result<AnyBuffer> y, Result<AnyBuffer> c, int64_t weight_type,
                          int64_t group_n, int64_t group_k, int64_t has_zero, int64_t has_scale2, int64_t has_bias,
                          int64_t act_group_k, int64_t gather_div, int64_t block_m, int64_t activation, float limit) {
  GemmProblem p;
  IndexedLayout l;
  HJ_RETURN_IF_ERROR(parse_gemm_indexed_gated(
      "gemm_indexed_gated", a, a_scale, qweight, scale, zero, scale2, bias, sorted_ids, block_expert_ids, ntpp,
      gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2, has_bias, act_group_k), activation, gather_div,
      block_m, *y, *c, &p, &l));
  gemm_indexed_gated_runs(p, l, *c, y->untyped_data(), activation, limit);
  return Error::Success();
}

Error ExpertsIndexedCpu(AnyBuffer x, AnyBuffer w1, AnyBuffer w1_scale, AnyBuffer w1_zero, AnyBuffer w1_scale2,
                        AnyBuffer w1_bias, AnyBuffer w2, AnyBuffer w2_scale, AnyBuffer w2_zero, AnyBuffer w2_scale2,
                        AnyBuffer w2_bias, AnyBuffer sorted_ids, AnyBuffer block_expert_ids, AnyBuffer ntpp,
                        Result<AnyBuffer> d, Result<AnyBuffer> y, Result<AnyBuffer> c, int64_t weight_type,
                        int64_t group_n, int64_t group_k, int64_t has_zero, int64_t has_scale2, int64_t has_bias,
                        int64_t down_weight_type, int64_t down_group_n, int64_t down_group_k, int64_t down_has_zero,
                        int64_t down_has_scale2, int64_t down_has_bias, int64_t gather_div, int64_t block_m,
                        int64_t activation, float limit) {
  const AnyBuffer up_w[5] = {w1, w1_scale, w1_zero, w1_scale2, w1_bias};
  const AnyBuffer down_w[5] = {w2, w2_scale, w2_zero, w2_scale2, w2_bias};
  ExpertsIndexedCall g;
  HJ_RETURN_IF_ERROR(parse_experts_indexed(
      "experts_indexed", x, up_w, down_w, sorted_ids, block_expert_ids, ntpp,
      WeightAttrs{weight_type, group_n, group_k, has_zero, has_scale2, has_bias},
      WeightAttrs{down_weight_type, down_group_n, down_group_k, down_has_zero, down_has_scale2, down_has_bias},
      activation, gather_div, block_m, *d, *y, *c, &g));
  experts_indexed_cpu(g, *c, y->untyped_data(), activation, limit);
  return Error::Success();
}

// experts_indexed_quant: the two gemm_indexed_quant calls' steps in their order, GEMM2's over
// GEMM1's rows c.
Error ExpertsIndexedQuantCpu(AnyBuffer x, AnyBuffer w1, AnyBuffer w1_scale, AnyBuffer w1_zero, AnyBuffer w1_scale2,
                             AnyBuffer w1_bias, AnyBuffer w2, AnyBuffer w2_scale, AnyBuffer w2_zero,
                             AnyBuffer w2_scale2, AnyBuffer w2_bias, AnyBuffer sorted_ids, AnyBuffer block_expert_ids,
                             AnyBuffer ntpp, Result<AnyBuffer> d, Result<AnyBuffer> c, Result<AnyBuffer> q1,
                             Result<AnyBuffer> q1_scale, Result<AnyBuffer> q2, Result<AnyBuffer> q2_scale,
                             int64_t weight_type, int64_t group_n, int64_t group_k, int64_t has_zero,
                             int64_t has_scale2, int64_t has_bias, int64_t down_weight_type, int64_t down_group_n,
                             int64_t down_group_k, int64_t down_has_zero, int64_t down_has_scale2,
                             int64_t down_has_bias, int64_t act_group_k, int64_t gather_div, int64_t block_m,
                             int64_t activation, float limit) {
  const AnyBuffer up_w[5] = {w1, w1_scale, w1_zero, w1_scale2, w1_bias};
  const AnyBuffer down_w[5] = {w2, w2_scale, w2_zero, w2_scale2, w2_bias};
  ExpertsIndexedQuantCall g;
  HJ_RETURN_IF_ERROR(parse_experts_indexed_quant(
      "experts_indexed_quant", x, up_w, down_w, sorted_ids, block_expert_ids, ntpp,
      WeightAttrs{weight_type, group_n, group_k, has_zero, has_scale2, has_bias},
      WeightAttrs{down_weight_type, down_group_n, down_group_k, down_has_zero, down_has_scale2, down_has_bias},
      act_group_k, activation, gather_div, block_m, *d, *c, *q1, *q1_scale, *q2, *q2_scale, &g));
  experts_indexed_quant_cpu(g, x, *c, act_group_k, activation, limit, *q1, *q1_scale, *q2, *q2_scale);
  return Error::Success();
}

// The grouped GEMM of R rows of p.a: rows [off[e], off[e+1]) (clamped monotone into [0, R]) use
// expert e, rows past the last offset become zeros.
void grouped_rows_cpu(const GemmProblem& p, const int32_t* off, int64_t R) {
  std::vector<RowRun> runs;
  int64_t done = 0;  // rows below `done` are covered; offsets are clamped to be monotone in [0, R]
  for (int64_t e = 0; e < p.w.E; ++e) {
    int64_t hi = off[e + 1];
    hi = hi < done ? done : (hi > R ? R : hi);
    RowRun run{e, {}, {}};
    for (int64_t r = done; r < hi; ++r) {
      run.a_rows.push_back(r);
      run.c_rows.push_back(r);
    }
    runs.push_back(std::move(run));
    done = hi;
  }
  gemm_runs(p, runs);
  zero_rows(p, done, R);
}

Error GemmGroupedCpu(AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale, AnyBuffer zero,
                     AnyBuffer scale2, AnyBuffer bias, AnyBuffer offsets, Result<AnyBuffer> c,
                     Result<AnyBuffer> workspace, int64_t weight_type, int64_t group_n, int64_t group_k,
                     int64_t has_zero, int64_t has_scale2, int64_t has_bias, int64_t act_group_k,
                     int64_t a_k_order) {
  const std::string call = "gemm_grouped";
  GemmProblem p;
  // The CPU needs no scratch: the workspace is validated and left untouched.
  HJ_RETURN_IF_ERROR(parse_gemm_grouped(call, a, a_scale, qweight, scale, zero, scale2, bias, offsets,
                                        gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2,
                                                   has_bias, act_group_k),
                                        *c, *workspace, &p));
  HJ_RETURN_IF_ERROR(check_a_k_order(call, a_k_order, &p));
  const int64_t R = dim(a, 0);
  std::vector<uint16_t> natural;
  if (p.a_k_order) {  // the rows back in their natural order, in a buffer of the CPU's own
    natural.resize(static_cast<size_t>(R * p.K));
    const auto* src = static_cast<const uint16_t*>(p.a.data);
    for (int64_t r = 0; r < R; ++r) rs4_order_row(src + r * p.K, natural.data() + r * p.K, p.K, /*to_order=*/false);
    p.a.data = natural.data();
  }
  grouped_rows_cpu(p, static_cast<const int32_t*>(offsets.untyped_data()), R);
  return Error::Success();
}

Error GemmGroupedGatedCpu(AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale, AnyBuffer zero,
                          AnyBuffer scale2, AnyBuffer bias, AnyBuffer offsets, Result<AnyBuffer> y,
                          Result<AnyBuffer> c, Result<AnyBuffer> workspace, int64_t weight_type, int64_t group_n,
                          int64_t group_k, int64_t has_zero, int64_t has_scale2, int64_t has_bias,
                          int64_t act_group_k, int64_t activation, float limit) {
  GemmProblem p;
  HJ_RETURN_IF_ERROR(parse_gemm_grouped_gated("gemm_grouped_gated", a, a_scale, qweight, scale, zero, scale2, bias,
                                              offsets,
                                              gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2,
                                                         has_bias, act_group_k),
                                              activation, *y, *c, *workspace, &p));
  grouped_rows_cpu(p, static_cast<const int32_t*>(offsets.untyped_data()), dim(a, 0));
  activate_rows_cpu(p.c_type, c->untyped_data(), dim(*c, 0), p.N, p.N / 2, static_cast<int>(activation), limit,
                    y->untyped_data());
  return Error::Success();
}

Error GemmGroupedGatherCpu(AnyBuffer x, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale, AnyBuffer zero,
                           AnyBuffer scale2, AnyBuffer bias, AnyBuffer permutation, AnyBuffer offsets,
                           Result<AnyBuffer> c, Result<AnyBuffer> workspace, int64_t weight_type, int64_t group_n,
                           int64_t group_k, int64_t has_zero, int64_t has_scale2, int64_t has_bias,
                           int64_t act_group_k, int64_t top_k) {
  const std::string call = "gemm_grouped_gather";
  GemmProblem p;
  int64_t R = 0;
  HJ_RETURN_IF_ERROR(parse_gemm_grouped_gather(call, x, a_scale, qweight, scale, zero, scale2, bias, permutation,
                                               offsets,
                                               gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2,
                                                          has_bias, act_group_k),
                                               top_k, *c, *workspace, &p, &R));
  // The rows permute_rows makes, in a buffer of the CPU's own.
  const int32_t* off = static_cast<const int32_t*>(offsets.untyped_data());
  const size_t row_bytes = static_cast<size_t>(p.K) * ffi::ByteWidth(x.element_type());
  std::vector<char> rows(static_cast<size_t>(R) * row_bytes);
  permute_rows_cpu(x.untyped_data(), static_cast<const int32_t*>(permutation.untyped_data()), off[p.w.E], R,
                   row_bytes, top_k, rows.data());
  p.a.data = rows.data();
  grouped_rows_cpu(p, off, R);
  return Error::Success();
}

Error gemm_batched_impl(const std::string& call, AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight,
                        AnyBuffer scale, AnyBuffer zero, AnyBuffer scale2, AnyBuffer bias, AnyBuffer counts,
                        AnyBuffer c, const GemmAttrs& at) {
  GemmProblem p;
  HJ_RETURN_IF_ERROR(parse_gemm(call, a, a_scale, qweight, scale, zero, scale2, bias, at, c, &p));
  HJ_RETURN_IF_ERROR(check_batched_layout(call, a, c, counts, p.w.E));
  const int32_t* cnt = static_cast<const int32_t*>(counts.untyped_data());
  const int64_t T = dim(a, 1);
  std::vector<RowRun> runs;
  for (int64_t e = 0; e < p.w.E; ++e) {
    int64_t n = cnt[e];
    n = n < 0 ? 0 : (n > T ? T : n);
    RowRun run{e, {}, {}};
    for (int64_t t = 0; t < n; ++t) {
      run.a_rows.push_back(e * T + t);
      run.c_rows.push_back(e * T + t);
    }
    runs.push_back(std::move(run));
    zero_rows(p, e * T + n, (e + 1) * T);  // rows past the count are written as zeros
  }
  gemm_runs(p, runs);
  return Error::Success();
}

Error GemmBatchedCpu(AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale, AnyBuffer zero,
                     AnyBuffer scale2, AnyBuffer bias, AnyBuffer counts, Result<AnyBuffer> c,
                     int64_t weight_type, int64_t group_n, int64_t group_k, int64_t has_zero,
                     int64_t has_scale2, int64_t has_bias, int64_t act_group_k) {
  return gemm_batched_impl("gemm_batched", a, a_scale, qweight, scale, zero, scale2, bias, counts, *c,
                           gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2, has_bias,
                                      act_group_k));
}

Error GemmBatchedIntoCpu(AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale,
                         AnyBuffer zero, AnyBuffer scale2, AnyBuffer bias, AnyBuffer counts, AnyBuffer out,
                         Result<AnyBuffer> c, int64_t weight_type, int64_t group_n, int64_t group_k,
                         int64_t has_zero, int64_t has_scale2, int64_t has_bias, int64_t act_group_k) {
  const std::string call = "gemm_batched_into";
  HJ_RETURN_IF_ERROR(check_batched_into_out(call, out, *c));
  return gemm_batched_impl(call, a, a_scale, qweight, scale, zero, scale2, bias, counts, *c,
                           gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2, has_bias,
                                      act_group_k));
}

}  // namespace

void experts_indexed_cpu(const ExpertsIndexedCall& g, const AnyBuffer& c, void* y, int64_t activation, float limit) {
  gemm_indexed_gated_runs(g.up, g.up_l, c, y, activation, limit);
  gemm_indexed_runs(g.down, g.down_l);
}

void experts_indexed_quant_cpu(const ExpertsIndexedQuantCall& g, const AnyBuffer& x, const AnyBuffer& c,
                               int64_t act_group_k, int64_t activation, float limit, AnyBuffer& q1,
                               AnyBuffer& q1_scale, AnyBuffer& q2, AnyBuffer& q2_scale) {
  gemm_indexed_quant_runs(g.up, x, -1, 0.0f, act_group_k, q1, q1_scale);
  gemm_indexed_quant_runs(g.down, c, activation, limit, act_group_k, q2, q2_scale);
}

}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmIndexedCpu, hj::GemmIndexedCpu, hj::bind_gemm_indexed<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmIndexedQuantCpu, hj::GemmIndexedQuantCpu,
                              hj::bind_gemm_indexed_quant<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmIndexedGatedCpu, hj::GemmIndexedGatedCpu,
                              hj::bind_gemm_indexed_gated<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmGroupedCpu, hj::GemmGroupedCpu, hj::bind_gemm_grouped<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjExpertsIndexedCpu, hj::ExpertsIndexedCpu, hj::bind_experts_indexed<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjExpertsIndexedQuantCpu, hj::ExpertsIndexedQuantCpu,
                              hj::bind_experts_indexed_quant<void>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmGroupedGatedCpu, hj::GemmGroupedGatedCpu,
                              hj::bind_gemm_grouped_gated<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmGroupedGatherCpu, hj::GemmGroupedGatherCpu,
                              hj::bind_gemm_grouped_gather<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmBatchedCpu, hj::GemmBatchedCpu, hj::bind_gemm_batched<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmBatchedIntoCpu, hj::GemmBatchedIntoCpu,
                              hj::bind_gemm_batched_into<void>());
