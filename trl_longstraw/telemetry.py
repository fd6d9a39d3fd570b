"""Per-phase wall time and peak memory, collected for the trainer's logs (and so W&B, TensorBoard, the console).

Peak memory is the CUDA allocator's `max_memory_allocated` when the phase runs on CUDA; otherwise it is the process
resident-set high-water mark (Linux `VmHWM`, reset at each phase start through `/proc/self/clear_refs`), named
`peak_rss_gib` so nobody mistakes one for the other.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections import defaultdict
from collections.abc import Iterator

import torch

PHASES = ("capture", "capture_ref", "score", "replay", "prompt_backward", "optimizer")
PREFIX = "longstraw"
_GIB = 1024**3


def _read_rss_high_water() -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_rss_high_water() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


class MemoryMeter:
    """Peak memory over a span of code, on CUDA (allocator) or on the host (RSS high-water)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.key = "peak_cuda_allocated_gib" if self.cuda else "peak_rss_gib"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif not _reset_rss_high_water():
            self.key = "peak_rss_lifetime_gib"  # the kernel would not reset VmHWM: report the process lifetime peak

    def peak_bytes(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        high_water = _read_rss_high_water()
        return high_water if high_water is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PhaseTelemetry:
    """Accumulates phase timings and peaks until `flush()` hands them to the trainer's metrics."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        self.meter = MemoryMeter(device)
        self.seconds: dict[str, float] = defaultdict(float)
        self.peaks: dict[str, int] = {}
        self.state_bytes: int | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases are {PHASES}")
        if not self.enabled:
            yield
            return
        self.meter.start()
        begin = time.perf_counter()
        try:
            yield
        finally:
            peak = self.meter.peak_bytes()
            self.seconds[name] += time.perf_counter() - begin
            self.peaks[name] = max(self.peaks.get(name, 0), peak)

    def record_state(self, nbytes: int) -> None:
        self.state_bytes = nbytes if self.state_bytes is None else max(self.state_bytes, nbytes)

    def flush(self) -> dict[str, float]:
        """The metrics since the last flush, keyed `longstraw/<phase>/time_s` and `longstraw/<phase>/<peak key>`."""
        metrics = {}
        for name, seconds in self.seconds.items():
            metrics[f"{PREFIX}/{name}/time_s"] = seconds
            metrics[f"{PREFIX}/{name}/{self.meter.key}"] = self.peaks[name] / _GIB
        if self.state_bytes is not None:
            metrics[f"{PREFIX}/prompt_state_gib"] = self.state_bytes / _GIB
        self.seconds.clear()
        self.peaks.clear()
        self.state_bytes = None
        return metrics
