"""``humming_jax.flax.HummingMoE`` against a reference MoE computed here in jnp.

The reference recomputes everything from the layer's parameters: router logits in float32,
softmax or sigmoid scores, top-k, renormalization, then the oracle ``moe_reference`` on the
experts' dequantized values (and a float32 shared expert). Fresh random inputs every run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOL, nan_out

nnx = pytest.importorskip("flax.nnx")

import humming_jax as hj  # noqa: E402
from humming_jax.activations import apply_activation  # noqa: E402
from humming_jax.flax import HummingMoE, QuantizedExperts, to_linen  # noqa: E402
from humming_jax.quantize import act_quant_params  # noqa: E402
from humming_jax.reference import InputQuant, moe_reference, relative_error  # noqa: E402

E, H, I, K = 8, 128, 128, 2
HI = jax.lax.Precision.HIGHEST


def reference_layer(x, kernel, weights: hj.MoEWeights, *, top_k=K, scoring="softmax", renormalize=True, scale=1.0,
                    activation="silu", shared=None):
    """The layer recomputed from its parameters; ``shared`` = (gate, up, down[, gate_w]) kernels."""
    x2 = jnp.asarray(x).reshape(-1, x.shape[-1])
    logits = jnp.matmul(x2.astype(jnp.float32), jnp.asarray(kernel, jnp.float32), precision=HI)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
    tw, ids = jax.lax.top_k(scores, top_k)
    if renormalize:
        tw = tw / tw.sum(-1, keepdims=True)
    tw = tw * scale
    d13, d2 = weights.dequantize()
    quant = InputQuant(*act_quant_params(weights.act_key)) if weights.act_key is not None else None
    xe = x2.astype(weights.dtype)
    y = moe_reference(xe, d13, d2, tw, ids.astype(jnp.int32), activation=activation, input_quant=quant).astype(jnp.float32)
    if shared is not None:
        xf = xe.astype(jnp.float32)
        g, u = (jnp.matmul(xf, jnp.asarray(w, jnp.float32), precision=HI) for w in shared[:2])
        s = jnp.matmul(apply_activation(jnp.concatenate([g, u], -1), activation), jnp.asarray(shared[2], jnp.float32), precision=HI)
        if len(shared) > 3:
            s = s * jax.nn.sigmoid(jnp.matmul(xf, jnp.asarray(shared[3], jnp.float32), precision=HI))
        y = y + s
    return y.reshape(x.shape)


def inputs(rng, shape=(2, 8, H), dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def run(layer, x):
    return nnx.jit(lambda m, x: m(x))(layer, x)


@pytest.mark.parametrize("scheme", ["bf16", "w4a16-int4-g128", "w8a8-fp8-block128"])
def test_matches_reference_under_nnx_jit(rng, scheme):
    layer = HummingMoE(E, H, I, K, scheme=scheme, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    # A router with a wide spread of logits, so the top-k choice is far from ties.
    layer.router.kernel.set_value(jnp.asarray(rng.standard_normal((H, E)), jnp.float32))
    x = inputs(rng)
    got = run(layer, x)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert layer.expert_weights.scheme == scheme
    want = reference_layer(x, layer.router.kernel.get_value(), layer.expert_weights)
    assert relative_error(got, want) < TOL[jnp.dtype(jnp.bfloat16)]


def test_sigmoid_scores_shared_expert_and_scaling(rng):
    layer = HummingMoE(E, H, I, 3, scheme="w4a16-uint4-zp-g128", scoring="sigmoid", renormalize=False,
                       rngs=nnx.Rngs(int(rng.integers(1 << 30))), shared_intermediate_size=64, shared_expert_gate=True,
                       routed_scaling_factor=2.5)
    layer.router.kernel.set_value(jnp.asarray(rng.standard_normal((H, E)), jnp.float32))
    x = inputs(rng, (5, H))
    se = layer.shared_expert
    shared = tuple(lin.kernel.get_value() for lin in (se.gate_proj, se.up_proj, se.down_proj, se.gate))
    want = reference_layer(x, layer.router.kernel.get_value(), layer.expert_weights, top_k=3, scoring="sigmoid",
                           renormalize=False, scale=2.5, shared=shared)
    assert relative_error(run(layer, x), want) < TOL[jnp.dtype(jnp.bfloat16)]


def test_split_merge_round_trip_and_state_types(rng):
    layer = HummingMoE(E, H, I, K, scheme="w4a16-int4-g128", rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = inputs(rng)
    before = run(layer, x)
    graphdef, state = nnx.split(layer)
    merged = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    assert isinstance(merged.experts, QuantizedExperts)
    np.testing.assert_array_equal(np.asarray(run(merged, x), np.float32), np.asarray(before, np.float32))
    # Quantized experts are state, but not trainable parameters.
    params = nnx.state(layer, nnx.Param)
    assert "experts" not in params and "router" in params
    experts = nnx.state(layer, QuantizedExperts)
    assert isinstance(experts["experts"].get_value(), hj.MoEWeights)
    # Their sharding annotation: the expert axis, a prefix for every MoEWeights leaf.
    assert nnx.get_partition_spec(experts)["experts"].get_value() == jax.sharding.PartitionSpec("ep")


def test_optimizer_updates_only_params(rng):
    optax = pytest.importorskip("optax")
    layer = HummingMoE(E, H, I, K, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    opt = nnx.Optimizer(layer, optax.sgd(0.1), wrt=nnx.Param)
    x = inputs(rng, (4, H))
    codes = np.asarray(layer.expert_weights.w13.data, np.float32)
    kernel = np.asarray(layer.router.kernel.get_value())

    def loss(m):
        return jnp.sum(m.route(x)[0] * jnp.arange(K, dtype=jnp.float32))

    grads = nnx.grad(loss)(layer)
    opt.update(layer, grads)
    assert not np.array_equal(np.asarray(layer.router.kernel.get_value()), kernel)
    np.testing.assert_array_equal(np.asarray(layer.expert_weights.w13.data, np.float32), codes)


def test_from_weights(rng):
    w13 = rng.standard_normal((E, 2 * I, H)).astype(np.float32) / np.sqrt(H)
    w2 = rng.standard_normal((E, H, I)).astype(np.float32) / np.sqrt(I)
    kernel = rng.standard_normal((H, E)).astype(np.float32)
    layer = HummingMoE.from_weights(w13, w2, kernel, top_k=K, scheme="w4a16-int4-g128")
    expect = hj.quantize_moe_weights(w13, w2, "w4a16-int4-g128")
    for a, b in zip(jax.tree.leaves(layer.expert_weights), jax.tree.leaves(expect)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(layer.router.kernel.get_value()), kernel)
    x = inputs(rng)
    assert relative_error(run(layer, x), reference_layer(x, kernel, expect)) < TOL[jnp.dtype(jnp.bfloat16)]
    # Kernel-format weights (e.g. from load_moe_layer) are taken as they are.
    again = HummingMoE.from_weights(expect, None, kernel, top_k=K)
    np.testing.assert_array_equal(np.asarray(run(again, x), np.float32), np.asarray(run(layer, x), np.float32))
    with pytest.raises(ValueError, match=r"router_kernel must be \[H, E\]"):
        HummingMoE.from_weights(w13, w2, kernel.T, top_k=K)


def test_from_weights_swigluoai_with_router_bias(rng):
    # gpt-oss's shape of layer: interleaved gate/up, expert biases, a router bias.
    w13 = rng.standard_normal((E, 2 * I, H)).astype(np.float32) / np.sqrt(H)
    w2 = rng.standard_normal((E, H, I)).astype(np.float32) / np.sqrt(I)
    weights = hj.quantize_moe_weights(w13, w2, "w4a16-mxfp4", b13=rng.standard_normal((E, 2 * I)) * 0.1,
                                      b2=rng.standard_normal((E, H)) * 0.1)
    kernel = rng.standard_normal((H, E)).astype(np.float32)
    bias = rng.standard_normal((E,)).astype(np.float32)
    layer = HummingMoE.from_weights(weights, None, kernel, top_k=K, activation="swigluoai", router_bias=bias)
    np.testing.assert_array_equal(np.asarray(layer.router.bias.get_value()), bias)
    x = inputs(rng)
    d13, d2 = weights.dequantize()
    x2 = x.reshape(-1, H)
    logits = jnp.matmul(x2.astype(jnp.float32), kernel, precision=HI) + bias
    tw, ids = jax.lax.top_k(jax.nn.softmax(logits, -1), K)
    want = moe_reference(x2, d13, d2, tw / tw.sum(-1, keepdims=True), ids.astype(jnp.int32), activation="swigluoai",
                         b13=weights.b13, b2=weights.b2).reshape(x.shape)
    assert relative_error(run(layer, x), want) < TOL[jnp.dtype(jnp.bfloat16)]


def test_caller_owned_out(rng):
    layer = HummingMoE(E, H, I, K, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = inputs(rng, (6, H))
    out = nan_out((6, H), jnp.bfloat16)
    got = nnx.jit(lambda m, x, out: m(x, out=out))(layer, x, out)
    assert relative_error(got, reference_layer(x, layer.router.kernel.get_value(), layer.expert_weights)) < TOL[
        jnp.dtype(jnp.bfloat16)]
    assert np.isnan(np.asarray(out, np.float32)).all()  # not donated: the caller's buffer is unchanged


def test_linen_wrapper(rng):
    model = to_linen(E, H, I, K, scheme="w4a16-int4-g128")
    x = inputs(rng)
    variables = model.init(jax.random.key(int(rng.integers(1 << 30))), x)
    assert set(variables) == {"params", "quantized_experts"}
    kernel = variables["params"]["router"]["kernel"]
    experts = variables["quantized_experts"]["experts"]
    experts = experts.value if hasattr(experts, "value") else experts
    assert isinstance(experts, hj.MoEWeights) and experts.scheme == "w4a16-int4-g128"
    got = jax.jit(model.apply)(variables, x)
    want = reference_layer(x, kernel.value if hasattr(kernel, "value") else kernel, experts)
    assert relative_error(got, want) < TOL[jnp.dtype(jnp.bfloat16)]


def test_abstract_construction(rng):
    abstract = nnx.eval_shape(lambda: HummingMoE(E, H, I, K, scheme="w4a16-int4-g128", rngs=nnx.Rngs(0)))
    concrete = HummingMoE(E, H, I, K, scheme="w4a16-int4-g128", rngs=nnx.Rngs(0))
    a = jax.tree.map(lambda v: (v.shape, v.dtype), nnx.state(abstract))
    c = jax.tree.map(lambda v: (v.shape, v.dtype), nnx.state(concrete))
    assert jax.tree.structure(a) == jax.tree.structure(c) and jax.tree.leaves(a) == jax.tree.leaves(c)


def test_config_errors():
    with pytest.raises(ValueError, match="top_k"):
        HummingMoE(4, H, I, 5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="scoring"):
        HummingMoE(4, H, I, 2, scoring="relu", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown scheme"):
        HummingMoE(4, H, I, 2, scheme="int3", rngs=nnx.Rngs(0))
    layer = HummingMoE(4, H, I, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\[\.\.\., H = 128\]"):
        layer(jnp.ones((3, 64), jnp.bfloat16))


MESH_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from humming_jax.flax import HummingMoE
    from humming_jax.reference import relative_error

    rng = np.random.default_rng(SEED)
    mesh = jax.make_mesh((4,), ("ep",))
    single = HummingMoE(8, 128, 128, 2, scheme="w4a16-int4-g128", rngs=nnx.Rngs(SEED))
    x = jnp.asarray(rng.standard_normal((2, 6, 128)), jnp.bfloat16)  # M = 12 tokens over 4 devices
    step = nnx.jit(lambda m, x: m(x))
    want = step(single, x)
    kernel = single.router.kernel.get_value()
    for mode in ("allgather", "all_to_all"):
        ep = HummingMoE.from_weights(single.expert_weights, None, kernel, top_k=2, mesh=mesh, ep_mode=mode)
        spec = ep.expert_weights.w13.data.sharding.spec
        assert spec[0] == "ep", spec
        got = step(ep, x)
        err = relative_error(got, want)
        assert err < 1e-2, (mode, err)
        if mode == "all_to_all":  # same GEMMs and finalize as one device: bitwise on CPU
            assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32)), mode
    print("MESH-OK")
    """
)


def test_expert_parallel_mesh(rng):
    """HummingMoE(mesh=...) through humming_jax.parallel on 4 host devices (a subprocess: the
    device count is fixed when JAX starts)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    code = MESH_SCRIPT.replace("SEED", str(int(rng.integers(1 << 30))))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).parent)
    assert "MESH-OK" in res.stdout, res.stdout + res.stderr
