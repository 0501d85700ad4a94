"""Class selection: format, explicit preference, environment variable, support checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import nan_out, random_layer

import humming_jax as hj
from humming_jax.experts import BatchedExperts, GroupedExperts, IndexedExperts
from humming_jax.quant_keys import GroupShape, QuantKey, ScaleDesc
from humming_jax.quantize import SCHEMES
from humming_jax.selection import ENV_GEMM_TYPE

BF16 = SCHEMES["bf16"].weight_key


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(ENV_GEMM_TYPE, raising=False)


def test_every_class_is_reachable():
    assert hj.select_experts(BF16, None, prefer="indexed") is IndexedExperts
    assert hj.select_experts(BF16, None, prefer="grouped") is GroupedExperts
    assert hj.select_experts(BF16, None, batched=True) is BatchedExperts
    assert hj.select_experts(BF16, None, batched=True, prefer="batched") is BatchedExperts


def test_auto_picks_a_standard_class():
    assert hj.select_experts(BF16, None) in (IndexedExperts, GroupedExperts)
    assert hj.select_experts(BF16, None, prefer="auto").activation_format == "standard"


@pytest.mark.parametrize("value,cls", [("indexed", IndexedExperts), ("grouped", GroupedExperts), ("GROUPED", GroupedExperts)])
def test_environment_variable_read_at_call_time(monkeypatch, value, cls):
    monkeypatch.setenv(ENV_GEMM_TYPE, value)
    assert hj.select_experts(BF16, None) is cls


def test_explicit_preference_beats_environment(monkeypatch):
    monkeypatch.setenv(ENV_GEMM_TYPE, "grouped")
    assert hj.select_experts(BF16, None, prefer="indexed") is IndexedExperts
    monkeypatch.setenv(ENV_GEMM_TYPE, "indexed")
    assert hj.select_experts(BF16, None, prefer="grouped") is GroupedExperts


def test_environment_does_not_affect_batched(monkeypatch):
    monkeypatch.setenv(ENV_GEMM_TYPE, "indexed")
    assert hj.select_experts(BF16, None, batched=True) is BatchedExperts


def test_bad_preferences(monkeypatch):
    with pytest.raises(ValueError, match="not one of"):
        hj.select_experts(BF16, None, prefer="batched")
    with pytest.raises(ValueError, match="names no batched-format class"):
        hj.select_experts(BF16, None, batched=True, prefer="indexed")
    monkeypatch.setenv(ENV_GEMM_TYPE, "fastest")
    with pytest.raises(ValueError, match=ENV_GEMM_TYPE):
        hj.select_experts(BF16, None)


def test_rejection_says_why_for_each_candidate():
    odd = QuantKey("int3", ScaleDesc("float32", True, GroupShape(1, 64)))
    with pytest.raises(ValueError) as info:
        hj.select_experts(odd, None, activation="swish")
    msg = str(info.value)
    assert "IndexedExperts" in msg and "GroupedExperts" in msg
    assert "unsupported quant scheme" in msg and "int3" in msg
    assert "unsupported activation 'swish'" in msg


def test_named_class_that_cannot_run_is_an_error_not_a_fallback():
    odd = QuantKey("int3", ScaleDesc("float32", True, GroupShape(1, 64)))
    with pytest.raises(ValueError, match="preference 'grouped'"):
        hj.select_experts(odd, None, prefer="grouped")


def test_supports_device():
    for cls in (IndexedExperts, GroupedExperts, BatchedExperts):
        assert cls.supports_device(jax.devices("cpu")[0])
        assert cls.supports_device()  # the default device (CPU here, the GPU there)
        assert not cls.supports_device("tpu")


def test_supports_quant_scheme_and_activation():
    for cls in (IndexedExperts, GroupedExperts, BatchedExperts):
        for scheme in SCHEMES.values():
            assert cls.supports_quant_scheme(scheme.weight_key, scheme.act_key), scheme.name
        assert not cls.supports_quant_scheme(BF16, SCHEMES["w8a8-fp8-block128"].act_key)
        assert cls.supports_activation("swigluoai") and not cls.supports_activation("tanh")


@pytest.mark.parametrize("gemm_type", ["indexed", "grouped", "auto", None])
def test_fused_moe_runs_every_choice(rng, monkeypatch, gemm_type):
    layer = random_layer(rng, m=8, e=4, h=32, i=16, k=2)
    from conftest import reference
    from humming_jax.reference import relative_error

    got = hj.fused_moe(layer.x, layer.weights, layer.topk_weights, layer.topk_ids, gemm_type=gemm_type)
    assert relative_error(got, reference(layer)) < 1.2e-2


def test_fused_moe_uses_the_environment(rng, monkeypatch):
    # The chosen class shows in the compiled program: grouped permutes rows, indexed does not.
    layer = random_layer(rng, m=8, e=4, h=32, i=16, k=2)
    # fused_moe reads the variable when it is traced; jit caches traces per function, so each
    # setting gets its own function here.
    def f():
        return lambda x, w, tw, ids: hj.fused_moe(x, w, tw, ids)

    monkeypatch.setenv(ENV_GEMM_TYPE, "grouped")
    grouped = jax.jit(f()).lower(layer.x, layer.weights, layer.topk_weights, layer.topk_ids).as_text()
    monkeypatch.setenv(ENV_GEMM_TYPE, "indexed")
    indexed = jax.jit(f()).lower(layer.x, layer.weights, layer.topk_weights, layer.topk_ids).as_text()
    assert "humming_jax.permute_rows" in grouped and "humming_jax.gemm_grouped" in grouped
    assert "humming_jax.layer_indexed" in indexed and "permute_rows" not in indexed


def test_grouped_class_gathers_its_rows_with_the_switch(rng, monkeypatch):
    """$HUMMING_JAX_PREFILL_GATHER=1 (read when the class is traced): the grouped class's GEMM1 is
    gemm_grouped_gather, with no permute_rows of the 16-bit rows, and the layer's output is bit
    for bit the default's; a value outside 0-2 is an error at trace time."""
    from humming_jax.ops import gemm as gemm_ops

    layer = random_layer(rng, m=40, e=4, h=64, i=32, k=2, pad_frac=0.1)
    args = (layer.x, layer.weights, layer.topk_weights, layer.topk_ids)
    f = lambda: jax.jit(lambda x, w, tw, ids: hj.fused_moe(x, w, tw, ids, gemm_type="grouped"))
    monkeypatch.delenv(gemm_ops.ENV_PREFILL_GATHER, raising=False)
    want = f()(*args)
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_GATHER, "1")
    g = f()
    hlo = g.lower(*args).as_text()
    assert "humming_jax.gemm_grouped_gather" in hlo and "humming_jax.permute_rows" not in hlo
    np.testing.assert_array_equal(np.asarray(g(*args).astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    monkeypatch.setenv(gemm_ops.ENV_PREFILL_GATHER, "3")
    with pytest.raises(ValueError, match="HUMMING_JAX_PREFILL_GATHER"):
        f()(*args)


def test_auto_prefers_grouped_for_prefill_sized_calls(monkeypatch):
    monkeypatch.delenv(ENV_GEMM_TYPE, raising=False)
    from humming_jax.selection import GROUPED_MIN_ROWS_PER_EXPERT as T

    assert hj.select_experts(BF16, None, rows_per_expert=T) is GroupedExperts
    assert hj.select_experts(BF16, None, rows_per_expert=T - 1) is IndexedExperts
    assert hj.select_experts(BF16, None, rows_per_expert=None) is IndexedExperts
    # an explicit preference still wins
    assert hj.select_experts(BF16, None, prefer="indexed", rows_per_expert=10 * T) is IndexedExperts
    assert hj.select_experts(BF16, None, batched=True, rows_per_expert=10 * T) is BatchedExperts


def test_auto_prefers_grouped_from_fewer_rows_for_the_4bit_mainloop_formats(monkeypatch):
    """Weights the 4-bit mainloop takes (MXFP4; symmetric int4 with bf16 scales per whole 64-k
    groups or per channel) with 16-bit activations switch to the grouped class from
    GROUPED_MIN_ROWS_PER_EXPERT_4BIT rows per expert; other 4-bit keys, and 8-bit activations, keep
    GROUPED_MIN_ROWS_PER_EXPERT."""
    monkeypatch.delenv(ENV_GEMM_TYPE, raising=False)
    from humming_jax import schemas
    from humming_jax.quantize import W_INT4_G128, W_MXFP4, W_UINT4_ZP_G128
    from humming_jax.selection import GROUPED_MIN_ROWS_PER_EXPERT as T
    from humming_jax.selection import GROUPED_MIN_ROWS_PER_EXPERT_4BIT as T4
    from humming_jax.selection import grouped_min_rows_per_expert

    assert T4 < T
    for key in (W_INT4_G128, W_MXFP4, schemas.GPTQ(4, 64).quant_key(), schemas.GPTQ(4, -1).quant_key()):
        assert grouped_min_rows_per_expert(key, None) == T4, key
    for key in (W_INT4_G128, W_MXFP4):  # the schemes the classes run
        assert hj.select_experts(key, None, rows_per_expert=T4) is GroupedExperts, key
        assert hj.select_experts(key, None, rows_per_expert=T4 - 1) is IndexedExperts, key
    fp8_act = QuantKey("float8_e4m3fn", ScaleDesc("float32", False, GroupShape(1, 128)))
    for key, act in ((W_UINT4_ZP_G128, None), (schemas.GPTQ(4, 32).quant_key(), None), (BF16, None),
                     (W_INT4_G128, fp8_act)):
        assert grouped_min_rows_per_expert(key, act) == T, (key, act)


def test_fused_moe_auto_runs_the_class_its_size_asks_for(rng, monkeypatch):
    """Auto at a prefill size compiles the grouped class, one row fewer per expert the indexed one;
    both equal the reference."""
    monkeypatch.delenv(ENV_GEMM_TYPE, raising=False)
    from conftest import reference
    from humming_jax.reference import relative_error
    from humming_jax.selection import GROUPED_MIN_ROWS_PER_EXPERT as T

    e, k = 2, 2
    for m, grouped in ((T * e // k, True), (T * e // k - 1, False)):
        layer = random_layer(rng, m=m, e=e, h=32, i=16, k=k)
        args = (layer.x, layer.weights, layer.topk_weights, layer.topk_ids)
        f = jax.jit(lambda x, w, tw, ids: hj.fused_moe(x, w, tw, ids))
        hlo = f.lower(*args).as_text()
        assert ("humming_jax.gemm_grouped" in hlo) == grouped, m
        indexed = any(f"humming_jax.{c}" in hlo for c in ("gemm_indexed", "experts_indexed", "layer_indexed"))
        assert indexed == (not grouped), m
        assert relative_error(f(*args), reference(layer)) < 1.2e-2
