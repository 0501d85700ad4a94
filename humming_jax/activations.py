"""The activations of the expert MLP: names, codes and their float32 jnp definitions."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax.scipy.special import erf

from ._abi import ActivationCode


@dataclass(frozen=True)
class ActivationSpec:
    name: str
    code: ActivationCode
    gated: bool
    default_limit: float | None  # the clamp applied when the caller gives none
    accepts_limit: bool


ACTIVATIONS: dict[str, ActivationSpec] = {
    s.name: s
    for s in (
        ActivationSpec("silu", ActivationCode.SILU, True, None, True),
        ActivationSpec("gelu", ActivationCode.GELU, True, None, False),
        ActivationSpec("gelu_tanh", ActivationCode.GELU_TANH, True, None, False),
        ActivationSpec("swigluoai", ActivationCode.SWIGLUOAI, True, 7.0, True),
        ActivationSpec("silu_no_mul", ActivationCode.SILU_NO_MUL, False, None, False),
        ActivationSpec("gelu_no_mul", ActivationCode.GELU_NO_MUL, False, None, False),
        ActivationSpec("gelu_tanh_no_mul", ActivationCode.GELU_TANH_NO_MUL, False, None, False),
        ActivationSpec("relu2_no_mul", ActivationCode.RELU2_NO_MUL, False, None, False),
    )
}


def get_activation(name: str, limit: float | None = None) -> tuple[ActivationSpec, float]:
    """Validates an activation name and clamp limit; returns the spec and the limit (-1: none)."""
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    spec = ACTIVATIONS[name]
    if limit is not None:
        if not spec.accepts_limit:
            raise ValueError(f"activation {name!r} takes no clamp limit (got {limit})")
        if not limit >= 0:
            raise ValueError(f"activation limit must be >= 0, got {limit}")
    eff = limit if limit is not None else spec.default_limit
    return spec, float(eff) if eff is not None else -1.0


def _silu(x: jnp.ndarray) -> jnp.ndarray:
    return x / (1.0 + jnp.exp(-x))


def _gelu(x: jnp.ndarray) -> jnp.ndarray:
    return 0.5 * x * (1.0 + erf(x * 0.70710678118654752))


def _gelu_tanh(x: jnp.ndarray) -> jnp.ndarray:
    return 0.5 * x * (1.0 + jnp.tanh(0.79788456080286536 * (x + 0.044715 * x * x * x)))


def apply_activation(gu: jnp.ndarray, name: str, limit: float | None = None) -> jnp.ndarray:
    """act(gu) in float32 over the last axis (N1 -> I for gated activations), per SPEC §2."""
    spec, lim = get_activation(name, limit)
    x = gu.astype(jnp.float32)
    if spec.gated:
        half = x.shape[-1] // 2
        if spec.code == ActivationCode.SWIGLUOAI:
            g, u = x[..., 0::2], x[..., 1::2]
        else:
            g, u = x[..., :half], x[..., half:]
        if spec.code == ActivationCode.SILU:
            if lim >= 0:
                g = jnp.minimum(g, lim)
                u = jnp.clip(u, -lim, lim)
            return _silu(g) * u
        if spec.code == ActivationCode.GELU:
            return _gelu(g) * u
        if spec.code == ActivationCode.GELU_TANH:
            return _gelu_tanh(g) * u
        g = jnp.minimum(g, lim)
        u = jnp.clip(u, -lim, lim)
        return (u + 1.0) * g / (1.0 + jnp.exp(-1.702 * g))
    if spec.code == ActivationCode.SILU_NO_MUL:
        return _silu(x)
    if spec.code == ActivationCode.GELU_NO_MUL:
        return _gelu(x)
    if spec.code == ActivationCode.GELU_TANH_NO_MUL:
        return _gelu_tanh(x)
    return jnp.square(jnp.maximum(x, 0.0))
