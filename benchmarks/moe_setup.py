"""What bench_moe.py measures: the BENCH.md shapes and formats, the routing and input sets shared
by every system, synthetic expert weights in our kernel layout, and the byte/FLOP accounting.

Inputs are drawn in NumPy from seeds that depend only on (seed, shape, M, routing, set), so a
point gets the same tokens and routing whichever subset of the matrix a run covers, and every
system at that point sees exactly the same arrays.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

# name: (E experts, top-k, hidden H, intermediate I) -- BENCH.md's matrix; "tiny" is for CPU smoke runs.
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3-ep8": (32, 8, 7168, 2048),
    "gpt-oss-120b": (128, 4, 2880, 2880),
    "tiny": (8, 2, 256, 256),
}
MATRIX_SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3-ep8", "gpt-oss-120b")
MATRIX_TOKENS = (1, 16, 128, 1024, 4096, 16384)

# BENCH.md format name -> our scheme (quantize_moe_weights) and how humming-kernels is configured
# for the same format (HummingLayer weight_config / input_config; None: 16-bit activations).
FORMATS: dict[str, dict] = {
    "bf16": {
        "scheme": "bf16",
        "hk_weight": {"dtype": "bfloat16"},
        "hk_input": None,
    },
    "w4a16-int4-g128": {
        "scheme": "w4a16-int4-g128",
        "hk_weight": {"dtype": "uint4", "group_size": 128, "scale_dtype": "bfloat16"},
        "hk_input": None,
    },
    "w8a8-fp8-block128": {
        "scheme": "w8a8-fp8-block128",
        "hk_weight": {"dtype": "float8e4m3", "group_size": 128, "group_size_n": 128},
        "hk_input": {"dtype": "float8e4m3", "group_size": 128},
    },
    "w4a16-mxfp4": {
        "scheme": "w4a16-mxfp4",
        "hk_weight": {"dtype": "float4e2m1", "group_size": 32, "scale_dtype": "float8e8m0"},
        "hk_input": None,
    },
    # Not in BENCH.md's matrix: the format of BENCH.md's earlier humming-kernels fp8 figures.
    "w8a8-fp8-channel": {
        "scheme": "w8a8-fp8-channel",
        "hk_weight": {"dtype": "float8e4m3"},
        "hk_input": {"dtype": "float8e4m3"},
    },
}
MATRIX_FORMATS = ("bf16", "w4a16-int4-g128", "w8a8-fp8-block128", "w4a16-mxfp4")

L2_BYTES = 50e6  # H200 L2 as BENCH.md counts it
MAX_SETS = 16  # input sets rotated within one timed executable


@dataclass
class InputSet:
    x: np.ndarray  # [M, H] float32 (cast to bf16 by each system)
    topk_ids: np.ndarray  # [M, k] int32, k distinct experts per token
    topk_weights: np.ndarray  # [M, k] float32, rows sum to 1


@dataclass
class Point:
    shape: str
    M: int
    routing: str  # "uniform" | "zipf<s>"
    sets: list[InputSet] = field(default_factory=list)

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return SHAPES[self.shape]

    @property
    def num_sets(self) -> int:
        return len(self.sets)


def _rng(seed: int, *parts: object) -> np.random.Generator:
    words = [seed] + [zlib.crc32(str(p).encode()) for p in parts]
    return np.random.default_rng(words)


def draw_routing(rng: np.random.Generator, m: int, e: int, k: int, zipf_s: float | None) -> np.ndarray:
    """[m, k] int32: k distinct experts per token, uniform or Zipf-skewed (Gumbel top-k)."""
    if zipf_s is None:
        logits = np.zeros((1, e))
    else:
        rank = rng.permutation(e) + 1  # which expert is most popular is itself random
        logits = (-zipf_s * np.log(rank.astype(np.float64)))[None, :]
    gumbel = -np.log(-np.log(rng.random((m, e)) + 1e-300) + 1e-300)
    return np.argsort(-(logits + gumbel), axis=1)[:, :k].astype(np.int32)


def make_point(shape: str, m: int, routing: str, num_sets: int, seed: int) -> Point:
    e, k, h, _ = SHAPES[shape]
    zipf_s = float(routing[4:]) if routing.startswith("zipf") else None
    point = Point(shape, m, routing)
    for r in range(num_sets):
        rng = _rng(seed, shape, m, routing, r)
        x = rng.standard_normal((m, h), dtype=np.float32)
        ids = draw_routing(rng, m, e, k, zipf_s)
        logits = rng.standard_normal((m, k)).astype(np.float32)
        tw = np.exp(logits - logits.max(1, keepdims=True))
        tw = (tw / tw.sum(1, keepdims=True)).astype(np.float32)
        point.sets.append(InputSet(x, ids, tw))
    return point


def experts_touched(ids: np.ndarray, e: int) -> int:
    return int(np.unique(ids[(ids >= 0) & (ids < e)]).size)


def touched_bytes(point: Point, bytes_per_expert: float) -> float:
    """Mean over the point's sets of (experts receiving tokens) x (weight + scale bytes per expert)."""
    e = point.dims[0]
    return float(np.mean([experts_touched(s.topk_ids, e) * bytes_per_expert for s in point.sets]))


def layer_flops(m: int, k: int, h: int, i: int) -> float:
    """2·M·k·H·N1 + 2·M·k·I·H with N1 = 2I (gated silu)."""
    return 2.0 * m * k * h * (2 * i) + 2.0 * m * k * i * h


def bf16_bytes_per_expert(h: int, i: int) -> float:
    return 2.0 * (2 * i * h + h * i)


def num_sets_for(bytes_touched_per_set: float, override: int | None) -> int:
    """How many input sets to rotate among: enough that their touched weights are ~4x the L2."""
    if override:
        return max(1, int(override))
    if bytes_touched_per_set <= 0:
        return 1
    return int(min(MAX_SETS, max(1, math.ceil(4 * L2_BYTES / bytes_touched_per_set))))


# --- synthetic expert weights in our kernel layout ----------------------------------------------
# Quantizing multi-GB float weights in NumPy would eat the device call's minutes; the kernels'
# speed does not depend on where the codes came from, so codes and scales are drawn directly on
# the device, with the layout quantize_moe_weights produces (tests/test_bench_smoke.py checks
# that) and magnitudes that keep every intermediate O(1): no zeros, no overflow.


def synthetic_weights(fmt: str, e: int, h: int, i: int, seed: int):
    import jax
    import jax.numpy as jnp

    import humming_jax as hj
    from humming_jax._abi import WeightType
    from humming_jax.weights import MoEWeights, PackedWeight

    scheme = hj.SCHEMES[FORMATS[fmt]["scheme"]]
    dtype = jnp.dtype(scheme.default_dtype)
    base = jax.random.PRNGKey(seed)

    def packed(tag: int, n: int, kk: int) -> PackedWeight:
        k1, k2 = jax.random.split(jax.random.fold_in(base, tag))
        name = scheme.name
        if name in ("bf16", "fp16"):
            data = _normal(k1, (e, n, kk), 1.0 / math.sqrt(kk), dtype)
            return PackedWeight(data, wtype=WeightType.FLOAT, k=kk)
        if name == "w4a16-int4-g128":
            if kk % 128:
                # Same rule as quantize_moe_weights: groups of 128 must tile K (gpt-oss has K = 2880).
                raise ValueError(f"{name} not applicable: K = {kk} is not a multiple of 128")
            data = _bytes(k1, (e, n, kk // 2))
            # codes q-8 in [-8, 7] have mean square 21.5
            scale = _uniform(k2, (e, n, kk // 128), 1.0 / math.sqrt(21.5 * kk), dtype)
            return PackedWeight(data, scale=scale, wtype=WeightType.UINT4, k=kk, group_n=1, group_k=128)
        if name in ("w8a8-fp8-block128", "w8a16-fp8-block128", "w8a8-fp8-channel"):
            data = _fp8(k1, (e, n, kk), 64.0)
            gn, gk = (128, 128) if "block" in name else (1, kk)
            grid = (e, -(-n // gn), -(-kk // gk))
            scale = _uniform(k2, grid, 1.0 / (64.0 * math.sqrt(kk)), jnp.float32)
            return PackedWeight(data, scale=scale, wtype=WeightType.FP8_E4M3, k=kk, group_n=gn, group_k=gk)
        if name in ("w4a16-mxfp4", "w4a8-mxfp4-fp8"):
            data = _bytes(k1, (e, n, kk // 2))
            # random e2m1 codes have mean square 8.56; pick the power of two that gives 1/K
            exp0 = 127 + round(math.log2(1.0 / math.sqrt(8.56 * kk)))
            jitter = jax.random.randint(k2, (e, n, kk // 32), -1, 2)
            scale = (exp0 + jitter).astype(jnp.uint8)
            return PackedWeight(data, scale=scale, wtype=WeightType.FP4_E2M1, k=kk, group_n=1, group_k=32)
        raise ValueError(f"no synthetic weights for scheme {name!r}")

    w13 = packed(13, 2 * i, h)
    w2 = packed(2, h, i)
    return MoEWeights(
        w13=w13,
        w2=w2,
        weight_key=scheme.weight_key,
        act_key=scheme.act_key,
        scheme=scheme.name,
        dtype=dtype,
    )


def _normal(key, shape, std, dtype):
    import jax

    return jax.jit(lambda k: (jax.random.normal(k, shape) * std).astype(dtype))(key)


def _uniform(key, shape, center, dtype):
    import jax

    return jax.jit(lambda k: (jax.random.uniform(k, shape, minval=0.8, maxval=1.2) * center).astype(dtype))(key)


def _bytes(key, shape):
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda k: jax.random.randint(k, shape, 0, 256, dtype=jnp.int32).astype(jnp.uint8))(key)


def _fp8(key, shape, std):
    import jax
    import jax.numpy as jnp

    f = lambda k: jnp.clip(jax.random.normal(k, shape) * std, -448.0, 448.0).astype(jnp.float8_e4m3fn)  # noqa: E731
    return jax.jit(f)(key)


def bytes_per_expert(weights) -> float:
    """Weight + scale bytes of one expert (both GEMMs) in our kernel layout."""
    return (weights.w13.nbytes + weights.w2.nbytes) / weights.num_experts
