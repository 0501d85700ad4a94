"""Device-side time per call of a JAX callable, read from a profiler trace of its kernels.

Wall-clock timing of calls that take ~25 µs on the GPU (qwen3-sized decode layers) is set by the
host whenever the host's dispatch falls behind: the same point then moves by 30% between two runs
(benchmarks/NOTES.md, v7), while the peers, timed by CUDA events over graph replays, do not. This
module traces a burst of calls with ``jax.profiler`` and measures the span of the GPU's activity
instead: the union of the kernel intervals on the device plane, counting the gaps between them up
to ``max_gap_us`` (launch gaps inside a graph or between back-to-back calls) and dropping longer
ones (the GPU waiting for the host). That is the time a host that keeps up would see, which is what
the peers' event timing measures.

    from device_timer import device_time_per_call
    ms = device_time_per_call(lambda: step(*args), calls=50)   # None without a GPU plane
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
from typing import Any, Callable, Iterable

import jax

# Lines of the device plane that the profiler derives from the kernels (or that hold no kernels);
# stream lines carry the kernels themselves.
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework Name Scope", "Source code", "XLA TraceMe")


def busy_time_ns(intervals: Iterable[tuple[float, float]], max_gap_ns: float) -> float:
    """Length of the union of [start, end) intervals plus the gaps between consecutive merged
    intervals that are at most ``max_gap_ns`` long."""
    spans = sorted((s, e) for s, e in intervals if e >= s)
    if not spans:
        return 0.0
    total = 0.0
    cur_s, cur_e = spans[0]
    for s, e in spans[1:]:
        if s <= cur_e + max_gap_ns:  # overlapping, or a short gap: one busy stretch
            cur_e = max(cur_e, e)
        else:
            total += cur_e - cur_s
            cur_s, cur_e = s, e
    return total + (cur_e - cur_s)


SAMPLE_MARK = "hj_timed_sample_"  # host annotation around each traced sample


def device_events(xspace_path: str, marks: list | None = None) -> tuple[list[tuple[str, float, float]], list[str]] | None:
    """Kernel events (name, start ns, end ns) on the trace's GPU planes and the names of the lines
    they came from; None when the trace has no GPU plane (CPU backend). Stream lines are
    preferred; without any, every line but the derived ones is taken. ``marks``, when given,
    receives the host annotations named SAMPLE_MARK<i> as (i, start ns, end ns)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(xspace_path)
    if marks is not None:
        for plane in data.planes:
            if plane.name.lower().startswith("/host"):
                for ln in plane.lines:
                    marks.extend((int(ev.name[len(SAMPLE_MARK):]), ev.start_ns, ev.start_ns + ev.duration_ns)
                                 for ev in ln.events if ev.name.startswith(SAMPLE_MARK))
    planes = [p for p in data.planes if "/device:gpu" in p.name.lower()]
    if not planes:
        return None
    events, used = [], []
    for plane in planes:
        lines = list(plane.lines)
        streams = [ln for ln in lines if ln.name.lower().startswith("stream")]
        for ln in streams or [ln for ln in lines if ln.name not in DERIVED_LINES]:
            used.append(f"{plane.name}: {ln.name}")
            events.extend((ev.name, ev.start_ns, ev.start_ns + ev.duration_ns) for ev in ln.events)
    return events, used


def trace_calls(call: Callable[[], Any], calls: int, trace_dir: str | None = None, marks: list | None = None):
    """device_events of a profiler trace of ``calls`` calls (None without a GPU plane)."""
    with tempfile.TemporaryDirectory(dir=trace_dir) as d:
        with jax.profiler.trace(d):
            out = None
            for _ in range(calls):
                out = call()
            jax.block_until_ready(out)
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise RuntimeError(f"the profiler wrote no trace under {d}")
        return device_events(files[0], marks)


def kernel_table(events: Iterable[tuple[str, float, float]], calls: int) -> list[tuple[str, float, float]]:
    """(kernel name, launches per call, µs per call), the most time first."""
    per: dict[str, list[float]] = {}
    for name, s, e in events:
        per.setdefault(name, []).append(e - s)
    rows = [(name, len(d) / calls, sum(d) / calls / 1e3) for name, d in per.items()]
    return sorted(rows, key=lambda r: -r[2])


def launch_sequence(events: Iterable[tuple[str, float, float]], calls: int) -> list[tuple[str, float]] | None:
    """(kernel name, mean µs) of each launch position within a call, in launch order, so that two
    launches of one kernel (a layer's GEMM1 and GEMM2) are told apart; None unless every call
    launched the same sequence of kernels."""
    ordered = sorted(events, key=lambda e: e[1])
    if calls <= 0 or not ordered or len(ordered) % calls:
        return None
    per = len(ordered) // calls
    seqs = [ordered[c * per:(c + 1) * per] for c in range(calls)]
    names = [n for n, _, _ in seqs[0]]
    if any([n for n, _, _ in seq] != names for seq in seqs[1:]):
        return None
    return [(names[p], sum(seq[p][2] - seq[p][1] for seq in seqs) / calls / 1e3) for p in range(per)]


def device_time_per_call(call: Callable[[], Any], calls: int, *, max_gap_us: float = 10.0,
                         trace_dir: str | None = None) -> dict | None:
    """Runs ``call()`` ``calls`` times under a profiler trace (warm it first: compilation and graph
    recording would be counted) and returns {"ms": device time per call, "kernels": intervals seen,
    "lines": lines used, "sequence": launch_sequence of the calls}; None when the trace has no GPU
    plane."""
    found = trace_calls(call, calls, trace_dir)
    if found is None:
        return None
    events, lines = found
    if not events:
        raise RuntimeError(f"the trace's GPU plane holds no kernel events (lines: {lines})")
    busy = busy_time_ns(((s, e) for _, s, e in events), max_gap_us * 1e3)
    return {"ms": busy / calls / 1e6, "kernels": len(events), "lines": lines,
            "sequence": launch_sequence(events, calls)}


def assign_to_marks(intervals: Iterable[tuple[float, float]], marks: list[tuple[int, float, float]],
                    samples: int) -> list[list[tuple[float, float]]] | None:
    """The intervals grouped by the host annotation (sample index, start, end) holding their
    midpoint: a sample's kernels run between its first launch and its synchronization, both inside
    its annotation. None unless there is one mark per sample, each holding at least one interval,
    and every interval falls in one (the host and device clocks then agree)."""
    if sorted(i for i, _, _ in marks) != list(range(samples)):
        return None
    order = sorted(marks, key=lambda m: m[1])
    groups: list[list[tuple[float, float]]] = [[] for _ in range(samples)]
    for s, e in sorted((s, e) for s, e in intervals if e >= s):
        mid = 0.5 * (s + e)
        hit = next((i for i, a, b in order if a <= mid <= b), None)
        if hit is None:
            return None
        groups[hit].append((s, e))
    return groups if all(groups) else None


def traced_samples(run_sample: Callable[[], Any], samples: int, runs_per_sample: int, *,
                   max_gap_us: float = 10.0, trace_dir: str | None = None) -> dict | None:
    """Traces ``samples`` calls of ``run_sample``, back to back, each synchronized inside a host
    annotation, and returns per sample, in ms per run: the device time (busy_time_ns of its kernels:
    gaps up to ``max_gap_us`` counted, longer ones dropped), the gaps dropped, and the wall time.
    None when the trace has no GPU plane. ``run_sample`` must return what to block on.

    A sample's kernels are those inside its annotation (assign_to_marks). The samples follow each
    other with no pause, as the peers' event-timed samples do: pauses of 5 ms between samples let
    compute-bound kernels run up to 11% faster than in a continuous run (benchmarks/NOTES.md, v8)."""
    walls: list[float] = []

    def burst():
        out = None
        for i in range(samples):
            t0 = time.perf_counter()
            with jax.profiler.TraceAnnotation(f"{SAMPLE_MARK}{i}"):
                out = jax.block_until_ready(run_sample())
            walls.append(time.perf_counter() - t0)
        return out

    marks: list[tuple[int, float, float]] = []
    found = trace_calls(burst, 1, trace_dir, marks)
    if found is None:
        return None
    events, lines = found
    intervals = [(s, e) for _, s, e in events]
    groups, how = assign_to_marks(intervals, marks, samples), "annotations"
    if groups is None and marks and intervals:
        # Host and device clocks with different origins: the first kernel starts as the first
        # sample opens (less its launch latency, which the midpoint rule tolerates).
        off = min(s for s, _ in intervals) - min(a for _, a, _ in marks)
        groups = assign_to_marks(intervals, [(i, a + off, b + off) for i, a, b in marks], samples)
        how = "annotations, clocks aligned at the first kernel"
    if groups is None:
        raise RuntimeError(f"the trace's {len(events)} kernel events (on {lines}) do not fall into the {samples} "
                           f"samples' host annotations ({len(marks)} found), with or without aligning the clocks")
    busy = [busy_time_ns(g, max_gap_us * 1e3) for g in groups]
    span = [max(e for _, e in g) - g[0][0] for g in groups]
    per = runs_per_sample * 1e6
    return {"samples_ms": [b / per for b in busy],
            "gap_ms": [(s - b) / per for s, b in zip(span, busy)],
            "wall_ms": [w * 1e3 / runs_per_sample for w in walls],
            "split": how,
            "lines": lines}
