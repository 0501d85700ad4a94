// CUDA handlers of the expert GEMM in its three forms (indexed gather, grouped contiguous, batched
// masked). Shapes and operands are parsed by the same code as on the CPU (ffi_common.h); routing
// metadata (num_tokens_post_padded, offsets, counts) is read only by the kernels, on the device.
#include <cuda_runtime.h>

#include "cuda_launch.cuh"
#include "ffi_common.h"
#include "gemm_kernels_sm80.cuh"
#include "layer_steps_cuda.h"
#include "quantize_cuda.h"
#if defined(HUMMING_JAX_FAST_PATHS)
#include "gemm_decode_sm90.h"
#include "gemm_prefill_sm90.h"
#endif

namespace hj {
namespace {

using gemm::GemmLaunch;
using gemm::RowMode;

// Rows per CTA from the expected rows per expert: small tiles waste less at decode sizes.
int pick_bm(int64_t rows_per_expert) {
  if (rows_per_expert <= 16) return 16;
  if (rows_per_expert <= 32) return 32;
  return 64;
}

// Checks the kernel's limits and fills the launch fields that depend only on the problem.
Error prepare(const std::string& call, const GemmProblem& p, GemmLaunch* L) {
  L->p = p;
  const int64_t K = p.K;
  const WeightView& w = p.w;
  const size_t a_unit = p.a.quantized() ? 8 : 16;
  L->vec_a = K % 8 == 0 && aligned_to(p.a.data, a_unit);
  const int64_t w_unit = w.type == WeightType::kFloat ? 16
                         : (w.type == WeightType::kUInt4 || w.type == WeightType::kFp4E2M1) ? 4
                                                                                            : 8;
  L->vec_w = K % 8 == 0 && aligned_to(w.data, static_cast<size_t>(w_unit));
  L->w_uniform = w.type == WeightType::kFloat || w.group_k % 8 == 0 || w.group_k >= K;
  L->period = 0;
  if (p.a.quantized()) {
    // The MMA sums codes over `period` columns; both scales must be constant over each period.
    auto divides = [&](int64_t group, int64_t d) { return group >= K || group % d == 0; };
    if (divides(w.group_k, 32) && divides(p.a.group_k, 32))
      L->period = 32;
    else if (divides(w.group_k, 16) && divides(p.a.group_k, 16))
      L->period = 16;
    else
      return invalid(call, "8-bit activations need weight and activation scale groups along K that are "
                           "multiples of 16 (or span K); got " + std::to_string(w.group_k) + " and " +
                           std::to_string(p.a.group_k));
  }
  if (w.type != WeightType::kFloat) {
    if (w.N > INT32_MAX || K > INT32_MAX || w.group_n > INT32_MAX || w.group_k > INT32_MAX ||
        w.E * w.scale_rows() * w.scale_cols() > INT32_MAX)
      return invalid(call, "weight shapes beyond 32-bit scale indexing are not supported");
    L->group_n = static_cast<uint32_t>(w.group_n);
    L->group_k = static_cast<uint32_t>(w.group_k);
    L->scale_rows = static_cast<uint32_t>(w.scale_rows());
    L->scale_cols = static_cast<uint32_t>(w.scale_cols());
  }
  if (p.a.quantized()) {
    if (p.a.group_k > INT32_MAX) return invalid(call, "act_group_k is too large");
    L->a_group_k = static_cast<uint32_t>(p.a.group_k);
    L->a_scale_cols = static_cast<uint32_t>(p.a.scale_cols());
  }
  if ((p.N + gemm::kBN - 1) / gemm::kBN > 65535)
    return invalid(call, "N = " + std::to_string(p.N) + " is too large");
  return Error::Success();
}

// qin: the call's activations are the quantization of qin->x, to run before the GEMM's kernel
// reads L.p.a (the decode path runs it itself, or has its kernel quantize while it loads).
// gate / gated (gemm_indexed_gated): the decode kernel may write the activated pairs itself
// (*gated = true; the caller starts it false); otherwise c is written and the caller activates it.
Error launch(const std::string& call, const GemmLaunch& L, int bm, int64_t m_tiles, cudaStream_t stream,
             const InputQuant* qin = nullptr, const GatedOut* gate = nullptr, bool* gated = nullptr) {
  const int64_t n_tiles = (L.p.N + gemm::kBN - 1) / gemm::kBN;
  if (m_tiles == 0 || n_tiles == 0) return Error::Success();
#if defined(HUMMING_JAX_FAST_PATHS)
  // Decode: the weight-streaming kernel (gemm_decode_sm90.h) when the rows per expert are few.
  bool decode_ran = false;
  const Error decode_err = decode::launch_decode(call, L, stream, &decode_ran, qin, gate, gated);
  if (decode_ran || !decode_err.success()) return decode_err;
#endif
  if (m_tiles > INT32_MAX) return invalid(call, "too many row tiles");
  if (qin) HJ_RETURN_IF_ERROR(launch_quantize(call, stream, *qin));
  const dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_tiles));
  switch (bm) {
    case 16: gemm::launch_sm80<16>(L, grid, stream); break;
    case 32: gemm::launch_sm80<32>(L, grid, stream); break;
    default: gemm::launch_sm80<64>(L, grid, stream); break;
  }
  return launch_status(call, "gemm_kernel");
}

// The indexed GEMM of a parsed problem over a checked layout (gemm_indexed, gemm_indexed_quant,
// gemm_indexed_gated).
// inputs_ready_but_a: GemmLaunch::inputs_ready_but_a (the launch follows a kernel of the same call).
Error launch_indexed(const std::string& call, const GemmProblem& p, const IndexedLayout& l, int64_t gather_div,
                     int64_t block_m, cudaStream_t stream, const InputQuant* qin = nullptr,
                     const GatedOut* gate = nullptr, bool* gated = nullptr, bool inputs_ready_but_a = false) {
  GemmLaunch L{};
  HJ_RETURN_IF_ERROR(prepare(call, p, &L));
  L.inputs_ready_but_a = inputs_ready_but_a;
  const int bm = pick_bm(block_m);
  L.mode = RowMode::kIndexed;
  L.E = p.w.E;
  L.sorted_ids = l.sorted_ids;
  L.block_expert_ids = l.block_expert_ids;
  L.ntpp = l.num_tokens_post_padded;
  L.block_m = block_m;
  L.gather_div = gather_div;
  L.a_rows = l.a_rows;
  L.c_rows = l.c_rows;
  L.padded_rows = l.padded_rows;
  L.sub_tiles = (block_m + bm - 1) / bm;
  return launch(call, L, bm, l.num_blocks * L.sub_tiles, stream, qin, gate, gated);
}

Error GemmIndexedCuda(cudaStream_t stream, AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale,
                      AnyBuffer zero, AnyBuffer scale2, AnyBuffer bias, AnyBuffer sorted_ids,
                      AnyBuffer block_expert_ids, AnyBuffer ntpp, Result<AnyBuffer> c, int64_t weight_type,
                      int64_t group_n, int64_t group_k, int64_t has_zero, int64_t has_scale2, int64_t has_bias,
                      int64_t act_group_k, int64_t gather_div, int64_t block_m) {
  const std::string call = "gemm_indexed";
  GemmProblem p;
  IndexedLayout l;
  HJ_RETURN_IF_ERROR(parse_gemm_indexed(
      call, a, a_scale, qweight, scale, zero, scale2, bias, sorted_ids, block_expert_ids, ntpp,
      gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2, has_bias, act_group_k), gather_div, block_m,
      *c, &p, &l));
  return launch_indexed(call, p, l, gather_div, block_m, stream);
}

// What gemm_indexed_quant's kernels need to quantize (after activation >= 0) the parsed x into q.
InputQuant input_quant(const AnyBuffer& x, const IndexedQuantCall& g, int64_t act_group_k, AnyBuffer& q,
                       AnyBuffer& q_scale, int64_t activation, float limit) {
  return InputQuant{x.untyped_data(), elem_type_of(x.element_type()), g.kind, g.s.R, g.s.N1, g.s.I, act_group_k,
                    q.untyped_data(), static_cast<float*>(q_scale.untyped_data()), static_cast<int>(activation),
                    limit};
}

Error GemmIndexedQuantCuda(cudaStream_t stream, AnyBuffer x, AnyBuffer /*unused*/, AnyBuffer qweight,
                           AnyBuffer scale, AnyBuffer zero, AnyBuffer scale2, AnyBuffer bias, AnyBuffer sorted_ids,
                           AnyBuffer block_expert_ids, AnyBuffer ntpp, Result<AnyBuffer> c, Result<AnyBuffer> q,
                           Result<AnyBuffer> q_scale, int64_t weight_type, int64_t group_n, int64_t group_k,
                           int64_t has_zero, int64_t has_scale2, int64_t has_bias, int64_t act_group_k,
                           int64_t gather_div, int64_t block_m, int64_t activation, float limit) {
  const std::string call = "gemm_indexed_quant";
  IndexedQuantCall g;
  HJ_RETURN_IF_ERROR(parse_gemm_indexed_quant(
      call, x, qweight, scale, zero, scale2, bias, sorted_ids, block_expert_ids, ntpp,
      gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2, has_bias, act_group_k), activation, gather_div,
      block_m, *c, *q, *q_scale, &g));
  const InputQuant qin = input_quant(x, g, act_group_k, *q, *q_scale, activation, limit);
  return launch_indexed(call, g.p, g.l, gather_div, block_m, stream, &qin);
}

Error GemmIndexedGatedCuda(cudaStream_t stream, AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale,
                           AnyBuffer zero, AnyBuffer scale2, AnyBuffer bias, AnyBuffer sorted_ids,
                           AnyBuffer block_expert_ids, AnyBuffer ntpp, Result<AnyBuffer> y, Result<AnyBuffer> c,
                           int64_t weight_type, int64_t group_n, int64_t group_k, int64_t has_zero,
                           int64_t has_scale2, int64_t has_bias, int64_t act_group_k, int64_t gather_div,
                           int64_t block_m, int64_t activation, float limit) {
  const std::string call = "gemm_indexed_gated";
  GemmProblem p;
  IndexedLayout l;
  HJ_RETURN_IF_ERROR(parse_gemm_indexed_gated(
      call, a, a_scale, qweight, scale, zero, scale2, bias, sorted_ids, block_expert_ids, ntpp,
      gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2, has_bias, act_group_k), activation, gather_div,
      block_m, *y, *c, &p, &l));
  const GatedOut gate{static_cast<int>(activation), limit, y->untyped_data()};
  bool gated = false;
  HJ_RETURN_IF_ERROR(launch_indexed(call, p, l, gather_div, block_m, stream, nullptr, &gate, &gated));
  if (gated) return Error::Success();
  // The GEMM wrote c: the activation kernel makes y from it.
  return launch_activation(call, stream, c->untyped_data(), y->untyped_data(), p.c_type, static_cast<int>(activation),
                           limit, dim(*c, 0), p.N, p.N / 2);
}

// GEMM1 with its gated activation, then GEMM2 launched dependent on GEMM1's (or the activation's)
// kernel: inside one call the two join without a full stream (or graph-node) boundary, and
// GEMM2's decode kernel reads the routing and issues its first weights while GEMM1 finishes
// (everything before GEMM1 has completed once GEMM1's CTAs have passed their own wait).
Error ExpertsIndexedCuda(cudaStream_t stream, AnyBuffer x, AnyBuffer w1, AnyBuffer w1_scale, AnyBuffer w1_zero,
                         AnyBuffer w1_scale2, AnyBuffer w1_bias, AnyBuffer w2, AnyBuffer w2_scale, AnyBuffer w2_zero,
                         AnyBuffer w2_scale2, AnyBuffer w2_bias, AnyBuffer sorted_ids, AnyBuffer block_expert_ids,
                         AnyBuffer ntpp, Result<AnyBuffer> d, Result<AnyBuffer> y, Result<AnyBuffer> c,
                         int64_t weight_type, int64_t group_n, int64_t group_k, int64_t has_zero, int64_t has_scale2,
                         int64_t has_bias, int64_t down_weight_type, int64_t down_group_n, int64_t down_group_k,
                         int64_t down_has_zero, int64_t down_has_scale2, int64_t down_has_bias, int64_t gather_div,
                         int64_t block_m, int64_t activation, float limit) {
  const std::string call = "experts_indexed";
  const AnyBuffer up_w[5] = {w1, w1_scale, w1_zero, w1_scale2, w1_bias};
  const AnyBuffer down_w[5] = {w2, w2_scale, w2_zero, w2_scale2, w2_bias};
  ExpertsIndexedCall g;
  HJ_RETURN_IF_ERROR(parse_experts_indexed(
      call, x, up_w, down_w, sorted_ids, block_expert_ids, ntpp,
      WeightAttrs{weight_type, group_n, group_k, has_zero, has_scale2, has_bias},
      WeightAttrs{down_weight_type, down_group_n, down_group_k, down_has_zero, down_has_scale2, down_has_bias},
      activation, gather_div, block_m, *d, *y, *c, &g));
  return launch_experts_indexed(call, stream, g, gather_div, block_m, activation, limit, *y, *c);
}

// The same for 8-bit activations: GEMM1 quantizes x, GEMM2 activates and quantizes GEMM1's rows.
// GEMM2's kernel is launched dependent on the kernel before it in this call (GEMM1's, or the
// quantization kernel that runs plainly after it), so its decode kernel reads the routing on that
// kernel's tail; its rows, or its own quantization of GEMM1's rows, wait for it.
Error ExpertsIndexedQuantCuda(cudaStream_t stream, AnyBuffer x, AnyBuffer w1, AnyBuffer w1_scale, AnyBuffer w1_zero,
                              AnyBuffer w1_scale2, AnyBuffer w1_bias, AnyBuffer w2, AnyBuffer w2_scale,
                              AnyBuffer w2_zero, AnyBuffer w2_scale2, AnyBuffer w2_bias, AnyBuffer sorted_ids,
                              AnyBuffer block_expert_ids, AnyBuffer ntpp, Result<AnyBuffer> d, Result<AnyBuffer> c,
                              Result<AnyBuffer> q1, Result<AnyBuffer> q1_scale, Result<AnyBuffer> q2,
                              Result<AnyBuffer> q2_scale, int64_t weight_type, int64_t group_n, int64_t group_k,
                              int64_t has_zero, int64_t has_scale2, int64_t has_bias, int64_t down_weight_type,
                              int64_t down_group_n, int64_t down_group_k, int64_t down_has_zero,
                              int64_t down_has_scale2, int64_t down_has_bias, int64_t act_group_k, int64_t gather_div,
                              int64_t block_m, int64_t activation, float limit) {
  const std::string call = "experts_indexed_quant";
  const AnyBuffer up_w[5] = {w1, w1_scale, w1_zero, w1_scale2, w1_bias};
  const AnyBuffer down_w[5] = {w2, w2_scale, w2_zero, w2_scale2, w2_bias};
  ExpertsIndexedQuantCall g;
  HJ_RETURN_IF_ERROR(parse_experts_indexed_quant(
      call, x, up_w, down_w, sorted_ids, block_expert_ids, ntpp,
      WeightAttrs{weight_type, group_n, group_k, has_zero, has_scale2, has_bias},
      WeightAttrs{down_weight_type, down_group_n, down_group_k, down_has_zero, down_has_scale2, down_has_bias},
      act_group_k, activation, gather_div, block_m, *d, *c, *q1, *q1_scale, *q2, *q2_scale, &g));
  return launch_experts_indexed_quant(call, stream, g, x, act_group_k, gather_div, block_m, activation, limit, *c,
                                      *q1, *q1_scale, *q2, *q2_scale);
}

// Rows of K 16-bit values in the 4-bit mainloop's k order (rs4_k_order.h) back in their natural
// order: a thread a 16-byte chunk, its eight values stored at the columns rs4_k_of names.
// K is a multiple of the order's tile, so a tile never straddles two rows.
__global__ void natural_order_kernel(const uint4* __restrict__ x, uint16_t* __restrict__ y, int64_t chunks) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < chunks;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 v = x[idx];
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    const int64_t first = idx * 8;  // the chunk's first element, flat
    const int64_t tile = first / kRs4OrderTile * kRs4OrderTile;
    const int L0 = static_cast<int>(first - tile);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      y[tile + rs4_k_of(L0 + i)] = static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2)));
  }
}

Error natural_order_rows(const std::string& call, cudaStream_t stream, const void* x, void* y, int64_t R, int64_t K) {
  const int64_t chunks = R * K / 8;
  if (chunks == 0) return Error::Success();
  if (!aligned_to(x, 16)) return invalid(call, "a_k_order = 1 needs 16-byte aligned rows");
  const int threads = 256;
  natural_order_kernel<<<grid_for(chunks, threads), threads, 0, stream>>>(static_cast<const uint4*>(x),
                                                                         static_cast<uint16_t*>(y), chunks);
  return launch_status(call, "natural_order_kernel");
}

// The grouped GEMM of R rows of p.a: the prefill kernel where it suits the problem, else the
// generic kernel. gate (gemm_grouped_gated): where the prefill kernel writes the activated rows
// itself, *gated = true (the caller starts it false); otherwise c is written.
Error grouped_rows(const std::string& call, const GemmProblem& p, const int32_t* offsets, int64_t R,
                   void* workspace, size_t ws_bytes, cudaStream_t stream, const GatedOut* gate = nullptr,
                   bool* gated = nullptr) {
  if (R > INT32_MAX) return invalid(call, "too many rows");
#if defined(HUMMING_JAX_FAST_PATHS)
  // Prefill: the CUTLASS grouped GEMM (gemm_prefill_sm90.h) when the problem suits it.
  bool prefill_ran = false;
  const Error prefill_err =
      prefill::try_grouped(call, p, offsets, R, workspace, ws_bytes, stream, &prefill_ran, nullptr, gate, gated);
  if (prefill_ran || !prefill_err.success()) return prefill_err;
#endif
  if (p.a_k_order) {
    // The 4-bit mainloop did not take the call (another device, or an environment that turns it off
    // since the call was traced): the rows back in their natural order at the workspace's end (the
    // room that mainloop's own copy of them would have taken), then whichever kernel takes them.
    const size_t bytes = static_cast<size_t>(R) * static_cast<size_t>(p.K) * 2;
    const uintptr_t base = reinterpret_cast<uintptr_t>(workspace);
    if (ws_bytes < bytes + 256) return invalid(call, "a_k_order = 1 needs a workspace for the natural rows");
    const uintptr_t tail = (base + ws_bytes - bytes) / 256 * 256;
    GemmProblem q = p;
    q.a_k_order = false;
    q.a.data = reinterpret_cast<void*>(tail);
    HJ_RETURN_IF_ERROR(natural_order_rows(call, stream, p.a.data, reinterpret_cast<void*>(tail), R, p.K));
    return grouped_rows(call, q, offsets, R, workspace, tail - base, stream, gate, gated);
  }
  GemmLaunch L{};
  HJ_RETURN_IF_ERROR(prepare(call, p, &L));
  const int bm = pick_bm(R / (p.w.E > 0 ? p.w.E : 1));
  const int64_t row_tiles = (R + bm - 1) / bm;
  L.mode = RowMode::kGrouped;
  L.E = p.w.E;
  L.offsets = offsets;
  L.R = R;
  // At most one partial tile per expert beyond R / bm full ones; then the zero-fill tiles.
  L.gemm_tiles = row_tiles + p.w.E;
  if (R == 0) return Error::Success();
  return launch(call, L, bm, L.gemm_tiles + row_tiles, stream);
}

Error GemmGroupedCuda(cudaStream_t stream, AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale,
                      AnyBuffer zero, AnyBuffer scale2, AnyBuffer bias, AnyBuffer offsets, Result<AnyBuffer> c,
                      Result<AnyBuffer> workspace, int64_t weight_type, int64_t group_n, int64_t group_k,
                      int64_t has_zero, int64_t has_scale2, int64_t has_bias, int64_t act_group_k,
                      int64_t a_k_order) {
  const std::string call = "gemm_grouped";
  GemmProblem p;
  HJ_RETURN_IF_ERROR(parse_gemm_grouped(call, a, a_scale, qweight, scale, zero, scale2, bias, offsets,
                                        gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2,
                                                   has_bias, act_group_k),
                                        *c, *workspace, &p));
  HJ_RETURN_IF_ERROR(check_a_k_order(call, a_k_order, &p));
  return grouped_rows(call, p, static_cast<const int32_t*>(offsets.untyped_data()), dim(a, 0),
                      workspace->untyped_data(), workspace->size_bytes(), stream);
}

Error GemmGroupedGatedCuda(cudaStream_t stream, AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale,
                           AnyBuffer zero, AnyBuffer scale2, AnyBuffer bias, AnyBuffer offsets, Result<AnyBuffer> y,
                           Result<AnyBuffer> c, Result<AnyBuffer> workspace, int64_t weight_type, int64_t group_n,
                           int64_t group_k, int64_t has_zero, int64_t has_scale2, int64_t has_bias,
                           int64_t act_group_k, int64_t activation, float limit) {
  const std::string call = "gemm_grouped_gated";
  GemmProblem p;
  HJ_RETURN_IF_ERROR(parse_gemm_grouped_gated(call, a, a_scale, qweight, scale, zero, scale2, bias, offsets,
                                              gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2,
                                                         has_bias, act_group_k),
                                              activation, *y, *c, *workspace, &p));
  const GatedOut gate{static_cast<int>(activation), limit, y->untyped_data()};
  bool gated = false;
  HJ_RETURN_IF_ERROR(grouped_rows(call, p, static_cast<const int32_t*>(offsets.untyped_data()), dim(a, 0),
                                  workspace->untyped_data(), workspace->size_bytes(), stream, &gate, &gated));
  if (gated) return Error::Success();
  // The GEMM wrote c: the activation kernel makes y from it.
  return launch_activation(call, stream, c->untyped_data(), y->untyped_data(), p.c_type, static_cast<int>(activation),
                           limit, dim(*c, 0), p.N, p.N / 2);
}

Error GemmGroupedGatherCuda(cudaStream_t stream, AnyBuffer x, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale,
                            AnyBuffer zero, AnyBuffer scale2, AnyBuffer bias, AnyBuffer permutation,
                            AnyBuffer offsets, Result<AnyBuffer> c, Result<AnyBuffer> workspace,
                            int64_t weight_type, int64_t group_n, int64_t group_k, int64_t has_zero,
                            int64_t has_scale2, int64_t has_bias, int64_t act_group_k, int64_t top_k) {
  const std::string call = "gemm_grouped_gather";
  GemmProblem p;
  int64_t R = 0;
  HJ_RETURN_IF_ERROR(parse_gemm_grouped_gather(call, x, a_scale, qweight, scale, zero, scale2, bias, permutation,
                                               offsets,
                                               gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2,
                                                          has_bias, act_group_k),
                                               top_k, *c, *workspace, &p, &R));
  if (R > INT32_MAX) return invalid(call, "too many rows");
  const int64_t row_bytes = p.K * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  const int64_t copy = gather_copy_bytes(R, p.K, ffi::ByteWidth(x.element_type()));
  const size_t ws_bytes = workspace->size_bytes();
  if (ws_bytes < static_cast<size_t>(copy))
    return invalid(call, "the workspace result holds " + std::to_string(ws_bytes) + " bytes, less than the " +
                             std::to_string(copy) + " of the permuted rows");
  const size_t ws_main = ws_bytes - static_cast<size_t>(copy);
  uint8_t* ws = static_cast<uint8_t*>(workspace->untyped_data());
  const int32_t* off = static_cast<const int32_t*>(offsets.untyped_data());
  const int32_t* perm = static_cast<const int32_t*>(permutation.untyped_data());
#if defined(HUMMING_JAX_FAST_PATHS)
  const prefill::GatherRows rows{perm, top_k};  // p.a is x
  bool ran = false;
  const Error err = prefill::try_grouped(call, p, off, R, ws, ws_main, stream, &ran, &rows);
  if (ran || !err.success()) return err;
#endif
  // No kernel gathers this problem's rows: permute them into the workspace's end, then the grouped
  // GEMM over that copy.
  const uintptr_t tail = reinterpret_cast<uintptr_t>(ws + ws_main);
  void* a = reinterpret_cast<void*>((tail + kGatherCopyAlign - 1) / kGatherCopyAlign * kGatherCopyAlign);
  HJ_RETURN_IF_ERROR(permute_rows_into(call, stream, x.untyped_data(), perm, off, p.w.E + 1, R, row_bytes, top_k, a));
  p.a.data = a;
  return grouped_rows(call, p, off, R, ws, ws_main, stream);
}

Error gemm_batched_impl(const std::string& call, cudaStream_t stream, AnyBuffer a, AnyBuffer a_scale,
                        AnyBuffer qweight, AnyBuffer scale, AnyBuffer zero, AnyBuffer scale2, AnyBuffer bias,
                        AnyBuffer counts, AnyBuffer c, const GemmAttrs& at) {
  GemmProblem p;
  HJ_RETURN_IF_ERROR(parse_gemm(call, a, a_scale, qweight, scale, zero, scale2, bias, at, c, &p));
  HJ_RETURN_IF_ERROR(check_batched_layout(call, a, c, counts, p.w.E));
  GemmLaunch L{};
  HJ_RETURN_IF_ERROR(prepare(call, p, &L));
  const int64_t T = dim(a, 1);
  const int bm = pick_bm(T);
  L.mode = RowMode::kBatched;
  L.E = p.w.E;
  L.counts = static_cast<const int32_t*>(counts.untyped_data());
  L.T = T;
  L.tiles_per_expert = (T + bm - 1) / bm;
  return launch(call, L, bm, p.w.E * L.tiles_per_expert, stream);
}

Error GemmBatchedCuda(cudaStream_t stream, AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight, AnyBuffer scale,
                      AnyBuffer zero, AnyBuffer scale2, AnyBuffer bias, AnyBuffer counts, Result<AnyBuffer> c,
                      int64_t weight_type, int64_t group_n, int64_t group_k, int64_t has_zero,
                      int64_t has_scale2, int64_t has_bias, int64_t act_group_k) {
  return gemm_batched_impl("gemm_batched", stream, a, a_scale, qweight, scale, zero, scale2, bias, counts, *c,
                           gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2, has_bias,
                                      act_group_k));
}

Error GemmBatchedIntoCuda(cudaStream_t stream, AnyBuffer a, AnyBuffer a_scale, AnyBuffer qweight,
                          AnyBuffer scale, AnyBuffer zero, AnyBuffer scale2, AnyBuffer bias, AnyBuffer counts,
                          AnyBuffer out, Result<AnyBuffer> c, int64_t weight_type, int64_t group_n,
                          int64_t group_k, int64_t has_zero, int64_t has_scale2, int64_t has_bias,
                          int64_t act_group_k) {
  const std::string call = "gemm_batched_into";
  HJ_RETURN_IF_ERROR(check_batched_into_out(call, out, *c));
  return gemm_batched_impl(call, stream, a, a_scale, qweight, scale, zero, scale2, bias, counts, *c,
                           gemm_attrs(weight_type, group_n, group_k, has_zero, has_scale2, has_bias,
                                      act_group_k));
}

}  // namespace

Error launch_experts_indexed(const std::string& call, cudaStream_t stream, const ExpertsIndexedCall& g,
                             int64_t gather_div, int64_t block_m, int64_t activation, float limit, AnyBuffer& y,
                             AnyBuffer& c) {
  const GatedOut gate{static_cast<int>(activation), limit, y.untyped_data()};
  bool gated = false;
  HJ_RETURN_IF_ERROR(launch_indexed(call, g.up, g.up_l, gather_div, block_m, stream, nullptr, &gate, &gated));
  if (!gated)
    HJ_RETURN_IF_ERROR(launch_activation(call, stream, c.untyped_data(), y.untyped_data(), g.up.c_type,
                                         static_cast<int>(activation), limit, dim(c, 0), g.up.N, g.up.N / 2));
  // GEMM1 launches a kernel unless it has no blocks or no columns; without one, the kernel before
  // GEMM2 could be the routing's own, whose results are not final while it runs.
  const bool up_launched = g.up_l.num_blocks > 0 && g.up.N > 0;
  return launch_indexed(call, g.down, g.down_l, 1, block_m, stream, nullptr, nullptr, nullptr, up_launched);
}

Error launch_experts_indexed_quant(const std::string& call, cudaStream_t stream, const ExpertsIndexedQuantCall& g,
                                   const AnyBuffer& x, int64_t act_group_k, int64_t gather_div, int64_t block_m,
                                   int64_t activation, float limit, AnyBuffer& c, AnyBuffer& q1, AnyBuffer& q1_scale,
                                   AnyBuffer& q2, AnyBuffer& q2_scale) {
  const InputQuant up_q = input_quant(x, g.up, act_group_k, q1, q1_scale, -1, 0.0f);
  HJ_RETURN_IF_ERROR(launch_indexed(call, g.up.p, g.up.l, gather_div, block_m, stream, &up_q));
  // As in experts_indexed: without a kernel of GEMM1 (and then none of its quantization either),
  // the kernel before GEMM2's could be the routing's own.
  const bool up_launched = g.up.l.num_blocks > 0 && g.up.p.N > 0;
  const InputQuant down_q = input_quant(c, g.down, act_group_k, q2, q2_scale, activation, limit);
  return launch_indexed(call, g.down.p, g.down.l, 1, block_m, stream, &down_q, nullptr, nullptr, up_launched);
}

}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmIndexedCuda, hj::GemmIndexedCuda, hj::bind_gemm_indexed<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmIndexedQuantCuda, hj::GemmIndexedQuantCuda,
                              hj::bind_gemm_indexed_quant<hj::CudaStream>(), {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmIndexedGatedCuda, hj::GemmIndexedGatedCuda,
                              hj::bind_gemm_indexed_gated<hj::CudaStream>(), {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjExpertsIndexedCuda, hj::ExpertsIndexedCuda,
                              hj::bind_experts_indexed<hj::CudaStream>(), {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjExpertsIndexedQuantCuda, hj::ExpertsIndexedQuantCuda,
                              hj::bind_experts_indexed_quant<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmGroupedCuda, hj::GemmGroupedCuda, hj::bind_gemm_grouped<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmGroupedGatedCuda, hj::GemmGroupedGatedCuda,
                              hj::bind_gemm_grouped_gated<hj::CudaStream>(), {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmGroupedGatherCuda, hj::GemmGroupedGatherCuda,
                              hj::bind_gemm_grouped_gather<hj::CudaStream>(), {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmBatchedCuda, hj::GemmBatchedCuda, hj::bind_gemm_batched<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjGemmBatchedIntoCuda, hj::GemmBatchedIntoCuda,
                              hj::bind_gemm_batched_into<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
