"""Load an MoE layer from a safetensors checkpoint, convert a checkpoint to kernel format, and
build a Flax layer from the converted weights."""

import json
import tempfile
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

import humming_jax as hj
from humming_jax.checkpoint import load_router_weight
from humming_jax.cli import main as humming_jax_cli
from humming_jax.flax import HummingMoE

# A tiny Qwen-MoE-style checkpoint stands in for a downloaded model directory.
E, H, I = 4, 128, 128
workdir = tempfile.TemporaryDirectory()  # removed when the script ends
tmp = Path(workdir.name)
src, dst = tmp / "qwen-moe-tiny", tmp / "qwen-moe-tiny-int4"
src.mkdir()
rng = np.random.default_rng(0)
tensors = {"model.layers.0.mlp.gate.weight": rng.standard_normal((E, H)).astype(np.float32)}
for e in range(E):
    for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        w = rng.standard_normal(shape) / np.sqrt(shape[1])
        tensors[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = w.astype(ml_dtypes.bfloat16)
save_file(tensors, str(src / "model.safetensors"))
(src / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16", "hidden_act": "silu"}))

# 1. One layer, read lazily expert by expert; the schema comes from config.json.
weights = hj.load_moe_layer(src, "model.layers.0.mlp")
assert weights.scheme == "bf16" and weights.num_experts == E

# 2. Convert every MoE layer, re-quantized to int4, then check the result against the oracle:
#    humming-jax convert SRC DST --scheme w4a16-int4-g128 ; humming-jax load DST
assert humming_jax_cli(["convert", str(src), str(dst), "--scheme", "w4a16-int4-g128", "--quiet"]) == 0
assert humming_jax_cli(["load", str(dst)]) == 0

# 3. A Flax layer from the converted weights and router.
w4 = hj.load_moe_layer(dst, "model.layers.0.mlp")  # a converted directory loads directly
router, _ = load_router_weight(dst, "model.layers.0.mlp")  # [E, H]
layer = HummingMoE.from_weights(w4, None, router.T, top_k=2)
y = nnx.jit(lambda m, x: m(x))(layer, jnp.ones((3, H), jnp.bfloat16))
assert y.shape == (3, H)
