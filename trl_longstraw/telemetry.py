"""Per-phase wall time, peak memory and run count, collected for the trainer's logs (W&B, TensorBoard, the console).

What the memory numbers are, and why:

- **CUDA** (the phase runs on a CUDA device): `cuda_allocated_peak_gib` is the caching allocator's allocated bytes at
  their highest during the phase. It is exact whenever the phase raised the process's allocator high-water mark
  (`max_memory_allocated` moved during the phase: the memory-hungry phase of a step always does); otherwise it is the
  largest of `memory_allocated()` at the phase's start and end and of samples taken every `interval_s` while it runs
  (a lower bound). `cuda_allocated_added_gib` is that peak minus the allocation at the phase's start: what the phase
  itself added on top of the weights, optimizer state and everything else alive. Reading allocator statistics needs
  no device synchronisation (the allocator accounts on the host, when work is issued). A model split over GPUs by
  `device_map` has each of its devices measured, and a phase reports the device whose peak was highest.
- **Host**: `rss_peak_gib` is the process's resident set (`/proc/self/statm`) at its highest among samples taken at
  the phase's start and end and every `interval_s` in between; `rss_added_gib` is that peak minus the resident set at
  the phase's start. Resident memory is the whole process (weights, Python, the allocator's cache), so the added value
  is the one that describes the phase; a spike shorter than the interval can be missed. Where `/proc` does not exist
  only times are logged.

Nothing here resets a process-wide counter: not CUDA's peak statistics (`reset_peak_memory_stats`), not the kernel's
RSS high-water mark (`/proc/self/clear_refs`). A user's own monitoring reads those, so they are left alone.

Train and eval accumulate separately: the trainer flushes `"train"` once per optimizer step and `"eval"` once per
evaluation, so evaluation work never shows up in a training step.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

PHASES = ("capture", "capture_ref", "rollout", "score", "replay", "prompt_backward", "optimizer")
MODES = ("train", "eval")
PREFIX = "longstraw"
_GIB = 1024**3


def read_rss_bytes() -> int | None:
    """The process's current resident set in bytes (Linux), or None where `/proc/self/statm` does not exist."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class PeakSampler:
    """Samples `read()` every `interval_s` on a daemon thread while a span is open; the span's maximum is kept.

    The thread sleeps on an event between spans, so it costs nothing outside the phases. `read` must be cheap and
    thread-safe (`/proc/self/statm`, `torch.cuda.memory_allocated`).
    """

    def __init__(self, read: Callable[[], int], interval_s: float = 0.005):
        self.read = read
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._peak = 0
        self._span = 0  # counts spans: a reading taken in one span never lands in the next
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        value = self.read()
        with self._lock:
            self._span += 1
            self._peak = value
        self._open.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="longstraw-memory-sampler", daemon=True)
            self._thread.start()
        return value

    def stop(self) -> int:
        self._open.clear()
        value = self.read()
        with self._lock:
            return max(self._peak, value)

    def _run(self) -> None:
        while True:
            self._open.wait()
            with self._lock:
                span = self._span
            value = self.read()
            with self._lock:
                if self._open.is_set() and self._span == span:
                    self._peak = max(self._peak, value)
            time.sleep(self.interval_s)


_SAMPLERS: dict[str, PeakSampler] = {}


def shared_sampler(key: str, read: Callable[[], int], interval_s: float) -> PeakSampler:
    """One sampler (one thread) per measured quantity per process, however many trainers are built."""
    if key not in _SAMPLERS:
        _SAMPLERS[key] = PeakSampler(read, interval_s)
    return _SAMPLERS[key]


class MemoryMeter:
    """The peak memory of one span and what the span added, on CUDA (allocator) or on the host (sampled RSS).

    Several devices (a model split by `device_map`): each CUDA device among them is measured, and the span reports
    the one whose peak was highest, the one such a model runs out of first."""

    def __init__(self, devices: torch.device | list[torch.device], interval_s: float = 0.005):
        devices = [torch.device(device) for device in (devices if isinstance(devices, list) else [devices])]
        gpus = [device for device in devices if device.type == "cuda"]
        self.cuda = bool(gpus)
        self.devices = gpus or devices[:1]
        if self.cuda:
            self.keys = ("cuda_allocated_peak_gib", "cuda_allocated_added_gib")
            self.samplers = [
                shared_sampler(str(device), lambda device=device: torch.cuda.memory_allocated(device), interval_s)
                for device in gpus
            ]
        elif read_rss_bytes() is not None:
            self.keys = ("rss_peak_gib", "rss_added_gib")
            self.samplers = [shared_sampler("rss", lambda: read_rss_bytes() or 0, interval_s)]
        else:
            self.keys, self.samplers, self.devices = (), [], []

    def _high_water(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device) if self.cuda else 0

    def start(self) -> None:
        """Open a span (spans do not nest)."""
        self._started = [
            (sampler.start(), self._high_water(device))
            for sampler, device in zip(self.samplers, self.devices, strict=True)
        ]

    def stop(self) -> tuple[int, int] | None:
        """`(peak, added)` bytes for the span `start()` opened (None where memory is not measured)."""
        if not self.samplers:
            return None
        measured = []
        for sampler, device, (at_start, high_water_at_start) in zip(
            self.samplers, self.devices, self._started, strict=True
        ):
            peak = sampler.stop()
            high_water = self._high_water(device)
            if high_water > high_water_at_start:  # this span set the high-water mark: exact
                peak = high_water
            measured.append((peak, max(peak - at_start, 0)))
        return max(measured)


class PhaseTelemetry:
    """Accumulates phase times, peaks and counts per mode ("train"/"eval") until `flush(mode)` hands them over."""

    def __init__(self, devices: torch.device | list[torch.device], enabled: bool = True, synchronize: bool = False):
        self.enabled = enabled
        self.meter = MemoryMeter(devices)
        self.synchronize = synchronize and self.meter.cuda
        self._seconds = {mode: defaultdict(float) for mode in MODES}
        self._counts = {mode: defaultdict(int) for mode in MODES}
        self._peaks: dict[str, dict[str, tuple[int, int]]] = {mode: {} for mode in MODES}
        self._state_bytes: dict[str, int] = {}

    def _synchronize(self) -> None:
        for device in self.meter.devices:
            torch.cuda.synchronize(device)

    @contextlib.contextmanager
    def phase(self, name: str, mode: str = "train") -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases are {PHASES}")
        if not self.enabled:
            yield
            return
        if self.synchronize:
            self._synchronize()
        self.meter.start()
        begin = time.perf_counter()
        try:
            yield
        finally:
            if self.synchronize:
                self._synchronize()
            self._seconds[mode][name] += time.perf_counter() - begin
            self._counts[mode][name] += 1
            measured = self.meter.stop()
            if measured is not None:
                previous = self._peaks[mode].get(name, (0, 0))
                self._peaks[mode][name] = (max(previous[0], measured[0]), max(previous[1], measured[1]))

    def record_state(self, nbytes: int, mode: str = "train") -> None:
        if self.enabled:
            self._state_bytes[mode] = max(self._state_bytes.get(mode, 0), nbytes)

    def flush(self, mode: str = "train") -> dict[str, float]:
        """The `mode`'s metrics since its last flush, keyed as docs/memory.md's "Logged metrics" lists them."""
        metrics = {}
        for name, seconds in self._seconds[mode].items():
            metrics[f"{PREFIX}/{name}/time_s"] = seconds
            metrics[f"{PREFIX}/{name}/count"] = float(self._counts[mode][name])
            if name in self._peaks[mode]:
                for key, value in zip(self.meter.keys, self._peaks[mode][name], strict=True):
                    metrics[f"{PREFIX}/{name}/{key}"] = value / _GIB
        if mode in self._state_bytes:
            metrics[f"{PREFIX}/prompt_state_gib"] = self._state_bytes.pop(mode) / _GIB
        self._seconds[mode].clear()
        self._counts[mode].clear()
        self._peaks[mode].clear()
        return metrics


def phase_rows(logs: dict[str, float]) -> tuple[list[str], list[list]]:
    """One logged step's phase metrics (`flush`'s keys, possibly under transformers' `train/` or `eval/` prefix) as a
    table: columns `phase` and each metric, one row per phase logged (a metric a phase lacks: 0)."""
    values: dict[str, dict[str, float]] = {}
    for key, value in logs.items():
        parts = key.split("/")
        if len(parts) >= 3 and parts[-3] == PREFIX and parts[-2] in PHASES:
            values.setdefault(parts[-2], {})[parts[-1]] = value
    metrics = sorted({metric for phase in values.values() for metric in phase})
    rows = [[phase, *(values[phase].get(metric, 0.0) for metric in metrics)] for phase in PHASES if phase in values]
    return ["phase", *metrics], rows
