"""The ``humming-jax`` command line: ``demo``, ``info``, ``convert``, ``load`` and ``bench``."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
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
    if args.block_steps > 0:
        ok = _demo_block(args) and ok
    return 0 if ok else 1


def _demo_block(args: argparse.Namespace) -> bool:
    """A tiny MoE transformer block (embedding, RMSNorm, ``HummingMoE`` with a residual, tied
    unembedding; attention omitted) decoding greedily; each step's MoE output is checked against
    the oracle with routing recomputed in float32."""
    try:
        from flax import nnx

        from humming_jax.flax import HummingMoE
    except ImportError:
        print("\nMoE block decode: skipped (flax is not installed: pip install 'humming-jax[flax]')")
        return True
    from humming_jax.quantize import act_quant_params
    from humming_jax.reference import InputQuant, moe_reference, relative_error

    vocab, h, i, e, k = 256, 128, 128, 16, 2
    scheme = (args.scheme or ["w4a16-int4-g128"])[0]

    class TinyMoEBlock(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(vocab, h, dtype=jnp.bfloat16, rngs=rngs)
            self.norm = nnx.RMSNorm(h, dtype=jnp.bfloat16, rngs=rngs)
            self.moe = HummingMoE(e, h, i, k, scheme=scheme, activation=args.activation, rngs=rngs)
            self.final_norm = nnx.RMSNorm(h, dtype=jnp.bfloat16, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            x = self.embed(tokens)
            normed = self.norm(x)
            moe_out = self.moe(normed)
            logits = self.embed.attend(self.final_norm(x + moe_out).astype(jnp.float32))
            return logits, normed, moe_out

    block = TinyMoEBlock(nnx.Rngs(args.seed))
    step = nnx.jit(lambda m, t: m(t))
    w13, w2 = block.moe.expert_weights.dequantize()
    kernel = block.moe.router.kernel.get_value()
    act_key = block.moe.expert_weights.act_key
    quant = InputQuant(*act_quant_params(act_key)) if act_key is not None else None
    tokens = jnp.asarray(np.random.default_rng(args.seed).integers(0, vocab, (4,)), jnp.int32)  # 4 sequences
    rows, worst = [], 0.0
    for t in range(args.block_steps):
        t0 = time.perf_counter()
        logits, normed, moe_out = jax.block_until_ready(step(block, tokens))
        ms = (time.perf_counter() - t0) * 1e3
        probs = jax.nn.softmax(jnp.matmul(normed.astype(jnp.float32), kernel, precision="highest"), axis=-1)
        tw, ids = jax.lax.top_k(probs, k)
        want = moe_reference(normed, w13, w2, tw / tw.sum(-1, keepdims=True), ids.astype(jnp.int32),
                             activation=args.activation, input_quant=quant)
        err = relative_error(moe_out, want)
        worst = max(worst, err)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        rows.append((t, " ".join(str(int(v)) for v in tokens), f"{err:.2e}", f"{ms:.2f}"))
    print(f"\nMoE block decode: HummingMoE E={e} top-k={k} H={h} I={i} scheme={scheme}, 4 sequences, greedy")
    print(_table(rows, ("step", "next tokens", "MoE rel. error vs oracle", "step ms")))
    ok = worst < 2e-2
    print(f"block outputs {'match' if ok else 'DO NOT match'} the oracle (worst relative error {worst:.2e})")
    return ok


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
    if report["cuda_missing_calls"]:
        print(f"not in the named CUDA build (CPU only): {report['cuda_missing_calls']}")
    print()
    rows = []
    for s in SCHEMES.values():
        classes = [c.__name__ for c in EXPERT_CLASSES if c.supports_quant_scheme(s.weight_key, s.act_key)]
        rows.append((s.name, str(s.weight_key), str(s.act_key) if s.act_key else "16-bit", ", ".join(classes)))
    print(_table(rows, ("scheme", "weight key", "activation key", "classes")))
    return 0


def convert(args: argparse.Namespace) -> int:
    from humming_jax.checkpoint import convert_checkpoint

    scheme = None if args.scheme in (None, "auto") else args.scheme
    meta = convert_checkpoint(args.src, args.dst, scheme=scheme, layers=args.layer, activation=args.activation,
                              progress=not args.quiet)
    rows = [(p, m["scheme"], m["activation"], m["num_experts"], m["hidden_size"], m["intermediate_size"], m["file"])
            for p, m in meta["layers"].items()]
    print(_table(rows, ("layer", "scheme", "activation", "E", "H", "I", "file")))
    print(f"wrote {len(rows)} layer(s) and {Path(args.dst) / 'humming_jax_moe.json'}")
    return 0


def load(args: argparse.Namespace) -> int:
    """Loads converted layers and runs each on random tokens against the oracle."""
    import humming_jax as hj
    from humming_jax.checkpoint import converted_layers, load_converted
    from humming_jax.quantize import act_quant_params
    from humming_jax.reference import InputQuant, moe_reference, relative_error

    layers = converted_layers(args.dir)
    names = args.layer or list(layers)
    rng = np.random.default_rng(args.seed)
    rows, worst = [], 0.0
    for name in names:
        w = load_converted(args.dir, name)
        act = layers[name]["activation"] if name in layers else "silu"
        k = min(2, w.num_experts)
        x = jnp.asarray(rng.standard_normal((args.tokens, w.hidden_size)), w.dtype)
        ids = jnp.asarray(np.stack([rng.choice(w.num_experts, k, replace=False) for _ in range(args.tokens)]), jnp.int32)
        tw = jnp.asarray(rng.dirichlet(np.ones(k), args.tokens), jnp.float32)
        got = jax.jit(lambda x, w, tw, ids: hj.fused_moe(x, w, tw, ids, activation=act))(x, w, tw, ids)
        d13, d2 = w.dequantize()
        quant = InputQuant(*act_quant_params(w.act_key)) if w.act_key is not None else None
        want = moe_reference(x, d13, d2, tw, ids, activation=act, b13=w.b13, b2=w.b2, input_quant=quant)
        err = relative_error(got, want)
        worst = max(worst, err)
        rows.append((name, w.scheme, act, w.num_experts, w.hidden_size, w.intermediate_size,
                     f"{w.nbytes / 2**20:.2f} MiB", f"{err:.2e}"))
    print(_table(rows, ("layer", "scheme", "activation", "E", "H", "I", "expert bytes", "rel. error vs oracle")))
    ok = worst < 2e-2
    print(f"all layers {'match' if ok else 'DO NOT match'} the float32 oracle (worst relative error {worst:.2e})")
    return 0 if ok else 1


def _bench_script() -> Path | None:
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        script = root / "benchmarks" / "bench_moe.py"
        if script.is_file():
            return script
    return None


def bench(args: argparse.Namespace) -> int:
    """Runs benchmarks/bench_moe.py with the remaining arguments."""
    script = _bench_script()
    if script is None:
        print(
            "humming-jax bench: benchmarks/bench_moe.py was not found (looked beside the humming_jax package and "
            "in the current directory); run from a source checkout that has it",
            file=sys.stderr,
        )
        return 2
    extra = [a for a in args.bench_args if a != "--"]
    return subprocess.call([sys.executable, str(script), *extra], env=dict(os.environ))


def _bench_argv(argv: Sequence[str]) -> argparse.Namespace | None:
    """``bench ARGS...``: everything after ``bench`` goes to the script untouched (argparse
    would read options such as ``--smoke`` as its own)."""
    if argv and argv[0] == "bench" and not {"-h", "--help"} & set(argv[1:2]):
        return argparse.Namespace(bench_args=list(argv[1:]))
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = _bench_argv(argv)
    if bench_args is not None:
        return bench(bench_args)
    parser = argparse.ArgumentParser(prog="humming-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="run a Qwen3-30B-A3B-shaped MoE layer and check it against the oracle")
    p_demo.add_argument("--tokens", type=int, default=64)
    p_demo.add_argument("--scheme", action="append", help="scheme name (repeatable); default: a representative set")
    p_demo.add_argument("--activation", default="silu")
    p_demo.add_argument("--full", action="store_true", help="the full layer shape even on a CPU")
    p_demo.add_argument("--repeats", type=int, default=5)
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.add_argument("--block-steps", type=int, default=4, help="decode steps of the tiny HummingMoE block (0: skip)")
    p_demo.set_defaults(func=demo)
    p_info = sub.add_parser("info", help="backends, registered custom calls, supported schemes")
    p_info.set_defaults(func=info)
    p_conv = sub.add_parser("convert", help="convert a checkpoint's MoE layers to kernel format (safetensors + JSON)")
    p_conv.add_argument("src", help="a .safetensors file or a checkpoint directory (config.json read if present)")
    p_conv.add_argument("dst", help="output directory")
    p_conv.add_argument("--scheme", default="auto", help="re-quantize to this scheme; 'auto' keeps the stored format")
    p_conv.add_argument("--layer", action="append", help="MoE block prefix to convert (repeatable); default: all found")
    p_conv.add_argument("--activation", default=None, help="default: swigluoai for gpt-oss layers, else config hidden_act")
    p_conv.add_argument("--quiet", action="store_true", help="no progress bars")
    p_conv.set_defaults(func=convert)
    p_load = sub.add_parser("load", help="load converted layers and check each against the oracle")
    p_load.add_argument("dir", help="a directory written by 'convert'")
    p_load.add_argument("--layer", action="append", help="layer prefix (repeatable); default: all")
    p_load.add_argument("--tokens", type=int, default=8)
    p_load.add_argument("--seed", type=int, default=0)
    p_load.set_defaults(func=load)
    p_bench = sub.add_parser("bench", help="run benchmarks/bench_moe.py (arguments after 'bench' are passed on)")
    p_bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    p_bench.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
