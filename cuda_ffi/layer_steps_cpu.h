// The indexed layer's steps on the host, each shared by its own call's CPU handler and by
// layer_indexed's (layer_cpu.cc): the routing (routing_cpu.cc), the two GEMMs (gemm_cpu.cc) and
// the finalize step (finalize_cpu.cc). Each runs on buffers its caller has parsed and checked.
#pragma once

#include <cstdint>

#include "ffi_common.h"

namespace hj {

// routing_indexed's results for s's topk_ids / expert_map (P: sorted_ids' length).
void routing_indexed_cpu(const RoutingShape& s, const AnyBuffer& topk_ids, const AnyBuffer& expert_map,
                         int64_t block_m, int64_t P, AnyBuffer& sorted_ids, AnyBuffer& block_expert_ids,
                         AnyBuffer& ntpp, AnyBuffer& src_rows);

// experts_indexed's: GEMM1 with its gated activation into y (c its rows before it), then GEMM2.
void experts_indexed_cpu(const ExpertsIndexedCall& g, const AnyBuffer& c, void* y, int64_t activation, float limit);

// experts_indexed_quant's: GEMM1 quantizing x (q1 / q1_scale) into c, then GEMM2 quantizing
// activation(c) (q2 / q2_scale) into g.down's c.
void experts_indexed_quant_cpu(const ExpertsIndexedQuantCall& g, const AnyBuffer& x, const AnyBuffer& c,
                               int64_t act_group_k, int64_t activation, float limit, AnyBuffer& q1,
                               AnyBuffer& q1_scale, AnyBuffer& q2, AnyBuffer& q2_scale);

// finalize's: result[t] = sum_j topk_weights[t, j] * d[src_rows[t, j]].
void finalize_cpu(const AnyBuffer& d, const AnyBuffer& topk_weights, const AnyBuffer& src_rows, AnyBuffer& result);

}  // namespace hj
