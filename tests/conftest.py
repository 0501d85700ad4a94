"""Shared fixtures: fresh random layers on jax's default backend (the GPU where there is one)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
from humming_jax.activations import ACTIVATIONS

BACKEND = jax.default_backend()

# Relative error allowed against the oracle: a few roundings of the 16-bit dtype.
TOL = {jnp.dtype(jnp.bfloat16): 1.2e-2, jnp.dtype(jnp.float16): 2e-3}


def layer_tolerance(dtype: Any, quant: tuple | None) -> float:
    """Relative-error bound of a layer against the jnp oracle: TOL of the 16-bit type, plus one code
    step for 8-bit activations (``quant``: act_quant_params; the oracle's quantization is not
    bit-faithful, so rounding ties can resolve the other way, as in test_quantization)."""
    return TOL[jnp.dtype(dtype)] + ({"fp8": 2.0**-4, "int8": 2.0**-7}[quant[0]] if quant else 0.0)


ROOT = Path(__file__).resolve().parents[1]


def cuda_constant(file: str, name: str) -> int:
    """The integer constant ``name = N;`` of ``cuda_ffi/<file>`` (Python mirrors some of them)."""
    found = re.search(rf"\b{name} = (\d+);", (ROOT / "cuda_ffi" / file).read_text())
    assert found, f"{name} not found in cuda_ffi/{file}"
    return int(found.group(1))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """$HUMMING_JAX_TEST_SHARD=i/n keeps every n-th selected test from the i-th (0-based, after -k
    and the other selections), so that scripts/gpu_check.sh can run one suite as n processes side
    by side (their time is mostly compilation on the host's cores); unset or empty: all."""
    spec = os.environ.get("HUMMING_JAX_TEST_SHARD", "")
    if not spec:
        return
    found = re.fullmatch(r"(\d+)/(\d+)", spec)
    if not found or not int(found.group(1)) < int(found.group(2)):
        raise pytest.UsageError(f"HUMMING_JAX_TEST_SHARD must be i/n with 0 <= i < n, got {spec!r}")
    i, n = int(found.group(1)), int(found.group(2))
    keep = [item for k, item in enumerate(items) if k % n == i]
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % n != i])
    items[:] = keep


def pytest_report_header(config: Any) -> str:
    return f"humming_jax backends: {hj._ffi.backend_report()}; jax default backend: {BACKEND}"


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A fresh generator per test; its seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("HUMMING_JAX_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
    print(f"[{request.node.name}] seed={seed}")
    return np.random.default_rng(seed)


@dataclass
class Layer:
    x: jax.Array
    weights: hj.MoEWeights
    topk_weights: jax.Array
    topk_ids: jax.Array
    w13: jax.Array  # dequantized float32
    w2: jax.Array


def random_weights(
    rng: np.random.Generator, e: int, h: int, i: int, *, gated: bool = True, scheme: str = "bf16", bias: bool = False
) -> hj.MoEWeights:
    n1 = 2 * i if gated else i
    w13 = rng.standard_normal((e, n1, h)).astype(np.float32) / np.sqrt(h)
    w2 = rng.standard_normal((e, h, i)).astype(np.float32) / np.sqrt(i)
    b13 = rng.standard_normal((e, n1)).astype(np.float32) * 0.1 if bias else None
    b2 = rng.standard_normal((e, h)).astype(np.float32) * 0.1 if bias else None
    return hj.quantize_moe_weights(w13, w2, scheme, b13=b13, b2=b2)


def random_routing(
    rng: np.random.Generator, m: int, k: int, e_global: int, *, pad_frac: float = 0.0, distinct: bool = True
) -> tuple[jax.Array, jax.Array]:
    if distinct and k <= e_global:
        ids = np.stack([rng.choice(e_global, k, replace=False) for _ in range(m)]) if m else np.zeros((0, k))
    else:
        ids = rng.integers(0, e_global, (m, k))
    ids = ids.astype(np.int32)
    if pad_frac:
        ids = np.where(rng.random((m, k)) < pad_frac, -1, ids).astype(np.int32)
    w = rng.random((m, k)).astype(np.float32) + 0.1
    w = w / w.sum(axis=1, keepdims=True) if m else w
    return jnp.asarray(w), jnp.asarray(ids)


def random_layer(
    rng: np.random.Generator,
    *,
    m: int = 16,
    e: int = 8,
    h: int = 64,
    i: int = 32,
    k: int = 2,
    activation: str = "silu",
    scheme: str = "bf16",
    bias: bool = False,
    pad_frac: float = 0.0,
    e_global: int | None = None,
) -> Layer:
    weights = random_weights(rng, e, h, i, gated=ACTIVATIONS[activation].gated, scheme=scheme, bias=bias)
    x = jnp.asarray(rng.standard_normal((m, h)), weights.dtype)
    tw, ids = random_routing(rng, m, k, e_global or e, pad_frac=pad_frac)
    w13, w2 = weights.dequantize()
    return Layer(x, weights, tw, ids, w13, w2)


def nan_out(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    return jnp.full(shape, jnp.nan, dtype)


def run_standard(cls: type, layer: Layer, *, jit: bool = True, **kw: Any) -> jax.Array:
    """Runs a standard-format class on a NaN-poisoned out."""
    out = nan_out(layer.x.shape, layer.x.dtype)

    def f(out, x, w, tw, ids):
        return cls().apply(out, x, w, tw, ids, **kw)

    f = jax.jit(f) if jit else f
    return f(out, layer.x, layer.weights, layer.topk_weights, layer.topk_ids)


def reference(layer: Layer, **kw: Any) -> jax.Array:
    from humming_jax.reference import moe_reference

    return moe_reference(layer.x, layer.w13, layer.w2, layer.topk_weights, layer.topk_ids, **kw)


def _param_name(hlo: str, index: int) -> str:
    m = re.search(rf"%(\S+) = \S+ parameter\({index}\)", hlo)
    assert m, f"parameter({index}) not found"
    return m.group(1)


def assert_out_written_in_place(hlo: str, index: int) -> None:
    """In the compiled module's entry computation: no copy instruction reads parameter `index`, and
    the last humming_jax custom call writes into it: the root is that call, or (a call with several
    results: layer_indexed) its aliased tuple element."""
    lines = hlo.splitlines()
    lines = lines[next(i for i, l in enumerate(lines) if l.startswith("ENTRY")):]
    name = _param_name("\n".join(lines), index)
    copies = [l for l in lines if re.search(rf"\bcopy(-start)?\(.*%{re.escape(name)}\b", l)]
    assert not copies, f"the compiled HLO copies out: {copies}"
    calls = [l for l in lines if "custom-call(" in l and "humming_jax." in l]
    assert calls, "no humming_jax custom call"
    last = calls[-1]
    assert f"%{name})" in last or f"%{name}," in last, f"out is not an operand of the last call: {last}"
    assert "output_to_operand_aliasing" in last
    call_name = re.match(r"\s*(?:ROOT )?%(\S+) =", last).group(1)
    root = [l for l in lines if l.strip().startswith("ROOT")][-1]
    assert root.strip().startswith(f"ROOT %{call_name} =") or re.search(
        rf"get-tuple-element\(.*%{re.escape(call_name)}\), index=0", root), f"the root is not the call's result: {root}"
