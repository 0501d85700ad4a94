"""Activation, fused activation + dynamic quantization, and dynamic quantization custom calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _ffi
from ..activations import get_activation

QUANT_DTYPES = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}


def _quant_shapes(rows: int, cols: int, quant: str, group_k: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    if quant not in QUANT_DTYPES:
        raise ValueError(f"unknown activation quantization {quant!r}; supported: {sorted(QUANT_DTYPES)}")
    if group_k and cols % group_k:
        raise ValueError(f"group size {group_k} does not divide {cols} columns")
    groups = cols // group_k if group_k else 1
    return (
        jax.ShapeDtypeStruct((rows, cols), QUANT_DTYPES[quant]),
        jax.ShapeDtypeStruct((rows, groups), jnp.float32),
    )


def activation(x: jax.Array, name: str, limit: float | None = None, *, k_order: bool = False) -> jax.Array:
    """[R, N1] -> [R, I] in x's dtype.

    ``k_order=True`` writes each row's columns in the 4-bit prefill mainloop's k order
    (``gemm.rs4_column_order``; I a multiple of 64) for a ``gemm_grouped`` call given
    ``a_k_order=True``."""
    spec, lim = get_activation(name, limit)
    cols = x.shape[1] // 2 if spec.gated else x.shape[1]
    return _ffi.call(
        "activation",
        jax.ShapeDtypeStruct((x.shape[0], cols), x.dtype),
        x,
        activation=int(spec.code),
        limit=lim,
        k_order=int(k_order),
    )


def activation_quant(
    x: jax.Array, name: str, limit: float | None, quant: str, group_k: int
) -> tuple[jax.Array, jax.Array]:
    """[R, N1] -> codes [R, I] and float32 scales [R, I / group_k] (group_k 0: one per row)."""
    spec, lim = get_activation(name, limit)
    cols = x.shape[1] // 2 if spec.gated else x.shape[1]
    q, s = _ffi.call(
        "activation_quant",
        _quant_shapes(x.shape[0], cols, quant, group_k),
        x,
        activation=int(spec.code),
        limit=lim,
        group_k=group_k,
    )
    return q, s


def quantize(x: jax.Array, quant: str, group_k: int) -> tuple[jax.Array, jax.Array]:
    """Dynamic quantization of a 16-bit [R, K]: scale = absmax / qmax per row or group."""
    q, s = _ffi.call("quantize", _quant_shapes(x.shape[0], x.shape[1], quant, group_k), x, group_k=group_k)
    return q, s


def quantize_permuted_supported(group_k: int, cols: int) -> bool:
    """Whether ``quantize_permuted`` takes this grouping: groups of 8 to 256 columns (a power of
    two) dividing ``cols`` (the CUDA kernel's lanes share a group's maximum)."""
    return 8 <= group_k <= 256 and group_k & (group_k - 1) == 0 and cols % group_k == 0


def quantize_permuted(
    x: jax.Array, permutation: jax.Array, expert_first_token_offset: jax.Array, src_rows: jax.Array, quant: str,
    group_k: int,
) -> tuple[jax.Array, jax.Array]:
    """``permute_rows`` of ``quantize(x)``, codes and scales, in one call that reads each token row
    of ``x`` [M, K] once: [M * k, K] codes and [M * k, K / group_k] scales in the grouped layout
    (``permutation``, ``expert_first_token_offset`` and ``src_rows`` [M, k] of ``routing_grouped``;
    k is top-k), zeros past the valid rows. ``group_k``: see ``quantize_permuted_supported``."""
    if not quantize_permuted_supported(group_k, x.shape[1]):
        raise ValueError(f"quantize_permuted takes groups of 8 to 256 columns (a power of two) dividing "
                         f"{x.shape[1]}, got {group_k}; quantize, then permute_rows, for other groupings")
    rows = permutation.shape[0]
    q, s = _ffi.call("quantize_permuted", _quant_shapes(rows, x.shape[1], quant, group_k), x, permutation,
                     expert_first_token_offset, src_rows, group_k=group_k)
    return q, s
