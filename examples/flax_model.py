"""A tiny MoE language model built from HummingMoE: jit-compiled decode, state split and merged."""

import jax
import jax.numpy as jnp
from flax import nnx

from humming_jax.flax import HummingMoE, QuantizedExperts, to_linen

VOCAB, HIDDEN = 512, 128


class MoEBlock(nnx.Module):
    """Pre-norm residual block with a quantized MoE feed-forward (attention omitted)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(HIDDEN, dtype=jnp.bfloat16, rngs=rngs)
        self.moe = HummingMoE(
            num_experts=8, hidden_size=HIDDEN, intermediate_size=128, top_k=2,
            scheme="w4a16-int4-g128", scoring="softmax", renormalize=True,
            shared_intermediate_size=64,  # optional shared expert (Qwen2-MoE style)
            rngs=rngs,
        )

    def __call__(self, x):
        return x + self.moe(self.norm(x))


class TinyMoELM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, HIDDEN, dtype=jnp.bfloat16, rngs=rngs)
        self.blocks = nnx.List([MoEBlock(rngs=rngs) for _ in range(2)])
        self.norm = nnx.RMSNorm(HIDDEN, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, tokens):  # [B] -> logits [B, VOCAB]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x).astype(jnp.float32))


model = TinyMoELM(rngs=nnx.Rngs(0))


@nnx.jit
def decode(model, tokens):
    return jnp.argmax(model(tokens), axis=-1).astype(jnp.int32)


tokens = jnp.array([1, 2, 3, 4], jnp.int32)
for _ in range(4):
    tokens = decode(model, tokens)

# The quantized experts are state (they split and merge), not trainable parameters.
graphdef, params, experts, rest = nnx.split(model, nnx.Param, QuantizedExperts, ...)
assert "experts" not in nnx.state(model.blocks[0].moe, nnx.Param)
restored = nnx.merge(graphdef, params, experts, rest)
assert (decode(restored, tokens) == decode(model, tokens)).all()
print(model.blocks[0].moe.expert_weights.scheme, "decoded:", tokens.tolist())

# In a Linen model: the same layer through flax's bridge.
linen_moe = to_linen(8, HIDDEN, 128, 2, scheme="bf16")
x = jnp.ones((4, HIDDEN), jnp.bfloat16)
variables = linen_moe.init(jax.random.key(0), x)  # {"params": router, "quantized_experts": experts}
y = jax.jit(linen_moe.apply)(variables, x)
assert y.shape == x.shape
