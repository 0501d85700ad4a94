// The driver's cuTensorMapEncodeTiled, for the kernels that load by TMA (gemm_decode_sm90_fp8_ring.cu,
// gemm_prefill_sm90_4bit.cu).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace hj {

// cuTensorMapEncodeTiled from the driver, through the runtime (no link against libcuda); nullptr
// where the driver does not have it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static std::once_flag once;
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    else
      cudaGetLastError();
  });
  return fn;
}

// A 3-D map over `depth` row-major matrices of rows x cols elements of elem_bytes, one after
// another in memory, read in boxes of box_cols x box_rows x 1 (no interleave, zero fill out of
// bounds); false where the encoder is missing or refuses the map.
inline bool encode_rows_3d(CUtensorMap* map, CUtensorMapDataType type, int elem_bytes, const void* base, int64_t cols,
                           int64_t rows, int64_t depth, uint32_t box_cols, uint32_t box_rows,
                           CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t row = static_cast<cuuint64_t>(cols) * static_cast<cuuint64_t>(elem_bytes);
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(depth)};
  const cuuint64_t strides[2] = {row, row * static_cast<cuuint64_t>(rows)};
  const cuuint32_t box[3] = {box_cols, box_rows, 1}, estrides[3] = {1, 1, 1};
  return encode(map, type, 3, const_cast<void*>(base), dims, strides, box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The L2 promotion an A/B switch names: environment variable `name` = none | 128 | 256; unset or
// anything else, `unset` (read at each launch).
inline CUtensorMapL2promotion l2_promotion_from_env(const char* name, CUtensorMapL2promotion unset) {
  const char* v = std::getenv(name);
  if (v == nullptr) return unset;
  if (std::strcmp(v, "none") == 0) return CU_TENSOR_MAP_L2_PROMOTION_NONE;
  if (std::strcmp(v, "128") == 0) return CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  if (std::strcmp(v, "256") == 0) return CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  return unset;
}

}  // namespace hj
