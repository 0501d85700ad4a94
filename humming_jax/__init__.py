"""humming-jax: quantized Mixture-of-Experts kernels for JAX as XLA FFI custom calls.

The public API: ``quantize_moe_weights`` / ``convert_to_kernel_format`` -> ``MoEWeights``;
``fused_moe`` (standard format, automatic class selection); the expert classes in
``humming_jax.experts``; ``select_experts``; the oracle in ``humming_jax.reference``;
``load_moe_layer`` (safetensors checkpoints, ``humming_jax.checkpoint``). The Flax layer lives in
``humming_jax.flax`` and is imported only on request (Flax is optional).
"""

from __future__ import annotations

from . import _ffi

_ffi.register_all()

from . import experts, reference, schemas  # noqa: E402
from .checkpoint import load_moe_layer  # noqa: E402  (safetensors is imported on first use)
from . import parallel  # noqa: E402
from .conversion import convert_to_kernel_format  # noqa: E402
from .experts import BatchedExperts, GroupedExperts, IndexedExperts  # noqa: E402
from .fused_moe import fused_moe  # noqa: E402
from .quant_keys import GroupShape, QuantKey, ScaleDesc  # noqa: E402
from .quantize import SCHEMES, quantize_moe_weights  # noqa: E402
from .selection import select_experts  # noqa: E402
from .weights import MoEWeights, PackedWeight  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "BatchedExperts",
    "GroupShape",
    "GroupedExperts",
    "IndexedExperts",
    "MoEWeights",
    "PackedWeight",
    "QuantKey",
    "SCHEMES",
    "ScaleDesc",
    "convert_to_kernel_format",
    "cuda_available",
    "experts",
    "fused_moe",
    "load_moe_layer",
    "parallel",
    "quantize_moe_weights",
    "reference",
    "schemas",
    "select_experts",
]

cuda_available = _ffi.cuda_available
