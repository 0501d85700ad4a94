"""``HummingMoE``: a ready Flax NNX Mixture-of-Experts layer (router + quantized experts).

Import it explicitly (``from humming_jax.flax import HummingMoE``); ``import humming_jax`` does not
import Flax, which is an optional dependency (``pip install 'humming-jax[flax]'``).

The layer routes in float32 (``router``: ``nnx.Linear(H, E, use_bias=False)``; softmax or sigmoid
scores, top-k, optional renormalization), runs the routed experts through ``fused_moe`` (or
``parallel.ep_moe`` over a mesh) and adds an optional shared expert.

The experts live in a ``QuantizedExperts`` variable, an ``nnx.Variable`` subclass that is *not*
``nnx.Param``: optimizers built with ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and ``nnx.grad``
(whose default ``wrt`` is ``nnx.Param``) leave the integer codes and scales alone, while
``nnx.split``/``nnx.merge``/``nnx.state`` carry them like any other state (filter them with
``QuantizedExperts``). Its value is the whole ``MoEWeights`` pytree; its ``out_sharding`` metadata
(``(expert_axis,)``) is a prefix spec for every leaf, all of which lead with the expert axis, so
``nnx.get_partition_spec`` / ``nnx.get_named_sharding`` give an expert-parallel placement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .activations import ACTIVATIONS, ActivationCode, apply_activation, get_activation
from .fused_moe import fused_moe
from .quantize import SCHEMES, quantize_moe_weights
from .weights import MoEWeights

__all__ = ["HummingMoE", "QuantizedExperts", "SharedExpert", "to_linen"]

SCORINGS = ("softmax", "sigmoid")
EP_MODES = ("allgather", "all_to_all")


class QuantizedExperts(nnx.Variable):
    """Holds an ``MoEWeights`` pytree. Not an ``nnx.Param``, so it is never trained (see the
    module docstring); in a Linen model (``to_linen``) it is the ``quantized_experts`` collection."""


nnx.register_variable_name("quantized_experts", QuantizedExperts, overwrite=True)


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _placeholder_experts(e: int, n1: int, h: int, i: int, scheme: str, dtype: Any) -> MoEWeights:
    """Zeros with the structure ``quantize_moe_weights`` would give, for abstract or traced
    construction (``nnx.eval_shape``, a jitted Linen ``apply``) where the values are replaced."""
    with jax.ensure_compile_time_eval():  # the quantizers use jnp on concrete values
        template = quantize_moe_weights(np.zeros((1, n1, h), np.float32), np.zeros((1, h, i), np.float32), scheme, dtype=dtype)
    return jax.tree.map(lambda a: jnp.zeros((e,) + a.shape[1:], a.dtype), template)


def _random_experts(key: jax.Array, e: int, n1: int, h: int, i: int, scheme: str, dtype: Any) -> MoEWeights:
    k13, k2 = jax.random.split(key)
    w13 = jax.random.normal(k13, (e, n1, h), jnp.float32) / np.sqrt(h)
    w2 = jax.random.normal(k2, (e, h, i), jnp.float32) / np.sqrt(i)
    if _is_tracer(w13):
        # Quantization runs in NumPy on concrete values; a traced construction gets zeros of
        # the right structure (its state is overwritten by the caller, e.g. the Linen bridge).
        return _placeholder_experts(e, n1, h, i, scheme, dtype)
    return quantize_moe_weights(np.asarray(w13), np.asarray(w2), scheme, dtype=dtype)


def _check_config(num_experts: int, top_k: int, activation: str, scoring: str, scheme: str | None) -> None:
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts = {num_experts}], got {top_k!r}")
    get_activation(activation)
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; supported: {sorted(SCHEMES)}")


class SharedExpert(nnx.Module):
    """A dense gated MLP applied to every token: ``down(act(gate(x), up(x)))``, optionally scaled
    by ``sigmoid(gate_weight(x))`` (Qwen2-MoE's ``shared_expert_gate``). Runs in ``dtype`` with
    float32 accumulation; kernels are ``nnx.Param`` in [in, out] layout."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str = "silu", dtype: Any = jnp.bfloat16,
                 gated_output: bool = False, rngs: nnx.Rngs) -> None:
        spec, _ = get_activation(activation)
        if not spec.gated or spec.code == ActivationCode.SWIGLUOAI:
            raise ValueError(
                f"the shared expert takes a gated activation with gate and up halves (silu, gelu, gelu_tanh), got {activation!r}"
            )
        self.activation = activation
        lin = dict(use_bias=False, dtype=dtype, param_dtype=dtype, preferred_element_type=jnp.float32, rngs=rngs)
        self.gate_proj = nnx.Linear(hidden_size, intermediate_size, **lin)
        self.up_proj = nnx.Linear(hidden_size, intermediate_size, **lin)
        self.down_proj = nnx.Linear(intermediate_size, hidden_size, **lin)
        self.gate = (
            nnx.Linear(hidden_size, 1, use_bias=False, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
            if gated_output
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [M, H] -> float32 [M, H]."""
        gu = jnp.concatenate([self.gate_proj(x), self.up_proj(x)], axis=-1).astype(x.dtype)
        a = apply_activation(gu, self.activation).astype(x.dtype)
        y = self.down_proj(a).astype(jnp.float32)
        if self.gate is not None:
            y = y * jax.nn.sigmoid(self.gate(x.astype(jnp.float32)))
        return y


class HummingMoE(nnx.Module):
    """A Mixture-of-Experts layer: float32 router, quantized experts through ``fused_moe``.

    ``HummingMoE(num_experts, hidden_size, intermediate_size, top_k, *, scheme, activation,
    scoring, renormalize, rngs)`` draws random experts (normal, 1/sqrt(fan_in)) and quantizes
    them with ``scheme`` (``humming_jax.SCHEMES``); ``from_weights`` builds one from given
    weights. Construct eagerly: quantization runs in NumPy on concrete values (a traced
    construction, e.g. under ``nnx.eval_shape``, gets zero experts of the right structure).

    Attributes: ``router`` (``nnx.Linear(H, E, use_bias=False)``, float32), ``experts``
    (``QuantizedExperts`` holding ``MoEWeights``; ``layer.experts.get_value().dequantize()``),
    ``shared_expert`` (``SharedExpert`` or None).

    Keyword-only extras: ``dtype`` (activation dtype of the experts; the scheme's default),
    ``shared_intermediate_size`` / ``shared_expert_gate`` (add a shared expert, with Qwen2-MoE's
    sigmoid gate), ``routed_scaling_factor`` (multiplies the routing weights, DeepSeek style),
    ``router_bias`` (a router bias, as gpt-oss has; off by default), ``gemm_type`` (passed to ``fused_moe``), ``mesh`` / ``expert_axis`` / ``ep_mode`` (expert
    parallelism through ``humming_jax.parallel``: experts sharded E/n over ``expert_axis`` and
    calls run ``ep_moe``), ``experts`` (pre-built ``MoEWeights``, skipping the random init).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        *,
        scheme: str = "bf16",
        activation: str = "silu",
        scoring: str = "softmax",
        renormalize: bool = True,
        rngs: nnx.Rngs,
        dtype: Any = None,
        shared_intermediate_size: int | None = None,
        shared_expert_gate: bool = False,
        routed_scaling_factor: float = 1.0,
        router_bias: bool = False,
        gemm_type: str | None = None,
        mesh: jax.sharding.Mesh | None = None,
        expert_axis: str = "ep",
        ep_mode: str = "allgather",
        experts: MoEWeights | None = None,
    ) -> None:
        _check_config(num_experts, top_k, activation, scoring, scheme if experts is None else None)
        if ep_mode not in EP_MODES:
            raise ValueError(f"ep_mode must be one of {EP_MODES}, got {ep_mode!r}")
        gated = ACTIVATIONS[activation].gated
        n1 = 2 * intermediate_size if gated else intermediate_size
        if experts is None:
            dtype = jnp.dtype(dtype or SCHEMES[scheme].default_dtype)
            experts = _random_experts(rngs.params(), num_experts, n1, hidden_size, intermediate_size, scheme, dtype)
        else:
            if not isinstance(experts, MoEWeights):
                raise TypeError(f"experts must be MoEWeights, got {type(experts).__name__}")
            want = (num_experts, n1, hidden_size, intermediate_size)
            got = (experts.num_experts, experts.n1, experts.hidden_size, experts.intermediate_size)
            if got != want:
                raise ValueError(
                    f"experts are (E, N1, H, I) = {got}, but the layer is configured for {want} "
                    f"(activation {activation!r})"
                )
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.top_k = top_k
        self.scheme = experts.scheme
        self.activation = activation
        self.scoring = scoring
        self.renormalize = bool(renormalize)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.gemm_type = gemm_type
        self.dtype = jnp.dtype(experts.dtype)
        self.mesh = mesh
        self.expert_axis = expert_axis
        self.ep_mode = ep_mode
        self.router = nnx.Linear(
            hidden_size, num_experts, use_bias=router_bias, dtype=jnp.float32, param_dtype=jnp.float32,
            precision=jax.lax.Precision.HIGHEST, rngs=rngs,
        )
        if mesh is not None and not _is_tracer(jax.tree.leaves(experts)[0]):
            from .parallel import shard_moe_weights

            experts = shard_moe_weights(experts, mesh, expert_axis)
        self.experts = QuantizedExperts(experts, out_sharding=(expert_axis,), eager_sharding=False)
        self.shared_expert = (
            SharedExpert(hidden_size, shared_intermediate_size, activation=activation, dtype=self.dtype,
                         gated_output=shared_expert_gate, rngs=rngs)
            if shared_intermediate_size
            else None
        )

    @classmethod
    def from_weights(
        cls,
        w13: Any,
        w2: Any,
        router_kernel: Any,
        *,
        top_k: int,
        scheme: str = "bf16",
        activation: str = "silu",
        scoring: str = "softmax",
        renormalize: bool = True,
        dtype: Any = None,
        shared_expert: Mapping[str, Any] | None = None,
        routed_scaling_factor: float = 1.0,
        router_bias: Any = None,
        gemm_type: str | None = None,
        mesh: jax.sharding.Mesh | None = None,
        expert_axis: str = "ep",
        ep_mode: str = "allgather",
    ) -> "HummingMoE":
        """A layer from given weights.

        ``w13`` [E, N1, H] and ``w2`` [E, H, I] are float expert weights (gate rows then up rows;
        interleaved for ``swigluoai``), quantized with ``scheme``; or ``w13`` is an
        ``MoEWeights`` already in kernel format (e.g. from ``load_moe_layer``) and ``w2`` None,
        in which case ``scheme`` is ignored. ``router_kernel`` is [H, E] (Flax layout: a
        PyTorch/safetensors router ``weight`` [E, H] transposed). ``shared_expert``: optional dict
        of [in, out] kernels ``gate_proj`` [H, Is], ``up_proj`` [H, Is], ``down_proj`` [Is, H]
        and optionally ``gate`` [H, 1]. ``router_bias``: optional [E] bias of the router logits."""
        if isinstance(w13, MoEWeights):
            if w2 is not None:
                raise ValueError("w13 is MoEWeights (kernel format); pass w2=None")
            weights = w13
        else:
            if w2 is None:
                raise ValueError("w2 is required when w13 is a float array")
            _check_config(1, 1, activation, scoring, scheme)
            weights = quantize_moe_weights(np.asarray(w13, np.float32), np.asarray(w2, np.float32), scheme, dtype=dtype)
        kernel = jnp.asarray(router_kernel, jnp.float32)
        e, h, i = weights.num_experts, weights.hidden_size, weights.intermediate_size
        if kernel.shape != (h, e):
            raise ValueError(f"router_kernel must be [H, E] = {(h, e)}, got {tuple(kernel.shape)} (transpose a [E, H] weight)")
        shared_i = None
        if shared_expert is not None:
            missing = {"gate_proj", "up_proj", "down_proj"} - set(shared_expert)
            if missing:
                raise ValueError(f"shared_expert lacks {sorted(missing)}; it needs gate_proj, up_proj, down_proj (and optional gate)")
            shared_i = int(np.shape(shared_expert["gate_proj"])[1])
        layer = cls(
            e, h, i, top_k, scheme=weights.scheme, activation=activation, scoring=scoring, renormalize=renormalize,
            rngs=nnx.Rngs(0), shared_intermediate_size=shared_i,
            shared_expert_gate=shared_expert is not None and "gate" in shared_expert,
            routed_scaling_factor=routed_scaling_factor, router_bias=router_bias is not None, gemm_type=gemm_type,
            mesh=mesh, expert_axis=expert_axis,
            ep_mode=ep_mode, experts=weights,
        )
        layer.router.kernel.set_value(kernel)
        if router_bias is not None:
            bias = jnp.asarray(router_bias, jnp.float32)
            if bias.shape != (e,):
                raise ValueError(f"router_bias must be [E] = ({e},), got {tuple(bias.shape)}")
            layer.router.bias.set_value(bias)
        if shared_expert is not None:
            se = layer.shared_expert
            for name in ("gate_proj", "up_proj", "down_proj", "gate"):
                if name in shared_expert:
                    lin = getattr(se, name)
                    value = jnp.asarray(shared_expert[name], lin.kernel.get_value().dtype)
                    if value.shape != lin.kernel.get_value().shape:
                        raise ValueError(
                            f"shared_expert[{name!r}] must be {tuple(lin.kernel.get_value().shape)}, got {tuple(value.shape)}"
                        )
                    lin.kernel.set_value(value)
        return layer

    @property
    def expert_weights(self) -> MoEWeights:
        """The experts' ``MoEWeights`` (kernel format)."""
        return self.experts.get_value()

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [M, H] -> (topk_weights [M, k] float32, topk_ids [M, k] int32), computed in float32."""
        logits = self.router(x.astype(jnp.float32))
        scores = jax.nn.softmax(logits, axis=-1) if self.scoring == "softmax" else jax.nn.sigmoid(logits)
        weights, ids = jax.lax.top_k(scores, self.top_k)
        if self.renormalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * jnp.float32(self.routed_scaling_factor)
        return weights.astype(jnp.float32), ids.astype(jnp.int32)

    def __call__(self, x: jax.Array, *, out: jax.Array | None = None) -> jax.Array:
        """x [..., H] -> [..., H] in x's dtype.

        ``out`` (optional, [M, H] in the experts' dtype, M = the product of x's leading dims) is
        the caller-owned buffer handed to ``fused_moe``; without a shared expert, with a 2-D x in
        the experts' dtype and on one device the result occupies it when donated."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [..., H = {self.hidden_size}], got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden_size)
        tw, ids = self.route(x2)
        weights = self.experts.get_value()
        xe = x2.astype(weights.dtype)
        if self.mesh is not None:
            from .parallel import ep_moe

            y = ep_moe(xe, weights, tw, ids, mesh=self.mesh, axis=self.expert_axis, mode=self.ep_mode,
                       activation=self.activation, gemm_type=self.gemm_type)
        else:
            y = fused_moe(xe, weights, tw, ids, activation=self.activation, out=out, gemm_type=self.gemm_type)
        if self.shared_expert is not None:
            y = (y.astype(jnp.float32) + self.shared_expert(xe)).astype(weights.dtype)
        return y.reshape(*lead, self.hidden_size).astype(x.dtype)


def to_linen(num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, *, name: str | None = None,
             **kwargs: Any) -> Any:
    """``HummingMoE`` as a Linen module, through ``flax.nnx.bridge.to_linen``.

    ``init`` creates the layer (router kernel in ``params``, experts in ``quantized_experts``);
    ``apply`` rebuilds it from those collections. Jit the ``apply``: an eager ``apply`` re-runs
    the random init (then discards it), a jitted one builds a zero placeholder instead."""
    return nnx.bridge.to_linen(HummingMoE, num_experts, hidden_size, intermediate_size, top_k, name=name, **kwargs)
