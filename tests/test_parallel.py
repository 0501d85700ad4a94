"""Expert and tensor parallelism (humming_jax.parallel) against single-device ``fused_moe``.

The checks need several devices. On CPU they run in a subprocess with 8 host devices
(``--xla_force_host_platform_device_count=8`` must be set before JAX starts, and this test
process has started JAX already); the subprocess is this file run as a script. Where the test
process itself sees >= 2 CUDA devices and the CUDA backend is built, the same checks also run
in-process on the GPUs (skipped elsewhere).

What the checks hold the layouts to (on CPU; on GPU the claims of bit-identity between kernel
forms become "within the rounding of the 16-bit dtype", see ``bitwise``):
- all_to_all: bitwise equal to single-device ``fused_moe`` (same GEMM loops, same finalize).
- allgather: bitwise equal to the model "each device's partial sum rounded to the output dtype,
  summed in float32, cast" (up to one ulp where the float32 sum of the partials is not exact),
  bitwise equal to single-device on every token whose valid experts all live on one device, and
  within 2^-8 * (sum of |partials| + |single|) elementwise everywhere.
- tp: bitwise equal to the model "per-device fused_moe on the I slice, float32 psum, cast";
  relative error against single-device <= 1e-2 (bf16, 16-bit activations).
- compiled HLO: the expected collectives only, and no all-gather or global shape of weights.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import humming_jax as hj
from humming_jax import parallel as par
from humming_jax.reference import relative_error

CPU_DEVICES = 8
BF16 = jnp.bfloat16
CHECKS: dict[str, Callable[[int], None]] = {}


def check(fn: Callable[[int], None]) -> Callable[[int], None]:
    """Registers a check; it takes the number of devices n and raises on failure."""
    CHECKS[fn.__name__] = fn
    return fn


# --- layers and routing --------------------------------------------------------------------
def weights_for(rng: np.random.Generator, e: int, h: int, i: int, *, gated: bool = True, scheme: str = "bf16", bias: bool = False) -> hj.MoEWeights:
    n1 = 2 * i if gated else i
    w13 = rng.standard_normal((e, n1, h)).astype(np.float32) / np.sqrt(h)
    w2 = rng.standard_normal((e, h, i)).astype(np.float32) / np.sqrt(i)
    b13 = rng.standard_normal((e, n1)).astype(np.float32) * 0.1 if bias else None
    b2 = rng.standard_normal((e, h)).astype(np.float32) * 0.1 if bias else None
    return hj.quantize_moe_weights(w13, w2, scheme, b13=b13, b2=b2)


def edge_routing(rng: np.random.Generator, n: int, m: int, k: int, e: int) -> tuple[jax.Array, jax.Array]:
    """Random routing [m, k] over e experts on n devices, with the cases EP must get right:
    a device whose experts get no tokens (the last), an expert with no tokens on a device that
    has work (expert 1), tokens whose experts all live on another device, duplicate ids in a
    row, padding ids (-1), ids >= e, and a row with no valid id at all."""
    e_loc = e // n
    m_loc = m // n
    unused = set(range((n - 1) * e_loc, n * e_loc)) | {1}
    allowed = np.array([x for x in range(e) if x not in unused])
    ids = rng.choice(allowed, (m, k))
    ids[rng.random((m, k)) < 0.15] = -1
    ids[1] = -1  # no expert at all
    ids[2, 0], ids[2, 1 % k] = e, e + 5  # out of range: skipped
    ids[(n - 1) * m_loc] = 0  # last shard's first token: expert 0 (device 0) k times
    ids[(n - 1) * m_loc, -1] = -1
    if n > 2:  # shard 0's first token: every expert on device n - 2
        ids[0] = (n - 2) * e_loc + np.arange(k) % e_loc
    w = rng.random((m, k)).astype(np.float32) + 0.1
    w = w / w.sum(axis=1, keepdims=True)
    return jnp.asarray(w), jnp.asarray(ids.astype(np.int32))


def assert_edge_cases_present(ids: np.ndarray, n: int, e: int) -> None:
    e_loc = e // n
    m_loc = ids.shape[0] // n
    counts = np.bincount(ids[(ids >= 0) & (ids < e)], minlength=e)
    assert counts[(n - 1) * e_loc :].sum() == 0 and counts[1] == 0, "some expert/device should get no tokens"
    home = np.arange(ids.shape[0]) // m_loc
    valid = (ids >= 0) & (ids < e)
    owner = np.where(valid, ids // e_loc, -1)
    remote_only = [t for t in range(ids.shape[0]) if valid[t].any() and not (owner[t][valid[t]] == home[t]).any()]
    assert remote_only, "some token's experts should all live on other devices"
    assert (~valid).all(axis=1).any(), "some token should have no valid expert"


def single_device(fn: Callable[..., jax.Array], *args: Any, **kw: Any) -> np.ndarray:
    """fn on the first device only, as float32 numpy."""
    dev = jax.devices()[0]
    args = jax.device_put(args, dev)
    return np.asarray(jax.jit(lambda *a: fn(*a, **kw))(*args).astype(jnp.float32))


def ep_layer(n: int, seed: int, *, scheme: str = "bf16", m_per: int = 8, h: int = 64, i: int = 24, k: int = 4, bias: bool = False):
    rng = np.random.default_rng(seed)
    e = 2 * n
    w = weights_for(rng, e, h, i, scheme=scheme, bias=bias)
    x = jnp.asarray(rng.standard_normal((m_per * n, h)), w.dtype)
    tw, ids = edge_routing(rng, n, m_per * n, k, e)
    return x, w, tw, ids


def mesh_of(n: int, axis: str = "ep", explicit: bool = False) -> jax.sharding.Mesh:
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh((n,), (axis,), axis_types=(kind,), devices=jax.devices()[:n])


def run_ep(x, w, tw, ids, mesh, mode: str, **kw: Any) -> np.ndarray:
    ws = par.shard_moe_weights(w, mesh)
    f = jax.jit(lambda x, w, tw, ids: par.ep_moe(x, w, tw, ids, mesh=mesh, mode=mode, **kw))
    return np.asarray(f(x, ws, tw, ids).astype(jnp.float32))


def bitwise(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit-identical on the CPU backend, where every GEMM form runs one loop. Elsewhere the
    kernels of the different forms and tile sizes may accumulate in other orders: there the
    values must agree to the rounding of the 16-bit dtype (relative error <= 1e-2)."""
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    if jax.default_backend() != "cpu":
        err = relative_error(got, want)
        assert err <= 1e-2, f"{what}: relative error {err:.2e}"
        return
    bad = np.argwhere(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{what}: {len(bad)} elements differ, first at {bad[0].tolist()}: {got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"


def allgather_model(x, w, tw, ids, n: int, **kw: Any) -> tuple[np.ndarray, list[np.ndarray]]:
    """The allgather layout's arithmetic on one device: per-device partials, float32 sum, cast."""
    e = w.num_experts
    parts = []
    for r in range(n):
        g = np.arange(e)
        emap = jnp.asarray(np.where(g // (e // n) == r, g, -1).astype(np.int32))
        parts.append(single_device(hj.fused_moe, x, w, tw, ids, expert_map=emap, **kw))
    total = np.sum(np.stack(parts), axis=0, dtype=np.float32)
    return np.asarray(jnp.asarray(total).astype(x.dtype).astype(jnp.float32)), parts


def check_allgather(got: np.ndarray, x, w, tw, ids, n: int, **kw: Any) -> np.ndarray:
    want = single_device(hj.fused_moe, x, w, tw, ids, **kw)
    model, parts = allgather_model(x, w, tw, ids, n, **kw)
    ulp = np.float32(2.0**-8)
    if jax.default_backend() == "cpu":
        assert np.all(np.abs(got - model) <= ulp * np.abs(model)), "allgather differs from its partial-sum model by > 1 ulp"
    # Tokens whose valid experts live on one device: one nonzero partial, so bitwise equal.
    e, idn = w.num_experts, np.asarray(ids)
    valid = (idn >= 0) & (idn < e)
    owners = [set((idn[t][valid[t]] // (e // n)).tolist()) for t in range(idn.shape[0])]
    one = np.array([len(o) <= 1 for o in owners], dtype=bool)
    bitwise(got[one], want[one], "allgather on single-owner tokens vs single device")
    if jax.default_backend() != "cpu":
        # The partials and the single-device layer run different kernel configurations (expert
        # counts and rows per expert differ), whose 16-bit intermediates may round apart; the
        # elementwise bound below holds only where every form runs one loop (the CPU).
        for name, ref in (("single device", want), ("partial-sum model", model)):
            err = relative_error(got, ref)
            assert err <= 1e-2, f"allgather vs {name}: relative error {err:.2e}"
        return one
    bound = ulp * (np.sum(np.abs(np.stack(parts)), axis=0) + np.abs(want)) + 1e-30
    assert np.all(np.abs(got - want) <= bound), f"allgather outside the rounding bound; max excess {np.max(np.abs(got - want) - bound)}"
    return one


# --- expert parallelism --------------------------------------------------------------------
@check
def ep_all_to_all_bitwise(n: int) -> None:
    x, w, tw, ids = ep_layer(n, 1)
    assert_edge_cases_present(np.asarray(ids), n, w.num_experts)
    want = single_device(hj.fused_moe, x, w, tw, ids)
    bitwise(run_ep(x, w, tw, ids, mesh_of(n), "all_to_all"), want, "all_to_all vs single device")


@check
def ep_all_to_all_worst_case_load(n: int) -> None:
    """Every routed row of the layer goes to one device, most of them to one expert: the padded
    capacities (per destination and per expert) must hold them all."""
    x, w, tw, _ = ep_layer(n, 20)
    m, k = tw.shape
    rng = np.random.default_rng(20)
    ids = np.full((m, k), 2, np.int32)  # expert 2 lives on device 1
    ids[rng.random((m, k)) < 0.2] = 3
    ids = jnp.asarray(ids)
    want = single_device(hj.fused_moe, x, w, tw, ids)
    bitwise(run_ep(x, w, tw, ids, mesh_of(n), "all_to_all"), want, "all_to_all with every row on one device")


@check
def ep_allgather_within_rounding(n: int) -> None:
    x, w, tw, ids = ep_layer(n, 2)
    assert_edge_cases_present(np.asarray(ids), n, w.num_experts)
    one = check_allgather(run_ep(x, w, tw, ids, mesh_of(n), "allgather"), x, w, tw, ids, n)
    # The edge routing leaves the last device idle, so on two devices every token has one owner:
    # uniform routing over all experts adds tokens whose partials come from several devices.
    rng = np.random.default_rng(12)
    ids_all = jnp.asarray(rng.integers(0, w.num_experts, ids.shape, dtype=np.int32))
    several = ~check_allgather(run_ep(x, w, tw, ids_all, mesh_of(n), "allgather"), x, w, tw, ids_all, n)
    assert one.any() and several.any(), "want tokens with one owner device and tokens with several"


@check
def ep_on_two_devices(n: int) -> None:
    """A two-device sub-mesh (partials summed in the output dtype) in both modes."""
    x, w, tw, ids = ep_layer(2, 21)
    mesh = mesh_of(2)
    bitwise(run_ep(x, w, tw, ids, mesh, "all_to_all"), single_device(hj.fused_moe, x, w, tw, ids), "2 devices all_to_all")
    check_allgather(run_ep(x, w, tw, ids, mesh, "allgather"), x, w, tw, ids, 2)


@check
def ep_quantized_schemes(n: int) -> None:
    """int4 group-128 weights, and fp8 block weights with fp8 per-group activations."""
    for seed, scheme in ((3, "w4a16-int4-g128"), (4, "w8a8-fp8-block128")):
        x, w, tw, ids = ep_layer(n, seed, scheme=scheme, h=128, i=128, m_per=4)
        want = single_device(hj.fused_moe, x, w, tw, ids)
        mesh = mesh_of(n)
        bitwise(run_ep(x, w, tw, ids, mesh, "all_to_all"), want, f"{scheme} all_to_all")
        check_allgather(run_ep(x, w, tw, ids, mesh, "allgather"), x, w, tw, ids, n)


@check
def ep_biases_activations_and_gemm_types(n: int) -> None:
    x, w, tw, ids = ep_layer(n, 5, bias=True)
    mesh = mesh_of(n)
    for act in ("swigluoai", "gelu"):
        want = single_device(hj.fused_moe, x, w, tw, ids, activation=act)
        bitwise(run_ep(x, w, tw, ids, mesh, "all_to_all", activation=act), want, f"{act} all_to_all")
    for gemm_type in ("indexed", "grouped"):
        got = run_ep(x, w, tw, ids, mesh, "allgather", gemm_type=gemm_type)
        check_allgather(got, x, w, tw, ids, n, gemm_type=gemm_type)


@check
def ep_uneven_and_empty_token_counts(n: int) -> None:
    """M not a multiple of n is padded internally; M = 0 and M = 1 work."""
    x, w, tw, ids = ep_layer(n, 6)
    mesh = mesh_of(n)
    for m in (0, 1, x.shape[0] - 3):
        args = (x[:m], w, tw[:m], ids[:m])
        want = single_device(hj.fused_moe, *args)
        for mode in par.MODES:
            got = run_ep(*args, mesh, mode)
            assert got.shape == (m, x.shape[1]), got.shape
            if m:
                if mode == "all_to_all":
                    bitwise(got, want, f"M={m} {mode}")
                else:
                    check_allgather(got, *args, n)


@check
def ep_expert_capacity(n: int) -> None:
    """A capacity equal to the busiest local expert's load changes nothing."""
    x, w, tw, ids = ep_layer(n, 7)
    idn = np.asarray(ids)
    busiest = int(np.bincount(idn[(idn >= 0) & (idn < w.num_experts)]).max())
    want = single_device(hj.fused_moe, x, w, tw, ids)
    got = run_ep(x, w, tw, ids, mesh_of(n), "all_to_all", expert_capacity=busiest)
    bitwise(got, want, "all_to_all with a tight capacity")


@check
def ep_all_to_all_grouped_layout(n: int) -> None:
    """The ragged (grouped) layout of the received rows: the same results as single-device
    fused_moe for random routing, every routed row on one device, a quantized scheme and another
    activation."""
    x, w, tw, ids = ep_layer(n, 1)
    mesh = mesh_of(n)
    want = single_device(hj.fused_moe, x, w, tw, ids)
    bitwise(run_ep(x, w, tw, ids, mesh, "all_to_all", expert_layout="grouped"), want, "grouped layout")
    crowd = np.full(ids.shape, 2, np.int32)  # expert 2 lives on device 1
    crowd[np.random.default_rng(22).random(ids.shape) < 0.2] = 3
    crowd = jnp.asarray(crowd)
    bitwise(run_ep(x, w, tw, crowd, mesh, "all_to_all", expert_layout="grouped"),
            single_device(hj.fused_moe, x, w, tw, crowd), "grouped layout, every row on one device")
    xq, wq, twq, idq = ep_layer(n, 4, scheme="w8a8-fp8-block128", h=128, i=128, m_per=4)
    bitwise(run_ep(xq, wq, twq, idq, mesh, "all_to_all", expert_layout="grouped"),
            single_device(hj.fused_moe, xq, wq, twq, idq), "grouped layout, fp8 block")
    bitwise(run_ep(x, w, tw, ids, mesh, "all_to_all", expert_layout="grouped", activation="gelu"),
            single_device(hj.fused_moe, x, w, tw, ids, activation="gelu"), "grouped layout, gelu")


@check
def ep_mesh_kinds_eager_and_jit(n: int) -> None:
    """Auto and Explicit meshes, inside and outside jax.set_mesh, eager and jitted, with
    weights sharded or not: same bits."""
    x, w, tw, ids = ep_layer(n, 8)
    want = single_device(hj.fused_moe, x, w, tw, ids)
    for explicit in (False, True):
        mesh = mesh_of(n, explicit=explicit)
        got = np.asarray(par.ep_moe(x, w, tw, ids, mesh=mesh, mode="all_to_all").astype(jnp.float32))
        bitwise(got, want, f"eager, unsharded weights, explicit={explicit}")
        if explicit:
            with jax.set_mesh(mesh):
                ws = par.shard_moe_weights(w, mesh)
                f = jax.jit(lambda x, w, tw, ids: par.ep_moe(x, w, tw, ids, mesh=mesh, mode="all_to_all"))
                bitwise(np.asarray(f(x, ws, tw, ids).astype(jnp.float32)), want, "jit inside set_mesh")


@check
def ep_weights_are_sharded(n: int) -> None:
    _, w, _, _ = ep_layer(n, 9)
    ws = par.shard_moe_weights(w, mesh_of(n))
    for leaf in jax.tree.leaves(ws):
        shards = leaf.addressable_shards
        assert len(shards) == n and all(s.data.shape[0] == w.num_experts // n for s in shards), leaf.sharding
    np.testing.assert_array_equal(np.asarray(ws.w13.data.astype(jnp.float32)), np.asarray(w.w13.data.astype(jnp.float32)))


# --- tensor parallelism --------------------------------------------------------------------
def tp_model(x, w: hj.MoEWeights, tw, ids, n: int, activation: str) -> np.ndarray:
    """tp_moe's arithmetic on one device, built independently from the dequantized weights:
    per slice of I a 16-bit layer (b2 on slice 0 only), float32 sum of the outputs, cast."""
    w13, w2 = (np.asarray(a) for a in w.dequantize())
    e, n1, _ = w13.shape
    i = w2.shape[2]
    s = i // n
    b13 = None if w.b13 is None else np.asarray(w.b13)
    parts = []
    for r in range(n):
        if activation == "swigluoai":
            rows = np.arange(2 * r * s, 2 * (r + 1) * s)
        elif n1 == 2 * i:
            rows = np.concatenate([np.arange(r * s, (r + 1) * s), i + np.arange(r * s, (r + 1) * s)])
        else:
            rows = np.arange(r * s, (r + 1) * s)
        b2 = None if w.b2 is None else np.asarray(w.b2) * (r == 0)
        scheme = "bf16" if jnp.dtype(w.dtype) == jnp.dtype(BF16) else "fp16"
        wr = hj.quantize_moe_weights(
            w13[:, rows], w2[:, :, r * s : (r + 1) * s], scheme, b13=None if b13 is None else b13[:, rows], b2=b2
        )
        parts.append(single_device(hj.fused_moe, x, wr, tw, ids, activation=activation))
    total = np.sum(np.stack(parts), axis=0, dtype=np.float32)
    return np.asarray(jnp.asarray(total).astype(x.dtype).astype(jnp.float32))


def run_tp(x, w, tw, ids, mesh, activation: str) -> np.ndarray:
    wt = par.shard_moe_weights_tp(w, mesh, "tp", activation=activation)
    f = jax.jit(lambda x, w, tw, ids: par.tp_moe(x, w, tw, ids, mesh=mesh, axis="tp", activation=activation))
    return np.asarray(f(x, wt, tw, ids).astype(jnp.float32))


def check_tp(n: int, seed: int, scheme: str, activation: str, *, h: int, i: int, bias: bool, tol: float = 1e-2, model: bool = True) -> None:
    rng = np.random.default_rng(seed)
    gated = hj.activations.ACTIVATIONS[activation].gated
    w = weights_for(rng, 4, h, i, gated=gated, scheme=scheme, bias=bias)
    x = jnp.asarray(rng.standard_normal((24, h)), w.dtype)
    tw, ids = edge_routing(rng, 2, 24, 3, 4)
    got = run_tp(x, w, tw, ids, mesh_of(n, "tp"), activation)
    want = single_device(hj.fused_moe, x, w, tw, ids, activation=activation)
    err = relative_error(got, want)
    assert err <= tol, f"tp {scheme} {activation}: relative error {err:.2e} > {tol}"
    assert np.all(got[1] == 0), "a token with no valid expert must be exactly 0"
    if model:
        bitwise(got, tp_model(x, w, tw, ids, n, activation), f"tp {scheme} {activation} vs its model")


@check
def tp_bf16_every_layout(n: int) -> None:
    for seed, act in ((10, "silu"), (11, "swigluoai"), (12, "relu2_no_mul")):
        check_tp(n, seed, "bf16", act, h=64, i=8 * n, bias=True)


@check
def tp_quantized_weights(n: int) -> None:
    """Scale grids split with their data (int4 g128 along I, int8 per channel along N1) or
    replicated (int8 per-channel w2 scale, fp8 per-tensor); two devices so I/n holds a group."""
    for seed, scheme in ((13, "w4a16-int4-g128"), (14, "w8a16-int8-channel"), (15, "w8a16-fp8-block128")):
        check_tp(2, seed, scheme, "silu", h=128, i=256, bias=False)
    # Per-token fp8 activations: the GEMM2 input is quantized per device slice of I.
    check_tp(2, 16, "w8a8-fp8-tensor", "silu", h=128, i=256, bias=False, tol=3e-2, model=False)


# --- compiled HLO --------------------------------------------------------------------------
_COLLECTIVE = re.compile(r"=\s*(.*?)\s(all-gather|reduce-scatter|all-to-all|all-reduce|collective-permute)(?:-start)?\(")
_SHAPE = re.compile(r"[a-z0-9]+\[([\d,]*)\]")


def collectives(hlo: str) -> dict[str, list[tuple[int, ...]]]:
    """Collective kind -> the shapes of its results in compiled HLO text."""
    found: dict[str, list[tuple[int, ...]]] = {}
    for result, kind in _COLLECTIVE.findall(hlo):
        shapes = [tuple(int(d) for d in s.split(",") if d) for s in _SHAPE.findall(result)]
        found.setdefault(kind, []).extend(shapes)
    return found


def weight_shapes(w: hj.MoEWeights) -> set[tuple[int, ...]]:
    return {tuple(a.shape) for a in jax.tree.leaves(w)}


def assert_no_global_weights(hlo: str, w: hj.MoEWeights, kinds: dict[str, list[tuple[int, ...]]]) -> None:
    for shape in weight_shapes(w):
        for kind, shapes in kinds.items():
            assert shape not in shapes, f"{kind} produces a global weight shape {shape}"
        text = "[" + ",".join(map(str, shape)) + "]"
        assert text not in hlo, f"global weight shape {text} appears in the compiled HLO"


@check
def hlo_ep_collectives(n: int) -> None:
    x, w, tw, ids = ep_layer(n, 17, h=64, i=40)  # shapes unlike any token array
    mesh = mesh_of(n)
    ws = par.shard_moe_weights(w, mesh)
    m, k = ids.shape
    for mode, layout in [(mode, "batched") for mode in par.MODES] + [("all_to_all", "grouped")]:
        f = jax.jit(lambda x, w, tw, ids: par.ep_moe(x, w, tw, ids, mesh=mesh, mode=mode, expert_layout=layout))
        hlo = f.lower(x, ws, tw, ids).compile().as_text()
        kinds = collectives(hlo)
        assert hlo.count("custom_call_target=\"humming_jax.") >= 4, "the expert custom calls are missing"
        assert_no_global_weights(hlo, w, kinds)
        if mode == "allgather":
            assert set(kinds) == {"all-gather", "reduce-scatter"}, kinds
            # Token rows and routing only, gathered from per-device pieces of m / n rows (the GPU's
            # async all-gather lists its operand shapes with its result).
            rows = {m, m // n}
            assert set(kinds["all-gather"]) <= {(r, c) for r in rows for c in (x.shape[1], k)}, kinds["all-gather"]
        else:
            assert set(kinds) == {"all-to-all"}, kinds
    # Unsharded weights: sliced per device, never gathered.
    f = jax.jit(lambda x, w, tw, ids: par.ep_moe(x, w, tw, ids, mesh=mesh, mode="allgather"))
    kinds = collectives(f.lower(x, w, tw, ids).compile().as_text())
    assert not weight_shapes(w) & set(kinds.get("all-gather", [])), kinds


@check
def hlo_tp_collectives(n: int) -> None:
    rng = np.random.default_rng(18)
    w = weights_for(rng, 4, 64, 8 * n)
    x = jnp.asarray(rng.standard_normal((24, 64)), w.dtype)
    tw, ids = edge_routing(rng, 2, 24, 3, 4)
    mesh = mesh_of(n, "tp")
    wt = par.shard_moe_weights_tp(w, mesh, "tp")
    f = jax.jit(lambda x, w, tw, ids: par.tp_moe(x, w, tw, ids, mesh=mesh, axis="tp"))
    hlo = f.lower(x, wt, tw, ids).compile().as_text()
    kinds = collectives(hlo)
    assert set(kinds) == {"all-reduce"} and len(kinds["all-reduce"]) == 1, kinds
    assert_no_global_weights(hlo, w, kinds)


# --- errors --------------------------------------------------------------------------------
@check
def errors_are_clear(n: int) -> None:
    rng = np.random.default_rng(19)
    mesh = mesh_of(n)
    w = weights_for(rng, 2 * n + 1, 64, 8 * n)
    x = jnp.zeros((n, 64), BF16)
    tw, ids = jnp.ones((n, 2), jnp.float32), jnp.zeros((n, 2), jnp.int32)

    def raises(exc: type, match: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except exc as err:
            assert re.search(match, str(err)), f"message {str(err)!r} lacks {match!r}"
            return
        raise AssertionError(f"no {exc.__name__} ({match})")

    raises(ValueError, "multiple of the axis size", lambda: par.shard_moe_weights(w, mesh))
    raises(ValueError, "do not split evenly", lambda: par.ep_moe(x, w, tw, ids, mesh=mesh))
    raises(ValueError, "no axis 'tp'", lambda: par.shard_moe_weights(w, mesh, "tp"))
    w_even = weights_for(rng, 2 * n, 64, 8 * n)
    raises(ValueError, "mode must be", lambda: par.ep_moe(x, w_even, tw, ids, mesh=mesh, mode="ring"))
    raises(ValueError, "expert_layout must be", lambda: par.ep_moe(x, w_even, tw, ids, mesh=mesh, mode="all_to_all",
                                                                   expert_layout="ragged"))
    raises(ValueError, "all_to_all' only", lambda: par.ep_moe(x, w_even, tw, ids, mesh=mesh, expert_layout="grouped"))
    raises(ValueError, "batched expert layout only", lambda: par.ep_moe(
        x, w_even, tw, ids, mesh=mesh, mode="all_to_all", expert_layout="grouped", expert_capacity=4))
    raises(TypeError, "shard_moe_weights_tp", lambda: par.tp_moe(x, w_even, tw, ids, mesh=mesh, axis="ep"))
    wt = par.shard_moe_weights_tp(w_even, mesh, "ep")
    raises(ValueError, "layout", lambda: par.tp_moe(x, wt, tw, ids, mesh=mesh, axis="ep", activation="swigluoai"))
    raises(ValueError, "does not split", lambda: par.shard_moe_weights_tp(weights_for(rng, 2, 64, n + 1), mesh, "ep"))
    fp8_block = weights_for(rng, 2, 128, 128, scheme="w8a16-fp8-block128")  # I / n < one 128-group
    raises(ValueError, "group size 128", lambda: par.shard_moe_weights_tp(fp8_block, mesh, "ep"))


# --- the worker and the tests --------------------------------------------------------------
def run_checks(n: int, names: list[str]) -> dict[str, str | None]:
    results: dict[str, str | None] = {}
    for name in names:
        print(f"check {name}", file=sys.stderr, flush=True)  # names the check a crash happens in
        try:
            CHECKS[name](n)
            results[name] = None
        except Exception:  # reported to the parent test, which fails with it
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def cpu_results() -> dict[str, str | None]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={CPU_DEVICES}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        # faulthandler: a crash in the worker prints the Python stack into stderr, reported below.
        [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(Path(__file__).resolve().parent),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"worker failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS ") :])


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_on_8_cpu_devices(cpu_results: dict[str, str | None], name: str) -> None:
    failure = cpu_results.get(name, "not run")
    assert failure is None, failure


def _gpu_count() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_on_gpus(name: str) -> None:
    count = _gpu_count()
    if count < 2 or not hj.cuda_available() or jax.default_backend() != "gpu":
        pytest.skip(f"needs >= 2 CUDA devices with the CUDA backend (have {count})")
    failure = run_checks(min(count, CPU_DEVICES), [name])[name]
    assert failure is None, failure


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    assert jax.device_count() >= CPU_DEVICES, f"worker sees {jax.device_count()} devices; set XLA_FLAGS"
    print("RESULTS " + json.dumps(run_checks(CPU_DEVICES, sorted(CHECKS))), flush=True)
