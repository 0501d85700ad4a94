// Prefill grouped GEMM, fp16 x fp16 -> fp16 (gemm_prefill_sm90_kernel.cuh): the bf16 kernel's
// configuration (128 x 256 x 64 tiles, clusters of two along N).
#include "gemm_prefill_sm90_kernel.cuh"

namespace hj {
namespace prefill {
namespace detail {
using F16Config = Config<cutlass::half_t, cutlass::half_t, false, Shape<_128, _256, _64>, Shape<_1, _2, _1>>;
}  // namespace detail
}  // namespace prefill
}  // namespace hj

HJ_DEFINE_PREFILL_KIND(f16, hj::prefill::detail::F16Config)
