"""The JAX systems of bench_moe.py: our layer (automatic selection and each expert class) and the
``jax.lax.ragged_dot`` peer, each jitted, and the timing loop they share.

Timing: one executable runs the layer once for each of the point's R input sets (R > 1 when the
touched weights of one set would stay in the L2), writing into the caller's donated ``out`` as a
serving step does; a timed sample is S back-to-back calls of it (S chosen from a burst of calls so
that a sample lasts about 10 ms, which hides the host's dispatch and the final synchronization the
way a many-layer serving step does) and counts wall time / (S·R) after ``block_until_ready``. The
figure is the median over the samples.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import humming_jax as hj
from humming_jax import experts as hj_experts
from humming_jax.ops import routing as routing_ops
from humming_jax.quantize import act_quant_params

from device_timer import traced_samples
from sampling import SLOW_CALL_S, calls_per_sample

PROBE_CALLS = 8  # calls of the burst that measures one call


TIMER = "wall"  # "device": the samples are GPU time read from a profiler trace (set by bench_moe --timer)


def time_jax(call: Callable[[Any], Any], carry: Any, *, repeats: int, warmup: int, chain: int,
             timer: str | None = None) -> dict:
    """Runs ``carry = call(carry)`` (first call compiles) and returns timing stats per layer run.

    ``timer`` (default: the module's TIMER) "wall" times each sample by the host clock; "device"
    traces the samples and takes each one's GPU time (device_timer.traced_samples), keeping the
    wall times and the dropped host-wait gaps beside it."""
    timer = timer or TIMER
    t0 = time.perf_counter()
    carry = call(carry)
    jax.block_until_ready(carry)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    carry = call(carry)
    jax.block_until_ready(carry)
    one = time.perf_counter() - t0
    if one < SLOW_CALL_S:  # slow calls are warm after one run; don't spend seconds on more
        for _ in range(warmup):
            carry = call(carry)
        jax.block_until_ready(carry)
        # A call's time from a burst: one synchronized call also counts the host's dispatch and
        # wake-up latency, which at decode sizes exceeds the device time and left 2-4 calls per
        # sample, too few to hide either.
        t0 = time.perf_counter()
        for _ in range(PROBE_CALLS):
            carry = call(carry)
        jax.block_until_ready(carry)
        one = (time.perf_counter() - t0) / PROBE_CALLS
    calls = calls_per_sample(one)
    note = None
    if timer == "device":
        state = {"carry": carry}

        def run_sample():
            for _ in range(calls):
                state["carry"] = call(state["carry"])
            return state["carry"]

        try:
            traced = traced_samples(run_sample, repeats, calls * chain)
        except RuntimeError as exc:  # samples not separable in the trace: timed by the wall clock below
            traced, note = None, f"device timer failed, wall clock used: {exc}"[:400]
        else:
            if traced is None:
                raise RuntimeError("timer 'device': the profiler trace has no GPU plane on this backend")
            return {
                "samples_ms": traced["samples_ms"],
                "wall_samples_ms": traced["wall_ms"],
                "gap_samples_ms": traced["gap_ms"],
                "device_split": traced["split"],
                "calls_per_sample": calls,
                "compile_s": compile_s,
                "mode": "jax_jit_device",
                "carry": state["carry"],
            }
        carry = state["carry"]
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            carry = call(carry)
        jax.block_until_ready(carry)
        samples.append((time.perf_counter() - t0) / (calls * chain) * 1e3)
    res = {
        "samples_ms": samples,
        "calls_per_sample": calls,
        "compile_s": compile_s,
        "mode": "jax_jit",
        "carry": carry,
    }
    if note:
        res["note"] = note
    return res


class JaxPoint:
    """A point's input sets on the device, with the layouts each system prepares outside the
    timed region (built lazily, once per point)."""

    def __init__(self, point, weights):
        self.point = point
        self.weights = weights
        e, k, h, i = point.dims
        self.e, self.k, self.h, self.i = e, k, h, i
        self.m = point.M
        self.R = point.num_sets
        dt = jnp.bfloat16
        self.xs = [jnp.asarray(s.x, dt) for s in point.sets]
        self.ids = [jnp.asarray(s.topk_ids, jnp.int32) for s in point.sets]
        self.tws = [jnp.asarray(s.topk_weights, jnp.float32) for s in point.sets]
        self.emap = jnp.arange(e, dtype=jnp.int32)
        self._cache: dict[str, Any] = {}

    def out(self) -> jax.Array:
        return jnp.full((self.m, self.h), jnp.nan, jnp.bfloat16)

    # -- layouts prepared outside the timed region -----------------------------------------
    def indexed_routing(self):
        if "indexed" not in self._cache:
            bm = hj_experts.indexed_block_m(self.m * self.k, self.e)
            f = jax.jit(lambda ids: routing_ops.routing_indexed(ids, self.emap, self.e, bm))
            self._cache["indexed"] = [f(ids) for ids in self.ids]
        return self._cache["indexed"]

    def grouped_routing(self):
        """Per input set, the grouped routing and the permuted rows, in their natural order and (16-bit
        rows of a multiple of 64 columns) in the 4-bit mainloop's k order, for the class to take
        whichever it asks permute_rows for."""
        if "grouped" not in self._cache:
            def f(x, ids):
                rt = routing_ops.routing_grouped(ids, self.emap, self.e)
                ordered = x.dtype in (jnp.bfloat16, jnp.float16) and x.shape[1] % 64 == 0
                xo = routing_ops.permute_rows(x, rt, self.k, k_order=True) if ordered else None
                return rt, (routing_ops.permute_rows(x, rt, self.k), xo)
            fj = jax.jit(f)
            self._cache["grouped"] = [fj(x, ids) for x, ids in zip(self.xs, self.ids)]
        return self._cache["grouped"]

    def batched_layout(self):
        """x_b [E, T, H] per set (rows past an expert's count repeat a real token row, never
        zeros) and expert_num_tokens [E]; T is the largest count over the sets, rounded up to 8."""
        if "batched" not in self._cache:
            e, k = self.e, self.k
            counts, idxs = [], []
            for s in self.point.sets:
                flat = s.topk_ids.reshape(-1)
                order = np.argsort(flat, kind="stable")
                cnt = np.bincount(flat, minlength=e).astype(np.int32)
                counts.append(cnt)
                idxs.append((order, flat[order], cnt))
            t = max(8, int(-(-max(int(c.max()) for c in counts) // 8) * 8))
            xbs = []
            for x, (order, sorted_e, cnt) in zip(self.xs, idxs):
                gather = np.zeros((e, t), np.int32)
                start = np.concatenate([[0], np.cumsum(cnt)[:-1]])
                pos = np.arange(order.size) - start[sorted_e]
                gather[sorted_e, pos] = order // k
                xbs.append(jnp.take(x, jnp.asarray(gather), axis=0))
            self._cache["batched"] = (xbs, [jnp.asarray(c) for c in counts], t)
        return self._cache["batched"]

    def sorted_layout(self):
        """ragged_dot's layout: rows sorted by expert, group sizes, and the inverse order."""
        if "sorted" not in self._cache:
            e, k = self.e, self.k
            out = []
            for x, s in zip(self.xs, self.point.sets):
                flat = s.topk_ids.reshape(-1)
                order = np.argsort(flat, kind="stable")
                gs = np.bincount(flat, minlength=e).astype(np.int32)
                inv = np.argsort(order).astype(np.int32)
                xs = jnp.take(x, jnp.asarray((order // k).astype(np.int32)), axis=0)
                out.append((xs, jnp.asarray(gs), jnp.asarray(inv)))
            self._cache["sorted"] = out
        return self._cache["sorted"]


# --- our layer ------------------------------------------------------------------------------
OUR_CLASSES = {
    "humming_jax": None,
    "humming_jax/indexed": "indexed",
    "humming_jax/grouped": "grouped",
}


def layer_step(jp: JaxPoint, gemm_type: str | None = None) -> Callable[[jax.Array], jax.Array]:
    """out -> out: fused_moe (automatic selection or a named class) on the R sets, chained through
    the donated out (no out-sized buffer is made per call)."""

    def chain(out, w, xs, tws, ids):
        for r in range(jp.R):
            out = hj.fused_moe(xs[r], w, tws[r], ids[r], activation="silu", out=out, gemm_type=gemm_type)
        return out

    step = jax.jit(chain, donate_argnums=0)
    return lambda out: step(out, jp.weights, jp.xs, jp.tws, jp.ids)


def our_layer(jp: JaxPoint, system: str, repeats: int, warmup: int) -> dict:
    """fused_moe (automatic selection or a named class), R sets chained through the donated out."""
    res = time_jax(layer_step(jp, OUR_CLASSES[system]), jp.out(), repeats=repeats, warmup=warmup, chain=jp.R)
    res["output"] = res.pop("carry")  # the layer on the last set
    return res


@contextlib.contextmanager
def _fixed_routing(indexed=None, grouped=None, permuted=None):
    """While a class's _experts is traced, its routing custom calls return the layouts prepared
    outside the timed region; counts the substitutions so a class that stops calling them is
    reported rather than timed with its routing inside."""
    saved = {n: getattr(routing_ops, n) for n in ("routing_indexed", "routing_grouped", "permute_rows")}
    used = {"n": 0}

    def give(value):
        def f(*_a, **_k):
            used["n"] += 1
            return value
        return f

    def give_permuted(value):
        natural, ordered = value

        def f(*_a, k_order=False, **_k):
            if k_order and ordered is None:
                raise RuntimeError("the class asks for rows in the 4-bit mainloop's k order, not prepared here")
            used["n"] += 1
            return ordered if k_order else natural
        return f

    def give_indexed(value):
        # the layout was built with indexed_block_m(); a class that pads to another block size
        # must not be fed it
        pre_bm = value.sorted_ids.shape[0] // value.block_expert_ids.shape[0]

        def f(*a, **k):
            bm = k.get("block_m", a[3] if len(a) > 3 else None)
            if bm != pre_bm:
                raise RuntimeError(f"class pads routing to block_m={bm}, the prepared layout to {pre_bm}")
            used["n"] += 1
            return value
        return f

    try:
        if indexed is not None:
            routing_ops.routing_indexed = give_indexed(indexed)
        if grouped is not None:
            routing_ops.routing_grouped = give(grouped)
        if permuted is not None:
            routing_ops.permute_rows = give_permuted(permuted)
        yield used
    finally:
        for n, f in saved.items():
            setattr(routing_ops, n, f)


def routing_layouts(jp: JaxPoint, gemm_type: str) -> list[tuple]:
    """Per input set, what _fixed_routing substitutes: (indexed routing, grouped routing, permuted
    rows: natural and k-ordered, JaxPoint.grouped_routing). With quantized activations the grouped
    class permutes the codes and scales of the quantized token rows, so the permutation stays inside
    the timed part (with the quantization, as for the indexed class); with 16-bit activations the
    permuted rows are prepared outside."""
    if gemm_type == "indexed":
        return [(rt, None, None) for rt in jp.indexed_routing()]
    quantized = act_quant_params(jp.weights.act_key) is not None
    return [(None, rt, None if quantized else xp) for rt, xp in jp.grouped_routing()]


def our_gemms(jp: JaxPoint, system: str, repeats: int, warmup: int) -> dict:
    """The class's own GEMM1 -> activation(+quant) -> GEMM2 with routing prepared outside and no
    finalize; for ``humming_jax`` the class the automatic selection picks."""
    w = jp.weights
    if system == "humming_jax/batched":
        return _batched(jp, repeats, warmup)
    gemm_type = OUR_CLASSES[system]
    cls = hj.select_experts(w.weight_key, w.act_key, "silu", prefer=gemm_type, rows_per_expert=jp.m * jp.k / jp.e)
    R = jp.R
    if cls.gemm_type not in ("indexed", "grouped"):
        raise ValueError(f"no gemms-only path for class {cls.__name__}")
    layouts = routing_layouts(jp, cls.gemm_type)
    substituted = []

    def chain(w, xs, ids, layouts):
        outs = []
        for r in range(R):
            ind, grp, perm = layouts[r]
            with _fixed_routing(ind, grp, perm) as used:
                d, _ = cls()._experts(xs[r], w, ids[r], jp.emap, "silu", None)
            substituted.append(used["n"])
            outs.append(d)
        return tuple(outs)

    step = jax.jit(chain)
    res = time_jax(lambda _: step(w, jp.xs, jp.ids, layouts), None, repeats=repeats, warmup=warmup, chain=R)
    if not substituted or min(substituted) == 0:
        raise RuntimeError(f"{cls.__name__}._experts no longer calls the routing custom calls: routing is not separable")
    res.pop("carry")
    res["selected"] = cls.__name__
    return res


def _batched(jp: JaxPoint, repeats: int, warmup: int) -> dict:
    xbs, counts, t = jp.batched_layout()
    R = jp.R
    apply = hj.BatchedExperts().apply

    def chain(outb, w, xbs, counts):
        for r in range(R):
            outb = apply(outb, xbs[r], w, None, None, activation="silu", expert_num_tokens=counts[r])
        return outb

    step = jax.jit(chain, donate_argnums=0)
    outb = jnp.full((jp.e, t, jp.h), jnp.nan, jnp.bfloat16)
    res = time_jax(lambda o: step(o, jp.weights, xbs, counts), outb, repeats=repeats, warmup=warmup, chain=R)
    res.pop("carry")
    res["batched_rows"] = t
    return res


# --- the ragged_dot peer ----------------------------------------------------------------------
def ragged_weights(weights) -> tuple[jax.Array, jax.Array]:
    """The exact values our kernels multiply, in bf16, laid out [E, K, N] for ragged_dot."""
    def one(pw, round_to):
        f = jax.jit(lambda p: jnp.swapaxes(p.values().astype(round_to).astype(jnp.bfloat16), 1, 2))
        return f(pw)

    rnd = weights.dtype if weights.act_key is None else jnp.float32
    return one(weights.w13, rnd), one(weights.w2, rnd)


def ragged(jp: JaxPoint, w13t: jax.Array, w2t: jax.Array, part: str, repeats: int, warmup: int) -> dict:
    """Both GEMMs + silu (and, for "layer", the weighted combine into [M, H]) on rows sorted by
    expert outside the timed region."""
    R, i, m, k, h = jp.R, jp.i, jp.m, jp.k, jp.h
    layout = jp.sorted_layout()

    def chain(w13t, w2t, layout, tws):
        outs = []
        for r in range(R):
            xs, gs, inv = layout[r]
            gu = jax.lax.ragged_dot(xs, w13t, gs)
            gate, up = gu[:, :i].astype(jnp.float32), gu[:, i:].astype(jnp.float32)
            a = (jax.nn.silu(gate) * up).astype(jnp.bfloat16)
            d = jax.lax.ragged_dot(a, w2t, gs)
            if part == "layer":
                d = jnp.take(d, inv, axis=0).reshape(m, k, h).astype(jnp.float32)
                d = jnp.sum(d * tws[r][:, :, None], axis=1).astype(jnp.bfloat16)
            outs.append(d)
        return tuple(outs)

    step = jax.jit(chain)
    res = time_jax(lambda _: step(w13t, w2t, layout, jp.tws), None, repeats=repeats, warmup=warmup, chain=R)
    carry = res.pop("carry")
    if part == "layer":
        res["output"] = carry[-1]
    return res


def rel_err(a: jax.Array, b: jax.Array) -> float:
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a32 - b32) / jnp.maximum(jnp.linalg.norm(b32), 1e-30))


def output_check(out: jax.Array) -> str:
    """'ok', or what is wrong with a layer output (NaN/Inf, all zeros)."""
    o = jnp.asarray(out, jnp.float32)
    if not bool(jnp.all(jnp.isfinite(o))):
        return "non-finite values"
    if not bool(jnp.any(o != 0)):
        return "all zeros"
    return "ok"


# --- ceilings without torch (CPU smoke runs) --------------------------------------------------
def ceilings_jax(matmul_n: int, copy_bytes: int, repeats: int) -> dict:
    a = jax.random.normal(jax.random.PRNGKey(1), (copy_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda v: v + 1.0)
    res = time_jax(lambda _: copy(a), None, repeats=repeats, warmup=1, chain=1)
    copy_ms = float(np.median(res["samples_ms"]))
    x = jax.random.normal(jax.random.PRNGKey(2), (matmul_n, matmul_n), jnp.bfloat16)
    y = jax.random.normal(jax.random.PRNGKey(3), (matmul_n, matmul_n), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    res = time_jax(lambda _: mm(x, y), None, repeats=repeats, warmup=1, chain=1)
    mm_ms = float(np.median(res["samples_ms"]))
    return {
        "copy_tbps": 2 * copy_bytes / (copy_ms * 1e-3) / 1e12,
        "bf16_tflops": 2 * matmul_n**3 / (mm_ms * 1e-3) / 1e12,
        "method": f"jax: a+1 over {copy_bytes >> 20} MiB f32 (bytes read + written); {matmul_n}^3 bf16 matmul",
    }
