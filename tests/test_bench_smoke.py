"""The peer-comparison benchmark (benchmarks/bench_moe.py) on CPU with a tiny shape: it runs, its
JSON follows BENCH.md's result format, peers that cannot run are recorded with a reason, and the
README section and targets check are generated from it."""

from __future__ import annotations

import json
import shutil
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import moe_setup as ms  # noqa: E402
import report  # noqa: E402

import humming_jax as hj  # noqa: E402


@pytest.mark.parametrize("fmt", sorted(ms.FORMATS))
def test_synthetic_weights_have_the_quantizer_layout(fmt):
    e, _, h, i = ms.SHAPES["tiny"]
    rng = np.random.default_rng(0)
    ref = hj.quantize_moe_weights(
        rng.standard_normal((e, 2 * i, h)).astype(np.float32) * 0.05,
        rng.standard_normal((e, h, i)).astype(np.float32) * 0.05,
        scheme=ms.FORMATS[fmt]["scheme"],
    )
    got = ms.synthetic_weights(fmt, e, h, i, seed=1)
    ref_leaves, ref_tree = jax.tree_util.tree_flatten(ref)
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    assert got_tree == ref_tree  # same fields present and the same static metadata
    assert [(a.shape, a.dtype) for a in got_leaves] == [(a.shape, a.dtype) for a in ref_leaves]
    w13, w2 = got.dequantize()
    for w in (w13, w2):
        w = np.asarray(w)
        assert np.all(np.isfinite(w)) and np.mean(w != 0) > 0.5
    # magnitudes keep the layer's intermediates O(1): x @ w13^T has unit scale for unit x
    assert 0.3 < float(np.sqrt(np.mean(np.square(np.asarray(w13))) * h)) < 3.0


def test_routing_sets_are_deterministic_distinct_and_skewed():
    a = ms.make_point("tiny", 64, "uniform", 2, seed=3)
    b = ms.make_point("tiny", 64, "uniform", 1, seed=3)
    np.testing.assert_array_equal(a.sets[0].topk_ids, b.sets[0].topk_ids)  # independent of the set count
    np.testing.assert_array_equal(a.sets[0].x, b.sets[0].x)
    assert not np.array_equal(a.sets[0].topk_ids, a.sets[1].topk_ids)
    e, k = ms.SHAPES["tiny"][:2]
    z = ms.make_point("tiny", 4096, "zipf1.2", 1, seed=3).sets[0].topk_ids
    for ids in (a.sets[0].topk_ids, z):
        assert ids.dtype == np.int32 and ids.shape[1] == k
        assert all(len(set(row)) == k for row in ids.tolist())
        assert ids.min() >= 0 and ids.max() < e
    counts = np.bincount(z.reshape(-1), minlength=e)
    assert counts.max() > 2 * counts.mean()
    np.testing.assert_allclose(a.sets[0].topk_weights.sum(1), 1.0, rtol=1e-5)
    assert ms.num_sets_for(1e6, None) == ms.MAX_SETS and ms.num_sets_for(1e12, None) == 1


def _bench(out: Path, *extra: str) -> subprocess.CompletedProcess:
    # CPU only, also on the GPU machine: no CUDA device for torch, so its peers record "skipped"
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    cmd = [
        sys.executable, str(BENCH / "bench_moe.py"), "--shapes", "tiny", "--tokens", "2", "--formats", "bf16",
        "--zipf-tokens", "0", "--sets", "2", "--repeats", "2", "--warmup", "0", "--ceiling-matmul-n", "64",
        "--ceiling-copy-mib", "4", "--no-plot", "--out", str(out), *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_bench_moe_gemms_part_hands_the_grouped_class_k_ordered_rows(tmp_path):
    """At a point the 4-bit mainloop takes (tiny mxfp4, 32 rows per expert), the grouped class asks
    permute_rows for rows in the mainloop's k order; the gemms part's prepared rows must come in that
    order too (jax_systems._fixed_routing), else the part would fail or time wrong values."""
    out = tmp_path / "order.json"
    proc = _bench(out, "--formats", "w4a16-mxfp4", "--tokens", "128", "--systems", "humming_jax/grouped",
                  "--parts", "gemms", "--all-parts")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["part"]) for r in rows] == [("humming_jax/grouped", "gemms")]
    assert rows[0].get("error") is None and rows[0]["median_ms"] > 0


def test_fixed_routing_gives_the_rows_in_the_order_asked_for():
    """The gemms part's stand-in for permute_rows returns the prepared rows in the order the class
    asks for (k_order), and refuses an order that was not prepared."""
    import jax_systems as js
    from humming_jax.ops import routing as routing_ops

    natural, ordered = np.zeros((4, 64)), np.ones((4, 64))
    with js._fixed_routing(None, None, (natural, ordered)) as used:
        assert routing_ops.permute_rows("x", "routing", 2) is natural
        assert routing_ops.permute_rows("x", "routing", 2, k_order=True) is ordered
    assert used["n"] == 2
    with js._fixed_routing(None, None, (natural, None)):
        with pytest.raises(RuntimeError, match="k order"):
            routing_ops.permute_rows("x", "routing", 2, k_order=True)


def test_bench_moe_stops_at_its_time_budget(tmp_path):
    out = tmp_path / "budget.json"
    proc = _bench(out, "--time-budget-s", "0.001")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert report.check_schema(data) == [] and data["rows"] == []
    assert data["not_run"] == [{"what": "tiny bf16", "why": "time budget"}]


def test_bench_moe_smoke_on_cpu(tmp_path):
    out = tmp_path / "smoke.json"
    proc = _bench(out, "--all-parts")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert report.check_schema(data) == []
    assert data["harness"] == "bench_moe" and "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL" in data["xla_flags"]
    assert data["ceilings"]["copy_tbps"] > 0 and data["ceilings"]["bf16_tflops"] > 0
    rows = {(r["system"], r["part"]): r for r in data["rows"]}
    for system in ("humming_jax", "humming_jax/indexed", "humming_jax/grouped", "ragged_dot"):
        for part in ("layer", "gemms"):
            r = rows[(system, part)]
            assert r.get("error") is None and r["median_ms"] > 0 and r["samples"] == 2 and r["chain"] == 2
            assert r["bytes"] > 0 and r["flops"] == ms.layer_flops(2, 2, 256, 256)
    assert rows[("humming_jax/batched", "gemms")]["median_ms"] > 0
    for system in ("humming_jax", "humming_jax/indexed", "humming_jax/grouped"):
        layer = rows[(system, "layer")]
        assert layer["check"] == "ok" and layer["rel_err_vs_ragged_dot"] < 1e-2
    assert rows[("humming_jax", "layer")]["selected"] in ("IndexedExperts", "GroupedExperts")
    # peers that cannot run here are recorded with the reason, never dropped
    for key in (("torch_grouped_mm", "layer"), ("torch_grouped_mm", "gemms"), ("humming_kernels", "gemms")):
        assert rows[key]["median_ms"] is None and rows[key]["error"].startswith("skipped")
    assert "median ms per layer" in proc.stdout and "around the GEMMs" in proc.stdout

    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Performance\n\n<!-- bench:begin -->\nold\n<!-- bench:end -->\ntail\n")
    gen = subprocess.run([sys.executable, str(BENCH / "readme_table.py"), str(out), "--readme", str(readme)],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    text = readme.read_text()
    assert "old" not in text and text.endswith("<!-- bench:end -->\ntail\n")
    assert "| smoke | tiny | bf16 | 2 |" in text and "skipped" in text
    check = subprocess.run([sys.executable, str(BENCH / "readme_table.py"), str(out), "--readme", str(readme), "--check"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0
    # FILE:-FORMAT leaves a format's rows of that run out (a later run measured them again)
    gen = subprocess.run([sys.executable, str(BENCH / "readme_table.py"), f"{out}:-bf16", "--readme", str(readme)],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    text = readme.read_text()
    assert "| smoke | tiny | bf16 | 2 |" not in text and "(without its bf16 rows)" in text
    # FILE:-FORMAT@SHAPE leaves one shape's rows of a format out, and only those
    for drop, gone in (("bf16@tiny", True), ("bf16@other-shape", False)):
        gen = subprocess.run([sys.executable, str(BENCH / "readme_table.py"), f"{out}:-{drop}", "--readme", str(readme)],
                             capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0, gen.stderr
        text = readme.read_text()
        assert ("| smoke | tiny | bf16 | 2 |" not in text) == gone and f"(without its {drop} rows)" in text
    # Without files, the section's own list (and what it leaves out) is checked and regenerated.
    check = subprocess.run([sys.executable, str(BENCH / "readme_table.py"), "--readme", str(readme), "--check"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    readme.write_text(text.replace("Runs (ceilings measured in each):", "Runs (edited by hand):"))
    check = subprocess.run([sys.executable, str(BENCH / "readme_table.py"), "--readme", str(readme), "--check"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 1 and "out of date" in check.stdout
    targets = report.check_targets(data)
    assert {t["status"] for t in targets} <= {"met", "missed", "not measured"} and len(targets) == 6


def test_env_sweep_times_every_value_in_turn(tmp_path):
    out = tmp_path / "sweep.json"
    env = {**os.environ, "HUMMING_JAX_DECODE_WK": "2"}
    res = subprocess.run([sys.executable, str(BENCH / "sweep_env.py"), "--var", "HUMMING_JAX_DECODE_WK", "--values",
                          "unset,1", "--shapes", "tiny", "--formats", "bf16", "--tokens", "1", "--repeats", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["var"] == "HUMMING_JAX_DECODE_WK" and data["values"] == ["unset", "1"] and data["part"] == "gemms"
    (row,) = data["rows"]
    assert set(row["ms"]) == {"unset", "1"} and all(len(v) == 2 for v in row["samples_ms"].values())
    assert all(v > 0 for v in row["ms"].values())


def test_env_sweep_xla_flags_replace_the_serving_ones(monkeypatch):
    from bench_moe import SERVING_XLA_FLAGS
    from sweep_env import _added_xla_flags

    monkeypatch.setattr(sys, "argv", ["sweep_env.py", "--var", "HUMMING_JAX_PDL", "--values", "unset,0"])
    assert _added_xla_flags() == SERVING_XLA_FLAGS
    monkeypatch.setattr(sys, "argv", ["sweep_env.py", "--xla-flags=--xla_gpu_enable_command_buffer=", "--part", "layer"])
    assert _added_xla_flags() == "--xla_gpu_enable_command_buffer="
    monkeypatch.setattr(sys, "argv", ["sweep_env.py", "--xla-flags", "", "--tokens", "1"])
    assert _added_xla_flags() == ""


def test_launch_medians_take_each_position_apart_and_refuse_differing_kernels():
    from sweep_env import launch_medians

    rng = np.random.default_rng()
    us = rng.uniform(1, 100, (5, 3))
    names = ["gemm", "act", "gemm"]  # one kernel launched twice: told apart by position
    seqs = [[(n, float(u)) for n, u in zip(names, row)] for row in us]
    got = launch_medians(seqs)
    assert [n for n, _ in got] == names
    np.testing.assert_allclose([u for _, u in got], np.median(us, axis=0), rtol=1e-12)
    assert launch_medians(seqs + [[("gemm", 1.0), ("other", 1.0), ("gemm", 1.0)]]) is None


def test_busy_time_merges_overlaps_and_counts_only_short_gaps():
    from device_timer import busy_time_ns

    rng = np.random.default_rng()
    starts = np.sort(rng.uniform(0, 1e6, 40))
    spans = [(float(s), float(s + d)) for s, d in zip(starts, rng.uniform(10, 5e4, 40))]
    # Reference by painting a 1-ns grid: busy where any interval covers, plus gaps <= the limit.
    grid = np.zeros(int(max(e for _, e in spans)) + 2, bool)
    for s, e in spans:
        grid[int(np.ceil(s)):int(np.ceil(e))] = True
    for gap in (0.0, 2e3, 1e9):
        idle = np.flatnonzero(~grid[: int(np.ceil(max(e for _, e in spans)))])
        painted = grid.copy()
        first, last = np.flatnonzero(grid)[[0, -1]]
        runs = np.split(idle, np.flatnonzero(np.diff(idle) > 1) + 1) if idle.size else []
        for r in runs:
            if r.size and r[0] > first and r[-1] < last and r.size <= gap:
                painted[r] = True
        assert abs(busy_time_ns(spans, gap) - painted.sum()) <= 2 * len(spans), gap
    assert busy_time_ns([], 1e3) == 0.0
    assert busy_time_ns([(0, 10), (5, 20), (25, 30)], 4) == 25 and busy_time_ns([(0, 10), (5, 20), (25, 30)], 5) == 30


def test_device_timer_reports_no_device_plane_on_the_cpu():
    from device_timer import device_time_per_call

    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU backend's answer")
    f = jax.jit(lambda x: (x @ x).sum())
    x = jax.numpy.ones((64, 64))
    f(x).block_until_ready()
    assert device_time_per_call(lambda: f(x), 3) is None


def test_kernel_table_sums_per_name_and_call():
    from device_timer import kernel_table

    rng = np.random.default_rng()
    names = ["gemm", "act", "finalize"]
    events, want = [], {n: 0.0 for n in names}
    for _ in range(60):
        n = names[int(rng.integers(3))]
        s = float(rng.uniform(0, 1e6))
        d = float(rng.uniform(100, 5e4))
        events.append((n, s, s + d))
        want[n] += d
    table = kernel_table(events, calls=3)
    assert [r[2] for r in table] == sorted((r[2] for r in table), reverse=True)
    for name, per_call, us in table:
        assert per_call == sum(1 for e in events if e[0] == name) / 3
        assert abs(us - want[name] / 3 / 1e3) < 1e-6 * max(1.0, us)


def test_launch_sequence_tells_launches_of_one_kernel_apart():
    from device_timer import launch_sequence

    rng = np.random.default_rng()
    seq = ["routing", "gemm", "act", "gemm", "finalize"]
    dur = rng.uniform(1e3, 9e4, len(seq))  # ns per position, the two gemms different
    events, t = [], 0.0
    for c in range(4):
        for name, d in zip(seq, dur):
            jitter = float(rng.uniform(-50, 50))
            events.append((name, t, t + d + jitter))
            t += d + 2e3
    rng.shuffle(events)  # the trace's order is not launch order
    got = launch_sequence([tuple(e) for e in events], calls=4)
    assert [n for n, _ in got] == seq
    for (_, us), d in zip(got, dur):
        assert abs(us - d / 1e3) < 0.05 + 1e-6 * us
    assert launch_sequence(events[:-1], calls=4) is None  # a call with a launch missing
    swapped = [("act" if n == "finalize" and s > t / 2 else n, s, e) for n, s, e in events]
    assert launch_sequence(swapped, calls=4) is None  # calls with different sequences


def test_device_timer_mode_refuses_a_backend_without_a_gpu_timeline():
    import jax_systems as js

    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU backend's answer")
    f = jax.jit(lambda c: c * 1.5 + 1.0)
    with pytest.raises(RuntimeError, match="no GPU plane"):
        js.time_jax(f, jax.numpy.ones((8,)), repeats=3, warmup=1, chain=1, timer="device")


def test_assign_to_marks_groups_by_annotation_and_refuses_a_misaligned_clock():
    from device_timer import assign_to_marks

    rng = np.random.default_rng()
    n = int(rng.integers(3, 8))
    marks, groups, t = [], [], 0.0
    for i in range(n):
        a = t
        g, u = [], a + float(rng.uniform(1e3, 2e4))  # the first launch comes after the mark opens
        for _ in range(int(rng.integers(1, 10))):
            g.append((u, u + float(rng.uniform(100, 3e4))))
            u = g[-1][1] + float(rng.uniform(0, 4e6))  # any gap inside a sample, even a long one
        b = u + float(rng.uniform(1e3, 1e4))  # synchronized before the mark closes
        marks.append((i, a, b))
        groups.append(g)
        t = b + 5e6
    flat = [iv for g in groups for iv in g]
    rng.shuffle(flat)
    rng.shuffle(marks)
    got = assign_to_marks(flat, marks, n)
    assert got is not None and got == [sorted(g) for g in groups]
    assert assign_to_marks(flat, marks[1:], n) is None  # a mark missing
    shifted = [(i, a + 1e9, b + 1e9) for i, a, b in marks]  # host and device clocks apart
    assert assign_to_marks(flat, shifted, n) is None


def test_timer_check_refuses_the_cpu_with_a_clear_message():
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU backend's answer")
    res = subprocess.run([sys.executable, str(BENCH / "timer_check.py"), "--points", "tiny:1"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "run it on the GPU machine" in res.stderr, res.stderr[-2000:]


def test_library_ab_runs_each_build_in_turn_and_checks_the_names(tmp_path):
    """ab_libraries.py: two named builds, one process each per round, one table of their medians. A
    missing build stops it first. With CUDA the builds are copies of the loaded library (a process on
    a GPU loads the file it is given); on the CPU, stand-in files (no CUDA library is loaded there)."""
    real = hj._ffi.backend_report()["cuda"]
    libs = []
    for name in ("old", "new"):
        dst = tmp_path / f"{name}.so"
        if real:
            shutil.copyfile(real, dst)
        else:
            dst.write_bytes(name.encode())
        libs += ["--lib", f"{name}={tmp_path / name}.so"]
    out = tmp_path / "ab.json"
    sweep = ["--shapes", "tiny", "--formats", "bf16", "--tokens", "1", "--repeats", "2"]
    res = subprocess.run([sys.executable, str(BENCH / "ab_libraries.py"), *libs, "--rounds", "2", "--out", str(out),
                          "--", *sweep], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert list(data["libs"]) == ["old", "new"] and data["rounds"] == 2
    assert "after round 1:" in res.stdout and "after round 2:" in res.stdout, "each round is reported"
    (pt,) = data["points"]
    assert (pt["shape"], pt["format"], pt["M"]) == ("tiny", "bf16", 1)
    assert pt["vs_first"]["old"] == 1.0 and pt["ms"]["new"] > 0 and pt["ms"]["old"] > 0
    for name in ("old", "new"):
        assert len(data["runs"][name]) == 2
        for run in data["runs"][name]:
            assert run["var"] == "HUMMING_JAX_CUDA_LIB" and run["values"] == [data["libs"][name]]
    bad = subprocess.run([sys.executable, str(BENCH / "ab_libraries.py"), "--lib", f"old={tmp_path / 'old.so'}",
                          "--lib", f"gone={tmp_path / 'gone.so'}", "--", *sweep], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "gone.so is not a file" in bad.stderr


def test_decode_split_fit_mirrors_the_plan_and_ranks_the_rules():
    """fit_decode_split.py on the committed per-GEMM sweeps: its copy of plan()'s candidates gives
    the splits the H200 logged (HUMMING_JAX_DECODE_LOG=1, v11k call 3) under the two earlier rules
    (HUMMING_JAX_DECODE_PLAN=resident, =bytes) and those an H100 logged under the rule in force,
    and the rule in force is closer to the per-GEMM best than both on each sweep (an H200's two,
    an H100's one)."""
    import fit_decode_split as fds

    logged = {  # (format, N, K, experts, routed rows): (resident rule's wk, v11k rule's wk)
        ("w8a8-fp8-block128", 1536, 2048, 128, 8): (8, 4),
        ("w8a8-fp8-block128", 2048, 768, 128, 8): (8, 4),
        ("w4a16-int4-g128", 4096, 7168, 32, 32): (1, 2),
        ("w4a16-int4-g128", 1536, 2048, 128, 32): (2, 2),
        ("w4a16-int4-g128", 2048, 768, 128, 32): (2, 1),
        ("w4a16-int4-g128", 4096, 14336, 8, 2): (8, 8),
        ("w8a8-fp8-block128", 28672, 4096, 8, 2): (2, 4),
        ("bf16", 7168, 2048, 32, 8): (2, 4),
    }
    for (fmt, n, k, e, rows), (old, new) in logged.items():
        cs = fds.candidates(fmt, n, k, e, rows)
        assert (fds.by_resident(cs), fds.by_time()(cs)) == (old, new), (fmt, n, k, e, rows)
    sweep = BENCH / "results" / "h200" / "2026-12-03-sweep-decode-wk-per-gemm.json"
    items = fds.gemms(json.loads(sweep.read_text()))
    assert len(items) == 72 and all(set(it["us"]) == {c.wk for c in it["cands"]} for it in items)
    old, new = fds.evaluate(items, fds.by_resident), fds.evaluate(items, fds.by_time())
    assert new["total"] < old["total"] and new["worst"] < old["worst"]
    # The splits an H100 logged under the rule in force (v40 call 1, plans.txt): (format, N, K,
    # experts, routed rows, GEMM1 pairing its halves, so at most 4 K groups): wk.
    logged_near = {
        ("bf16", 1536, 2048, 128, 128, True): 4, ("bf16", 1536, 2048, 128, 8, True): 4,
        ("w4a16-int4-g128", 1536, 2048, 128, 128, True): 1, ("w4a16-int4-g128", 1536, 2048, 128, 8, True): 4,
        ("bf16", 2048, 768, 128, 128, False): 1, ("bf16", 2048, 768, 128, 8, False): 4,
        ("w4a16-int4-g128", 2048, 768, 128, 128, False): 1, ("w4a16-int4-g128", 2048, 768, 128, 8, False): 4,
        ("bf16", 28672, 4096, 8, 32, True): 4, ("bf16", 28672, 4096, 8, 2, True): 4,
        ("w4a16-int4-g128", 28672, 4096, 8, 32, True): 1, ("w4a16-int4-g128", 28672, 4096, 8, 2, True): 1,
        ("bf16", 4096, 14336, 8, 32, False): 8, ("bf16", 4096, 14336, 8, 2, False): 8,
        ("w4a16-int4-g128", 4096, 14336, 8, 32, False): 4, ("w4a16-int4-g128", 4096, 14336, 8, 2, False): 8,
        ("bf16", 4096, 7168, 32, 128, True): 4, ("bf16", 4096, 7168, 32, 8, True): 4,
        ("w4a16-int4-g128", 4096, 7168, 32, 128, True): 2, ("w4a16-int4-g128", 4096, 7168, 32, 8, True): 2,
        ("bf16", 7168, 2048, 32, 128, False): 2, ("bf16", 7168, 2048, 32, 8, False): 4,
        ("w4a16-int4-g128", 7168, 2048, 32, 128, False): 1, ("w4a16-int4-g128", 7168, 2048, 32, 8, False): 1,
    }
    for (fmt, n, k, e, rows, gated), wk in logged_near.items():
        cs = fds.candidates(fmt, n, k, e, rows, max_wk=4 if gated else 8)
        assert fds.by_time_near()(cs) == wk, (fmt, n, k, e, rows, gated)
    h100 = [BENCH / "results" / "h100" / f"2026-12-07-v39-call{c}-sweep-decode-wk-{m}.json"
            for c, m in (("5", "m1-4"), ("4", "m16"), ("5", "m16-bf16"))]
    v11u = BENCH / "results" / "h200" / "2026-12-04-v11u-sweep-decode-wk-per-gemm.json"
    for sweep_items in (fds.gemms(json.loads(sweep.read_text()), stages=4),
                        fds.gemms(json.loads(v11u.read_text()), stages=4),
                        [it for f in h100 for it in fds.gemms(json.loads(f.read_text()), gemm2_from_total=True)]):
        v11k, near = fds.evaluate(sweep_items, fds.by_time()), fds.evaluate(sweep_items, fds.by_time_near())
        assert near["total"] < v11k["total"] - 0.005 and near["worst"] <= v11k["worst"]

    # A sweep of the one-call experts (GEMM2 launched dependent on GEMM1, so its own duration holds
    # its wait on GEMM1's tail): with gemm2_from_total, GEMM2 is the call's median less GEMM1.
    one_call = BENCH / "results" / "h100" / "2026-12-07-v39-call4-sweep-decode-wk-m16.json"
    data = json.loads(one_call.read_text())
    row = data["rows"][0]
    plain, from_total = fds.gemms(data), fds.gemms(data, gemm2_from_total=True)
    g1, g2 = (us for _, us in row["launches_us"]["1"])  # the forced wk = 1, one input set
    assert plain[0]["us"] == from_total[0]["us"] and plain[1]["us"][1] == g2
    assert abs(from_total[1]["us"][1] - (1000 * row["ms"]["1"] - g1)) < 1e-9 and from_total[1]["us"][1] < g2


def test_sweep_launches_splits_gemms_and_names_the_kernels(capsys):
    """sweep_launches.py on a made-up device-timer sweep: two input sets per call, each GEMM1 (a
    GEMM launch followed by the activation) and GEMM2; the kernel of each value named from the
    trace's names (the mma.sync decode kernel, the fp8 ring kernel, or both in one call; the
    quantization and activation kernels named by neither)."""
    import sweep_launches as sl

    mma = ("void hj::decode::decode_kernel<(hj::WeightType)3, (hj::decode::ActKind)2, (hj::decode::Deq)4, "
           "true, true>(hj::decode::DecodeLaunch)")
    ring = "hj::decode::(anonymous namespace)::fp8_ring_kernel(hj::decode::(anonymous namespace)::RingLaunch)"
    act, quant = "void hj::activation_kernel<1>(...)", "void hj::group_quant_vec_kernel<1, 4, 16>(...)"

    def call(k1, g1, g2, k2=None):  # quantize, GEMM1, activation, GEMM2 of two input sets, interleaved
        k2 = k2 or k1
        return [[quant, 2.0], [quant, 2.1], [k1, g1[0]], [act, 3.0], [k1, g1[1]], [act, 3.1], [k2, g2[0]],
                [k2, g2[1]]]

    data = {"rows": [{"shape": "qwen3-30b-a3b", "format": "w8a8-fp8-block128", "M": 16, "sets": 2,
                      "ms": {"unset": 0.12, "1": 0.11, "2": 0.13},
                      "launches_us": {"unset": call(mma, (70.0, 72.0), (44.0, 46.0)),
                                      "1": call(ring, (66.0, 68.0), (40.0, 41.0)),
                                      "2": call(ring, (73.0, 73.0), (48.0, 50.0), mma)}}]}
    got = {e["value"]: e for e in sl.summarize(data)}
    assert got["unset"]["gemm1_us"] == 71.0 and got["unset"]["gemm2_us"] == 45.0
    assert got["1"]["gemm1_us"] == 67.0 and got["1"]["gemm2_us"] == 40.5
    assert [got[v]["kernels"] for v in ("unset", "1", "2")] == ["decode", "ring", "decode+ring"]
    assert got["2"]["gemm2_us"] == 49.0 and got["1"]["ms"] == 0.11


def test_readme_table_reads_its_sources_from_the_section(tmp_path):
    """The section's first line names its result files and the formats left out of each; without
    file arguments readme_table.py uses exactly that list, and a named file that is gone is an error."""
    import readme_table as rt

    root = tmp_path
    text = ("# x\n<!-- bench:begin -->\nGenerated by `benchmarks/readme_table.py` from `r/a.json` (without its "
            "bf16, w8a8-fp8-block128 rows), `r/b.json`. Each ratio is `r/not-a-source.json` ...\nrest\n"
            "<!-- bench:end -->\n")
    got = rt.files_in_readme(text, root)
    assert got == [(root / "r/a.json", ("bf16", "w8a8-fp8-block128")), (root / "r/b.json", ())]
    assert rt.files_in_readme("# x\n<!-- bench:begin -->\nNo H200 results yet\n<!-- bench:end -->\n", root) == []
    readme = tmp_path / "README.md"
    readme.write_text(text)
    with pytest.raises(SystemExit, match="not here: .*a.json"):
        rt.main(["--readme", str(readme), "--check"])
    with pytest.raises(SystemExit, match="one or the other"):
        rt.main(["--all", "x.json", "--readme", str(readme)])


def test_the_readme_performance_section_is_current():
    """README.md's performance section is what readme_table.py builds from the runs it names."""
    import readme_table as rt

    assert rt.main(["--check"]) == 0, "run: python benchmarks/readme_table.py"


def test_readme_table_leaving_a_format_out_keeps_the_runs_bf16_peers(tmp_path):
    """FILE:-bf16 drops our bf16 rows and humming-kernels' but keeps torch's and ragged_dot's: a
    quantized row of that run is still compared with the torch bf16 row measured beside it."""
    import readme_table as rt

    rng = np.random.default_rng()
    t_ours, t_torch, t_rd = rng.uniform(0.5, 2.0, 3)

    def row(system, fmt, part, ms):
        return {"system": system, "format": fmt, "shape": "tiny", "M": 16, "part": part, "median_ms": ms,
                "bytes": 1000, "flops": 10}

    rows = [row(s, f, p, ms) for s, f, ms in (("humming_jax", "w4a16-int4-g128", t_ours),
                                              ("humming_jax", "bf16", t_ours * 2),
                                              ("humming_kernels", "bf16", t_ours * 3),
                                              ("torch_grouped_mm", "bf16", t_torch),
                                              ("ragged_dot", "bf16", t_rd)) for p in ("layer", "gemms")]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"harness": "bench_moe", "rows": rows}))
    data = rt.load_without(path, ("bf16",))
    left = {(r["system"], r["format"]) for r in data["rows"]}
    assert left == {("humming_jax", "w4a16-int4-g128"), ("torch_grouped_mm", "bf16"), ("ragged_dot", "bf16")}
    table = report.markdown_table([("run", data)])
    assert "| tiny | bf16 |" not in table
    line = next(l for l in table.splitlines() if "| tiny | w4a16-int4-g128 |" in l)
    assert f"{t_torch / t_ours:.2f}×" in line and f"{t_rd / t_ours:.2f}×" in line


def test_readme_table_gives_a_refused_shape_one_line_with_its_reason():
    """A block whose every row of ours failed the same input check is one line naming the check; a
    block with one measured point keeps its lines (its failures show as errors)."""
    rng = np.random.default_rng()
    ms = float(rng.uniform(0.5, 2.0))
    why = f"group size 128 does not divide {int(rng.integers(129, 4000)) | 1} columns"

    def row(system, fmt, m, part, **kw):
        return {"system": system, "format": fmt, "shape": "tiny", "M": m, "part": part, "median_ms": None,
                "bytes": 1000, "flops": 10} | kw

    rows = [row(s, "w8a8-fp8-block128", m, p, error=f"ValueError: {why}")
            for s in ("humming_jax", "humming_jax/indexed") for m in (1, 16, 128) for p in ("layer", "gemms")]
    rows += [row("humming_jax", "bf16", 1, p, median_ms=ms) for p in ("layer", "gemms")]
    rows += [row("humming_jax", "bf16", 16, p, error="RuntimeError: CUDA error") for p in ("layer", "gemms")]
    table = report.markdown_table([("run", {"rows": rows})])
    fp8 = [l for l in table.splitlines() if "| w8a8-fp8-block128 |" in l]
    assert fp8 == [f"| run | tiny | w8a8-fp8-block128 | all | not supported: {why} | — | — | — | — | — | — |"]
    bf16 = [l for l in table.splitlines() if "| bf16 |" in l]
    assert len(bf16) == 2 and f"{ms:.3f}" in bf16[0] and "| error |" in bf16[1]
