"""The PyTorch-side peers of bench_moe.py and the ceilings: ``torch._grouped_mm`` (bf16) and the
PyPI package ``humming-kernels`` (import name ``humming``), each timed as CUDA-graph replays with
CUDA events, and the copy-bandwidth and bf16-matmul ceilings.

humming-kernels is only called, as its own source drives it: one ``HummingLayer`` per GEMM
(``load_from_unquantized`` then ``transform``), per-M kernel configs from
``humming.tune.get_heuristics_config`` compiled ahead with ``HummingKernel.prepare_kernels``,
routing tensors from ``humming.testing.data.generate_moe_tensors`` (indexed layout, padded to
each config's block M), the activation (+ fp8 quantization) between the GEMMs through
``humming.forward.may_process_input``. It has no routing or finalize kernels of its own, so only
its "gemms" part exists.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable

from sampling import SLOW_CALL_S, calls_per_sample

SILU_MUL = "a / (1.0f + expf(-a)) * b"  # humming's binary_split: a = gate half, b = up half


def status() -> tuple[bool, str]:
    """(usable, reason) for the torch peers."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return False, f"skipped: torch not importable ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return False, "skipped: no CUDA device (torch.cuda.is_available() is False)"
    return True, ""


def versions() -> dict:
    out = {}
    try:
        import torch

        out["torch_version"] = torch.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import importlib.metadata as md

        out["humming_kernels_version"] = md.version("humming-kernels")
    except Exception:  # noqa: BLE001
        pass
    return out


def capture(run: Callable[[], Any], graph: bool = True) -> tuple[Callable[[], Any], str, str | None, Any]:
    """(fn, mode, note, graph object): ``run`` captured in a CUDA graph and fn its replay, or, when
    capture fails (noted) or ``graph`` is False, ``run`` itself run eagerly. Keep the graph object
    alive while fn is used."""
    import torch

    note = None
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    fn, mode, g = run, "eager", None
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run()
            fn, mode = g.replay, "cuda_graph"
        except Exception as exc:  # noqa: BLE001
            note = f"graph capture failed, eager timing: {type(exc).__name__}: {str(exc)[:200]}"
            torch.cuda.synchronize()
    return fn, mode, note, g


def time_torch(run: Callable[[], Any], *, repeats: int, warmup: int, chain: int, graph: bool = True) -> dict:
    """Times ``run`` (one pass over the point's R sets) as CUDA-graph replays (falls back to
    eager launches, noted, when capture fails), S replays per sample between two events."""
    import torch

    fn, mode, note, g = capture(run, graph)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    torch.cuda.synchronize()
    one = e0.elapsed_time(e1) * 1e-3
    if one < SLOW_CALL_S:  # slow calls are warm after one run
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
    calls = calls_per_sample(one)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for s, e in zip(starts, ends):
        s.record()
        for _ in range(calls):
            fn()
        e.record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) / (calls * chain) for s, e in zip(starts, ends)]
    del g
    return {"samples_ms": samples, "calls_per_sample": calls, "mode": mode, "note": note}


def ceilings(matmul_n: int, copy_bytes: int, repeats: int) -> dict:
    import torch

    src = torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    res = time_torch(lambda: dst.copy_(src), repeats=repeats, warmup=3, chain=1, graph=False)
    copy_ms = sorted(res["samples_ms"])[len(res["samples_ms"]) // 2]
    a = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(matmul_n, matmul_n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty_like(a)
    res = time_torch(lambda: torch.matmul(a, b, out=c), repeats=repeats, warmup=3, chain=1, graph=False)
    mm_ms = sorted(res["samples_ms"])[len(res["samples_ms"]) // 2]
    return {
        "copy_tbps": 2 * copy_bytes / (copy_ms * 1e-3) / 1e12,
        "bf16_tflops": 2 * matmul_n**3 / (mm_ms * 1e-3) / 1e12,
        "method": (
            f"torch, CUDA events, median of {repeats}: copy_ of {copy_bytes >> 20} MiB bf16 "
            f"(bytes read + written); {matmul_n}^3 bf16 matmul on random data"
        ),
        "device": torch.cuda.get_device_name(),
    }


class TorchPoint:
    """A point's input sets as CUDA tensors (the same NumPy arrays the JAX systems use)."""

    def __init__(self, point, device: str = "cuda"):
        import torch

        self.point = point
        e, k, h, i = point.dims
        self.e, self.k, self.h, self.i, self.m, self.R = e, k, h, i, point.M, point.num_sets
        self.xs = [torch.from_numpy(s.x).to(device, torch.bfloat16) for s in point.sets]
        self.ids = [torch.from_numpy(s.topk_ids).to(device) for s in point.sets]
        self.tws = [torch.from_numpy(s.topk_weights).to(device) for s in point.sets]


def _random_bf16(shape, std: float, seed: int, device: str = "cuda"):
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randn(shape, dtype=torch.bfloat16, device=device, generator=g).mul_(std)


# --- torch._grouped_mm -----------------------------------------------------------------------
class GroupedMM:
    """bf16 experts through torch._grouped_mm, rows sorted by expert outside the timed region."""

    def __init__(self, e: int, h: int, i: int, seed: int, device: str = "cuda"):
        import torch

        self.fn = getattr(torch, "_grouped_mm", None) or getattr(torch.nn.functional, "grouped_mm", None)
        if self.fn is None:
            raise RuntimeError(f"torch {torch.__version__} has neither torch._grouped_mm nor F.grouped_mm")
        # weights stored [E, N, K] like ours; the GEMMs read them transposed (K-major B)
        self.w13 = _random_bf16((e, 2 * i, h), 1.0 / math.sqrt(h), seed, device)
        self.w2 = _random_bf16((e, h, i), 1.0 / math.sqrt(i), seed + 1, device)
        self.i = i

    @property
    def bytes_per_expert(self) -> float:
        return (self.w13[0].numel() + self.w2[0].numel()) * 2.0

    def measure(self, tp: TorchPoint, part: str, repeats: int, warmup: int) -> dict:
        run, _ = self.prepare(tp, part)
        return time_torch(run, repeats=repeats, warmup=warmup, chain=tp.R)

    def prepare(self, tp: TorchPoint, part: str) -> tuple[Callable[[], None], list]:
        """(run, outs): run() computes every set's result into outs."""
        import torch
        import torch.nn.functional as F

        m, k, h, i = tp.m, tp.k, tp.h, self.i
        prepared = []
        for x, ids in zip(tp.xs, tp.ids):
            flat = ids.reshape(-1).long()
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=tp.e)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            xs = x.index_select(0, order // k).contiguous()
            inv = torch.argsort(order)
            prepared.append((xs, offs, inv))
        b13, b2 = self.w13.transpose(1, 2), self.w2.transpose(1, 2)
        outs: list = [None] * tp.R

        def run():
            for r, (xs, offs, inv) in enumerate(prepared):
                gu = self.fn(xs, b13, offs=offs)
                a = (F.silu(gu[:, :i].float()) * gu[:, i:].float()).to(torch.bfloat16)
                d = self.fn(a, b2, offs=offs)
                if part == "layer":
                    d = (d.index_select(0, inv).view(m, k, h).float() * tp.tws[r].unsqueeze(-1)).sum(1)
                    d = d.to(torch.bfloat16)
                outs[r] = d

        return run, outs


# --- humming-kernels --------------------------------------------------------------------------
def _json_config(cfg: Any) -> Any:
    """A heuristic config as plain JSON values (so the string compiled ahead is the string the
    forward call looks up)."""
    import enum

    def enc(o):
        if isinstance(o, enum.Enum):
            return o.value
        return str(o)

    return json.loads(json.dumps(cfg, default=enc))


class HummingKernelsPeer:
    """Two HummingLayers (w13: N1 x H, w2: H x I) for one shape and format, with each M's kernel
    configs compiled ahead."""

    def __init__(self, fmt_spec: dict, e: int, k: int, h: int, i: int, tokens: list[int], seed: int):
        import torch
        from humming.layer import HummingLayer

        self.e, self.k, self.h, self.i = e, k, h, i
        self.device = torch.cuda.current_device()
        t0 = time.perf_counter()
        self.layers = []
        for tag, (n, kk) in enumerate(((2 * i, h), (h, i))):
            layer = HummingLayer(
                shape_n=n,
                shape_k=kk,
                weight_config=dict(fmt_spec["hk_weight"]),
                input_config=dict(fmt_spec["hk_input"]) if fmt_spec["hk_input"] else None,
                num_experts=e,
                torch_dtype=torch.bfloat16,
            ).cuda()
            w = _random_bf16((e, n, kk), 1.0 / math.sqrt(kk), seed + 10 + tag)
            layer.load_from_unquantized(w)
            del w
            layer.transform()
            self.layers.append(layer)
        torch.cuda.synchronize()
        self.build_s = time.perf_counter() - t0
        self.compute_config = json.dumps({"gemm_type": "indexed"})
        self.configs: dict[int, list[dict]] = {}  # M -> [cfg GEMM1, cfg GEMM2]
        self.compile_s = 0.0
        self.compile_error = None
        self._prepare(tokens)

    @property
    def bytes_per_expert(self) -> float:
        total = 0
        for layer in self.layers:
            for name in ("weight", "weight_scale", "zero_point", "weight_scale_2"):
                t = getattr(layer, name, None)
                if t is not None:
                    total += t.numel() * t.element_size()
        return total / self.e

    def _prepare(self, tokens: list[int]) -> None:
        from humming.kernel.humming import HummingKernel
        from humming.tune import get_heuristics_config

        for m in sorted(set(tokens)):
            self.configs[m] = [
                _json_config(get_heuristics_config(layer.humming_config, shape_m=m * self.k, gemm_type="indexed", device=self.device))
                for layer in self.layers
            ]
        # One parallel NVRTC pass per layer, both layers at once: intervals (prev M*k, M*k].
        errors: list[str] = []

        def compile_layer(idx: int) -> None:
            intervals, prev = [], 0
            for m in sorted(self.configs):
                intervals.append([prev, m * self.k, self.configs[m][idx]])
                prev = m * self.k
            try:
                HummingKernel.prepare_kernels(
                    self.layers[idx].humming_config.to_str(), self.compute_config, json.dumps(intervals), self.device
                )
            except Exception as exc:  # noqa: BLE001 - per-M compiles retry at warm-up
                errors.append(f"GEMM{idx + 1} ahead-of-time compile: {type(exc).__name__}: {str(exc)[:300]}")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=compile_layer, args=(idx,)) for idx in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.compile_s = time.perf_counter() - t0
        self.compile_error = "; ".join(errors) or None

    def config_summary(self, m: int) -> dict:
        keys = ("block_shape", "warp_shape", "num_stages", "use_stream_k", "mma_type", "use_warp_spec")
        return {f"gemm{j + 1}": {k: c.get(k) for k in keys if k in c} for j, c in enumerate(self.configs[m])}

    def measure(self, tp: TorchPoint, repeats: int, warmup: int) -> dict:
        import torch
        from humming.forward import may_process_input
        from humming.testing.data import generate_moe_tensors

        m, k = tp.m, self.k
        l13, l2 = self.layers
        cfg13, cfg2 = self.configs[m]
        tc13, tc2 = json.dumps(cfg13), json.dumps(cfg2)
        lc2 = l2.humming_config
        mode2 = lc2.input_quant_mode
        routes = []
        for ids in tp.ids:
            per_block: dict[int, tuple] = {}
            for cfg in (cfg13, cfg2):
                bm = int(cfg["block_shape"][0])
                if bm not in per_block:
                    _, _, sorted_ids, expert_ids, ntp = generate_moe_tensors(ids, self.e, "indexed", block_size_config=bm)
                    per_block[bm] = (sorted_ids, expert_ids, ntp)
            routes.append((per_block[int(cfg13["block_shape"][0])], per_block[int(cfg2["block_shape"][0])]))
        torch.cuda.synchronize()
        outs: list = [None] * tp.R

        def run():
            for r, (x, (rt13, rt2)) in enumerate(zip(tp.xs, routes)):
                gu = l13.forward(
                    x, sorted_ids=rt13[0], expert_ids=rt13[1], num_tokens_padded=rt13[2], top_k=k,
                    compute_config=self.compute_config, tuning_config=tc13,
                )
                a, gs, ts = may_process_input(lc2, gu, activation_type="binary_split", activation_impl=SILU_MUL)
                scale = gs if mode2.has_group_scale else ts
                scale2 = ts if mode2.has_secondary_scale else None
                outs[r] = l2.forward(
                    a, input_scale=scale, input_scale_2=scale2, sorted_ids=rt2[0], expert_ids=rt2[1],
                    num_tokens_padded=rt2[2], top_k=1, compute_config=self.compute_config, tuning_config=tc2,
                )

        res = time_torch(run, repeats=repeats, warmup=warmup, chain=tp.R)
        res["hk_config"] = self.config_summary(m)
        run()  # once more outside the graph, so the outputs checked are plain tensors
        torch.cuda.synchronize()
        bad = [o for o in outs if not bool(torch.isfinite(o).all())]
        res["check"] = "non-finite values" if bad else ("all zeros" if not any(bool(o.any()) for o in outs) else "ok")
        return res

    def close(self) -> None:
        import torch

        self.layers = []
        torch.cuda.empty_cache()
