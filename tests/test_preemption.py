"""Preemption: a SIGTERM (what a cluster scheduler sends) stops training with `Preempted`, at once outside a checkpoint
save and once the save is complete during one; the last checkpoint is complete, and resuming from it ends where the
uninterrupted run ends, bitwise (weights, losses, grad norms, rewards), in one process and at cp = 2.

The runs are subprocesses (`tests/preemption_worker.py`); the callback's rules are also checked in this process."""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState

from trl_longstraw.faults import in_phase
from trl_longstraw.preemption import Preempted, PreemptionCallback

from .launch import ranks_command, worker_env

WORKER = os.path.join(os.path.dirname(__file__), "preemption_worker.py")
ENV = worker_env()


# ---------------------------------------------------------------------------------------------------------------------
# The callback's rules, in this process (the test function plays the training loop)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def received():
    """A recording SIGTERM handler in place of the default (which would end pytest), restored afterwards."""
    signals = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: signals.append(signum))
    yield signals
    signal.signal(signal.SIGTERM, previous)


def trainer_state(tmp_path, global_step=0, save_strategy="steps"):
    """What the Trainer passes a callback (the training loop is the function that calls `on_train_begin`)."""
    args = SimpleNamespace(output_dir=str(tmp_path), save_strategy=save_strategy)
    return args, TrainerState(global_step=global_step), TrainerControl()


def test_a_signal_outside_a_save_stops_at_once_naming_the_step_phase_and_the_fix(received, tmp_path):
    callback, (args, state, control) = PreemptionCallback(), trainer_state(tmp_path, global_step=4)
    callback.on_train_begin(args, state, control)
    with pytest.raises(Preempted) as raised, in_phase("replay"):
        os.kill(os.getpid(), signal.SIGTERM)
    message = str(raised.value)
    assert "SIGTERM received during optimizer step 5 (LongStraw phase 'replay')" in message
    assert "no checkpoint since it resumed at optimizer step 4" in message
    assert "resume_from_checkpoint=True" in message and "--resume_from_checkpoint" in message
    os.kill(os.getpid(), signal.SIGTERM)  # stopping already (torchrun forwards a second one): ignored
    assert received == []


def test_a_signal_during_a_save_waits_for_the_save_to_complete(received, tmp_path):
    callback, (args, state, control) = PreemptionCallback(), trainer_state(tmp_path)
    callback.on_train_begin(args, state, control)
    state.global_step, control.should_save = 2, True
    callback.on_step_end(args, state, control)  # after DefaultFlowCallback decided to save
    os.kill(os.getpid(), signal.SIGTERM)  # held: nothing raised while the checkpoint is written
    with pytest.raises(Preempted) as raised:
        callback.on_save(args, state, control)
    checkpoint = os.path.join(tmp_path, "checkpoint-2")
    assert f"SIGTERM received after optimizer step 2, while checkpoint {checkpoint} was being saved" in str(
        raised.value
    )
    assert f"The last complete checkpoint: {checkpoint}." in str(raised.value)
    assert received == []


def test_a_save_decided_by_an_evaluation_that_does_not_save_stops_before_the_next_step(received, tmp_path):
    callback, (args, state, control) = PreemptionCallback(), trainer_state(tmp_path, 6, save_strategy="best")
    callback.on_train_begin(args, state, control)
    control.should_evaluate = True  # save_strategy="best": the evaluation decides
    callback.on_step_end(args, state, control)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(
        Preempted, match="(?s)after optimizer step 6, while a checkpoint save was pending; none was made"
    ):
        callback.on_step_begin(args, state, control)  # no new best: no on_save came


def test_the_previous_handler_comes_back_after_training_ends_or_raises(received, tmp_path):
    callback, (args, state, control) = PreemptionCallback(), trainer_state(tmp_path)
    callback.on_train_begin(args, state, control)
    assert signal.getsignal(signal.SIGTERM) == callback._handle
    callback.on_train_end(args, state, control)
    assert signal.getsignal(signal.SIGTERM) is not callback._handle
    os.kill(os.getpid(), signal.SIGTERM)
    assert received == [signal.SIGTERM]

    def training_loop_that_raises():
        callback.on_train_begin(args, state, control)
        raise ValueError("a failure in a step")

    with pytest.raises(ValueError):
        training_loop_that_raises()
    assert signal.getsignal(signal.SIGTERM) == callback._handle  # nothing ran on_train_end
    os.kill(os.getpid(), signal.SIGTERM)  # the loop is gone: the previous handler gets it, and is back in place
    assert received == [signal.SIGTERM, signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is not callback._handle


# ---------------------------------------------------------------------------------------------------------------------
# Whole runs, each in its own process
# ---------------------------------------------------------------------------------------------------------------------
def start(command: list[str], log) -> subprocess.Popen:
    """`command` in a process group of its own, its stderr in the file `log` (a pipe left unread could fill)."""
    with open(log, "w") as file:
        return subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=file, start_new_session=True)


def finish(process: subprocess.Popen, log, timeout: float) -> str:
    """Wait for `process` (killing its process group if it overruns); its stderr."""
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    with open(log) as file:
        return file.read()


def checkpoints(directory) -> set[str]:
    return {name for name in os.listdir(directory) if name.startswith("checkpoint-")}


def assert_complete(checkpoint, reference_checkpoint):
    """Every file the uninterrupted run's checkpoint has, and the trainer state of its step."""
    assert set(os.listdir(checkpoint)) == set(os.listdir(reference_checkpoint))
    with open(os.path.join(checkpoint, "trainer_state.json")) as file:
        assert json.load(file)["global_step"] == 2


def assert_resumed_like_the_uninterrupted_run(results: dict, resumed: str):
    reference, run = results["reference"], results[resumed]
    assert run["steps_run"] == 2 and reference["steps_run"] == 4  # the resumed run took steps 3 and 4 only
    assert run["logs"] == reference["logs"]  # steps 1-2 from the checkpoint, 3-4 taken again: bitwise
    assert run["weights"].keys() == reference["weights"].keys()
    for name, weight in reference["weights"].items():
        assert torch.equal(run["weights"][name], weight), name


@pytest.mark.slow
def test_sigterm_in_a_step_or_in_a_save_leaves_a_complete_checkpoint_and_resuming_ends_as_uninterrupted(tmp_path):
    """One process: SIGTERM in the replay of step 3 stops there; SIGTERM while checkpoint-2 is written (weights
    written, optimizer not yet) stops once it is complete. Both exit non-zero naming the checkpoint, and resuming
    from either ends with the uninterrupted run's weights and logs, bitwise."""
    runs = {}
    for run in ("replay", "save"):
        (tmp_path / run).mkdir()
        runs[run] = start([sys.executable, WORKER, str(tmp_path / run), "1", run], tmp_path / f"{run}.log")
    for run, process in runs.items():
        stderr = finish(process, tmp_path / f"{run}.log", timeout=300)
        assert process.returncode == 1, stderr[-4000:]
        assert "trl_longstraw.faults.Preempted: SIGTERM received" in stderr, stderr[-4000:]
        if run == "replay":
            assert "during optimizer step 3 (LongStraw phase 'replay')" in stderr
        else:
            assert f"while checkpoint {tmp_path / run / 'checkpoint-2'} was being saved" in stderr
        assert f"The last complete checkpoint: {tmp_path / run / 'checkpoint-2'}." in stderr
        assert checkpoints(tmp_path / run) == {"checkpoint-2"}  # nothing of step 3 or later

    resumed = [str(tmp_path / run) for run in runs]
    process = start([sys.executable, WORKER, str(tmp_path), "1", "reference", *resumed], tmp_path / "reference.log")
    stderr = finish(process, tmp_path / "reference.log", timeout=300)
    assert process.returncode == 0, stderr[-4000:]
    results = torch.load(tmp_path / "results-rank0.pt")
    for run in resumed:
        assert_complete(os.path.join(run, "checkpoint-2"), tmp_path / "reference" / "checkpoint-2")
        assert_resumed_like_the_uninterrupted_run(results, run)


@pytest.mark.slow
def test_sigterm_to_a_context_parallel_launch_stops_both_ranks_and_resuming_ends_as_uninterrupted(tmp_path):
    """cp = 2 under `accelerate launch`: both ranks wait in the replay of step 3, then the launcher's process group
    gets SIGTERM (as a scheduler sends it; torchrun forwards it to the ranks again). Both ranks stop with
    `Preempted`, checkpoint-2 is complete, and resuming at cp = 2 ends as the uninterrupted cp = 2 run, bitwise."""

    def launch(out, log, *arguments):
        return start([*ranks_command(2), WORKER, str(out), "2", *arguments], log)

    interrupted, log = tmp_path / "interrupted", tmp_path / "interrupted.log"
    interrupted.mkdir()
    process = launch(interrupted, log, "wait")
    deadline = time.monotonic() + 300
    while not all((interrupted / f"ready-rank{rank}").exists() for rank in range(2)):
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(finish(process, log, timeout=0)[-4000:])
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGTERM)  # the launcher and both ranks
    stderr = finish(process, log, timeout=120)
    assert process.returncode != 0, stderr[-4000:]
    for rank in range(2):
        assert f"[rank{rank}]: trl_longstraw.faults.Preempted: SIGTERM received during optimizer step 3" in stderr
        assert f"[rank{rank}]: The last complete checkpoint: {interrupted / 'checkpoint-2'}." in stderr
    assert checkpoints(interrupted) == {"checkpoint-2"}

    process = launch(tmp_path, tmp_path / "reference.log", "reference", interrupted)
    stderr = finish(process, tmp_path / "reference.log", timeout=300)
    assert process.returncode == 0, stderr[-4000:]
    assert_complete(interrupted / "checkpoint-2", tmp_path / "reference" / "checkpoint-2")
    ranks = [torch.load(tmp_path / f"results-rank{rank}.pt") for rank in range(2)]
    for results in ranks:
        assert_resumed_like_the_uninterrupted_run(results, str(interrupted))
        for name, weight in ranks[0]["reference"]["weights"].items():
            assert torch.equal(results["reference"]["weights"][name], weight), name  # the ranks agree
