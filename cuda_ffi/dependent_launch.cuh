// Programmatic dependent launch (sm_90): a kernel launched by launch_dependent() may be scheduled
// onto the multiprocessors while the kernel before it on the stream is still running, so that its
// launch and its CTAs' start overlap that kernel's tail instead of following it.
//
// The contract of such a kernel: grid_dependency_wait() before its first access to global memory
// that an earlier kernel may write or read (griddepcontrol.wait returns once every prerequisite
// grid has completed and its memory operations are visible; at once for a kernel launched
// normally), then allow_dependents(), which lets the next dependent launch be scheduled. Placed
// after the wait, at most one kernel waits ahead of the one that runs.
// HUMMING_JAX_PDL=0 launches these kernels normally (A/B timing); read at each launch.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda_launch.cuh"

namespace hj {

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Both in one: the start of every kernel that launch_dependent() launches.
__device__ __forceinline__ void begin_dependent_grid() {
  grid_dependency_wait();
  allow_dependents();
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization allowed
// (unless HUMMING_JAX_PDL=0). A failure is left in cudaGetLastError, as a <<<>>> launch's is.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = env_flag("HUMMING_JAX_PDL", true) ? 1 : 0;
  cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace hj
