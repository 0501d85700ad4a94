"""Weight and input schemas: what a checkpoint's expert weights are and how activations enter.

A weight schema names a published quantization format (GPTQ, AWQ, FP8, MXFP4, NVFP4, INT8, or
unquantized 16-bit); an input schema says whether activations stay 16-bit or are quantized
dynamically per call. Each maps to a ``QuantKey`` (``.quant_key()``), and a (weight, input)
pair is usable only when the kernels implement that key pair (``quantize.SUPPORTED_PAIRS``):
``resolve_scheme`` checks that and names the matching scheme of ``quantize.SCHEMES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import jax.numpy as jnp

from .quant_keys import GroupShape, QuantKey, ScaleDesc, describe_pair
from .quantize import (
    ACT_FP8_PER_GROUP_128,
    ACT_FP8_PER_TOKEN,
    ACT_INT8_PER_TOKEN,
    SCHEMES,
    SUPPORTED_PAIRS,
    W_BF16,
    W_FP8_BLOCK128,
    W_FP8_CHANNEL,
    W_FP8_TENSOR,
    W_FP16,
    W_INT4_G128,
    W_INT8_CHANNEL,
    W_MXFP4,
    W_NVFP4,
    W_UINT4_ZP_G128,
)

__all__ = [
    "AWQ",
    "FP8",
    "FP8Dynamic",
    "GPTQ",
    "InputSchema",
    "Int8",
    "Int8Dynamic",
    "MXFP4",
    "NVFP4",
    "NoInputQuant",
    "Unquantized",
    "WeightSchema",
    "resolve_scheme",
    "supported_pairs_text",
]


def _group_shape(group_size: int) -> GroupShape:
    """Per-row groups of ``group_size`` along K; -1 (or 0) means one group per output channel."""
    return GroupShape.PER_CHANNEL if group_size <= 0 else GroupShape(1, group_size)


def _check_group_size(schema: str, group_size: Any) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise TypeError(f"{schema}: group_size must be an int, got {group_size!r}")
    if group_size == 0 or group_size < -1:
        raise ValueError(f"{schema}: group_size must be positive, or -1 for one group per channel; got {group_size}")


# --- weight schemas ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Unquantized:
    """16-bit float weights (``weight`` tensors), bfloat16 or float16."""

    dtype: Any = jnp.bfloat16

    def __post_init__(self) -> None:
        name = jnp.dtype(self.dtype).name
        if name not in ("bfloat16", "float16"):
            raise ValueError(f"Unquantized: dtype must be bfloat16 or float16, got {name}")
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    def quant_key(self) -> QuantKey:
        return W_BF16 if self.dtype == jnp.dtype(jnp.bfloat16) else W_FP16


@dataclass(frozen=True)
class GPTQ:
    """GPTQ integer weights: ``bits`` 4 or 8, scales per ``group_size`` input channels (-1: per
    output channel), symmetric (implicit zero 2^(bits-1)) or with real zero points (``sym=False``).

    Activation reordering (``desc_act=True``, a permuting ``g_idx``) is not supported."""

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"GPTQ: bits must be 4 or 8, got {self.bits!r}")
        _check_group_size("GPTQ", self.group_size)
        if self.desc_act:
            raise ValueError(
                "GPTQ: desc_act=True (activation reordering through g_idx) is not supported; "
                "re-quantize without desc_act, or reorder the input channels (and g_idx) offline"
            )
        if self.bits == 8 and not self.sym:
            raise ValueError(
                "GPTQ: 8-bit weights with zero points (sym=False) are not supported; the int8 "
                "kernels take symmetric codes"
            )

    def quant_key(self) -> QuantKey:
        if self.bits == 8:
            return QuantKey("int8", ScaleDesc("float32", True, _group_shape(self.group_size)))
        shape = _group_shape(self.group_size)
        if self.sym:
            return W_INT4_G128 if shape == GroupShape(1, 128) else QuantKey("int4", ScaleDesc("bfloat16", True, shape))
        if shape == GroupShape(1, 128):
            return W_UINT4_ZP_G128
        return QuantKey("uint4", ScaleDesc("bfloat16", True, shape), symmetric=False)


@dataclass(frozen=True)
class AWQ:
    """AWQ 4-bit weights with scales (and, by default, zero points) per ``group_size``."""

    bits: int = 4
    group_size: int = 128
    zero_point: bool = True

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ValueError(f"AWQ: only 4-bit weights are published in the AWQ layout, got bits={self.bits!r}")
        _check_group_size("AWQ", self.group_size)

    def quant_key(self) -> QuantKey:
        return GPTQ(4, self.group_size, sym=not self.zero_point).quant_key()


@dataclass(frozen=True)
class FP8:
    """float8_e4m3fn weights with 128x128 block scales (``block=(128, 128)``), one scale per
    tensor (``per_tensor=True``) or, by default, one scale per output channel."""

    block: tuple[int, int] | None = None
    per_tensor: bool = False

    def __post_init__(self) -> None:
        if self.block is not None:
            block = tuple(self.block)
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ValueError(f"FP8: block must be None or (rows, cols) of positive ints, got {self.block!r}")
            if self.per_tensor:
                raise ValueError("FP8: block scales and per_tensor=True exclude each other")
            object.__setattr__(self, "block", block)

    def quant_key(self) -> QuantKey:
        if self.block is not None:
            if self.block == (128, 128):
                return W_FP8_BLOCK128
            return QuantKey("float8_e4m3fn", ScaleDesc("float32", True, GroupShape(*self.block)))
        return W_FP8_TENSOR if self.per_tensor else W_FP8_CHANNEL


@dataclass(frozen=True)
class MXFP4:
    """OCP MX FP4: e2m1 codes, one e8m0 (power of two) scale per 32 input channels."""

    def quant_key(self) -> QuantKey:
        return W_MXFP4


@dataclass(frozen=True)
class NVFP4:
    """NVIDIA FP4: e2m1 codes, one e4m3 scale per 16 input channels, one float32 scale per expert."""

    def quant_key(self) -> QuantKey:
        return W_NVFP4


@dataclass(frozen=True)
class Int8:
    """int8 weights with one scale per output channel (``per_channel=False``: per tensor)."""

    per_channel: bool = True

    def quant_key(self) -> QuantKey:
        if self.per_channel:
            return W_INT8_CHANNEL
        return QuantKey("int8", ScaleDesc("float32", True, GroupShape.PER_TENSOR))


WeightSchema = Union[Unquantized, GPTQ, AWQ, FP8, MXFP4, NVFP4, Int8]
WEIGHT_SCHEMAS: tuple[type, ...] = (Unquantized, GPTQ, AWQ, FP8, MXFP4, NVFP4, Int8)


# --- input schemas ----------------------------------------------------------------------------
@dataclass(frozen=True)
class NoInputQuant:
    """Activations enter the GEMMs as 16-bit values."""

    def quant_key(self) -> None:
        return None


@dataclass(frozen=True)
class FP8Dynamic:
    """Activations quantized per call to float8_e4m3fn: scale = absmax / 448 per token
    (``group_size=None``) or per token and group of ``group_size`` channels."""

    group_size: int | None = None

    def __post_init__(self) -> None:
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise ValueError(f"FP8Dynamic: group_size must be None or a positive int, got {self.group_size!r}")

    def quant_key(self) -> QuantKey:
        if self.group_size is None:
            return ACT_FP8_PER_TOKEN
        if self.group_size == 128:
            return ACT_FP8_PER_GROUP_128
        return QuantKey("float8_e4m3fn", ScaleDesc("float32", False, GroupShape(1, self.group_size)))


@dataclass(frozen=True)
class Int8Dynamic:
    """Activations quantized per call to int8: scale = absmax / 127 per token."""

    def quant_key(self) -> QuantKey:
        return ACT_INT8_PER_TOKEN


InputSchema = Union[NoInputQuant, FP8Dynamic, Int8Dynamic]
INPUT_SCHEMAS: tuple[type, ...] = (NoInputQuant, FP8Dynamic, Int8Dynamic)


# --- the supported pairs ----------------------------------------------------------------------
def supported_pairs_text() -> str:
    """One line per supported (weight, activation) key pair, with its scheme name."""
    return "\n".join(f"  {name}: {describe_pair(s.weight_key, s.act_key)}" for name, s in SCHEMES.items())


def resolve_scheme(weight_schema: Any, input_schema: Any = None) -> str:
    """The name of the scheme in ``quantize.SCHEMES`` that a (weight, input) schema pair runs as.

    Raises TypeError for objects that are not schemas and ValueError, naming the pair and listing
    every supported one, when the kernels do not implement the pair."""
    if not isinstance(weight_schema, WEIGHT_SCHEMAS):
        names = ", ".join(c.__name__ for c in WEIGHT_SCHEMAS)
        raise TypeError(f"weight_schema must be one of humming_jax.schemas.{{{names}}}, got {weight_schema!r}")
    if input_schema is None:
        input_schema = NoInputQuant()
    if not isinstance(input_schema, INPUT_SCHEMAS):
        names = ", ".join(c.__name__ for c in INPUT_SCHEMAS)
        raise TypeError(f"input_schema must be None or one of humming_jax.schemas.{{{names}}}, got {input_schema!r}")
    wkey, akey = weight_schema.quant_key(), input_schema.quant_key()
    if (wkey, akey) in SUPPORTED_PAIRS:
        return next(name for name, s in SCHEMES.items() if (s.weight_key, s.act_key) == (wkey, akey))
    raise ValueError(
        f"unsupported quantization pair {weight_schema!r} + {input_schema!r}, i.e. "
        f"{describe_pair(wkey, akey)}; the supported pairs are:\n{supported_pairs_text()}"
    )
