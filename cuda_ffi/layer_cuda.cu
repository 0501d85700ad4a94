// CUDA handlers of layer_indexed and layer_indexed_quant: the indexed layer's three calls
// (routing_indexed, experts_indexed or experts_indexed_quant, finalize) as one. Under CUDA graphs
// XLA records each custom call as a graph of its own, and a kernel launched dependent on the one
// before it (programmatic stream serialization) is scheduled on that kernel's tail only inside
// one: here the routing kernel, the GEMMs' kernels and the finalize kernel each start on the tail of
// the one before, with no graph boundary between them. GEMM1's decode kernel waits before it reads
// the routing (its results are not final while the routing kernel runs); GEMM2's reads it early,
// as in the experts_* calls, since every kernel before GEMM1's has completed once GEMM1's CTAs have
// passed their wait.
#include <cuda_runtime.h>

#include "cuda_launch.cuh"
#include "ffi_common.h"
#include "layer_steps_cuda.h"

namespace hj {
namespace {

Error LayerIndexedCuda(cudaStream_t stream, AnyBuffer x, AnyBuffer w1, AnyBuffer w1_scale, AnyBuffer w1_zero,
                       AnyBuffer w1_scale2, AnyBuffer w1_bias, AnyBuffer w2, AnyBuffer w2_scale, AnyBuffer w2_zero,
                       AnyBuffer w2_scale2, AnyBuffer w2_bias, AnyBuffer topk_ids, AnyBuffer expert_map,
                       AnyBuffer topk_weights, AnyBuffer out, Result<AnyBuffer> result, Result<AnyBuffer> d,
                       Result<AnyBuffer> y, Result<AnyBuffer> c, Result<AnyBuffer> sorted_ids,
                       Result<AnyBuffer> block_expert_ids, Result<AnyBuffer> ntpp, Result<AnyBuffer> src_rows,
                       int64_t weight_type, int64_t group_n, int64_t group_k, int64_t has_zero, int64_t has_scale2,
                       int64_t has_bias, int64_t down_weight_type, int64_t down_group_n, int64_t down_group_k,
                       int64_t down_has_zero, int64_t down_has_scale2, int64_t down_has_bias,
                       int64_t num_local_experts, int64_t block_m, int64_t identity_map, int64_t activation,
                       float limit) {
  const std::string call = "layer_indexed";
  const AnyBuffer up_w[5] = {w1, w1_scale, w1_zero, w1_scale2, w1_bias};
  const AnyBuffer down_w[5] = {w2, w2_scale, w2_zero, w2_scale2, w2_bias};
  LayerIndexedCall L;
  HJ_RETURN_IF_ERROR(parse_layer_indexed(
      call, x, up_w, down_w, topk_ids, expert_map, topk_weights, out,
      WeightAttrs{weight_type, group_n, group_k, has_zero, has_scale2, has_bias},
      WeightAttrs{down_weight_type, down_group_n, down_group_k, down_has_zero, down_has_scale2, down_has_bias},
      num_local_experts, block_m, identity_map, activation, *result, *d, *y, *c, *sorted_ids, *block_expert_ids,
      *ntpp, *src_rows, &L));
  HJ_RETURN_IF_ERROR(launch_routing_indexed(call, stream, L.s, topk_ids, expert_map, block_m, L.padded_rows,
                                            *sorted_ids, *block_expert_ids, *ntpp, *src_rows));
  HJ_RETURN_IF_ERROR(launch_experts_indexed(call, stream, L.g, L.s.top_k, block_m, activation, limit, *y, *c));
  return launch_finalize_rows(call, stream, *d, topk_weights, *src_rows, *result);
}

Error LayerIndexedQuantCuda(cudaStream_t stream, AnyBuffer x, AnyBuffer w1, AnyBuffer w1_scale, AnyBuffer w1_zero,
                            AnyBuffer w1_scale2, AnyBuffer w1_bias, AnyBuffer w2, AnyBuffer w2_scale,
                            AnyBuffer w2_zero, AnyBuffer w2_scale2, AnyBuffer w2_bias, AnyBuffer topk_ids,
                            AnyBuffer expert_map, AnyBuffer topk_weights, AnyBuffer out, Result<AnyBuffer> result,
                            Result<AnyBuffer> d, Result<AnyBuffer> c, Result<AnyBuffer> q1,
                            Result<AnyBuffer> q1_scale, Result<AnyBuffer> q2, Result<AnyBuffer> q2_scale,
                            Result<AnyBuffer> sorted_ids, Result<AnyBuffer> block_expert_ids,
                            Result<AnyBuffer> ntpp, Result<AnyBuffer> src_rows, int64_t weight_type,
                            int64_t group_n, int64_t group_k, int64_t has_zero, int64_t has_scale2, int64_t has_bias,
                            int64_t down_weight_type, int64_t down_group_n, int64_t down_group_k,
                            int64_t down_has_zero, int64_t down_has_scale2, int64_t down_has_bias,
                            int64_t act_group_k, int64_t num_local_experts, int64_t block_m, int64_t identity_map,
                            int64_t activation, float limit) {
  const std::string call = "layer_indexed_quant";
  const AnyBuffer up_w[5] = {w1, w1_scale, w1_zero, w1_scale2, w1_bias};
  const AnyBuffer down_w[5] = {w2, w2_scale, w2_zero, w2_scale2, w2_bias};
  LayerIndexedQuantCall L;
  HJ_RETURN_IF_ERROR(parse_layer_indexed_quant(
      call, x, up_w, down_w, topk_ids, expert_map, topk_weights, out,
      WeightAttrs{weight_type, group_n, group_k, has_zero, has_scale2, has_bias},
      WeightAttrs{down_weight_type, down_group_n, down_group_k, down_has_zero, down_has_scale2, down_has_bias},
      act_group_k, num_local_experts, block_m, identity_map, activation, *result, *d, *c, *q1, *q1_scale, *q2,
      *q2_scale, *sorted_ids, *block_expert_ids, *ntpp, *src_rows, &L));
  HJ_RETURN_IF_ERROR(launch_routing_indexed(call, stream, L.s, topk_ids, expert_map, block_m, L.padded_rows,
                                            *sorted_ids, *block_expert_ids, *ntpp, *src_rows));
  HJ_RETURN_IF_ERROR(launch_experts_indexed_quant(call, stream, L.g, x, act_group_k, L.s.top_k, block_m, activation,
                                                  limit, *c, *q1, *q1_scale, *q2, *q2_scale));
  return launch_finalize_rows(call, stream, *d, topk_weights, *src_rows, *result);
}

}  // namespace
}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjLayerIndexedCuda, hj::LayerIndexedCuda, hj::bind_layer_indexed<hj::CudaStream>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjLayerIndexedQuantCuda, hj::LayerIndexedQuantCuda,
                              hj::bind_layer_indexed_quant<hj::CudaStream>(), {xla::ffi::Traits::kCmdBufferCompatible});
