// Prefill grouped GEMM for experts of few rows (32 to 127 on average), fp16 x fp16 -> fp16
// (gemm_prefill_sm90_kernel.cuh): 64 x 256 x 64 tiles, pingpong (each consumer warpgroup owns a
// whole tile, so a 64-row expert wastes no half tile and one warpgroup's epilogue overlaps the
// other's mainloop); clusters of two CTAs along N share each A tile by multicast.
#include "gemm_prefill_sm90_kernel.cuh"

namespace hj {
namespace prefill {
namespace detail {
using F16M64Config =
    Config<cutlass::half_t, cutlass::half_t, false, Shape<_64, _256, _64>, Shape<_1, _2, _1>, true>;
}  // namespace detail
}  // namespace prefill
}  // namespace hj

HJ_DEFINE_PREFILL_KIND(f16_m64, hj::prefill::detail::F16M64Config)
