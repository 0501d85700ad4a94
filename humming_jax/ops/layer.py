"""The whole indexed layer as one custom call (``layer_indexed``, ``layer_indexed_quant`` for 8-bit
activations): routing, both GEMMs and the finalize step into the caller's ``out``."""

from __future__ import annotations

from typing import Any

import jax

from .. import _ffi
from ..weights import PackedWeight
from .gemm import experts_indexed_quant_results, experts_indexed_results, experts_weight_operands
from .routing import routing_indexed_parts


def layer_indexed(
    x: jax.Array,
    w13: PackedWeight,
    b13: jax.Array | None,
    w2: PackedWeight,
    b2: jax.Array | None,
    topk_ids: jax.Array,
    expert_map: jax.Array | None,
    topk_weights: jax.Array,
    out: jax.Array,
    *,
    block_m: int,
    activation: str,
    limit: float | None = None,
) -> jax.Array:
    """``finalize(experts_indexed(x, routing_indexed(topk_ids, expert_map), ...), topk_weights,
    src_rows, out)`` in one call, for 16-bit activations and a gated activation: the same values as
    those three calls, bit for bit. The result aliases ``out`` (operand 14): under donation it
    occupies out's buffer. The routing arrays and the GEMMs' rows are the call's own scratch
    results. On the GPU the four kernels (routing, GEMM1, GEMM2, finalize) each start on the tail
    of the one before: under CUDA graphs, where each custom call is a graph of its own, three
    calls would put a graph boundary between them."""
    m, k = topk_ids.shape
    results, attrs = experts_indexed_results("layer_indexed", w13, w2, m * k, x.dtype, activation, limit)
    return _call_layer("layer_indexed", results, x, w13, b13, w2, b2, topk_ids, expert_map, topk_weights, out,
                       block_m=block_m, **attrs)


def layer_indexed_quant(
    x: jax.Array,
    w13: PackedWeight,
    b13: jax.Array | None,
    w2: PackedWeight,
    b2: jax.Array | None,
    topk_ids: jax.Array,
    expert_map: jax.Array | None,
    topk_weights: jax.Array,
    out: jax.Array,
    *,
    block_m: int,
    quant: str,
    act_group_k: int,
    activation: str,
    limit: float | None = None,
) -> jax.Array:
    """``layer_indexed`` for 8-bit activations: ``finalize(experts_indexed_quant(x, routing, ...),
    ...)`` in one call, any activation (gated or not), the same values as the three calls bit for
    bit. The result aliases ``out``; the routing arrays, the GEMMs' rows and the quantized
    activations are the call's own scratch results."""
    m, k = topk_ids.shape
    results, attrs = experts_indexed_quant_results(m, x.shape[1], w13, w2, m * k, x.dtype, quant, act_group_k,
                                                   activation, limit)
    return _call_layer("layer_indexed_quant", results, x, w13, b13, w2, b2, topk_ids, expert_map, topk_weights, out,
                       block_m=block_m, **attrs)


def _call_layer(
    name: str,
    experts_results: tuple,
    x: jax.Array,
    w13: PackedWeight,
    b13: jax.Array | None,
    w2: PackedWeight,
    b2: jax.Array | None,
    topk_ids: jax.Array,
    expert_map: jax.Array | None,
    topk_weights: jax.Array,
    out: jax.Array,
    *,
    block_m: int,
    **attrs: Any,
) -> jax.Array:
    """A layer_* call: x, the weights, topk_ids, the map (or its stand-in), topk_weights and out
    (aliased to result 0); results out, the experts call's results, then the routing's four."""
    routing_results, map_operand, routing_attrs = routing_indexed_parts(topk_ids, expert_map, w13.data.shape[0],
                                                                        block_m)
    weights, weight_attrs = experts_weight_operands(w13, b13, w2, b2)
    results = (jax.ShapeDtypeStruct(out.shape, out.dtype), *experts_results, *routing_results)
    operands = (x, *weights, topk_ids, map_operand, topk_weights, out)
    res = _ffi.call(name, results, *operands, aliases={len(operands) - 1: 0}, **weight_attrs, **routing_attrs, **attrs)
    return res[0]
