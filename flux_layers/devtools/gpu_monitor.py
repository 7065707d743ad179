"""SM clock and power of the GPUs while a benchmark runs, sampled by ``nvidia-smi`` (read-only queries).

    with GpuSampler() as sampler:
        ... run; note (label, start, end) wall-clock windows ...
    sampler.summary(windows, gpu=0)  # {label: {"sm_clock_mhz": mean, "power_w": mean, "samples": n}}

Samples carry nvidia-smi's own timestamps (its output reaches us in buffered bursts, seconds late), read as local
time like ``time.time()``. The period is 100 ms by default, so a window shorter than a few periods gets few
samples; the summary says how many. nvidia-smi's power reading is its own running average.
"""
from __future__ import annotations

import datetime
import shutil
import subprocess
import threading
from statistics import mean

QUERY = "timestamp,index,clocks.sm,power.draw"
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"


class GpuSampler:
    def __init__(self, interval_ms: int = 100, command: list[str] | None = None):
        self.command = command or ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                   f"-lms={interval_ms}"]
        self.samples: list[tuple[float, int, float, float]] = []  # (time, gpu, MHz, W)
        self._proc = None
        self._thread = None

    @staticmethod
    def available() -> bool:
        return shutil.which("nvidia-smi") is not None

    def __enter__(self) -> "GpuSampler":
        self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            fields = [f.strip() for f in line.split(",")]
            try:
                t = datetime.datetime.strptime(fields[0], TIMESTAMP).timestamp()
                self.samples.append((t, int(fields[1]), float(fields[2]), float(fields[3])))
            except (ValueError, IndexError):
                continue  # "[N/A]" or a partial line

    def __exit__(self, *exc) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._thread.join(timeout=5)

    def summary(self, windows: list[tuple[str, float, float]], gpu: int) -> dict:
        """Mean SM clock and power of GPU ``gpu`` over the samples inside each label's windows."""
        out = {}
        for label in dict.fromkeys(w[0] for w in windows):
            inside = [(mhz, w) for t, g, mhz, w in self.samples if g == gpu
                      and any(lab == label and a <= t <= b for lab, a, b in windows)]
            out[label] = {"sm_clock_mhz": mean(s[0] for s in inside) if inside else None,
                          "power_w": mean(s[1] for s in inside) if inside else None, "samples": len(inside)}
        return out
