"""The three expert classes: Indexed and Grouped (standard format) and Batched (batched format).

Each ``apply`` is a pure function of its arguments: ``hidden_states -> routing -> GEMM1 ->
activation(+quant) -> GEMM2 -> finalize(out)``, every step a custom call, the last one writing
into ``out`` through a declared input-output alias. Intermediates are XLA values, so XLA's
buffer assignment keeps every kernel's output apart from its inputs.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from . import _ffi
from .activations import ACTIVATIONS, get_activation
from .ops import activation as act_ops
from .ops import finalize as fin_ops
from .ops import gemm as gemm_ops
from .ops import layer as layer_ops
from .ops import routing as routing_ops
from .quant_keys import QuantKey, describe_pair
from .quantize import SUPPORTED_PAIRS, act_quant_params
from .weights import MoEWeights

_FLOAT16 = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def indexed_block_m(entries: int, num_experts: int) -> int:
    """Rows per block of the indexed layout, from the mean rows per expert."""
    mean = entries / max(num_experts, 1)
    for bm in (16, 32, 64):
        if mean <= bm:
            return bm
    return 64


def _dtype_name(x: Any) -> str:
    return jnp.dtype(x.dtype).name if hasattr(x, "dtype") else type(x).__name__


def _check_array(x: Any, name: str, rank: int) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if len(x.shape) != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")


def _check_out(out: Any, shape: tuple[int, ...], dtype: Any) -> None:
    """``out`` must match exactly: ffi_call aliases only identical shape, dtype and layout."""
    if out is None:
        raise ValueError("out is required: pass the caller-owned output buffer")
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise TypeError(f"out must be an array, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if jnp.dtype(out.dtype) != jnp.dtype(dtype):
        raise TypeError(f"out has dtype {jnp.dtype(out.dtype).name}, expected {jnp.dtype(dtype).name} (the dtype of hidden_states)")


def _check_weights(weights: Any, hidden_states: Any, activation: str, activation_limit: float | None) -> None:
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights must be MoEWeights (see quantize_moe_weights), got {type(weights).__name__}")
    spec, _ = get_activation(activation, activation_limit)
    if jnp.dtype(hidden_states.dtype) not in _FLOAT16:
        raise TypeError(f"hidden_states must be bfloat16 or float16, got {_dtype_name(hidden_states)}")
    if jnp.dtype(hidden_states.dtype) != jnp.dtype(weights.dtype):
        raise TypeError(
            f"hidden_states dtype {_dtype_name(hidden_states)} differs from the weights' activation dtype "
            f"{jnp.dtype(weights.dtype).name}"
        )
    h = hidden_states.shape[-1]
    if h != weights.hidden_size:
        raise ValueError(f"hidden size mismatch: hidden_states has H = {h}, weights have H = {weights.hidden_size}")
    i = weights.intermediate_size
    want_n1 = 2 * i if spec.gated else i
    if weights.n1 != want_n1:
        kind = "gated" if spec.gated else "non-gated"
        raise ValueError(
            f"intermediate size mismatch: {kind} activation {activation!r} needs w13 with N1 = {want_n1} "
            f"rows for w2's I = {i}, got N1 = {weights.n1}"
        )


def _check_topk(topk_weights: Any, topk_ids: Any, m: int) -> tuple[jax.Array, jax.Array]:
    _check_array(topk_ids, "topk_ids", 2)
    _check_array(topk_weights, "topk_weights", 2)
    if jnp.dtype(topk_ids.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"topk_ids must be int32, got {_dtype_name(topk_ids)}")
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise TypeError(f"topk_weights must be a float array, got {_dtype_name(topk_weights)}")
    if tuple(topk_ids.shape) != tuple(topk_weights.shape):
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} differ in shape")
    if topk_ids.shape[0] != m:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows, hidden_states has {m}")
    if topk_ids.shape[1] < 1:
        raise ValueError("top_k must be at least 1")
    return jnp.asarray(topk_weights, jnp.float32), jnp.asarray(topk_ids)


def _expert_map(expert_map: Any, global_num_experts: int | None, num_local: int) -> jax.Array | None:
    if expert_map is None:
        n = num_local if global_num_experts is None else int(global_num_experts)
        if n < num_local:
            raise ValueError(f"global_num_experts = {n} is below the {num_local} local experts")
        # No map: the routing calls' identity over the local experts (ids in [num_local, n) live
        # elsewhere and are skipped, as are ids past n): the same routing as the explicit map,
        # without a device kernel to build one for every call.
        return None
    _check_array(expert_map, "expert_map", 1)
    if jnp.dtype(expert_map.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"expert_map must be int32, got {_dtype_name(expert_map)}")
    if global_num_experts is not None and int(global_num_experts) != expert_map.shape[0]:
        raise ValueError(
            f"global_num_experts = {global_num_experts} but expert_map has {expert_map.shape[0]} entries"
        )
    if expert_map.shape[0] < 1:
        raise ValueError("expert_map must not be empty")
    return jnp.asarray(expert_map)


class FusedMoEExperts:
    """Common interface of the expert classes. Subclasses set the format and the GEMM path."""

    gemm_type: ClassVar[str]
    activation_format: ClassVar[str]  # "standard" | "batched"

    @classmethod
    def supports_quant_scheme(cls, weight_key: QuantKey | None, act_key: QuantKey | None) -> bool:
        return (weight_key, act_key) in SUPPORTED_PAIRS

    @classmethod
    def supports_activation(cls, name: str) -> bool:
        return name in ACTIVATIONS

    @classmethod
    def supports_device(cls, device: Any = None) -> bool:
        dev = device if device is not None else jax.devices()[0]
        platform = getattr(dev, "platform", str(dev)).lower()
        if platform == "cpu":
            return True
        if platform in ("gpu", "cuda"):
            return _ffi.cuda_available()
        return False

    @classmethod
    def rejection_reasons(
        cls, weight_key: QuantKey | None, act_key: QuantKey | None, activation: str, device: Any = None
    ) -> list[str]:
        """Why this class cannot run the given scheme/activation/device (empty: it can)."""
        reasons = []
        if not cls.supports_quant_scheme(weight_key, act_key):
            reasons.append(f"unsupported quant scheme: {describe_pair(weight_key, act_key)}")
        if not cls.supports_activation(activation):
            reasons.append(f"unsupported activation {activation!r}")
        if not cls.supports_device(device):
            dev = device if device is not None else jax.devices()[0]
            reasons.append(f"unsupported device {dev} ({_ffi.backend_report()['cuda_unavailable_because']})")
        return reasons

    def _check_supported(self, weights: MoEWeights, activation: str) -> None:
        reasons = self.rejection_reasons(weights.weight_key, weights.act_key, activation)
        if reasons:
            raise ValueError(f"{type(self).__name__} cannot run this layer: " + "; ".join(reasons))

    def apply(
        self,
        out: jax.Array,
        hidden_states: jax.Array,
        weights: MoEWeights,
        topk_weights: jax.Array | None,
        topk_ids: jax.Array | None,
        *,
        activation: str = "silu",
        global_num_experts: int | None = None,
        expert_map: jax.Array | None = None,
        expert_num_tokens: jax.Array | None = None,
        activation_limit: float | None = None,
    ) -> jax.Array:
        raise NotImplementedError


class _StandardExperts(FusedMoEExperts):
    activation_format = "standard"

    def apply(
        self,
        out: jax.Array,
        hidden_states: jax.Array,
        weights: MoEWeights,
        topk_weights: jax.Array | None,
        topk_ids: jax.Array | None,
        *,
        activation: str = "silu",
        global_num_experts: int | None = None,
        expert_map: jax.Array | None = None,
        expert_num_tokens: jax.Array | None = None,
        activation_limit: float | None = None,
    ) -> jax.Array:
        """Runs the layer on hidden_states [M, H] and writes the result into out [M, H].

        Returns the final custom call's result, which aliases ``out``: under
        ``jax.jit(..., donate_argnums=...)`` it occupies out's buffer."""
        _check_array(hidden_states, "hidden_states", 2)
        _check_weights(weights, hidden_states, activation, activation_limit)
        self._check_supported(weights, activation)
        _check_out(out, hidden_states.shape, hidden_states.dtype)
        if topk_ids is None or topk_weights is None:
            raise ValueError(f"{type(self).__name__} needs topk_weights and topk_ids")
        if expert_num_tokens is not None:
            raise ValueError("expert_num_tokens belongs to the batched format")
        tw, ids = _check_topk(topk_weights, topk_ids, hidden_states.shape[0])
        emap = _expert_map(expert_map, global_num_experts, weights.num_experts)
        whole = self._layer(out, hidden_states, weights, tw, ids, emap, activation, activation_limit)
        if whole is not None:
            return whole
        d, src_rows = self._experts(hidden_states, weights, ids, emap, activation, activation_limit)
        return fin_ops.finalize(d, tw, src_rows, out)

    def _layer(
        self,
        out: jax.Array,
        x: jax.Array,
        weights: MoEWeights,
        topk_weights: jax.Array,
        ids: jax.Array,
        emap: jax.Array | None,
        activation: str,
        limit: float | None,
    ) -> jax.Array | None:
        """The whole layer as one call where the class has one for this case (its result, which
        aliases ``out``), else None: routing, experts and finalize then run as calls of their own."""
        return None

    def _experts(
        self,
        x: jax.Array,
        weights: MoEWeights,
        ids: jax.Array,
        emap: jax.Array | None,
        activation: str,
        limit: float | None,
    ) -> tuple[jax.Array, jax.Array]:
        """Returns (d [rows, H], src_rows [M, k]) for the finalize step."""
        raise NotImplementedError


def fused_input_quant() -> bool:
    """Whether the indexed class quantizes each GEMM's input (GEMM2's after the activation) in the
    GEMM's own call (``gemm_indexed_quant``; the default) rather than in calls of their own. Read
    at trace time from ``HUMMING_JAX_FUSED_INPUT_QUANT`` (``0``: the separate calls, for A/B
    timing); the values are the same either way."""
    return os.environ.get("HUMMING_JAX_FUSED_INPUT_QUANT", "1") != "0"


def fused_activation() -> int:
    """Where a gated activation with 16-bit activations is applied in GEMM1's call (the GEMM writes
    act(gate, up)) rather than in a call of its own: 0, nowhere; 1 (the default), in the indexed
    class (``gemm_indexed_gated``); 2, also in the grouped class (``gemm_grouped_gated``: opt-in,
    measured 0.90-1.02x the separate call at prefill sizes on the H100, benchmarks/NOTES.md v18, v20).
    Read at trace time from ``HUMMING_JAX_FUSED_ACTIVATION``. The values are the same either way,
    except on a GPU for the indexed class's halves layout where GEMM1's K split differs (see
    ``gemm_indexed_gated``)."""
    v = os.environ.get("HUMMING_JAX_FUSED_ACTIVATION", "1")
    if v not in ("0", "1", "2"):
        raise ValueError(f"HUMMING_JAX_FUSED_ACTIVATION={v!r}: expected 0, 1 or 2")
    return int(v)


def fused_layer() -> bool:
    """Whether the indexed class runs the whole layer as one call (``layer_indexed`` /
    ``layer_indexed_quant``: routing, the two GEMMs and finalize) where its GEMMs would be one
    ``experts_indexed`` / ``experts_indexed_quant`` call. Read at trace time from
    ``HUMMING_JAX_FUSED_LAYER`` (``0``: routing, experts and finalize as three calls, for A/B
    timing); the values are the same either way. A CUDA library named by ``$HUMMING_JAX_CUDA_LIB``
    that predates these calls keeps the three calls."""
    return (os.environ.get("HUMMING_JAX_FUSED_LAYER", "1") != "0" and _ffi.call_available("layer_indexed")
            and _ffi.call_available("layer_indexed_quant"))


def fused_experts(call: str = "experts_indexed") -> bool:
    """Whether the indexed class runs its two GEMMs in one call: ``experts_indexed`` where GEMM1
    writes the activated rows (16-bit activations, a gated activation, ``fused_activation() >= 1``)
    rather than ``gemm_indexed_gated`` then ``gemm_indexed``; ``experts_indexed_quant`` where each
    GEMM quantizes its own input (8-bit activations, ``fused_input_quant()``) rather than two
    ``gemm_indexed_quant`` calls. Read at trace time from ``HUMMING_JAX_FUSED_EXPERTS`` (``0``: the
    two calls, for A/B timing); the values are the same either way. A CUDA library named by
    ``$HUMMING_JAX_CUDA_LIB`` that predates ``call`` keeps the two calls."""
    return os.environ.get("HUMMING_JAX_FUSED_EXPERTS", "1") != "0" and _ffi.call_available(call)


class IndexedExperts(_StandardExperts):
    """Standard format, indexed: GEMM1 gathers token rows through expert-sorted ids."""

    gemm_type = "indexed"

    def _layer(self, out, x, weights, topk_weights, ids, emap, activation, limit):
        # Where the two GEMMs would be one experts_indexed(_quant) call, routing and finalize join them.
        if not fused_layer():
            return None
        m, k = ids.shape
        common = dict(block_m=indexed_block_m(m * k, weights.num_experts), activation=activation, limit=limit)
        ops = (x, weights.w13, weights.b13, weights.w2, weights.b2, ids, emap, topk_weights, out)
        quant = act_quant_params(weights.act_key)
        if quant is not None:
            if not (fused_input_quant() and fused_experts("experts_indexed_quant")):
                return None
            return layer_ops.layer_indexed_quant(*ops, quant=quant[0], act_group_k=quant[1], **common)
        if not (get_activation(activation, limit)[0].gated and fused_activation() >= 1 and fused_experts()):
            return None
        return layer_ops.layer_indexed(*ops, **common)

    def _experts(self, x, weights, ids, emap, activation, limit):
        m, k = ids.shape
        e = weights.num_experts
        block_m = indexed_block_m(m * k, e)
        routing = routing_ops.routing_indexed(ids, emap, e, block_m)
        quant = act_quant_params(weights.act_key)
        dtype = x.dtype
        common = dict(rows=m * k, block_m=block_m, out_dtype=dtype)
        if quant is not None and fused_input_quant():
            # Each GEMM quantizes its own input (GEMM2 after the activation) in its call.
            fq = dict(quant=quant[0], act_group_k=quant[1], **common)
            if fused_experts("experts_indexed_quant"):
                d = gemm_ops.experts_indexed_quant(
                    x, weights.w13, weights.b13, weights.w2, weights.b2, routing, gather_div=k,
                    activation=activation, limit=limit, **fq
                )
                return d, routing.src_rows
            gu = gemm_ops.gemm_indexed_quant(x, weights.w13, weights.b13, routing, gather_div=k, **fq)
            d = gemm_ops.gemm_indexed_quant(
                gu, weights.w2, weights.b2, routing, gather_div=1, activation=activation, limit=limit, **fq
            )
            return d, routing.src_rows
        if quant is None and get_activation(activation, limit)[0].gated and fused_activation() >= 1:
            # GEMM1 writes the activated rows (its epilogue pairs gate and up).
            if fused_experts():
                d = gemm_ops.experts_indexed(
                    x, weights.w13, weights.b13, weights.w2, weights.b2, routing, gather_div=k,
                    activation=activation, limit=limit, **common
                )
                return d, routing.src_rows
            a2 = gemm_ops.gemm_indexed_gated(
                x, None, weights.w13, weights.b13, routing, gather_div=k, activation=activation, limit=limit, **common
            )
            d = gemm_ops.gemm_indexed(a2, None, weights.w2, weights.b2, routing, gather_div=1, **common)
            return d, routing.src_rows
        a, a_scale, agk = x, None, 0
        if quant is not None:
            a, a_scale = act_ops.quantize(x, quant[0], quant[1])
            agk = quant[1]
        gu = gemm_ops.gemm_indexed(a, a_scale, weights.w13, weights.b13, routing, gather_div=k, act_group_k=agk, **common)
        a2, a2_scale, agk2 = _activate(gu, activation, limit, quant)
        d = gemm_ops.gemm_indexed(a2, a2_scale, weights.w2, weights.b2, routing, gather_div=1, act_group_k=agk2, **common)
        return d, routing.src_rows


class GroupedExperts(_StandardExperts):
    """Standard format, grouped: rows permuted so each expert's rows are contiguous."""

    gemm_type = "grouped"

    def _experts(self, x, weights, ids, emap, activation, limit):
        k = ids.shape[1]
        rows = x.shape[0] * k
        routing = routing_ops.routing_grouped(ids, emap, weights.num_experts)
        quant = act_quant_params(weights.act_key)
        offsets = routing.expert_first_token_offset
        if quant is None and gemm_ops.gather_switch():
            # GEMM1 reads the token rows through the permutation ($HUMMING_JAX_PREFILL_GATHER).
            gu = gemm_ops.gemm_grouped_gather(x, weights.w13, weights.b13, routing.permutation, offsets, k,
                                              out_dtype=x.dtype)
        elif quant is None and get_activation(activation, limit)[0].gated and fused_activation() >= 2:
            # GEMM1 writes the activated rows (its epilogue pairs gate and up).
            a2 = gemm_ops.gemm_grouped_gated(routing_ops.permute_rows(x, routing, k), weights.w13, weights.b13,
                                             offsets, out_dtype=x.dtype, activation=activation, limit=limit)
            d = gemm_ops.gemm_grouped(a2, None, weights.w2, weights.b2, offsets, out_dtype=x.dtype)
            return d, routing.src_rows
        elif quant is None:
            # Rows for the 4-bit mainloop are permuted straight into its k order (gemm.rs4_act_order).
            order1 = gemm_ops.rs4_act_order(rows, weights.w13, x.dtype, x.dtype)
            gu = gemm_ops.gemm_grouped(routing_ops.permute_rows(x, routing, k, k_order=order1), None, weights.w13,
                                       weights.b13, offsets, out_dtype=x.dtype, a_k_order=order1)
        else:
            # The M token rows are quantized, then codes and scales permuted: the same rows as
            # quantizing the M * k permuted ones (the quantization is per row), for 1/k of the work.
            # One call where the grouping allows it (each row read once); else two steps.
            if act_ops.quantize_permuted_supported(quant[1], x.shape[1]) and _ffi.call_available(
                    "quantize_permuted"):
                a, a_scale = act_ops.quantize_permuted(x, routing.permutation, offsets, routing.src_rows,
                                                       quant[0], quant[1])
            else:
                q, s = act_ops.quantize(x, quant[0], quant[1])
                a, a_scale = routing_ops.permute_rows(q, routing, k), routing_ops.permute_rows(s, routing, k)
            gu = gemm_ops.gemm_grouped(a, a_scale, weights.w13, weights.b13, offsets, out_dtype=x.dtype,
                                       act_group_k=quant[1])
        order2 = quant is None and gemm_ops.rs4_act_order(rows, weights.w2, x.dtype, x.dtype)
        a2, a2_scale, agk2 = _activate(gu, activation, limit, quant, k_order=order2)
        d = gemm_ops.gemm_grouped(a2, a2_scale, weights.w2, weights.b2, offsets, out_dtype=x.dtype, act_group_k=agk2,
                                  a_k_order=order2)
        return d, routing.src_rows


class BatchedExperts(FusedMoEExperts):
    """Batched format: hidden_states [E_local, T, H] with expert_num_tokens [E_local]; the
    result [E_local, T, H] is unweighted (the combine after dispatch applies router weights)."""

    gemm_type = "batched"
    activation_format = "batched"

    def apply(
        self,
        out: jax.Array,
        hidden_states: jax.Array,
        weights: MoEWeights,
        topk_weights: jax.Array | None,
        topk_ids: jax.Array | None,
        *,
        activation: str = "silu",
        global_num_experts: int | None = None,
        expert_map: jax.Array | None = None,
        expert_num_tokens: jax.Array | None = None,
        activation_limit: float | None = None,
    ) -> jax.Array:
        """Runs every local expert on its first expert_num_tokens[e] rows; rows past the
        count are written as zeros. The result aliases ``out`` [E_local, T, H]."""
        _check_array(hidden_states, "hidden_states", 3)
        _check_weights(weights, hidden_states, activation, activation_limit)
        self._check_supported(weights, activation)
        _check_out(out, hidden_states.shape, hidden_states.dtype)
        if topk_weights is not None or topk_ids is not None or expert_map is not None:
            raise ValueError("the batched format takes no topk_weights, topk_ids or expert_map (pass None)")
        e, t, h = hidden_states.shape
        if e != weights.num_experts:
            raise ValueError(f"hidden_states has {e} expert slabs, weights have {weights.num_experts} experts")
        if expert_num_tokens is None:
            raise ValueError("BatchedExperts needs expert_num_tokens [E_local]")
        _check_array(expert_num_tokens, "expert_num_tokens", 1)
        if jnp.dtype(expert_num_tokens.dtype) != jnp.dtype(jnp.int32):
            raise TypeError(f"expert_num_tokens must be int32, got {_dtype_name(expert_num_tokens)}")
        if expert_num_tokens.shape[0] != e:
            raise ValueError(f"expert_num_tokens has {expert_num_tokens.shape[0]} entries, expected {e}")
        quant = act_quant_params(weights.act_key)
        a, a_scale, agk = hidden_states, None, 0
        if quant is not None:
            q, a_scale = act_ops.quantize(hidden_states.reshape(e * t, h), quant[0], quant[1])
            a, agk = q.reshape(e, t, h), quant[1]
        gu = gemm_ops.gemm_batched(a, a_scale, weights.w13, weights.b13, expert_num_tokens, out_dtype=hidden_states.dtype, act_group_k=agk)
        a2, a2_scale, agk2 = _activate(gu.reshape(e * t, gu.shape[-1]), activation, activation_limit, quant)
        return gemm_ops.gemm_batched(
            a2.reshape(e, t, a2.shape[-1]),
            a2_scale,
            weights.w2,
            weights.b2,
            expert_num_tokens,
            out_dtype=hidden_states.dtype,
            act_group_k=agk2,
            out=out,
        )


def _activate(
    gu: jax.Array, activation: str, limit: float | None, quant: tuple[str, int] | None, *, k_order: bool = False
) -> tuple[jax.Array, jax.Array | None, int]:
    """The activation, fused with dynamic quantization for 8-bit-activation schemes; k_order: the
    16-bit rows in the 4-bit mainloop's k order (act_ops.activation)."""
    if quant is None:
        return act_ops.activation(gu, activation, limit, k_order=k_order), None, 0
    q, s = act_ops.activation_quant(gu, activation, limit, quant[0], quant[1])
    return q, s, quant[1]


EXPERT_CLASSES: tuple[type[FusedMoEExperts], ...] = (IndexedExperts, GroupedExperts, BatchedExperts)
