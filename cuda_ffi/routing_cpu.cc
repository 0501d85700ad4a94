// CPU handlers of the routing metadata (indexed and grouped layouts) and of the row permutation
// of the grouped format. Entries are placed in increasing token*k+j order within each expert.
#include <cstring>
#include <vector>

#include "ffi_common.h"

namespace hj {
namespace {

Error RoutingIndexedCpu(AnyBuffer topk_ids, AnyBuffer expert_map, Result<AnyBuffer> sorted_ids,
                        Result<AnyBuffer> block_expert_ids, Result<AnyBuffer> ntpp, Result<AnyBuffer> src_rows,
                        int64_t num_local_experts, int64_t block_m) {
  const std::string call = "routing_indexed";
  RoutingShape s;
  HJ_RETURN_IF_ERROR(check_routing_inputs(call, topk_ids, expert_map, num_local_experts, &s));
  if (block_m <= 0) return invalid(call, "block_m must be positive");
  const int64_t entries = s.M * s.top_k;
  const int64_t P = indexed_padded_rows(entries, s.num_local, block_m);
  HJ_RETURN_IF_ERROR(expect_shape(call, "sorted_ids", *sorted_ids, {P}));
  HJ_RETURN_IF_ERROR(expect_shape(call, "block_expert_ids", *block_expert_ids, {P / block_m}));
  HJ_RETURN_IF_ERROR(expect_shape(call, "num_tokens_post_padded", *ntpp, {1}));
  HJ_RETURN_IF_ERROR(expect_shape(call, "src_rows", *src_rows, {s.M, s.top_k}));
  HJ_RETURN_IF_ERROR(check_no_overlap(
      call,
      {span_of("sorted_ids", *sorted_ids), span_of("block_expert_ids", *block_expert_ids),
       span_of("num_tokens_post_padded", *ntpp), span_of("src_rows", *src_rows)},
      {span_of("topk_ids", topk_ids), span_of("expert_map", expert_map)}));

  const int32_t* ids = static_cast<const int32_t*>(topk_ids.untyped_data());
  const int32_t* map = static_cast<const int32_t*>(expert_map.untyped_data());
  int32_t* sorted = static_cast<int32_t*>(sorted_ids->untyped_data());
  int32_t* blocks = static_cast<int32_t*>(block_expert_ids->untyped_data());
  int32_t* src = static_cast<int32_t*>(src_rows->untyped_data());

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
  *static_cast<int32_t*>(ntpp->untyped_data()) = static_cast<int32_t>(start);
  return Error::Success();
}

Error RoutingGroupedCpu(AnyBuffer topk_ids, AnyBuffer expert_map, Result<AnyBuffer> permutation,
                        Result<AnyBuffer> offsets, Result<AnyBuffer> src_rows, int64_t num_local_experts) {
  const std::string call = "routing_grouped";
  RoutingShape s;
  HJ_RETURN_IF_ERROR(check_routing_inputs(call, topk_ids, expert_map, num_local_experts, &s));
  const int64_t entries = s.M * s.top_k;
  HJ_RETURN_IF_ERROR(expect_shape(call, "permutation", *permutation, {entries}));
  HJ_RETURN_IF_ERROR(expect_shape(call, "expert_first_token_offset", *offsets, {s.num_local + 1}));
  HJ_RETURN_IF_ERROR(expect_shape(call, "src_rows", *src_rows, {s.M, s.top_k}));
  HJ_RETURN_IF_ERROR(check_no_overlap(
      call,
      {span_of("permutation", *permutation), span_of("expert_first_token_offset", *offsets),
       span_of("src_rows", *src_rows)},
      {span_of("topk_ids", topk_ids), span_of("expert_map", expert_map)}));

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
                     int64_t top_k) {
  const std::string call = "permute_rows";
  HJ_RETURN_IF_ERROR(expect_rank(call, "x", x, 2));
  HJ_RETURN_IF_ERROR(expect_rank(call, "permutation", permutation, 1));
  HJ_RETURN_IF_ERROR(expect_s32(call, "permutation", permutation));
  HJ_RETURN_IF_ERROR(expect_rank(call, "expert_first_token_offset", offsets, 1));
  HJ_RETURN_IF_ERROR(expect_s32(call, "expert_first_token_offset", offsets));
  if (top_k <= 0) return invalid(call, "top_k must be positive");
  const int64_t M = dim(x, 0), cols = dim(x, 1), R = dim(permutation, 0);
  if (R != M * top_k) return invalid(call, "permutation must have M * top_k entries");
  HJ_RETURN_IF_ERROR(expect_shape(call, "y", *y, {R, cols}));
  if (y->element_type() != x.element_type()) return invalid(call, "y must have the dtype of x");
  HJ_RETURN_IF_ERROR(check_no_overlap(call, {span_of("y", *y)},
                                      {span_of("x", x), span_of("permutation", permutation),
                                       span_of("expert_first_token_offset", offsets)}));
  const int32_t* perm = static_cast<const int32_t*>(permutation.untyped_data());
  const int32_t* off = static_cast<const int32_t*>(offsets.untyped_data());
  int64_t valid = off[dim(offsets, 0) - 1];
  valid = valid < 0 ? 0 : (valid > R ? R : valid);
  const size_t row_bytes = static_cast<size_t>(cols) * ffi::ByteWidth(x.element_type());
  const char* xs = static_cast<const char*>(x.untyped_data());
  char* ys = static_cast<char*>(y->untyped_data());
  for (int64_t p = 0; p < R; ++p) {
    const int64_t id = p < valid ? perm[p] : -1;
    if (id >= 0 && id < R)
      std::memcpy(ys + p * row_bytes, xs + (id / top_k) * row_bytes, row_bytes);
    else
      std::memset(ys + p * row_bytes, 0, row_bytes);
  }
  return Error::Success();
}

}  // namespace
}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjRoutingIndexedCpu, hj::RoutingIndexedCpu,
                              hj::bind_routing_indexed<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjRoutingGroupedCpu, hj::RoutingGroupedCpu,
                              hj::bind_routing_grouped<void>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HjPermuteRowsCpu, hj::PermuteRowsCpu, hj::bind_permute_rows<void>());
