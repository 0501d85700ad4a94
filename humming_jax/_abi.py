"""Integer codes shared with the C++/CUDA handlers (kept in step with cuda_ffi/moe_contract.h)."""

from __future__ import annotations

import enum


class WeightType(enum.IntEnum):
    FLOAT = 0  # bf16 / fp16 values, no scale
    UINT4 = 1  # two 4-bit codes per byte, low nibble = even k; w = (q - zero) * scale
    INT8 = 2  # w = q * scale
    FP8_E4M3 = 3  # w = q * scale
    FP4_E2M1 = 4  # two e2m1 codes per byte, low nibble = even k; w = q * scale (* scale2)


class ActivationCode(enum.IntEnum):
    SILU = 0
    GELU = 1
    GELU_TANH = 2
    SWIGLUOAI = 3
    SILU_NO_MUL = 4
    GELU_NO_MUL = 5
    GELU_TANH_NO_MUL = 6
    RELU2_NO_MUL = 7
