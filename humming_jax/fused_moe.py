"""``fused_moe``: the standard-format MoE layer with automatic class selection."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .selection import select_experts
from .weights import MoEWeights


def fused_moe(
    hidden_states: jax.Array,
    weights: MoEWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    activation: str = "silu",
    expert_map: jax.Array | None = None,
    out: jax.Array | None = None,
    gemm_type: str | None = None,
    global_num_experts: int | None = None,
    activation_limit: float | None = None,
) -> jax.Array:
    """MoE experts on hidden_states [M, H] with routing topk_weights/topk_ids [M, k].

    ``out`` [M, H] (hidden_states' dtype) is the caller-owned result buffer; the returned array
    aliases it (donate it under ``jax.jit`` to write in place). Without ``out`` a fresh buffer is
    used. ``gemm_type`` ("indexed" | "grouped" | "auto") overrides $HUMMING_JAX_MOE_GEMM_TYPE; auto
    takes the grouped class for prefill-sized calls (``select_experts``, ``rows_per_expert``).
    """
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights must be MoEWeights, got {type(weights).__name__}")
    m, top_k = topk_ids.shape if topk_ids.ndim == 2 else (hidden_states.shape[0], 1)
    rows_per_expert = m * top_k / max(weights.num_experts, 1)
    cls = select_experts(weights.weight_key, weights.act_key, activation, prefer=gemm_type,
                         rows_per_expert=rows_per_expert)
    if out is None:
        out = jnp.zeros(hidden_states.shape, hidden_states.dtype)
    return cls().apply(
        out,
        hidden_states,
        weights,
        topk_weights,
        topk_ids,
        activation=activation,
        expert_map=expert_map,
        global_num_experts=global_num_experts,
        activation_limit=activation_limit,
    )
