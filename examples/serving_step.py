"""A jit-compiled serving step whose MoE layer writes into a donated, caller-owned buffer."""

import jax
import jax.numpy as jnp
import numpy as np

import humming_jax as hj
from humming_jax.reference import moe_reference, relative_error

E, K, H, I, M = 8, 2, 256, 128, 16  # Qwen3-30B-A3B: E=128, K=8, H=2048, I=768
rng = np.random.default_rng(0)
w13 = rng.standard_normal((E, 2 * I, H)).astype(np.float32) / np.sqrt(H)  # gate rows, then up rows
w2 = rng.standard_normal((E, H, I)).astype(np.float32) / np.sqrt(I)
weights = hj.quantize_moe_weights(w13, w2, "w4a16-int4-g128")  # or hj.load_moe_layer(checkpoint, prefix)
router = jnp.asarray(rng.standard_normal((H, E)), jnp.float32)


def moe_step(out, x, weights, router):
    """Routing in float32, then the experts; ``out`` is the caller's [M, H] buffer."""
    probs = jax.nn.softmax(jnp.matmul(x.astype(jnp.float32), router), axis=-1)
    topk_weights, topk_ids = jax.lax.top_k(probs, K)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdims=True)
    return hj.fused_moe(x, weights, topk_weights, topk_ids.astype(jnp.int32), activation="silu", out=out)


step = jax.jit(moe_step, donate_argnums=0)  # out is donated: the result is written in place
out = jnp.zeros((M, H), jnp.bfloat16)
for _ in range(3):  # decode steps
    x = jnp.asarray(rng.standard_normal((M, H)), jnp.bfloat16)
    buffer = out.unsafe_buffer_pointer()
    out = step(out, x, weights, router)
    assert out.unsafe_buffer_pointer() == buffer  # same device memory, no copy

# Check the last step against the float32 oracle on the dequantized weights.
probs = jax.nn.softmax(jnp.matmul(x.astype(jnp.float32), router), axis=-1)
tw, ids = jax.lax.top_k(probs, K)
want = moe_reference(x, *weights.dequantize(), tw / tw.sum(-1, keepdims=True), ids.astype(jnp.int32))
assert relative_error(out, want) < 2e-2
