"""Expert and tensor parallelism over a device mesh, on JAX's own collectives.

Every custom call runs inside ``jax.shard_map`` and sees local shards only (a bare FFI call on
sharded operands would get an implicit all-gather, SPEC §7). Three layouts:

- ``ep_moe(mode="allgather")`` (decode): experts sharded E/n per device, tokens sharded over the
  axis. All-gather the tokens and routing, run the standard-format experts on the local experts
  (the global->local ``expert_map`` is built from ``axis_index``), reduce-scatter the partial
  sums back to the token shards.
- ``ep_moe(mode="all_to_all")`` (prefill): same sharding; each routed row travels to its expert's
  device through a padded ``all_to_all``, lands in the batched format [E_local, T, H] with
  ``expert_num_tokens``, runs through ``BatchedExperts`` and travels back; the finalize custom
  call combines it with the router weights on the token's own device. With
  ``expert_layout="grouped"`` the received rows instead stay one ragged list, sorted by local
  expert and run through ``GroupedExperts`` (no per-expert capacity: buffers of the rows
  received, not E_local times a worst case).
- ``tp_moe`` (few large experts): I sharded, each device computes partial outputs from its slice
  of every expert, one ``psum`` (float32, or the output dtype on two devices).

Numerics against single-device ``fused_moe`` (same weights, routing, CPU or CUDA backend):

- all_to_all (either expert layout): bitwise equal on the CPU backend. Each d row is rounded once
  to the output dtype, by GEMM loops shared by the batched and standard forms; the weighted sum over k runs in the
  same finalize kernel, in increasing j. On CUDA the batched and indexed GEMMs share one kernel
  template; where their tiles accumulate K in another order, the result is within the rounding
  of d instead.
- allgather: within rounding. Each device rounds its partial sum (its local experts' terms) to
  the output dtype before the cross-device sum (float32, then one cast; two partials are summed
  in the output dtype, which rounds the same way). A token whose valid experts all live on one
  device is bitwise equal; elsewhere the extra rounding of the partials bounds the difference
  elementwise by 2^-8 * (sum over devices of |partial| + |single|) in bf16 (2^-11 in fp16).
- tp: each device rounds gu, the activation, its partial d and its weighted partial sum to the
  output dtype, so the result differs from single-device by rounding (a few ulps of the terms;
  the tests hold it to a relative error of 1e-2 in bf16). For 8-bit activation schemes with one
  scale per token the GEMM2 input is quantized per device slice of I (a finer grid than the
  single-device per-token scale); per-128-group schemes see the same groups when 128 divides I/n.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .activations import ActivationCode, get_activation
from .experts import BatchedExperts, GroupedExperts
from .fused_moe import fused_moe
from .ops import finalize as fin_ops
from .selection import ENV_GEMM_TYPE
from .weights import MoEWeights

MODES = ("allgather", "all_to_all")
EXPERT_LAYOUTS = ("batched", "grouped")  # of the received rows in all_to_all mode


# --- helpers ----------------------------------------------------------------------------------
def _axis_size(mesh: Mesh, axis: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.axis_names)}")
    return int(mesh.shape[axis])


def _check_moe_weights(weights: Any) -> None:
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights must be MoEWeights (see quantize_moe_weights), got {type(weights).__name__}")


def _leaf_specs(tree: Any, spec: P) -> Any:
    """The same PartitionSpec for every array leaf of a pytree (None leaves stay None)."""
    return jax.tree.map(lambda _: spec, tree)


def _run_sharded(body: Any, mesh: Mesh, in_specs: tuple[Any, ...], out_specs: Any, *args: Any) -> Any:
    """``jax.shard_map(body)(*args)`` for meshes of either axis type.

    Outside a mesh context the map runs over an Auto-typed copy of ``mesh``, so shard_map
    reshards the inputs itself (whatever their sharding); inside ``jax.set_mesh`` the context
    mesh is used and inputs on Explicit axes are resharded to the specs first."""
    names = tuple(mesh.axis_names)
    if jax.sharding.get_abstract_mesh().empty:
        mesh = Mesh(mesh.devices, names, axis_types=(AxisType.Auto,) * len(names))
    elif any(t == AxisType.Explicit for t in mesh.axis_types):
        args = jax.tree.map(lambda a, s: jax.reshard(a, NamedSharding(mesh, s)), args, in_specs)
    # Custom calls carry no varying-manual-axes rule, so the vma type check is off.
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return fn(*args)


def _check_tokens(hidden_states: Any, topk_weights: Any, topk_ids: Any) -> None:
    if getattr(hidden_states, "ndim", None) != 2:
        raise ValueError(f"hidden_states must be [M, H], got shape {getattr(hidden_states, 'shape', None)}")
    for name, a in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if getattr(a, "ndim", None) != 2 or a.shape[0] != hidden_states.shape[0]:
            raise ValueError(
                f"{name} must be [M, k] with M = {hidden_states.shape[0]}, got shape {getattr(a, 'shape', None)}"
            )


def _pad_tokens(x: jax.Array, tw: jax.Array, ids: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """Pads M up to a multiple of n with rows routed nowhere (id -1, weight 0)."""
    m = x.shape[0]
    pad = -m % n
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
        tw = jnp.pad(tw, ((0, pad), (0, 0)))
        ids = jnp.pad(ids, ((0, pad), (0, 0)), constant_values=-1)
    return x, tw, ids, m


def _bucket(keys: jax.Array, num_buckets: int, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Packs entries into buckets by key (``num_buckets`` = no bucket), keeping entry order.

    Returns (src [num_buckets, capacity]: the entry in each slot, ``len(keys)`` where empty;
    counts [num_buckets]: entries per bucket, possibly above capacity; pos [R]: each entry's
    slot in its bucket — an entry with pos >= capacity or no bucket has no slot)."""
    r = keys.shape[0]
    order = jnp.argsort(keys, stable=True).astype(jnp.int32)
    counts_all = jnp.zeros((num_buckets + 1,), jnp.int32).at[keys].add(1)
    starts = jnp.cumsum(counts_all) - counts_all
    counts = counts_all[:num_buckets]
    slot = jnp.arange(capacity, dtype=jnp.int32)
    idx = starts[:num_buckets, None] + slot[None, :]
    live = slot[None, :] < counts[:, None]
    src = jnp.where(live, order[jnp.minimum(idx, r - 1)], r)
    rank_sorted = jnp.arange(r, dtype=jnp.int32) - starts[keys[order]]
    pos = jnp.zeros((r,), jnp.int32).at[order].set(rank_sorted, unique_indices=True)
    return src, counts, pos


def _reduce_dtype(n: int, dtype: Any) -> Any:
    """The dtype partial outputs are summed in across devices. Two 16-bit partials summed in
    the collective round once, exactly as a float32 sum then a cast would (half the bytes);
    more partials go through float32 so the result sees one rounding, not one per step."""
    return dtype if n == 2 else jnp.float32


def _with_zero_row(x: jax.Array) -> jax.Array:
    """x [R, H] with a zero row appended at index R (the target of empty slots)."""
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)], axis=0)


# --- expert parallelism -----------------------------------------------------------------------
def shard_moe_weights(weights: MoEWeights, mesh: Mesh, axis: str = "ep") -> MoEWeights:
    """Places each expert weight array on ``mesh`` sharded along its leading (expert) axis over
    ``axis``: E / n experts per device, replicated over the mesh's other axes.

    The result is an ordinary ``MoEWeights`` (gathering it gives the input back); pass it to
    ``ep_moe`` with the same mesh and axis."""
    _check_moe_weights(weights)
    n = _axis_size(mesh, axis)
    e = weights.num_experts
    if e % n:
        raise ValueError(
            f"cannot shard {e} experts over mesh axis {axis!r} of size {n}: E must be a multiple of the axis size"
        )
    return jax.device_put(weights, NamedSharding(mesh, P(axis)))


def local_expert_map(shard: jax.Array | int, num_experts: int, num_local: int) -> jax.Array:
    """expert_map [num_experts] int32 for the device holding experts
    [shard * num_local, (shard + 1) * num_local): global id -> local slot, -1 elsewhere."""
    ids = jnp.arange(num_experts, dtype=jnp.int32)
    return jnp.where(ids // num_local == shard, ids % num_local, -1).astype(jnp.int32)


def ep_moe(
    hidden_states: jax.Array,
    weights: MoEWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    mesh: Mesh,
    axis: str = "ep",
    mode: str = "allgather",
    activation: str = "silu",
    activation_limit: float | None = None,
    gemm_type: str | None = None,
    expert_capacity: int | None = None,
    expert_layout: str = "batched",
) -> jax.Array:
    """Expert-parallel MoE over mesh axis ``axis``; returns [M, H] like ``fused_moe`` on one device.

    ``weights`` hold all E experts (ideally already placed by ``shard_moe_weights``; otherwise
    they are resharded, E/n experts per device). Tokens and routing are sharded over ``axis``
    (M is padded internally to a multiple of n); the result is sharded the same way.
    ``mode``: "allgather" (decode) or "all_to_all" (prefill); see the module docstring for the
    numerics of each. ``gemm_type`` picks the standard-format class in allgather mode.
    ``expert_capacity`` (all_to_all only) bounds the rows per local expert in the batched
    buffer; None is the no-drop worst case (every routed row of the layer, M*k) — a smaller
    value saves memory but drops the rows past it (they contribute nothing). ``expert_layout``
    (all_to_all only): "batched" (the rows of each local expert in [E_local, capacity, H]) or
    "grouped" (the received rows sorted by local expert, no capacity, nothing dropped). Works
    under jit.
    """
    _check_moe_weights(weights)
    _check_tokens(hidden_states, topk_weights, topk_ids)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    get_activation(activation, activation_limit)
    n = _axis_size(mesh, axis)
    e = weights.num_experts
    if e % n:
        raise ValueError(f"{e} experts do not split evenly over mesh axis {axis!r} of size {n}")
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    if expert_layout != "batched" and mode != "all_to_all":
        raise ValueError("expert_layout applies to mode='all_to_all' only")
    if expert_capacity is not None and (mode != "all_to_all" or expert_layout != "batched" or int(expert_capacity) < 1):
        raise ValueError("expert_capacity is a positive row count, used by mode='all_to_all' with the batched "
                         "expert layout only")
    ids = jnp.asarray(topk_ids)
    if jnp.dtype(ids.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"topk_ids must be int32, got {jnp.dtype(ids.dtype).name}")
    if hidden_states.shape[0] == 0:
        return jnp.zeros(hidden_states.shape, hidden_states.dtype)
    if gemm_type is None:  # read now, as fused_moe would: the jitted core caches its trace
        gemm_type = os.environ.get(ENV_GEMM_TYPE) or None
    return _ep_moe(
        hidden_states, weights, jnp.asarray(topk_weights, jnp.float32), ids, mesh=mesh, axis=axis, mode=mode,
        activation=activation, limit=activation_limit, gemm_type=gemm_type, capacity=expert_capacity,
        layout=expert_layout,
    )


@partial(jax.jit, static_argnames=("mesh", "axis", "mode", "activation", "limit", "gemm_type", "capacity", "layout"))
def _ep_moe(
    x: jax.Array, weights: MoEWeights, tw: jax.Array, ids: jax.Array, *, mesh: Mesh, axis: str, mode: str,
    activation: str, limit: float | None, gemm_type: str | None, capacity: int | None, layout: str,
) -> jax.Array:
    # Jitted so that eager callers run one compiled program (inlined under an outer jit).
    n = int(mesh.shape[axis])
    x, tw, ids, m = _pad_tokens(x, tw, ids, n)
    common = dict(axis=axis, n=n, e_global=weights.num_experts, activation=activation, limit=limit)
    if mode == "allgather":
        body = _allgather_body(gemm_type=gemm_type, **common)
    else:
        body = _all_to_all_body(capacity=capacity, layout=layout, **common)
    tok = P(axis)
    out = _run_sharded(body, mesh, (tok, tok, tok, _leaf_specs(weights, P(axis))), tok, x, tw, ids, weights)
    return out[:m] if out.shape[0] != m else out


def _allgather_body(*, axis: str, n: int, e_global: int, activation: str, limit: float | None, gemm_type: str | None) -> Any:
    def body(x: jax.Array, tw: jax.Array, ids: jax.Array, w: MoEWeights) -> jax.Array:
        x_all = jax.lax.all_gather(x, axis, tiled=True)
        tw_all = jax.lax.all_gather(tw, axis, tiled=True)
        ids_all = jax.lax.all_gather(ids, axis, tiled=True)
        emap = local_expert_map(jax.lax.axis_index(axis), e_global, w.num_experts)
        part = fused_moe(
            x_all, w, tw_all, ids_all, activation=activation, expert_map=emap, gemm_type=gemm_type,
            activation_limit=limit,
        )
        part = part.astype(_reduce_dtype(n, x.dtype))
        return jax.lax.psum_scatter(part, axis, scatter_dimension=0, tiled=True).astype(x.dtype)

    return body


def _all_to_all_body(*, axis: str, n: int, e_global: int, activation: str, limit: float | None, capacity: int | None,
                     layout: str) -> Any:
    def body(x: jax.Array, tw: jax.Array, ids: jax.Array, w: MoEWeights) -> jax.Array:
        m_loc, k = ids.shape
        h = x.shape[1]
        e_loc = w.num_experts
        r1 = m_loc * k  # entries t*k+j of this shard
        flat = ids.reshape(r1)
        valid = (flat >= 0) & (flat < e_global)
        dest = jnp.where(valid, flat // e_loc, n)
        slot = jnp.where(valid, flat % e_loc, -1)

        # Dispatch: per destination device at most every entry of this shard (no drops).
        c1 = r1
        src1, _, pos1 = _bucket(dest, n, c1)
        send_x = _with_zero_row(x)[src1 // k]  # empty slots -> row m_loc (zeros)
        send_slot = jnp.concatenate([slot, jnp.full((1,), -1, jnp.int32)])[src1]  # -1: empty slot
        recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=True)  # [n (source), c1, H]
        recv_slot = jax.lax.all_to_all(send_slot, axis, 0, 0, tiled=True)

        r2 = n * c1
        rows = recv_x.reshape(r2, h)
        if layout == "grouped":
            # One ragged list: the received rows as tokens of top-1 routing to their local expert
            # (empty slots route nowhere and come back as zeros), weight 1 (exact: each row is its
            # d row), through the grouped GEMMs, in received order.
            y = GroupedExperts().apply(
                jnp.zeros(rows.shape, rows.dtype), rows, w, jnp.ones((r2, 1), jnp.float32), recv_slot.reshape(r2, 1),
                activation=activation, activation_limit=limit,
            )
            back = y.reshape(n, c1, h)
        else:
            # Batched format on the expert's device: rows grouped by local expert, source order kept.
            t_cap = r2 if capacity is None else min(int(capacity), r2)
            keys2 = jnp.where(recv_slot >= 0, recv_slot, e_loc).reshape(r2)
            src2, counts2, pos2 = _bucket(keys2, e_loc, t_cap)
            batched = _with_zero_row(rows)[src2]  # [e_loc, t_cap, H]
            num_tokens = jnp.minimum(counts2, t_cap).astype(jnp.int32)
            y = BatchedExperts().apply(
                jnp.zeros(batched.shape, batched.dtype), batched, w, None, None,
                activation=activation, expert_num_tokens=num_tokens, activation_limit=limit,
            )
            kept = (keys2 < e_loc) & (pos2 < t_cap)
            flat_y = _with_zero_row(y.reshape(e_loc * t_cap, h))
            back = flat_y[jnp.where(kept, keys2 * t_cap + pos2, e_loc * t_cap)].reshape(n, c1, h)

        # Back to the source devices, then the weighted sum over k in the finalize kernel.
        ret = jax.lax.all_to_all(back, axis, 0, 0, tiled=True)  # [n (expert device), c1, H]
        d = _with_zero_row(ret.reshape(n * c1, h))[jnp.where(valid, dest * c1 + pos1, n * c1)]
        src_rows = jnp.where(valid, jnp.arange(r1, dtype=jnp.int32), -1).reshape(m_loc, k)
        return fin_ops.finalize(d, tw, src_rows, jnp.zeros(x.shape, x.dtype))

    return body


# --- tensor parallelism -----------------------------------------------------------------------
def _layout_of(activation: str) -> str:
    spec, _ = get_activation(activation)
    if not spec.gated:
        return "single"
    return "interleaved" if spec.code == ActivationCode.SWIGLUOAI else "gate_up"


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class TPMoEWeights:
    """Expert weights laid out for ``tp_moe``: I split into ``num_shards`` slices.

    ``weights`` holds global arrays whose w13 rows are in shard-major order (device r's gate
    and up slices adjacent, so a plain split of N1 gives each device a consistent gate/up
    pair) — not the standard layout: use it only with ``tp_moe``. ``layout``: "gate_up",
    "interleaved" (``swigluoai``) or "single" (``*_no_mul``)."""

    weights: MoEWeights
    num_shards: int
    layout: str

    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return (self.weights,), (self.num_shards, self.layout)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: tuple[Any, ...]) -> "TPMoEWeights":
        return cls(children[0], *aux)

    @property
    def num_experts(self) -> int:
        return self.weights.num_experts


def _grid_sharded(grid_dim: int) -> bool:
    """A scale grid of one entry along the split dimension (whole-dimension group) is replicated."""
    return grid_dim > 1


def _shard_major_rows(a: jax.Array, n: int, layout: str) -> jax.Array:
    """Reorders axis 1 of a [E, N1, ...] so device r's rows are contiguous (gate_up layout only)."""
    if layout != "gate_up":
        return a
    e, n1 = a.shape[:2]
    rest = a.shape[2:]
    halves = a.reshape(e, 2, n, n1 // (2 * n), *rest)
    return jnp.swapaxes(halves, 1, 2).reshape(a.shape)


def _check_split(what: str, size: int, n: int, group: int, halves: int = 1) -> None:
    """Each of the ``halves`` parts of a dimension of ``size`` splits into n slices, and a scale
    grid with more than one entry along it (group < size) splits at group boundaries."""
    per = size // halves
    if per % n:
        raise ValueError(f"{what}: {per} does not split over {n} devices")
    if group < size and (per // n) % group:
        raise ValueError(f"{what}: the slice of {per // n} per device is not a multiple of the group size {group}")


def shard_moe_weights_tp(weights: MoEWeights, mesh: Mesh, axis: str = "tp", *, activation: str = "silu") -> TPMoEWeights:
    """Places the experts on ``mesh`` for ``tp_moe``: the intermediate size I split over ``axis``.

    w13's rows are split consistently (device r gets gate rows and up rows of the same slice of
    I; the interleaved ``swigluoai`` layout splits as is), w2 along its I columns; scale grids
    follow their data (a whole-dimension scale is replicated); biases b13 follow w13's rows,
    b2 is replicated (``tp_moe`` adds it on one device). ``activation`` fixes the w13 layout."""
    _check_moe_weights(weights)
    n = _axis_size(mesh, axis)
    layout = _layout_of(activation)
    i = weights.intermediate_size
    halves = 2 if layout != "single" else 1
    if weights.n1 != halves * i:
        raise ValueError(f"activation {activation!r} needs w13 with N1 = {halves * i} rows, got {weights.n1}")
    if i % n:
        raise ValueError(f"intermediate size I = {i} does not split over mesh axis {axis!r} of size {n}")
    w13, w2 = weights.w13, weights.w2
    row_halves = 2 if layout == "gate_up" else 1
    _check_split("w13 rows", w13.n, n, w13.group_n, row_halves)
    _check_split("w2 columns", w2.k, n, w2.group_k)
    if w2.data.shape[2] % n:
        raise ValueError(f"w2's packed columns ({w2.data.shape[2]} bytes) do not split over {n} devices")

    def sharding(*spec: Any) -> NamedSharding:
        return NamedSharding(mesh, P(*spec))

    def put13(a: jax.Array | None) -> jax.Array | None:
        if a is None:
            return None
        if not _grid_sharded(a.shape[1]):
            return jax.device_put(a, sharding())
        return jax.device_put(_shard_major_rows(jnp.asarray(a), n, layout), sharding(None, axis))

    def put2(a: jax.Array | None) -> jax.Array | None:
        if a is None:
            return None
        if a.ndim < 3 or not _grid_sharded(a.shape[2]):
            return jax.device_put(a, sharding())
        return jax.device_put(a, sharding(None, None, axis))

    new13 = replace(w13, data=put13(w13.data), scale=put13(w13.scale), zero=put13(w13.zero), scale2=put2(w13.scale2))
    new2 = replace(w2, data=put2(w2.data), scale=put2(w2.scale), zero=put2(w2.zero), scale2=put2(w2.scale2))
    placed = replace(weights, w13=new13, w2=new2, b13=put13(weights.b13), b2=put2(weights.b2))
    return TPMoEWeights(placed, n, layout)


def _tp_specs(w: MoEWeights, axis: str) -> MoEWeights:
    """PartitionSpecs of a TP-placed MoEWeights, derived from its global shapes."""

    def s13(a: jax.Array | None) -> P | None:
        if a is None:
            return None
        return P(None, axis) if _grid_sharded(a.shape[1]) else P()

    def s2(a: jax.Array | None) -> P | None:
        if a is None:
            return None
        return P(None, None, axis) if a.ndim == 3 and _grid_sharded(a.shape[2]) else P()

    w13, w2 = w.w13, w.w2
    return replace(
        w,
        w13=replace(w13, data=s13(w13.data), scale=s13(w13.scale), zero=s13(w13.zero), scale2=s2(w13.scale2)),
        w2=replace(w2, data=s2(w2.data), scale=s2(w2.scale), zero=s2(w2.zero), scale2=s2(w2.scale2)),
        b13=s13(w.b13),
        b2=s2(w.b2),
    )


def _local_tp(w: MoEWeights, n: int) -> MoEWeights:
    """The per-device metadata inside shard_map: I is I/n; a whole-dimension group shrinks too."""
    w13, w2 = w.w13, w.w2
    n1_global, i_global = w13.n * n, w2.k
    gn = w13.group_n if w13.group_n < n1_global else w13.n
    gk = w2.group_k if w2.group_k < i_global else i_global // n
    return replace(w, w13=replace(w13, group_n=gn), w2=replace(w2, k=i_global // n, group_k=gk))


def tp_moe(
    hidden_states: jax.Array,
    weights: TPMoEWeights,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    mesh: Mesh,
    axis: str = "tp",
    activation: str = "silu",
    activation_limit: float | None = None,
    gemm_type: str | None = None,
) -> jax.Array:
    """Tensor-parallel MoE: every device runs all experts on its slice of I and one ``psum``
    (float32; the output dtype on two devices) adds the partial outputs. Tokens and routing are replicated over ``axis``; so is
    the result [M, H]. ``weights`` come from ``shard_moe_weights_tp`` with the same mesh, axis
    and activation layout. Differs from single-device ``fused_moe`` by rounding (module
    docstring). Works under jit."""
    if not isinstance(weights, TPMoEWeights):
        raise TypeError(
            f"tp_moe needs weights from shard_moe_weights_tp (TPMoEWeights), got {type(weights).__name__}"
        )
    _check_tokens(hidden_states, topk_weights, topk_ids)
    n = _axis_size(mesh, axis)
    if weights.num_shards != n:
        raise ValueError(f"weights were split {weights.num_shards} ways, mesh axis {axis!r} has {n} devices")
    if _layout_of(activation) != weights.layout:
        raise ValueError(
            f"activation {activation!r} needs the {_layout_of(activation)!r} w13 layout; "
            f"these weights were split for {weights.layout!r}"
        )
    get_activation(activation, activation_limit)
    if gemm_type is None:
        gemm_type = os.environ.get(ENV_GEMM_TYPE) or None
    return _tp_moe(
        hidden_states, weights.weights, jnp.asarray(topk_weights, jnp.float32), topk_ids, mesh=mesh, axis=axis,
        activation=activation, limit=activation_limit, gemm_type=gemm_type,
    )


@partial(jax.jit, static_argnames=("mesh", "axis", "activation", "limit", "gemm_type"))
def _tp_moe(
    x: jax.Array, weights: MoEWeights, tw: jax.Array, ids: jax.Array, *, mesh: Mesh, axis: str, activation: str,
    limit: float | None, gemm_type: str | None,
) -> jax.Array:
    n = int(mesh.shape[axis])

    def body(x: jax.Array, tw: jax.Array, ids: jax.Array, w: MoEWeights) -> jax.Array:
        w = _local_tp(w, n)
        if w.b2 is not None:  # b2 belongs to the sum once, not once per device
            w = replace(w, b2=jnp.where(jax.lax.axis_index(axis) == 0, w.b2, 0.0))
        part = fused_moe(x, w, tw, ids, activation=activation, gemm_type=gemm_type, activation_limit=limit)
        return jax.lax.psum(part.astype(_reduce_dtype(n, x.dtype)), axis).astype(x.dtype)

    specs = (P(), P(), P(), _tp_specs(weights, axis))
    return _run_sharded(body, mesh, specs, P(), x, tw, ids, weights)
