// The indexed layer's steps on the GPU, each shared by its own call's CUDA handler and by
// layer_indexed's (layer_cuda.cu): the routing (routing_cuda.cu), the two GEMMs (gemm_cuda.cu) and
// the finalize step (finalize_cuda.cu). Each launches on buffers its caller has parsed and checked;
// every kernel is launched dependent on the one before it (dependent_launch.cuh) and waits for it
// before reading what it wrote.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi_common.h"

namespace hj {

// routing_indexed's kernel for s's topk_ids / expert_map (P: sorted_ids' length).
Error launch_routing_indexed(const std::string& call, cudaStream_t stream, const RoutingShape& s,
                             const AnyBuffer& topk_ids, const AnyBuffer& expert_map, int64_t block_m, int64_t P,
                             AnyBuffer& sorted_ids, AnyBuffer& block_expert_ids, AnyBuffer& ntpp,
                             AnyBuffer& src_rows);

// experts_indexed's kernels: GEMM1 with its gated activation into y (c: its rows before it, where
// the activation runs as a kernel of its own), then GEMM2 into g.down's c.
Error launch_experts_indexed(const std::string& call, cudaStream_t stream, const ExpertsIndexedCall& g,
                             int64_t gather_div, int64_t block_m, int64_t activation, float limit, AnyBuffer& y,
                             AnyBuffer& c);

// experts_indexed_quant's kernels: GEMM1 quantizing x (q1 / q1_scale) into c, then GEMM2
// quantizing activation(c) (q2 / q2_scale) into g.down's c, launched dependent on the kernel before it.
Error launch_experts_indexed_quant(const std::string& call, cudaStream_t stream, const ExpertsIndexedQuantCall& g,
                                   const AnyBuffer& x, int64_t act_group_k, int64_t gather_div, int64_t block_m,
                                   int64_t activation, float limit, AnyBuffer& c, AnyBuffer& q1, AnyBuffer& q1_scale,
                                   AnyBuffer& q2, AnyBuffer& q2_scale);

// finalize's kernel: result[t] = sum_j topk_weights[t, j] * d[src_rows[t, j]].
Error launch_finalize_rows(const std::string& call, cudaStream_t stream, const AnyBuffer& d,
                           const AnyBuffer& topk_weights, const AnyBuffer& src_rows, AnyBuffer& result);

}  // namespace hj
