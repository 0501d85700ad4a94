"""The GPU's clock, power and throttle state while a benchmark runs, so that each timed row says
under which clock it was timed.

An H200 running fp8 GEMMs back to back reaches its 700 W limit within a second or two and holds
the SM clock at ~1500 MHz instead of 1980 (benchmarks/NOTES.md, v23): the same layer timed from an
idle card and under sustained load differed by 17%. `GpuStateSampler` runs `nvidia-smi` in its
loop mode in the background and keeps each sample with the host's monotonic clock; `window(t0, t1)`
summarizes the samples of a timed interval. Without `nvidia-smi` (the CPU), `start` says why and
every window is None.
"""

from __future__ import annotations

import atexit
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

# clocks_event_reasons bits (NVML): software power cap, hardware slowdown, software thermal
# slowdown, hardware thermal slowdown, hardware power brake. Idle (0x1) and the application clock
# setting (0x2) are not slowdowns.
SLOWDOWN_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
IDLE_BIT = 0x1  # the GPU had no work: a compilation or the host's set-up, not a timed kernel
QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


@dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic() when the line was read
    sm_mhz: float | None
    power_w: float | None
    reasons: int | None


def parse_line(line: str, t: float) -> Sample | None:
    """One `--format=csv,noheader,nounits` line of QUERY: "1980, 650.12, 0x0000000000000004"."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None

    def num(s: str) -> float | None:
        try:
            return float(s)
        except ValueError:  # "[N/A]", "[Not Supported]"
            return None

    try:
        reasons = int(parts[2], 16)
    except ValueError:
        reasons = None
    sm, pw = num(parts[0]), num(parts[1])
    if sm is None and pw is None and reasons is None:
        return None
    return Sample(t, sm, pw, reasons)


def summarize(samples: Sequence[Sample]) -> dict | None:
    """Median and lowest SM clock, highest power, and how many samples had a slowdown reason, over
    the samples at which the GPU was busy (idle ones are only counted: a window that holds a
    compilation would otherwise read the idle clock)."""
    if not samples:
        return None
    idle = sum(1 for s in samples if s.reasons is not None and s.reasons & IDLE_BIT)
    samples = [s for s in samples if s.reasons is None or not s.reasons & IDLE_BIT]
    if not samples:
        return {"samples": 0, "idle_samples": idle, "slowdown_samples": 0}
    clocks = [s.sm_mhz for s in samples if s.sm_mhz is not None]
    power = [s.power_w for s in samples if s.power_w is not None]
    slowed = [s for s in samples if s.reasons is not None and s.reasons & SLOWDOWN_BITS]
    out: dict = {"samples": len(samples), "idle_samples": idle, "slowdown_samples": len(slowed)}
    if clocks:
        out["sm_mhz_median"] = statistics.median(clocks)
        out["sm_mhz_min"] = min(clocks)
    if power:
        out["power_w_max"] = max(power)
    reasons = 0
    for s in slowed:
        reasons |= s.reasons & SLOWDOWN_BITS
    if reasons:
        out["slowdown_reasons"] = hex(reasons)
    return out


def describe(summary: dict) -> str:
    """A summary's clocks and power in words (the line the benchmarks print beside their timings)."""
    return (f"SM clock median {summary.get('sm_mhz_median')} MHz, lowest {summary.get('sm_mhz_min')}, "
            f"power up to {summary.get('power_w_max')} W")


class GpuStateSampler:
    """`nvidia-smi --query-gpu=QUERY -lms PERIOD` read by a background thread.

    command: the command to run instead (tests); its stdout must be QUERY's csv lines.
    """

    def __init__(self, period_ms: int = 100, gpu: int = 0, command: Sequence[str] | None = None):
        self.period_ms = period_ms
        self.command = list(command) if command is not None else [
            "nvidia-smi", f"--id={gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(period_ms)]
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None

    def start(self) -> str | None:
        """Starts sampling; returns None, or why there will be no samples."""
        if shutil.which(self.command[0]) is None:
            return f"{self.command[0]} not found"
        try:
            self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as exc:
            return f"{self.command[0]}: {exc}"
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # a run that ends early leaves no sampler behind (it would die of SIGPIPE)
        return None

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            s = parse_line(line, time.monotonic())
            if s is not None:
                with self._lock:
                    self.samples.append(s)

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._proc = None

    def window(self, t0: float, t1: float) -> dict | None:
        """The summary of the samples read between t0 and t1 (time.monotonic()), or None."""
        return self.windows([(t0, t1)])

    def windows(self, intervals: Sequence[tuple[float, float]]) -> dict | None:
        """The summary of the samples read inside any of the intervals (e.g. one variant's samples
        when variants are timed in turn), or None."""
        with self._lock:
            inside = [s for s in self.samples if any(t0 <= s.t <= t1 for t0, t1 in intervals)]
        return summarize(inside)

    def overall(self) -> dict | None:
        with self._lock:
            return summarize(list(self.samples))
