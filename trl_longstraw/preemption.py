"""Preemption: a SIGTERM (what a cluster scheduler sends a job before it kills it) stops training with the last
checkpoint complete, and `train(resume_from_checkpoint=True)` then continues as the uninterrupted run would.

Why a handler: Python's default action for SIGTERM ends the process wherever it stands. transformers' Trainer writes
`checkpoint-N/` in place, one file after another (weights, optimizer, scheduler, random states, `trainer_state.json`
last), so a SIGTERM during a save leaves a directory with files missing or cut short, which `get_last_checkpoint` (what
`resume_from_checkpoint=True` resumes from) picks by its name alone.

`PreemptionCallback`, which `LongStrawGRPOTrainer` registers, handles SIGTERM while `train()` runs:

- during a checkpoint save (from the `on_step_end` or `on_epoch_end` that decided it, `control.should_save`, to the
  `on_save` that follows it) it waits: the save completes, then `on_save` raises `Preempted`;
- anywhere else it raises `Preempted` at once, from the handler. Python runs a signal handler in the main thread
  between two bytecodes, so the step in progress is abandoned where it stands and nothing of it is saved: every
  checkpoint on disk comes from a save that completed.

`Preempted` (a `RuntimeError`) leaves `train()` as any exception does, so the process exits non-zero, with a message
naming the signal, the optimizer step it stopped, the LongStraw phase in progress, the last complete checkpoint and
how to resume. Resuming reloads the checkpoint's weights, optimizer, scheduler and random states; no prompt state is
saved and none is needed, so the resumed run takes the steps the uninterrupted one took.

Under `accelerate launch` (torchrun) every rank handles its own signal: a scheduler signals every process of the job,
and torchrun forwards the SIGTERM it receives to its workers (a second one, which a stopping rank ignores). A rank
that stops ends its peers' collectives (`faults.py` reports it); a rank that is saving completes its part first. The
ranks do not agree on where to stop (that would take a collective at every step): a signal that reaches one rank just
before the end of a step that saves and another just after leaves the second rank's random state alone in that
checkpoint's directory.

The previous handlers come back at `on_train_end`. Where `train()` leaves by an exception instead (this one or any
other), the handler sees at its next signal that the training loop it was installed for is no longer running: it
puts the previous handler back and hands it the signal. Python lets only the main thread set signal handlers, so a
`train()` called from another thread leaves the signals as they are.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import CodeType, FrameType

from transformers import TrainerCallback
from transformers import trainer_callback as _trainer_callback

from .faults import Preempted, current_phase
from .telemetry import PHASES

logger = logging.getLogger(__name__)

__all__ = ["Preempted", "PreemptionCallback"]


class PreemptionCallback(TrainerCallback):
    """Stops `train()` on `signals` (SIGTERM) by raising `Preempted`: at once, or, during a checkpoint save, once the
    save is complete (see the module docstring)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = tuple(signals)
        self._previous: dict[int, object] = {}
        self._loop: CodeType | None = None  # the code of the training loop the handler serves
        self._state = None
        self._output_dir: str | None = None
        self._saving = False  # between the decision to save a checkpoint and the end of that save
        self._received: int | None = None  # a signal held until the save is complete
        self._stopping = False
        self._checkpoint: str | None = None  # the last checkpoint this run saved completely
        self._resumed_at = 0

    # -- Trainer events -----------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            logger.warning("train() runs outside the main thread: SIGTERM keeps its own handler (no Preempted).")
            return
        self._loop = _caller_code()
        self._state, self._output_dir = state, args.output_dir
        self._saving, self._received, self._stopping = False, None, False
        self._checkpoint, self._resumed_at = None, state.global_step
        for signum in self.signals:
            previous = signal.getsignal(signum)
            if previous != self._handle:  # else left installed by a train() that raised: keep what it replaced
                self._previous[signum] = signal.SIG_DFL if previous is None else previous
            signal.signal(signum, self._handle)

    def on_step_begin(self, args, state, control, **kwargs):
        self._stop_if_received(saved=False)  # a save was decided, then not made (save_strategy="best", no new best)

    def on_step_end(self, args, state, control, **kwargs):
        self._saving = _save_decided(args, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._stop_if_received(saved=False)
        self._saving = _save_decided(args, control)

    def on_save(self, args, state, control, **kwargs):
        self._saving = False
        self._checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self._stop_if_received(saved=True)

    def on_train_end(self, args, state, control, **kwargs):
        self._restore()
        self._stop_if_received(saved=False)

    # -- The handler --------------------------------------------------------------------------------------------------
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._in_training_loop(sys._getframe(1)):  # train() left by an exception: hand the signal on
            previous = self._previous.get(signum, signal.SIG_DFL)
            self._restore()
            _deliver(previous, signum, frame)
            return
        if self._stopping:  # a second signal while stopping (torchrun forwards the scheduler's SIGTERM)
            return
        if self._saving:
            self._received = self._received or signum
            return
        self._stopping = True
        phase = current_phase()
        where = f"LongStraw phase {phase!r}" if phase in PHASES else phase  # current_phase() says when none runs
        step = self._state.global_step + 1
        raise Preempted(
            self._message(
                f"{signal.Signals(signum).name} received during optimizer step {step} ({where}): training stopped "
                "there, and nothing of that step was saved."
            )
        )

    def _stop_if_received(self, saved: bool) -> None:
        """Raise `Preempted` for a signal held during a checkpoint save, now that the save is over."""
        if self._received is None or self._stopping:
            return
        self._stopping = True
        name, step = signal.Signals(self._received).name, self._state.global_step
        if saved:
            what = f"while checkpoint {self._checkpoint} was being saved: training stopped once it was complete."
        else:
            what = (
                "while a checkpoint save was pending; none was made (no new best metric), and training stopped there."
            )
        raise Preempted(self._message(f"{name} received after optimizer step {step}, {what}"))

    def _in_training_loop(self, frame: FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code is self._loop:
                return True
            frame = frame.f_back
        return False

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        self._previous.clear()
        self._loop = None

    def _message(self, head: str) -> str:
        """`head`, then the last complete checkpoint and how to resume."""
        if self._checkpoint is not None:
            last = f"The last complete checkpoint: {self._checkpoint}."
        elif self._resumed_at:
            last = (
                f"This run saved no checkpoint since it resumed at optimizer step {self._resumed_at}: the checkpoint "
                "it resumed from is the last one."
            )
        else:
            last = "No checkpoint was saved yet (see save_strategy and save_steps): a new run starts from step 0."
        return (
            f"{head}\n{last}\nTo continue as the uninterrupted run would, resume: "
            f"`trainer.train(resume_from_checkpoint=True)` (the last checkpoint in output_dir {self._output_dir}), or "
            "pass the checkpoint's path (the recipe: `--resume_from_checkpoint <path>`)."
        )


def _caller_code() -> CodeType | None:
    """The code of the function that raised the current Trainer event (the training loop, for `on_train_begin`):
    the first frame up the stack outside transformers' callback dispatch and this module."""
    skip = {os.path.abspath(_trainer_callback.__file__), os.path.abspath(__file__)}
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in skip:
        frame = frame.f_back
    return frame.f_code if frame is not None else None


def _save_decided(args, control) -> bool:
    """Whether the Trainer saves a checkpoint before the next step: `should_save`, or an evaluation that can decide
    one (`save_strategy="best"`)."""
    return bool(control.should_save or (args.save_strategy == "best" and control.should_evaluate))


def _deliver(handler, signum: int, frame: FrameType | None) -> None:
    """What `handler` (a previous handler, now back in place) does with `signum`."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:  # SIG_DFL: the default action (for SIGTERM, the process ends)
        signal.raise_signal(signum)
