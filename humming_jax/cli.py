"""The ``humming-jax`` command line: ``demo`` and ``info``."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# A Qwen3-30B-A3B-shaped layer (E=128, top-8, H=2048, I=768); on a CPU it is scaled down in H
# and I so the check against the float32 oracle stays quick.
QWEN3_SHAPE = dict(experts=128, top_k=8, hidden=2048, intermediate=768)
QWEN3_CPU_SHAPE = dict(experts=128, top_k=8, hidden=256, intermediate=128)
DEMO_SCHEMES = ("bf16", "w4a16-int4-g128", "w8a8-fp8-block128", "w4a16-mxfp4")


def _table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def _median_ms(fn: Any, args: Sequence[Any], repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def demo(args: argparse.Namespace) -> int:
    import humming_jax as hj
    from humming_jax.activations import ACTIVATIONS
    from humming_jax.reference import InputQuant, moe_reference, relative_error

    backend = jax.default_backend()
    shape = QWEN3_SHAPE if (backend != "cpu" or args.full) else QWEN3_CPU_SHAPE
    e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
    m = args.tokens
    rng = np.random.default_rng(args.seed)
    gated = ACTIVATIONS[args.activation].gated
    w13 = rng.standard_normal((e, 2 * i if gated else i, h)).astype(np.float32) / np.sqrt(h)
    w2 = rng.standard_normal((e, h, i)).astype(np.float32) / np.sqrt(i)
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    logits = rng.standard_normal((m, e)).astype(np.float32)
    ids = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
    probs = np.exp(np.take_along_axis(logits, ids, 1))
    topk_w = jnp.asarray(probs / probs.sum(1, keepdims=True), jnp.float32)
    topk_ids = jnp.asarray(ids)

    print(f"humming-jax demo: backend={backend}  layer: E={e} top-k={k} H={h} I={i}  tokens M={m}  activation={args.activation}")
    rows, worst = [], 0.0
    schemes = args.scheme or list(DEMO_SCHEMES)
    for scheme in schemes:
        weights = hj.quantize_moe_weights(w13, w2, scheme)
        dw13, dw2 = weights.dequantize()
        quant = None
        if weights.act_key is not None:
            from humming_jax.quantize import act_quant_params

            quant = InputQuant(*act_quant_params(weights.act_key))
        want = moe_reference(x, dw13, dw2, topk_w, topk_ids, activation=args.activation, input_quant=quant)
        for gemm_type in ("indexed", "grouped"):
            step = jax.jit(
                lambda out, x, w, tw, ids, g=gemm_type: hj.fused_moe(x, w, tw, ids, out=out, activation=args.activation, gemm_type=g),
                donate_argnums=0,
            )
            out = jnp.full(x.shape, jnp.nan, x.dtype)
            got = step(out, x, weights, topk_w, topk_ids)
            err = relative_error(got, want)
            worst = max(worst, err)
            ms = _median_ms(lambda: step(jnp.zeros(x.shape, x.dtype), x, weights, topk_w, topk_ids), (), args.repeats)
            rows.append((scheme, gemm_type, f"{weights.nbytes / 2**20:.1f} MiB", f"{err:.2e}", f"{ms:.3f}"))
    print(_table(rows, ("scheme", "class", "expert bytes", "rel. error vs oracle", "median ms")))
    ok = worst < 2e-2
    print(f"all results {'match' if ok else 'DO NOT match'} the float32 oracle (worst relative error {worst:.2e})")
    return 0 if ok else 1


def info(args: argparse.Namespace) -> int:
    import humming_jax as hj
    from humming_jax import _ffi
    from humming_jax.experts import EXPERT_CLASSES
    from humming_jax.quantize import SCHEMES

    report = _ffi.backend_report()
    print(f"humming-jax {hj.__version__}  jax {jax.__version__}  devices: {[str(d) for d in jax.devices()]}")
    print(f"CPU handlers:  {report['cpu']}")
    print(f"CUDA handlers: {report['cuda'] or 'not available: ' + str(report['cuda_unavailable_because'])}")
    platforms = "cpu, CUDA" if report["cuda"] else "cpu"
    print(f"registered targets ({platforms}): " + ", ".join(_ffi.PREFIX + c for c in _ffi.CALLS))
    print()
    rows = []
    for s in SCHEMES.values():
        classes = [c.__name__ for c in EXPERT_CLASSES if c.supports_quant_scheme(s.weight_key, s.act_key)]
        rows.append((s.name, str(s.weight_key), str(s.act_key) if s.act_key else "16-bit", ", ".join(classes)))
    print(_table(rows, ("scheme", "weight key", "activation key", "classes")))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="humming-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run a Qwen3-30B-A3B-shaped MoE layer and check it against the oracle")
    p_demo.add_argument("--tokens", type=int, default=64)
    p_demo.add_argument("--scheme", action="append", help="scheme name (repeatable); default: a representative set")
    p_demo.add_argument("--activation", default="silu")
    p_demo.add_argument("--full", action="store_true", help="the full layer shape even on a CPU")
    p_demo.add_argument("--repeats", type=int, default=5)
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.set_defaults(func=demo)
    p_info = sub.add_parser("info", help="backends, registered custom calls, supported schemes")
    p_info.set_defaults(func=info)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
