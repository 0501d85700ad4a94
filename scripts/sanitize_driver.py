"""Runs every humming_jax custom call on the GPU at small shapes, every weight type and layout, for
compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python3 scripts/sanitize_driver.py [--rs4 | --wsp | --fp8-ring CASE] [--cpu]

(--rs4: only the 4-bit mainloop's calls; --wsp: only the bf16 and w8a8-fp8-block128 grouped calls,
for a run with HUMMING_JAX_PREFILL_BF16_WSP / _FP8_WSP; --fp8-ring CASE: one w8a8-fp8-block128
grouped call, by how far each CTA's stage ring runs (fp8_ring_case); --cpu: on the CPU backend, to
check this script.)

Shapes are chosen to reach the kernels' edge paths: N not a multiple of the tile, K not a multiple
of 8 or 32, scale groups narrower than 8 columns, empty experts, padding ids, zero tokens.
"""

from __future__ import annotations

import contextlib
import itertools

import os
import sys

# One device allocation per buffer, so out-of-bounds accesses past a buffer's end are caught.
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import humming_jax as hj  # noqa: E402
from humming_jax._abi import WeightType  # noqa: E402
from humming_jax.activations import ACTIVATIONS  # noqa: E402
from humming_jax.experts import BatchedExperts, GroupedExperts, IndexedExperts  # noqa: E402
from humming_jax.ops import activation as act_ops  # noqa: E402
from humming_jax.ops import finalize as fin_ops  # noqa: E402
from humming_jax.ops import gemm as gemm_ops  # noqa: E402
from humming_jax.ops import routing as routing_ops  # noqa: E402
from humming_jax.quantize import SCHEMES, act_quant_params  # noqa: E402
from humming_jax.testing import (  # noqa: E402
    distinct_topk_ids,
    gemm_forms,
    experts_indexed_forms,
    experts_indexed_quant_forms,
    gated_forms,
    indexed_quant_forms,
    random_packed_weight,
    random_routing,
)
from humming_jax.weights import PackedWeight  # noqa: E402

rng = np.random.default_rng(0)
calls = 0


def run(fn, *args):
    global calls
    calls += 1
    return jax.block_until_ready(jax.jit(fn)(*args))


def gemm_all_forms(w, bias, dtype, quant, m=13, topk=2, t=5):
    """Every GEMM form of one random problem (humming_jax.testing.gemm_forms), in one jitted call."""
    e = w.num_experts
    ids, emap = random_routing(rng, m, topk, e + 1, e, 0.2)
    fn, operands = gemm_forms(rng, w, bias, dtype, quant, ids, emap, t)
    run(fn, *operands)


def custom_weight(wtype, e, n, k, gk, **kw):
    return random_packed_weight(rng, wtype, e, n, k, gk, **kw)


@contextlib.contextmanager
def env_set(name: str, value: str | None):
    """$name = value inside the block (value None: left as it is), restored after."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def prefill_grouped(scheme, m, e=3, n=384, k=256, topk=2, experts=(0, 2), gather=False, gated=None,
                    k_order=False):
    """One grouped prefill GEMM: routing, permutation, (quantization,) gemm_grouped; ``experts`` are
    the ids drawn (others receive nothing), 5% of the entries padding. ``gather`` (16-bit
    activations): gemm_grouped_gather instead, the rows read through the permutation. ``gated`` (a
    gated activation, 16-bit activations): gemm_grouped_gated, the activation in the GEMM's call.
    ``k_order`` (a call the 4-bit mainloop takes): the rows permuted into its k order and read in
    place (a_k_order)."""
    spec = SCHEMES[scheme]
    w = spec.quantize(rng.standard_normal((e, n, k)).astype(np.float32) / 16, spec.default_dtype)
    bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32))
    quant = act_quant_params(spec.act_key)
    ids = rng.choice(list(experts), (m, topk)).astype(np.int32)
    ids[rng.random((m, topk)) < 0.05] = -1
    x = jnp.asarray(rng.standard_normal((m, k)), spec.default_dtype)

    def prefill(x, ids, w, bias):
        r = routing_ops.routing_grouped(ids, jnp.arange(e, dtype=jnp.int32), e)
        if gather and quant is None:
            return gemm_ops.gemm_grouped_gather(x, w, bias, r.permutation, r.expert_first_token_offset, topk,
                                                out_dtype=spec.default_dtype)
        xp = routing_ops.permute_rows(x, r, topk, k_order=k_order)
        if k_order:
            return gemm_ops.gemm_grouped(xp, None, w, bias, r.expert_first_token_offset, out_dtype=spec.default_dtype,
                                         a_k_order=True)
        if gated and quant is None:
            return gemm_ops.gemm_grouped_gated(xp, w, bias, r.expert_first_token_offset, out_dtype=spec.default_dtype,
                                               activation=gated, limit=7.0 if gated == "swigluoai" else None)
        a, s = act_ops.quantize(xp, *quant) if quant else (xp, None)
        return gemm_ops.gemm_grouped(a, s, w, bias if quant is None else None, r.expert_first_token_offset,
                                     out_dtype=spec.default_dtype, act_group_k=quant[1] if quant else 0)

    # The persistent bf16 kernel gathers only where $HUMMING_JAX_PREFILL_GATHER allows it (read at
    # each call); the gathered calls here ask for every form that can (2).
    with env_set("HUMMING_JAX_PREFILL_GATHER", "2" if gather else None):
        run(prefill, x, jnp.asarray(ids), w, bias)


def rs4_many_items():
    """The 4-bit mainloop with more work items than SMs in every form (~140 rows on each of 64
    experts, N = 512, 8 k tiles): the persistent forms' CTAs take several items, their rings
    running on across them; also with the rows in the mainloop's k order; and a small last round
    split over K."""
    for scheme in ("w4a16-int4-g128", "w4a16-mxfp4"):
        prefill_grouped(scheme, 2400, e=64, n=512, k=512, topk=4, experts=range(64))
        prefill_grouped(scheme, 2400, e=64, n=512, k=512, topk=4, experts=range(64), k_order=True)
    # K = 2048: the persistent forms' scales by TMA, two windows an item (uint4) or four (e2m1).
    for scheme in ("w4a16-int4-g128", "w4a16-mxfp4"):
        prefill_grouped(scheme, 2400, e=64, n=512, k=2048, topk=4, experts=range(64))
    # ~16 rows on each of 64 experts, N = 2304: whole rounds, then a last round of 56 (two slabs) or 48
    # (one slab) items on 132 SMs, split over K (a unit's scale windows from the middle of K).
    for scheme in ("w4a16-int4-g128", "w4a16-mxfp4"):
        prefill_grouped(scheme, 256, e=64, n=2304, k=2048, topk=4, experts=range(64))


def rs4_k_order_paths():
    """The k order's own kernels: the activation writing it (a row of 320 columns: five tiles), and
    a gemm_grouped call given k-ordered rows that the 4-bit mainloop turns down
    ($HUMMING_JAX_PREFILL_FP4=0 while it is traced and run): the handler's copy back into the
    natural order at the workspace's end, then the kernel that takes the call."""
    y = jnp.asarray(rng.standard_normal((300, 640)), jnp.bfloat16)
    run(lambda y: act_ops.activation(y, "silu", k_order=True), y)
    spec = SCHEMES["w4a16-mxfp4"]
    e, n, k, rows = 3, 384, 256, 96  # 32 rows per expert
    w = spec.quantize(rng.standard_normal((e, n, k)).astype(np.float32) / 16, spec.default_dtype)
    a = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    off = jnp.asarray([0, 40, 40, 90], jnp.int32)
    ws = gemm_ops._grouped_workspace(rows, jnp.bfloat16, None, w, jnp.bfloat16)
    ops, attrs = gemm_ops._operands(a, None, w, None, 0)
    shapes = (jax.ShapeDtypeStruct((rows, n), jnp.bfloat16), jax.ShapeDtypeStruct((ws,), jnp.uint8))
    with env_set("HUMMING_JAX_PREFILL_FP4", "0"):
        run(lambda *o: hj._ffi.call("gemm_grouped", shapes, *o, **attrs, a_k_order=1)[0], *ops, off)


def wsp_many_items():
    """bf16 and fp8 grouped calls with more work items than SMs (~150 rows on each of 64 experts:
    two tiles each; N = 600 / 512, the last weight block partial; a partial last k stage for bf16)."""
    prefill_grouped("bf16", 2400, e=64, n=600, k=328, topk=4, experts=range(64))
    prefill_grouped("bf16", 2400, e=64, n=600, k=328, topk=4, experts=range(64), gather=True)
    for act in ("silu", "swigluoai"):  # the gated epilogue (N / 2 = 296: a last block part past it)
        prefill_grouped("bf16", 2400, e=64, n=592, k=328, topk=4, experts=range(64), gated=act)
    fp8_ring_case("across")


# One w8a8-fp8-block128 grouped call each (prefill_grouped's arguments), by how far a CTA's stage
# ring runs: "none": fewer tiles than SMs and 2 k blocks, no slot written twice; "within": few
# tiles of 12 k blocks, the ring wrapping within a tile; "across": more tiles than SMs of 3 k
# blocks (wsp_many_items' fp8 call), the ring running on across a CTA's tiles.
FP8_RING_CASES = {
    "none": dict(m=1200),
    "within": dict(m=300, e=3, n=256, k=1536),
    "across": dict(m=2400, e=64, n=512, k=384, topk=4, experts=range(64)),
}


def fp8_ring_case(name: str) -> None:
    """One case of FP8_RING_CASES alone, for a racecheck run that places where a hazard needs the
    stage ring to wrap."""
    prefill_grouped("w8a8-fp8-block128", **FP8_RING_CASES[name])


def main() -> None:
    # --cpu: the same calls on the CPU backend (checks this script where there is no GPU).
    if "--cpu" not in sys.argv:
        assert hj.cuda_available(), hj._ffi.backend_report()
    if "--rs4" in sys.argv:
        # Only the 4-bit mainloop's calls (for a sanitizer run of one of its forms,
        # HUMMING_JAX_PREFILL_RS4_WS).
        for scheme, m in itertools.product(("w4a16-int4-g128", "w4a16-mxfp4"), (300, 60)):
            prefill_grouped(scheme, m)
            prefill_grouped(scheme, m, k_order=True)
        rs4_many_items()
        rs4_k_order_paths()
        print(f"sanitize_driver: {calls} jitted calls completed (--rs4)")
        return
    if "--fp8-ring" in sys.argv:
        at = sys.argv.index("--fp8-ring") + 1
        name = sys.argv[at] if at < len(sys.argv) else ""
        if name not in FP8_RING_CASES:
            raise SystemExit(f"--fp8-ring takes one of {sorted(FP8_RING_CASES)}, not {name!r}")
        fp8_ring_case(name)
        print(f"sanitize_driver: {calls} jitted calls completed (--fp8-ring {name})")
        return
    if "--wsp" in sys.argv:
        # Only the calls of the persistent bf16 and fp8 kernels (for a sanitizer run with
        # HUMMING_JAX_PREFILL_BF16_WSP / HUMMING_JAX_PREFILL_FP8_WSP = 1 to 4).
        for scheme, m in itertools.product(("bf16", "w8a8-fp8-block128"), (300, 60)):
            prefill_grouped(scheme, m)
        prefill_grouped("bf16", 200, e=8, n=264, k=136, topk=3, experts=range(8))
        prefill_grouped("bf16", 200, e=8, n=264, k=136, topk=3, experts=range(8), gather=True)
        prefill_grouped("bf16", 1200, gated="silu")  # the gated epilogue on clusters of two (the rule's form 4)
        wsp_many_items()
        print(f"sanitize_driver: {calls} jitted calls completed (--wsp)")
        return
    # Routing and permutation, including zero tokens and per-expert padding of block_m = 5; up to
    # 32 entries the single-warp routing kernel, above it the per-expert one.
    for m, k, eg, el, bm in [(0, 2, 4, 4, 16), (1, 8, 16, 16, 16), (16, 2, 9, 5, 5), (37, 3, 9, 5, 5),
                             (200, 4, 32, 32, 64)]:
        ids, emap = random_routing(rng, m, k, eg, el, 0.1)
        run(lambda i, e: routing_ops.routing_indexed(i, e, el, bm), ids, emap)
        run(lambda i, e: routing_ops.routing_grouped(i, e, el), ids, emap)
    for cols in (64, 33):
        ids, emap = random_routing(rng, 21, 3, 6, 6, 0.2)
        x = jnp.asarray(rng.standard_normal((21, cols)), jnp.bfloat16)
        run(lambda x, i, e: routing_ops.permute_rows(x, routing_ops.routing_grouped(i, e, 6), 3), x, ids, emap)

    # GEMMs: every scheme (every weight type and activation quantization), then odd layouts.
    for name, spec in sorted(SCHEMES.items()):
        e, n, k = 3, 72, 256
        w = spec.quantize(rng.standard_normal((e, n, k)).astype(np.float32) / 16, spec.default_dtype)
        bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32))
        gemm_all_forms(w, bias, spec.default_dtype, act_quant_params(spec.act_key))
    gemm_all_forms(custom_weight(WeightType.UINT4, 3, 40, 48, 12, zero=True), None, jnp.bfloat16, None)
    gemm_all_forms(custom_weight(WeightType.INT8, 3, 40, 38, 38, scale_dtype=np.float16), None, jnp.float16, None)
    gemm_all_forms(custom_weight(WeightType.FP8_E4M3, 2, 24, 100, 4, scale2=True), None, jnp.bfloat16, None)
    gemm_all_forms(custom_weight(WeightType.FP4_E2M1, 2, 24, 96, 32), None, jnp.bfloat16, ("fp8", 0))
    gemm_all_forms(custom_weight(WeightType.INT8, 2, 24, 48, 16), None, jnp.float16, ("int8", 16))
    gemm_all_forms(PackedWeight(jnp.asarray(rng.standard_normal((2, 130, 21)), jnp.float16), wtype=WeightType.FLOAT,
                                k=21), None, jnp.float16, None)

    # A GEMM quantizing its own input (gemm_indexed_quant; GEMM2's form after a gated activation):
    # in the decode kernel where it takes the call with every item whole, else after the
    # quantization kernel (the fp8 ring among them).
    for dtype, (m, topk, e, n, k), act in itertools.product((jnp.bfloat16, jnp.float16),
                                                          ((1, 8, 16, 264, 256), (16, 4, 8, 200, 384)),
                                                          (None, "silu")):
        w = SCHEMES["w8a8-fp8-block128"].quantize(rng.standard_normal((e, n, k)).astype(np.float32) / 16, dtype)
        bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32))
        ids = distinct_topk_ids(rng, m, topk, e, pad=0.1)
        fn, operands = indexed_quant_forms(rng, w, bias, dtype, ("fp8", 128), ids, act)
        run(fn, *operands)

    # GEMM1 writing the gated activation of its rows (gemm_indexed_gated): the decode kernel's
    # epilogue pairs gate and up rows (interleaved for swigluoai, halves otherwise).
    for scheme, (m, topk, e, n, k), act in itertools.product(("w4a16-int4-g128", "w4a16-mxfp4", "bf16"),
                                                           ((1, 8, 16, 528, 256), (16, 4, 8, 200, 256)),
                                                           ("silu", "swigluoai")):
        dtype = SCHEMES[scheme].default_dtype
        w = SCHEMES[scheme].quantize(rng.standard_normal((e, n, k)).astype(np.float32) / 16, dtype)
        bias = jnp.asarray(rng.standard_normal((e, n)).astype(np.float32))
        ids = distinct_topk_ids(rng, m, topk, e, pad=0.1)
        fn, operands = gated_forms(rng, w, bias, dtype, ids, act, 7.0 if act == "swigluoai" else None)
        run(fn, *operands)

    # The two GEMMs in one call (experts_indexed): GEMM2's decode kernel reads the routing and
    # issues its first weights before it waits for GEMM1's rows.
    for scheme, (m, topk, e, h, i), act in itertools.product(("w4a16-int4-g128", "w4a16-mxfp4", "bf16"),
                                                           ((1, 8, 16, 256, 264), (16, 4, 8, 256, 128)),
                                                           ("silu", "swigluoai")):
        dtype = SCHEMES[scheme].default_dtype
        q = SCHEMES[scheme].quantize
        i = i if scheme == "bf16" else 128 * (i // 128)
        w13 = q(rng.standard_normal((e, 2 * i, h)).astype(np.float32) / 16, dtype)
        w2 = q(rng.standard_normal((e, h, i)).astype(np.float32) / 16, dtype)
        b13 = jnp.asarray(rng.standard_normal((e, 2 * i)).astype(np.float32))
        ids = distinct_topk_ids(rng, m, topk, e, pad=0.1)
        fn, operands = experts_indexed_forms(rng, w13, b13, w2, None, dtype, ids, act,
                                             7.0 if act == "swigluoai" else None)
        run(fn, *operands)

    # The same with 8-bit activations (experts_indexed_quant): GEMM2 after GEMM1's kernel or the
    # quantization kernel, on the decode kernel (quantizing its rows itself or not) and the ring.
    for (m, topk, e, h, i), act, ring in itertools.product(((1, 8, 16, 256, 256), (16, 4, 8, 512, 128)),
                                                          ("silu", "gelu_no_mul"), ("0", "1")):
        q = SCHEMES["w8a8-fp8-block128"].quantize
        i2 = i if act == "silu" else 2 * i
        w13 = q(rng.standard_normal((e, 2 * i, h)).astype(np.float32) / 16, jnp.bfloat16)
        w2 = q(rng.standard_normal((e, h, i2)).astype(np.float32) / 16, jnp.bfloat16)
        b13 = jnp.asarray(rng.standard_normal((e, 2 * i)).astype(np.float32))
        ids = distinct_topk_ids(rng, m, topk, e, pad=0.1)
        with env_set("HUMMING_JAX_DECODE_RING", ring):
            fn, operands = experts_indexed_quant_forms(rng, w13, b13, w2, None, jnp.bfloat16, ("fp8", 128), ids, act)
            run(fn, *operands)

    # Prefill-sized grouped GEMMs (>= 32 rows per expert: the sm_90a wgmma kernel where built, on
    # 128-row tiles for m = 1200 and 300 and 64-row tiles for m = 60; int4 through the mixed-input
    # kinds (256-token tiles at m = 1200, 128 at 300) and the 4-bit mainloop at 60, mxfp4 through the dequantization
    # buffer at m = 1200 and the 4-bit mainloop below (tiles of up to 128 tokens at 300, 40 at 60)),
    # with an empty expert, uneven expert sizes and rows past off[E].
    for scheme, m in itertools.product(("bf16", "fp16", "w8a8-fp8-block128", "w4a16-int4-g128", "w4a16-mxfp4"),
                                       (1200, 300, 60)):
        prefill_grouped(scheme, m)
    for m in (1200, 300, 60):  # GEMM1's gathered rows (clusters of two at 1200, one CTA per SM below)
        prefill_grouped("bf16", m, gather=True)
    for m, act in itertools.product((1200, 300), ("silu", "swigluoai")):  # the gated epilogue, both clusters
        prefill_grouped("bf16", m, gated=act)
    rs4_many_items()
    rs4_k_order_paths()
    wsp_many_items()
    # Activation, fused quantization, quantization, finalize.
    x = jnp.asarray(rng.standard_normal((9, 2 * 136)), jnp.bfloat16)
    for name in sorted(ACTIVATIONS):
        run(lambda x: act_ops.activation(x, name, None), x)
    for quant, gk in [("fp8", 0), ("fp8", 8), ("int8", 0), ("int8", 136)]:
        run(lambda x: act_ops.activation_quant(x, "silu", None, quant, gk), x)
        run(lambda x: act_ops.quantize(x, quant, gk), x)
    for h, dtype in [(64, jnp.bfloat16), (37, jnp.float16)]:
        d = jnp.asarray(rng.standard_normal((30, h)), dtype)
        src = jnp.asarray(rng.integers(-1, 33, (11, 3)).astype(np.int32))
        w = jnp.asarray(rng.random((11, 3)).astype(np.float32))
        run(lambda d, w, s, o: fin_ops.finalize(d, w, s, o), d, w, src, jnp.zeros((11, h), dtype))

    # Whole layers, including zero tokens.
    for scheme in ("bf16", "w4a16-int4-g128", "w8a8-fp8-block128"):
        wts = hj.quantize_moe_weights(rng.standard_normal((4, 256, 128)) / 11, rng.standard_normal((4, 128, 128)) / 11,
                                      scheme)
        for m in (0, 7):
            x = jnp.asarray(rng.standard_normal((m, 128)), jnp.bfloat16)
            tw = jnp.asarray(rng.random((m, 2)).astype(np.float32))
            ids, _ = random_routing(rng, m, 2, 6, 4, 0.1)
            for cls in (IndexedExperts, GroupedExperts):
                run(lambda o, x, w, tw, ids, cls=cls: cls().apply(o, x, w, tw, ids), jnp.zeros_like(x), x, wts, tw, ids)
        xb = jnp.asarray(rng.standard_normal((4, 6, 128)), jnp.bfloat16)
        cnt = jnp.asarray([0, 6, 3, 9], jnp.int32)
        run(lambda o, x, w, c: BatchedExperts().apply(o, x, w, None, None, expert_num_tokens=c), jnp.zeros_like(xb), xb,
            wts, cnt)
    counts = {name: (fn() if fn else None) for name in ("HjDecodeLaunches", "HjDecodeRingLaunches",
                                                              "HjDecodeQuantLaunches", "HjDecodeGatedLaunches",
                                                              "HjPrefillLaunches", "HjPrefillGatherLaunches",
                                                              "HjPrefillGatedLaunches")
              for fn in [hj._ffi.launch_counter(name)]}
    print(f"sanitize_driver: {calls} jitted calls completed; fast-path launches {counts}")


if __name__ == "__main__":
    main()
