"""Telemetry users can trust: per mode, per phase, measured inside the phase, and no process-wide counter reset."""

import os
import threading
import time

import pytest
import torch

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw import telemetry as telemetry_module
from trl_longstraw.telemetry import MemoryMeter, PeakSampler, PhaseTelemetry, phase_rows

from .conftest import length_reward, make_trainer, synthetic_inputs, trainer_args

_MIB = 1024**2
HAS_PROC = os.path.exists("/proc/self/statm")


def rss_high_water_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_a_spike_inside_a_phase_is_measured_as_that_phase_s(tmp_path):
    telemetry = PhaseTelemetry(torch.device("cpu"))
    with telemetry.phase("replay", "train"):
        spike = torch.ones(64 * _MIB)  # 256 MiB, touched
        time.sleep(0.05)  # several sampling intervals
        del spike
    with telemetry.phase("score", "train"):
        pass
    metrics = telemetry.flush("train")
    assert metrics["longstraw/replay/rss_added_gib"] >= 0.2
    assert metrics["longstraw/score/rss_added_gib"] < 0.05
    assert metrics["longstraw/replay/count"] == 1 and metrics["longstraw/replay/time_s"] >= 0.05


def test_a_reading_the_sampler_took_in_one_span_never_lands_in_the_next():
    sampler_read = threading.Event()
    release = threading.Event()
    readings = []

    def read():
        if threading.current_thread().name != "longstraw-memory-sampler":
            return 1
        readings.append(None)
        if len(readings) == 1:  # the sampler's first reading, in span A: a spike, reported after span B has begun
            sampler_read.set()
            release.wait(5)
            return 1000
        return 1

    sampler = PeakSampler(read, interval_s=0.001)
    sampler.start()  # span A
    assert sampler_read.wait(5)
    sampler.stop()
    sampler.start()  # span B
    release.set()
    while len(readings) < 3:  # the spike is in, and B has been sampled since
        time.sleep(0.001)
    assert sampler.stop() == 1


def test_train_and_eval_accumulate_separately():
    telemetry = PhaseTelemetry(torch.device("cpu"))
    with telemetry.phase("capture", "eval"):
        pass
    telemetry.record_state(1024**3, "eval")
    assert telemetry.flush("train") == {}
    eval_metrics = telemetry.flush("eval")
    assert eval_metrics["longstraw/capture/count"] == 1 and eval_metrics["longstraw/prompt_state_gib"] == 1.0


def test_a_phase_run_twice_in_a_step_sums_its_time_and_keeps_its_largest_peak(monkeypatch):
    """The replay phase runs once per group: a step's log counts both spans, adds their times, and reports the larger
    span's peak and addition; the largest state of the step, once (the next flush starts afresh)."""
    allocated, high_water = [0], [0]
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated[0])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: high_water[0])
    telemetry = PhaseTelemetry(torch.device("cuda", 0))
    for start, peak, seconds in ((100, 900, 0.02), (500, 700, 0.03)):
        allocated[0] = start
        with telemetry.phase("replay"):
            allocated[0], high_water[0] = peak, max(high_water[0], peak)
            time.sleep(seconds)
        allocated[0] = start
    telemetry.record_state(2 * 1024**3)
    telemetry.record_state(1024**3)
    metrics = telemetry.flush("train")
    assert metrics["longstraw/replay/count"] == 2 and metrics["longstraw/replay/time_s"] >= 0.05
    assert metrics["longstraw/replay/cuda_allocated_peak_gib"] * 1024**3 == 900
    assert metrics["longstraw/replay/cuda_allocated_added_gib"] * 1024**3 == 800
    assert metrics["longstraw/prompt_state_gib"] == 2.0
    assert "longstraw/prompt_state_gib" not in telemetry.flush("train")


def test_synchronised_phases_on_the_cpu_touch_no_cuda_call():
    telemetry = PhaseTelemetry(torch.device("cpu"), synchronize=True)
    with telemetry.phase("score"):
        pass
    assert telemetry.flush("train")["longstraw/score/count"] == 1


def test_an_unknown_phase_name_is_refused():
    with (
        pytest.raises(ValueError, match="unknown phase 'replays'"),
        PhaseTelemetry(torch.device("cpu")).phase("replays"),
    ):
        pass


def test_a_host_without_proc_logs_times_only(monkeypatch):
    """macOS, Windows: no `/proc/self/statm`, so no memory reading, and the phases still run and are timed."""
    monkeypatch.setattr(telemetry_module, "read_rss_bytes", lambda: None)
    telemetry = PhaseTelemetry(torch.device("cpu"))
    with telemetry.phase("capture"):
        pass
    assert set(telemetry.flush("train")) == {"longstraw/capture/time_s", "longstraw/capture/count"}


def test_disabled_telemetry_logs_nothing():
    telemetry = PhaseTelemetry(torch.device("cpu"), enabled=False)
    with telemetry.phase("capture"):
        pass
    telemetry.record_state(1024**3)
    assert telemetry.flush("train") == {}


@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_the_update_resets_no_process_wide_counter(fresh_model, tokenizer, prompt_dataset, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("LongStraw reset CUDA's peak memory statistics")

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", refuse)
    trainer = make_trainer(LongStrawGRPOTrainer, fresh_model(), tokenizer, prompt_dataset, tmp_path)
    spike = torch.ones(128 * _MIB)  # raise the kernel's RSS high-water mark by 512 MiB, then free it
    del spike
    high_water = rss_high_water_bytes()
    trainer.replay_and_backward(trainer.model, synthetic_inputs(len(tokenizer)))
    assert rss_high_water_bytes() >= high_water  # nothing wrote /proc/self/clear_refs


def test_a_cuda_span_reads_the_allocator_and_resets_no_peak_statistic(monkeypatch):
    """The CUDA meter on a CPU machine, through the allocator calls it makes: it reads `memory_allocated` and
    `max_memory_allocated` and never resets a statistic the user's own monitoring may read."""

    def refuse(*args, **kwargs):
        raise AssertionError("LongStraw reset CUDA's memory statistics")

    allocated, high_water = [100], [500]
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: high_water[0])
    for reset in ("reset_peak_memory_stats", "reset_max_memory_allocated", "reset_accumulated_memory_stats"):
        monkeypatch.setattr(torch.cuda, reset, refuse)
    meter = MemoryMeter(torch.device("cuda", 0))
    meter.start()
    allocated[0], high_water[0] = 300, 900  # the span raised the process's high-water mark: its peak is exact
    assert meter.stop() == (900, 800)
    meter.start()
    allocated[0] = 250  # below the high-water mark: the sampled peak of the span
    assert meter.stop() == (300, 0)


def test_a_model_split_over_gpus_reports_the_device_with_the_highest_peak(monkeypatch):
    """`device_map` over two GPUs (and a host-resident module, not measured as a GPU): each GPU is read, and the span
    reports the one that came closest to running out."""
    allocated = {"cuda:0": 100, "cuda:1": 50}
    high_water = {"cuda:0": 500, "cuda:1": 500}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated[str(device)])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: high_water[str(device)])
    meter = MemoryMeter([torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)])
    assert meter.devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    meter.start()
    allocated["cuda:1"], high_water["cuda:1"] = 200, 700  # cuda:1 set its high-water mark: exact there
    assert meter.stop() == (700, 650)


@pytest.mark.slow
def test_evaluation_phases_are_logged_with_evaluation_not_folded_into_training(
    fresh_model, tokenizer, prompt_dataset, tmp_path
):
    runs = {}
    for evaluate in (False, True):
        trainer = LongStrawGRPOTrainer(
            model=fresh_model(),
            reward_funcs=length_reward,
            args=trainer_args(
                LongStrawGRPOConfig,
                tmp_path / str(evaluate),
                max_steps=2,
                eval_strategy="steps" if evaluate else "no",
                eval_steps=1,
                per_device_eval_batch_size=3,
            ),
            train_dataset=prompt_dataset,
            eval_dataset=prompt_dataset if evaluate else None,
            processing_class=tokenizer,
        )
        trainer.train()
        runs[evaluate] = trainer.state.log_history
    train_counts = {
        evaluate: [entry["longstraw/capture/count"] for entry in history if "loss" in entry]
        for evaluate, history in runs.items()
    }
    assert train_counts[True] == train_counts[False]  # evaluation's captures are not in the training steps
    eval_logs = [entry for entry in runs[True] if "eval_loss" in entry]
    assert len(eval_logs) == 2
    for entry in eval_logs:
        assert entry["eval_longstraw/capture/count"] > 0 and entry["eval_longstraw/score/time_s"] > 0
        assert entry["eval_longstraw/capture/rss_peak_gib"] > 0 and "eval_longstraw/prompt_state_gib" in entry


def test_phase_rows_tabulate_one_logged_step_by_phase():
    logs = {
        "train/longstraw/capture/time_s": 2.0,
        "train/longstraw/capture/rss_peak_gib": 1.5,
        "longstraw/replay/time_s": 3.0,
        "train/longstraw/prompt_state_gib": 0.5,  # not a phase
        "train/loss": 0.1,
    }
    columns, rows = phase_rows(logs)
    assert columns == ["phase", "rss_peak_gib", "time_s"]
    assert rows == [["capture", 1.5, 2.0], ["replay", 0.0, 3.0]]
