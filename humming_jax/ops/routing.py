"""Routing metadata custom calls (computed on the device, never read back to the host)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import _ffi


class IndexedRouting(NamedTuple):
    """Indexed layout: entry ids t*k+j sorted by local expert, padded per expert to block_m."""

    sorted_ids: jax.Array  # [P] int32, padding = M*k
    block_expert_ids: jax.Array  # [P / block_m] int32, -1 past the used blocks
    num_tokens_post_padded: jax.Array  # [1] int32
    src_rows: jax.Array  # [M, k] int32: t*k+j, or -1 where the entry is skipped


class GroupedRouting(NamedTuple):
    """Grouped layout: entries permuted so each local expert's rows are contiguous."""

    permutation: jax.Array  # [M*k] int32: position -> t*k+j, -1 past the valid rows
    expert_first_token_offset: jax.Array  # [E_local + 1] int32
    src_rows: jax.Array  # [M, k] int32: position of t*k+j, or -1 where skipped


def indexed_padded_rows(entries: int, num_local_experts: int, block_m: int) -> int:
    """Rows of the padded sorted-id list (mirrors hj::indexed_padded_rows)."""
    worst = entries + num_local_experts * (block_m - 1)
    return -(-worst // block_m) * block_m


def _map_operand(topk_ids: jax.Array, expert_map: jax.Array | None) -> tuple[jax.Array, int]:
    """(the map operand, identity_map). No map (None or empty) is the identity: the handlers are
    told so by the attribute and get ``topk_ids`` in the map's slot, which they do not read, so
    that no constant or zero-sized buffer enters the program."""
    if expert_map is None or (jnp.ndim(expert_map) == 1 and jnp.shape(expert_map)[0] == 0):
        return topk_ids, 1
    return expert_map, 0


def routing_indexed(
    topk_ids: jax.Array, expert_map: jax.Array | None, num_local_experts: int, block_m: int
) -> IndexedRouting:
    """The indexed layout of ``topk_ids`` [M, k] through ``expert_map`` (global id -> local slot or
    -1; None or an empty map is the identity over the local experts, every other id skipped)."""
    results, map_operand, attrs = routing_indexed_parts(topk_ids, expert_map, num_local_experts, block_m)
    return IndexedRouting(*_ffi.call("routing_indexed", results, topk_ids, map_operand, **attrs))


def routing_indexed_parts(
    topk_ids: jax.Array, expert_map: jax.Array | None, num_local_experts: int, block_m: int
) -> tuple[tuple, jax.Array, dict[str, int]]:
    """The result shapes (IndexedRouting's four arrays), the map operand and the attributes of
    ``routing_indexed``, which ``layer_indexed`` returns after its experts results."""
    m, k = topk_ids.shape
    map_operand, identity = _map_operand(topk_ids, expert_map)
    p = indexed_padded_rows(m * k, num_local_experts, block_m)
    i32 = jnp.int32
    results = (
        jax.ShapeDtypeStruct((p,), i32),
        jax.ShapeDtypeStruct((p // block_m,), i32),
        jax.ShapeDtypeStruct((1,), i32),
        jax.ShapeDtypeStruct((m, k), i32),
    )
    return results, map_operand, dict(num_local_experts=num_local_experts, block_m=block_m, identity_map=identity)


def routing_grouped(topk_ids: jax.Array, expert_map: jax.Array | None, num_local_experts: int) -> GroupedRouting:
    """The grouped layout of ``topk_ids`` [M, k] through ``expert_map`` (as routing_indexed)."""
    m, k = topk_ids.shape
    map_operand, identity = _map_operand(topk_ids, expert_map)
    i32 = jnp.int32
    out = _ffi.call(
        "routing_grouped",
        (
            jax.ShapeDtypeStruct((m * k,), i32),
            jax.ShapeDtypeStruct((num_local_experts + 1,), i32),
            jax.ShapeDtypeStruct((m, k), i32),
        ),
        topk_ids,
        map_operand,
        num_local_experts=num_local_experts,
        identity_map=identity,
    )
    return GroupedRouting(*out)


def permute_rows(x: jax.Array, routing: GroupedRouting, top_k: int, *, k_order: bool = False) -> jax.Array:
    """y[p] = x[permutation[p] // top_k] for valid positions, zeros elsewhere: [M*k, cols].

    ``k_order=True`` writes each row's columns in the 4-bit prefill mainloop's k order
    (``gemm.rs4_column_order``; 16-bit rows, cols a multiple of 64) for a ``gemm_grouped`` call
    given ``a_k_order=True``."""
    rows = routing.permutation.shape[0]
    return _ffi.call(
        "permute_rows",
        jax.ShapeDtypeStruct((rows, x.shape[1]), x.dtype),
        x,
        routing.permutation,
        routing.expert_first_token_offset,
        top_k=top_k,
        k_order=int(k_order),
    )
