"""benchmarks/gpu_state.py: the GPU clock / power / throttle sampler behind each benchmark row's
`gpu_state`, checked on the CPU with a stand-in for nvidia-smi."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_state as gs  # noqa: E402


def test_parse_line_reads_clock_power_and_reasons():
    s = gs.parse_line("1515, 698.42, 0x0000000000000004\n", 3.0)
    assert s == gs.Sample(3.0, 1515.0, 698.42, 4)
    s = gs.parse_line("1980, [N/A], 0x0000000000000000", 1.0)
    assert s.sm_mhz == 1980.0 and s.power_w is None and s.reasons == 0
    assert gs.parse_line("garbage", 0.0) is None
    assert gs.parse_line("[N/A], [N/A], [N/A]", 0.0) is None


def test_summarize_leaves_idle_samples_out_and_collects_slowdowns():
    rng = np.random.default_rng()
    busy = rng.uniform(1400, 1980, size=9)
    samples = [gs.Sample(float(t), float(c), float(c) / 3, 0x4 if c < 1600 else 0) for t, c in enumerate(busy)]
    samples += [gs.Sample(100.0, 345.0, 80.0, 0x1), gs.Sample(101.0, 345.0, 81.0, 0x1)]
    out = gs.summarize(samples)
    assert out["samples"] == 9 and out["idle_samples"] == 2
    assert out["sm_mhz_median"] == pytest.approx(float(np.median(busy)))
    assert out["sm_mhz_min"] == pytest.approx(float(busy.min()))
    assert out["power_w_max"] == pytest.approx(float(busy.max()) / 3)
    n_slow = int((busy < 1600).sum())
    assert out["slowdown_samples"] == n_slow
    assert out.get("slowdown_reasons") == ("0x4" if n_slow else None)
    # Only idle samples: counted, no clock read from them.
    idle = gs.summarize([gs.Sample(0.0, 345.0, 80.0, 0x1)])
    assert idle == {"samples": 0, "idle_samples": 1, "slowdown_samples": 0}
    assert gs.summarize([]) is None
    text = gs.describe(out)
    assert text == (f"SM clock median {out['sm_mhz_median']} MHz, lowest {out['sm_mhz_min']}, "
                    f"power up to {out['power_w_max']} W")


def test_sampler_windows_over_a_stand_in_command(tmp_path):
    # Prints a throttled phase, then an unthrottled one, 20 ms apart, like `nvidia-smi -lms 20`.
    script = tmp_path / "fake_smi.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        for i in range(200):
            clock, reasons = (1500, 4) if i < 10 else (1980, 0)
            print(f"{clock}, 650.0, 0x{reasons:016x}", flush=True)
            time.sleep(0.02)
    """))
    sampler = gs.GpuStateSampler(command=[sys.executable, str(script)])
    t0 = time.monotonic()
    assert sampler.start() is None and sampler.running
    deadline = time.monotonic() + 20
    while len(sampler.samples) < 25 and time.monotonic() < deadline:
        time.sleep(0.01)
    t1 = time.monotonic()
    sampler.stop()
    assert not sampler.running
    assert len(sampler.samples) >= 25
    first = sampler.window(t0, sampler.samples[9].t)
    assert first["sm_mhz_median"] == 1500.0 and first["slowdown_samples"] == 10 and first["slowdown_reasons"] == "0x4"
    later = sampler.window(sampler.samples[10].t, t1)
    assert later["sm_mhz_min"] == 1980.0 and later["slowdown_samples"] == 0 and "slowdown_reasons" not in later
    assert sampler.window(t1 + 10, t1 + 20) is None  # no samples in the interval
    # Two intervals, one in each phase: both phases' samples, the slowed ones counted.
    both = sampler.windows([(sampler.samples[0].t, sampler.samples[1].t), (sampler.samples[20].t, sampler.samples[21].t)])
    assert both["samples"] == 4 and both["slowdown_samples"] == 2 and both["sm_mhz_min"] == 1500.0
    assert sampler.windows([]) is None
    n = len(sampler.samples)
    time.sleep(0.1)
    assert len(sampler.samples) == n  # stopped: nothing more is read


def test_sampler_without_the_command_says_why():
    sampler = gs.GpuStateSampler(command=["hj-no-such-command-for-gpu-state"])
    why = sampler.start()
    assert why is not None and "not found" in why
    assert not sampler.running
    assert sampler.window(0.0, time.monotonic()) is None
    sampler.stop()  # harmless
