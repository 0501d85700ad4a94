// The CPU module: registrations() maps each custom call's name to its handler capsule. The
// CUDA handlers live in a separate library without Python (see humming_jax/_ffi.py).
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* HjRoutingIndexedCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjRoutingGroupedCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjPermuteRowsCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjGemmIndexedCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjGemmIndexedQuantCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjGemmIndexedGatedCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjExpertsIndexedCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjExpertsIndexedQuantCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjGemmGroupedCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjGemmGroupedGatedCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjGemmGroupedGatherCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjGemmBatchedCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjGemmBatchedIntoCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjActivationCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjActivationQuantCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjQuantizeCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjQuantizePermutedCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjFinalizeCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjLayerIndexedCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* HjLayerIndexedQuantCpu(XLA_FFI_CallFrame*);
}

namespace {
template <typename T>
nb::capsule encapsulate(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_humming_jax_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["routing_indexed"] = encapsulate(HjRoutingIndexedCpu);
    d["routing_grouped"] = encapsulate(HjRoutingGroupedCpu);
    d["permute_rows"] = encapsulate(HjPermuteRowsCpu);
    d["gemm_indexed"] = encapsulate(HjGemmIndexedCpu);
    d["gemm_indexed_quant"] = encapsulate(HjGemmIndexedQuantCpu);
    d["gemm_indexed_gated"] = encapsulate(HjGemmIndexedGatedCpu);
    d["experts_indexed"] = encapsulate(HjExpertsIndexedCpu);
    d["experts_indexed_quant"] = encapsulate(HjExpertsIndexedQuantCpu);
    d["gemm_grouped"] = encapsulate(HjGemmGroupedCpu);
    d["gemm_grouped_gated"] = encapsulate(HjGemmGroupedGatedCpu);
    d["gemm_grouped_gather"] = encapsulate(HjGemmGroupedGatherCpu);
    d["gemm_batched"] = encapsulate(HjGemmBatchedCpu);
    d["gemm_batched_into"] = encapsulate(HjGemmBatchedIntoCpu);
    d["activation"] = encapsulate(HjActivationCpu);
    d["activation_quant"] = encapsulate(HjActivationQuantCpu);
    d["quantize"] = encapsulate(HjQuantizeCpu);
    d["quantize_permuted"] = encapsulate(HjQuantizePermutedCpu);
    d["finalize"] = encapsulate(HjFinalizeCpu);
    d["layer_indexed"] = encapsulate(HjLayerIndexedCpu);
    d["layer_indexed_quant"] = encapsulate(HjLayerIndexedQuantCpu);
    return d;
  });
}
