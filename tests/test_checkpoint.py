"""Checkpoint import (humming_jax.checkpoint) on synthetic safetensors checkpoints.

The tests write checkpoints themselves, in each naming convention (per-expert HF and Mixtral
naming, gpt-oss fused tensors) and layout, with the independent packers of test_conversion (which
draw codes and scales and compute the weight values in float64 from the published format). A
loaded layer's ``dequantize()`` must equal those values exactly; ``convert`` then ``load`` must give
the same arrays back; broken checkpoints must raise errors that name the tensor and the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import TOL, nan_out, random_routing
from test_conversion import (
    E,
    assert_values,
    kernel_values,
    make_awq,
    make_ct_int,
    make_float,
    make_fp8,
    make_gptq,
    make_int8,
    make_mxfp4,
    make_nvfp4,
)

import humming_jax as hj
from humming_jax import checkpoint as ck
from humming_jax import schemas as sc
from humming_jax.cli import main as cli_main
from humming_jax.reference import relative_error

safetensors_numpy = pytest.importorskip("safetensors.numpy")

H, I = 128, 128  # E = 2 experts (test_conversion's packers)
BF16 = ml_dtypes.bfloat16
UNSTACKED = ("weight_shape", "g_idx", "weight_g_idx")  # per-projection tensors without an E axis
PREFIX = "model.layers.0.mlp"


# --- writing checkpoints ----------------------------------------------------------------------
def save(root: Path, tensors: dict[str, np.ndarray], *, shards: int = 1, config: dict[str, Any] | None = None) -> Path:
    """Writes tensors as ``shards`` safetensors files (with an index when > 1) and config.json."""
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    files = [f"model-{s + 1:05d}-of-{shards:05d}.safetensors" for s in range(shards)] if shards > 1 else ["model.safetensors"]
    weight_map = {n: files[j % len(files)] for j, n in enumerate(names)}
    for f in files:
        part = {n: np.ascontiguousarray(tensors[n]) for n in names if weight_map[n] == f}
        safetensors_numpy.save_file(part, str(root / f))
    if shards > 1:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(config or {"torch_dtype": "bfloat16"}))
    return root


def per_expert_tensors(prefix: str, projs: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """{proj name: maker tensors with a leading E axis} -> {prefix}.experts.{e}.{proj}.{name}."""
    out = {}
    for proj, tensors in projs.items():
        for e in range(E):
            for name, arr in tensors.items():
                out[f"{prefix}.experts.{e}.{proj}.{name}"] = arr if name in UNSTACKED else arr[e]
    return out


def router(rng: np.random.Generator, prefix: str, name: str = "gate") -> dict[str, np.ndarray]:
    return {f"{prefix}.{name}.weight": rng.standard_normal((E, H)).astype(np.float32)}


def ct_config(weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
    }


GPTQ_CFG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}

# id -> (maker, maker kwargs, quantization_config, expected scheme, value dtype)
CASES: dict[str, tuple[Any, dict[str, Any], dict[str, Any] | None, str, Any]] = {
    "gptq-sym": (make_gptq, dict(g_idx=True), GPTQ_CFG, "w4a16-int4-g128", BF16),
    "gptq-zp": (make_gptq, dict(sym=False), {**GPTQ_CFG, "sym": False}, "w4a16-uint4-zp-g128", BF16),
    "awq": (make_awq, {}, {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
            "w4a16-uint4-zp-g128", BF16),
    "ct-int4-zp": (make_ct_int, dict(sym=False, packed_zp=True),
                   ct_config({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False},
                             None, "pack-quantized"), "w4a16-uint4-zp-g128", BF16),
    "ct-int8": (make_int8, {}, ct_config({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                                        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
                                        "int-quantized"), "w8a8-int8-channel", None),
    "fp8-block": (make_fp8, dict(kind="block"), {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                 "activation_scheme": "dynamic"}, "w8a8-fp8-block128", None),
    "ct-fp8-channel": (make_fp8, dict(kind="channel", scale_name="weight_scale"),
                       ct_config({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                                 {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                                 "float-quantized"), "w8a8-fp8-channel", None),
    # Per-tensor FP8 with gate and up scales that differ: one exact scale per row (per-channel).
    "fp8-tensor": (make_fp8, dict(kind="tensor", scale_name="weight_scale"),
                   {"quant_method": "fp8", "activation_scheme": "static"}, "w8a8-fp8-channel", None),
    "bf16": (make_float, {}, None, "bf16", BF16),
}


def write_case(tmp: Path, rng: np.random.Generator, case: str, *, shards: int = 1,
               names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), prefix: str = PREFIX):
    maker, kw, qc, scheme, vdtype = CASES[case]
    (tg, vg), (tu, vu), (td, vd) = maker(rng, I, H, **kw), maker(rng, I, H, **kw), maker(rng, H, I, **kw)
    tensors = per_expert_tensors(prefix, dict(zip(names, (tg, tu, td))))
    tensors.update(router(rng, prefix))
    config = {"torch_dtype": "bfloat16", **({"quantization_config": qc} if qc else {})}
    root = save(tmp / case, tensors, shards=shards, config=config)
    return root, np.concatenate([vg, vu], axis=1), vd, scheme, vdtype


# --- per-expert naming ------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_per_expert_layouts_load_to_packed_values(tmp_path, rng, case):
    root, v13, v2, scheme, vdtype = write_case(tmp_path, rng, case, shards=2 if case == "gptq-sym" else 1)
    w = hj.load_moe_layer(root, PREFIX)  # schema from config.json
    assert w.scheme == scheme and w.num_experts == E
    assert_values(w, v13, v2, vdtype)


def test_nvfp4_per_expert(tmp_path, rng):
    # ModelOpt NVFP4 stores weight_scale_2 per projection; gate and up share it in practice.
    t13, v13 = make_nvfp4(rng, 2 * I, H)
    td, v2 = make_nvfp4(rng, H, I)
    tg = {k: (v[:, :I] if v.ndim > 1 else v) for k, v in t13.items()}
    tu = {k: (v[:, I:] if v.ndim > 1 else v) for k, v in t13.items()}
    tensors = per_expert_tensors(PREFIX, {"gate_proj": tg, "up_proj": tu, "down_proj": td})
    root = save(tmp_path / "nvfp4", tensors, config={"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})
    w = hj.load_moe_layer(root, PREFIX)
    assert w.scheme == "w4a16-nvfp4"
    assert_values(w, v13, v2)


def test_mixtral_naming_and_explicit_schema(tmp_path, rng):
    root, v13, v2, _, _ = write_case(tmp_path, rng, "gptq-sym", names=("w1", "w3", "w2"), prefix="model.layers.0.block_sparse_moe")
    (root / "config.json").write_text("{}")  # no quantization_config: the schema is given
    w = hj.load_moe_layer(root, "model.layers.0.block_sparse_moe.experts", sc.GPTQ(4, 128), dtype=jnp.float16)
    assert w.scheme == "w4a16-int4-g128" and w.dtype == jnp.float16
    assert_values(w, v13, v2, np.float16)


def test_halves_to_interleaved_for_swigluoai(tmp_path, rng):
    root, v13, v2, _, _ = write_case(tmp_path, rng, "bf16")
    w = hj.load_moe_layer(root, PREFIX, activation="swigluoai")
    inter = np.stack([np.arange(I), np.arange(I) + I], axis=1).reshape(-1)  # gate 0, up 0, gate 1, ...
    assert_values(w, v13[:, inter], v2)


def test_directory_without_index(tmp_path, rng):
    root, v13, v2, scheme, vdtype = write_case(tmp_path, rng, "awq", shards=2)
    (root / "model.safetensors.index.json").unlink()
    assert_values(hj.load_moe_layer(root, PREFIX), v13, v2, vdtype)


def test_single_file_path(tmp_path, rng):
    root, v13, v2, _, vdtype = write_case(tmp_path, rng, "fp8-block")
    w = hj.load_moe_layer(root / "model.safetensors", PREFIX)  # config.json beside the file
    assert w.scheme == "w8a8-fp8-block128"
    assert_values(w, v13, v2, vdtype)


# --- gpt-oss fused naming ---------------------------------------------------------------------
def write_gpt_oss(tmp: Path, rng: np.random.Generator, *, quantized: bool = True) -> tuple[Path, dict[str, np.ndarray]]:
    base = f"{PREFIX}.experts."
    b13 = (rng.standard_normal((E, 2 * I)) * 0.1).astype(BF16)
    b2 = (rng.standard_normal((E, H)) * 0.1).astype(BF16)
    if quantized:
        (t13, v13), (t2, v2) = make_mxfp4(rng, 2 * I, H, "gate_up_proj_"), make_mxfp4(rng, H, I, "down_proj_")
        tensors = {base + k: v for k, v in {**t13, **t2}.items()}
        config = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}}
    else:  # transformers' dequantized layout: input dimension first
        v13 = rng.standard_normal((E, 2 * I, H)).astype(BF16).astype(np.float64)
        v2 = rng.standard_normal((E, H, I)).astype(BF16).astype(np.float64)
        tensors = {base + "gate_up_proj": v13.transpose(0, 2, 1).astype(BF16), base + "down_proj": v2.transpose(0, 2, 1).astype(BF16)}
        config = {"model_type": "gpt_oss"}
    tensors[base + "gate_up_proj_bias"] = b13
    tensors[base + "down_proj_bias"] = b2
    tensors[f"{PREFIX}.router.weight"] = rng.standard_normal((E, H)).astype(BF16)
    tensors[f"{PREFIX}.router.bias"] = rng.standard_normal((E,)).astype(BF16)
    root = save(tmp / ("gpt_oss" if quantized else "gpt_oss_bf16"), tensors, config=config)
    return root, {"v13": v13, "v2": v2, "b13": b13.astype(np.float32), "b2": b2.astype(np.float32)}


def swigluoai_reference(x: np.ndarray, v: dict[str, np.ndarray], tw: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """gpt-oss's expert MLP written from its published definition (float64, no rounding):
    gate = even rows, up = odd rows of gate_up; gate <= 7; -7 <= up <= 7;
    (up + 1) * gate * sigmoid(1.702 gate)."""
    out = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            gu = v["v13"][e] @ x[t] + v["b13"][e]
            gate, up = np.minimum(gu[0::2], 7.0), np.clip(gu[1::2], -7.0, 7.0)
            a = (up + 1) * gate * 0.5 * (1 + np.tanh(0.851 * gate))  # sigmoid(1.702 g), overflow-free
            out[t] += tw[t, j] * (v["v2"][e] @ a + v["b2"][e])
    return out


@pytest.mark.parametrize("quantized", [True, False])
def test_gpt_oss_fused_loads_as_swigluoai(tmp_path, rng, quantized, monkeypatch):
    root, v = write_gpt_oss(tmp_path, rng, quantized=quantized)
    reads: list[tuple[str, int | None]] = []
    real_read = ck._File.read
    monkeypatch.setattr(ck._File, "read", lambda self, name, index=None: reads.append((name, index)) or real_read(self, name, index))
    w = hj.load_moe_layer(root, PREFIX)
    # Lazy: every stacked expert tensor is read one expert at a time, never whole.
    assert reads and all(index is not None for _, index in reads)
    assert w.scheme == ("w4a16-mxfp4" if quantized else "bf16")
    assert_values(w, v["v13"], v["v2"])  # rows stay interleaved: the swigluoai layout
    np.testing.assert_array_equal(np.asarray(w.b13), v["b13"])
    np.testing.assert_array_equal(np.asarray(w.b2), v["b2"])
    # The activation is the right one: the layer matches gpt-oss's MLP computed independently.
    m, k = 8, 2
    x = jnp.asarray(rng.standard_normal((m, H)), jnp.bfloat16)
    tw, ids = random_routing(rng, m, k, E)
    got = jax.jit(lambda x, w, tw, ids: hj.fused_moe(x, w, tw, ids, activation="swigluoai"))(x, w, tw, ids)
    want = swigluoai_reference(np.asarray(x, np.float64), v, np.asarray(tw, np.float64), np.asarray(ids))
    assert relative_error(got, want) < 2 * TOL[jnp.dtype(jnp.bfloat16)]
    weight, bias = ck.load_router_weight(root, PREFIX)
    assert weight.shape == (E, H) and bias.shape == (E,)


def test_gpt_oss_deinterleaves_for_silu(tmp_path, rng):
    root, v = write_gpt_oss(tmp_path, rng)
    w = hj.load_moe_layer(root, PREFIX, activation="silu")
    halves = np.concatenate([np.arange(0, 2 * I, 2), np.arange(1, 2 * I, 2)])
    assert_values(w, v["v13"][:, halves], v["v2"])
    np.testing.assert_array_equal(np.asarray(w.b13), v["b13"][:, halves])


# --- schemas from config.json -----------------------------------------------------------------
@pytest.mark.parametrize(
    "qc,want",
    [
        (None, (sc.Unquantized(jnp.bfloat16), sc.NoInputQuant())),
        ({"quant_method": "gptq", "bits": 8, "group_size": -1}, (sc.GPTQ(8, -1), sc.NoInputQuant())),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, (sc.FP8(block=(128, 128)), sc.FP8Dynamic(128))),
        ({"quant_method": "fp8"}, (sc.FP8(per_tensor=True), sc.FP8Dynamic())),
        ({"quant_method": "mxfp4"}, (sc.MXFP4(), sc.NoInputQuant())),
        ({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}, (sc.NVFP4(), sc.NoInputQuant())),
        (ct_config({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
                   {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True},
                   "float-quantized"), (sc.FP8(block=(128, 128)), sc.FP8Dynamic(128))),
        (ct_config({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}, None,
                   "pack-quantized"), (sc.GPTQ(4, 128), sc.NoInputQuant())),
    ],
)
def test_schema_from_config(qc, want):
    config = {"torch_dtype": "bfloat16", **({"quantization_config": qc} if qc else {})}
    assert ck.schema_from_config(config, "model.layers.0.mlp.experts.0.gate_proj") == want


def test_schema_from_config_ignored_and_unsupported():
    qc = ct_config({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, None, "pack-quantized")
    qc["ignore"] = ["re:.*experts.*"]
    assert ck.schema_from_config({"quantization_config": qc, "torch_dtype": "float16"}, "m.experts.0.gate_proj") == (
        sc.Unquantized(jnp.float16), sc.NoInputQuant())
    with pytest.raises(ValueError, match="gptq_v2"):
        ck.schema_from_config({"quantization_config": {"quant_method": "gptq", "checkpoint_format": "gptq_v2"}})
    with pytest.raises(ValueError, match="desc_act"):
        ck.schema_from_config({"quantization_config": {"quant_method": "gptq", "desc_act": True}})
    with pytest.raises(ValueError, match="gemv"):
        ck.schema_from_config({"quantization_config": {"quant_method": "awq", "version": "gemv"}})
    with pytest.raises(ValueError, match="bitsandbytes"):
        ck.schema_from_config({"quantization_config": {"quant_method": "bitsandbytes"}})


# --- broken checkpoints -----------------------------------------------------------------------
def test_missing_tensor_not_in_index(tmp_path, rng):
    root, *_ = write_case(tmp_path, rng, "gptq-sym", shards=2)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    name = f"{PREFIX}.experts.1.up_proj.scales"
    del index["weight_map"][name]
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ck.CheckpointError, match=rf"missing tensor '{name}'.*model-0000\d-of-00002\.safetensors"):
        hj.load_moe_layer(root, PREFIX)


def test_missing_tensor_in_its_file(tmp_path, rng):
    root, *_ = write_case(tmp_path, rng, "awq")
    name = f"{PREFIX}.experts.1.down_proj.qzeros"
    f = root / "model.safetensors"
    with safetensors_numpy.safe_open(str(f), "numpy") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys() if k != name}
    safetensors_numpy.save_file(tensors, str(f))
    with pytest.raises(ck.CheckpointError, match=rf"missing tensor '{name}'.*model\.safetensors"):
        hj.load_moe_layer(root, PREFIX)


@pytest.mark.parametrize("damage", ["header", "truncated", "missing_file"])
def test_corrupt_shard_names_tensor_and_file(tmp_path, rng, damage):
    root, *_ = write_case(tmp_path, rng, "gptq-sym", shards=2)
    shard = root / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    if damage == "header":
        shard.write_bytes(data[:8] + b"\xff" * 32 + data[40:])
    elif damage == "truncated":
        shard.write_bytes(data[: len(data) - 100])
    else:
        shard.unlink()
    with pytest.raises(ck.CheckpointError, match=rf"tensor '{PREFIX}\.experts\.\d\.\w+\.\w+'.*{shard.name}"):
        hj.load_moe_layer(root, PREFIX)


def test_bad_tensor_contents_name_tensor_and_file(tmp_path, rng):
    root, *_ = write_case(tmp_path, rng, "gptq-sym")
    f = root / "model.safetensors"
    name = f"{PREFIX}.experts.1.up_proj.scales"
    with safetensors_numpy.safe_open(str(f), "numpy") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    tensors[name] = tensors[name][:, : I // 2]  # a scale grid of the wrong width
    safetensors_numpy.save_file(tensors, str(f))
    with pytest.raises(ck.CheckpointError, match=rf"'{name}' \[1, 64\].*same shape.*model\.safetensors"):
        hj.load_moe_layer(root, PREFIX)


def test_nan_scale_code_names_tensor_and_file(tmp_path, rng):
    root, _ = write_gpt_oss(tmp_path, rng)
    f = root / "model.safetensors"
    name = f"{PREFIX}.experts.gate_up_proj_scales"
    with safetensors_numpy.safe_open(str(f), "numpy") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys() if not k.endswith("bias") and "router" not in k}
    tensors[name][1, 3, 0] = 255  # e8m0 NaN
    safetensors_numpy.save_file(tensors, str(f))
    with pytest.raises(ck.CheckpointError, match=rf"\(expert 1\).*NaN.*'{name}' in .*model\.safetensors"):
        hj.load_moe_layer(root, PREFIX)


def test_unknown_prefix_lists_layers(tmp_path, rng):
    root, *_ = write_case(tmp_path, rng, "bf16")
    with pytest.raises(ck.CheckpointError, match=r"model\.layers\.7\.mlp\.experts\..*found: \['model\.layers\.0\.mlp'\]"):
        hj.load_moe_layer(root, "model.layers.7.mlp")


# --- convert, then load -----------------------------------------------------------------------
def two_layer_checkpoint(tmp: Path, rng: np.random.Generator) -> tuple[Path, list[str]]:
    prefixes = [f"model.layers.{j}.mlp" for j in (0, 1)]
    tensors: dict[str, np.ndarray] = {}
    for p in prefixes:
        projs = {"gate_proj": make_gptq(rng, I, H, sym=False)[0], "up_proj": make_gptq(rng, I, H, sym=False)[0],
                 "down_proj": make_gptq(rng, H, I, sym=False)[0]}
        tensors.update(per_expert_tensors(p, projs))
        tensors.update(router(rng, p))
    tensors["model.embed_tokens.weight"] = rng.standard_normal((16, H)).astype(BF16)
    return save(tmp / "src", tensors, shards=2, config={"quantization_config": {**GPTQ_CFG, "sym": False}}), prefixes


def assert_same_weights(a: hj.MoEWeights, b: hj.MoEWeights) -> None:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def test_convert_then_load_round_trips(tmp_path, rng):
    src, prefixes = two_layer_checkpoint(tmp_path, rng)
    assert ck.discover_moe_layers(src) == prefixes
    dst = tmp_path / "dst"
    assert cli_main(["convert", str(src), str(dst), "--quiet"]) == 0
    meta = json.loads((dst / ck.METADATA_FILE).read_text())
    assert meta["format"] == "humming-jax-moe" and list(meta["layers"]) == prefixes
    for p in prefixes:
        entry = meta["layers"][p]
        assert entry["scheme"] == "w4a16-uint4-zp-g128" and entry["activation"] == "silu"
        assert (entry["num_experts"], entry["hidden_size"], entry["intermediate_size"]) == (E, H, I)
        direct = hj.load_moe_layer(src, p)
        assert_same_weights(ck.load_converted(dst, p), direct)
        assert_same_weights(hj.load_moe_layer(dst, p), direct)  # a converted dir loads the same way
        np.testing.assert_array_equal(ck.load_router_weight(dst, p)[0], ck.load_router_weight(src, p)[0])
    assert cli_main(["load", str(dst), "--tokens", "4"]) == 0  # runs each layer against the oracle


def test_convert_requantizes_expert_by_expert(tmp_path, rng):
    root, v13, v2, _, _ = write_case(tmp_path, rng, "bf16")
    dst = tmp_path / "int4"
    ck.convert_checkpoint(root, dst, scheme="w4a16-int4-g128", progress=False)
    got = ck.load_converted(dst, PREFIX)
    want = hj.quantize_moe_weights(kernel_values(v13, BF16), kernel_values(v2, BF16), "w4a16-int4-g128")
    assert_same_weights(got, want)


def test_converted_missing_tensor_names_tensor_and_file(tmp_path, rng):
    root, *_ = write_case(tmp_path, rng, "fp8-block")
    dst = tmp_path / "dst"
    ck.convert_checkpoint(root, dst, progress=False)
    f = dst / ck.converted_layers(dst)[PREFIX]["file"]
    with safetensors_numpy.safe_open(str(f), "numpy") as h:
        keep = [k for k in h.keys() if k != "experts.w2.scale"]
    tensors = {k: ck._File(f).read(k) for k in keep}  # F8 tensors need the raw reader
    safetensors_numpy.save_file(tensors, str(f))
    with pytest.raises(ck.CheckpointError, match=rf"missing tensor 'experts\.w2\.scale' in .*{f.name}"):
        ck.load_converted(dst, PREFIX)


def test_loaded_layer_runs(tmp_path, rng):
    """A loaded layer runs through fused_moe on a NaN-poisoned out like any other weights."""
    root, v13, v2, _, _ = write_case(tmp_path, rng, "awq")
    w = hj.load_moe_layer(root, PREFIX)
    m = 6
    x = jnp.asarray(rng.standard_normal((m, H)), jnp.bfloat16)
    tw, ids = random_routing(rng, m, 2, E)
    got = jax.jit(lambda out, x, w, tw, ids: hj.fused_moe(x, w, tw, ids, out=out))(nan_out((m, H), jnp.bfloat16), x, w, tw, ids)
    from humming_jax.reference import moe_reference

    want = moe_reference(x, kernel_values(v13, BF16), kernel_values(v2, BF16), tw, ids)
    assert relative_error(got, want) < TOL[jnp.dtype(jnp.bfloat16)]
