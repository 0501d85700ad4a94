// CPU handlers of the routing metadata (indexed and grouped layouts) and of the row permutation
// of the grouped format. Entries are placed in increasing token*k+j order within each expert.
#include <vector>

#include "ffi_common.h"
#include "layer_steps_cpu.h"
#include "permute_rows_cpu.h"

namespace hj {

void routing_indexed_cpu(const RoutingShape& s, const AnyBuffer& topk_ids, const AnyBuffer& expert_map,
                         int64_t block_m, int64_t P, AnyBuffer& sorted_ids, AnyBuffer& block_expert_ids,
                         AnyBuffer& ntpp, AnyBuffer& src_rows) {
  const int64_t entries = s.M * s.top_k;
  const int32_t* ids = static_cast<const int32_t*>(topk_ids.untyped_data());
  const int32_t* map = static_cast<const int32_t*>(expert_map.untyped_data());
  int32_t* sorted = static_cast<int32_t*>(sorted_ids.untyped_data());
  int32_t* blocks = static_cast<int32_t*>(block_expert_ids.untyped_data());
  int32_t* src = static_cast<int32_t*>(src_rows.untyped_data());

  std::vector<int64_t> count(s.num_local, 0), cursor(s.num_local, 0);
  std::vector<int32_t> local(entries);
  for (int64_t i = 0; i < entries; ++i) {
    local[i] = local_expert(ids[i], map, s.num_global, s.num_local);
    if (local[i] >= 0) ++count[local[i]];
    src[i] = local[i] >= 0 ? static_cast<int32_t>(i) : -1;
  }
  for (int64_t i = 0; i < P; ++i) sorted[i] = static_cast<int32_t>(entries);  // sentinel
  for (int64_t b = 0; b < P / block_m; ++b) blocks[b] = -1;
  int64_t start = 0;
  for (int64_t e = 0; e < s.num_local; ++e) {
    cursor[e] = start;
    const int64_t padded = (count[e] + block_m - 1) / block_m * block_m;
    for (int64_t b = start / block_m; b < (start + padded) / block_m; ++b) blocks[b] = static_cast<int32_t>(e);
    start += padded;
  }
  for (int64_t i = 0; i < entries; ++i)
    if (local[i] >= 0) sorted[cursor[local[i]]++] = static_cast<int32_t>(i);
  *static_cast<int32_t*>(ntpp.untyped_data()) = static_cast<int32_t>(start);
}

namespace {

Error RoutingIndexedCpu(AnyBuffer topk_ids, AnyBuffer expert_map, Result<AnyBuffer> sorted_ids,
                        Result<AnyBuffer> block_expert_ids, Result<AnyBuffer> ntpp, Result<AnyBuffer> src_rows,
                        int64_t num_local_experts, int64_t block_m, int64_t identity_map) {
  const std::string call = "routing_indexed";
  RoutingShape s;
  HJ_RETURN_IF_ERROR(check_routing_inputs(call, topk_ids, expert_map, num_local_experts, identity_map, &s));
  int64_t P = 0;
  HJ_RETURN_IF_ERROR(check_routing_indexed_outputs(call, s, block_m, topk_ids, expert_map, *sorted_ids,
                                                   *block_expert_ids, *ntpp, *src_rows, &P));
  routing_indexed_cpu(s, topk_ids, expert_map, block_m, P, *sorted_ids, *block_expert_ids, *ntpp, *src_rows);
  return Error::Success();
}

Error RoutingGroupedCpu(AnyBuffer topk_ids, AnyBuffer expert_map, Result<AnyBuffer> permutation,
                        Result<AnyBuffer> offsets, Result<AnyBuffer> src_rows, int64_t num_local_experts,
                        int64_t identity_map) {
  const std::string call = "routing_grouped";
  RoutingShape s;
  HJ_RETURN_IF_ERROR(check_routing_inputs(call, topk_ids, expert_map, num_local_experts, identity_map, &s));
  HJ_RETURN_IF_ERROR(
      check_routing_grouped_outputs(call, s, topk_ids, expert_map, *permutation, *offsets, *src_rows));
  const int64_t entries = s.M * s.top_k;

  const int32_t* ids = static_cast<const int32_t*>(topk_ids.untyped_data());
  const int32_t* map = static_cast<const int32_t*>(expert_map.untyped_data());
  int32_t* perm = static_cast<int32_t*>(permutation->untyped_data());
  int32_t* off = static_cast<int32_t*>(offsets->untyped_data());
  int32_t* src = static_cast<int32_t*>(src_rows->untyped_data());

  std::vector<int64_t> cursor(s.num_local + 1, 0);
  std::vector<int32_t> local(entries);
  for (int64_t i = 0; i < entries; ++i) {
    local[i] = local_expert(ids[i], map, s.num_global, s.num_local);
    if (local[i] >= 0) ++cursor[local[i] + 1];
  }
  for (int64_t e = 0; e < s.num_local; ++e) cursor[e + 1] += cursor[e];
  for (int64_t e = 0; e <= s.num_local; ++e) off[e] = static_cast<int32_t>(cursor[e]);
  for (int64_t p = 0; p < entries; ++p) perm[p] = -1;
  for (int64_t i = 0; i < entries; ++i) {
    if (local[i] < 0) {
      src[i] = -1;
      continue;
    }
    const int64_t p = cursor[local[i]]++;
    perm[p] = static_cast<int32_t>(i);
    src[i] = static_cast<int32_t>(p);
  }
  return Error::Success();
}

Error PermuteRowsCpu(AnyBuffer x, AnyBuffer permutation, AnyBuffer offsets, Result<AnyBuffer> y,
                     int64_t top_k, int64_t k_order) {
  const std::string call = "permute_rows";
  PermuteShape ps;
  HJ_RETURN_IF_ERROR(check_permute_rows(call, x, permutation, offsets, *y, top_k, &ps));
  HJ_RETURN_IF_ERROR(check_k_order(call, k_order, x.element_type(), ps.cols));
  const int32_t* off = static_cast<const int32_t*>(offsets.untyped_data());
  permute_rows_cpu(x.untyped_data(), static_cast<const int32_t*>(permutation.untyped_data()), off[dim(offsets, 0) - 1],
                   ps.R, static_cast<size_t>(ps.cols) * ffi::ByteWidth(x.element_type()), top_k, y->untyped_data());
  if (k_order == 1) rs4_order_rows_in_place(static_cast<uint16_t*>(y->untyped_data()), ps.R, ps.cols);
  return Error::Success();
}

}  // namespace
}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjRoutingIndexedCpu, hj::RoutingIndexedCpu,
                              hj::bind_routing_indexed<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjRoutingGroupedCpu, hj::RoutingGroupedCpu,
                              hj::bind_routing_grouped<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjPermuteRowsCpu, hj::PermuteRowsCpu, hj::bind_permute_rows<void>());
