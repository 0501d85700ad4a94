// CPU handler of the finalize step: out[t] = sum over j of topk_weights[t, j] * d[src_rows[t, j]],
// accumulated in float32 in increasing j, then rounded; entries with src_rows < 0 are skipped, so
// a token with no local expert gets exactly 0. `out` is the caller's buffer, aliased to the result.
#include <vector>

#include "cpu_parallel.h"
#include "ffi_common.h"
#include "layer_steps_cpu.h"

namespace hj {

void finalize_cpu(const AnyBuffer& d, const AnyBuffer& topk_weights, const AnyBuffer& src_rows, AnyBuffer& result) {
  const int64_t M = dim(result, 0), H = dim(result, 1), k = dim(topk_weights, 1), Rd = dim(d, 0);
  const ElemType t = elem_type_of(d.element_type());
  const float* w = static_cast<const float*>(topk_weights.untyped_data());
  const int32_t* src = static_cast<const int32_t*>(src_rows.untyped_data());
  parallel_for(M, H * (k + 1), [&](int64_t m) {
    std::vector<float> acc(static_cast<size_t>(H), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = src[m * k + j];
      if (row < 0 || row >= Rd) continue;
      const float wj = w[m * k + j];
      for (int64_t h = 0; h < H; ++h) acc[h] += wj * load_elem(t, d.untyped_data(), row * H + h);
    }
    for (int64_t h = 0; h < H; ++h) store_elem(t, result.untyped_data(), m * H + h, acc[h]);
  });
}

namespace {

Error FinalizeCpu(AnyBuffer d, AnyBuffer topk_weights, AnyBuffer src_rows, AnyBuffer out, Result<AnyBuffer> result) {
  HJ_RETURN_IF_ERROR(check_finalize_result("finalize", d, topk_weights, src_rows, out, *result));
  finalize_cpu(d, topk_weights, src_rows, *result);
  return Error::Success();
}

}  // namespace
}  // namespace hj

XLA_FFI_DEFINE_HANDLER_SYMBOL(HjFinalizeCpu, hj::FinalizeCpu, hj::bind_finalize<void>());
