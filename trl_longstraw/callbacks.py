"""The trainer's callbacks: the optimizer step timed as a phase, and the phases charted on W&B.

Each gets what it needs at construction (a phase context, a function to call after the step, the memory plan) and
reaches into nothing else of the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from transformers import TrainerCallback

from .faults import forget_reports
from .plan import GIB, Plan
from .telemetry import phase_rows


class OptimizerStepCallback(TrainerCallback):
    """Times the optimizer step as the phase "optimizer" (the Trainer owns that call), then runs `after_step`
    (the trainer drops the state captured under the old weights and flushes the step's telemetry)."""

    def __init__(self, phase: Callable[[str], AbstractContextManager], after_step: Callable[[], None]):
        self.phase = phase
        self.after_step = after_step
        self.span: AbstractContextManager | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        forget_reports()  # a failure of an earlier train() in this process is not this run's

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.span is not None:  # left open by an optimizer step that raised
            self.span.__exit__(None, None, None)
        self.span = self.phase("optimizer")
        self.span.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None
        self.after_step()


class PhaseChartsCallback(TrainerCallback):
    """On W&B (where transformers' WandbCallback started a run): the memory plan in the run's config at the start;
    each log's phases as one bar chart per metric (time, memory) beside the scalar keys, and the highest peak measured
    so far in the run summary, next to the plan's prediction."""

    def __init__(self, plan: Plan | None):
        self.plan = plan

    @staticmethod
    def _wandb_run(args, state):
        """The W&B run this process logs to, or None."""
        if not state.is_world_process_zero or "wandb" not in (args.report_to or []):
            return None
        import wandb

        return wandb.run

    def on_train_begin(self, args, state, control, **kwargs):
        run = self._wandb_run(args, state)
        if self.plan is not None and run is not None:
            run.config.update({"longstraw_memory_plan": self.plan.to_dict()}, allow_val_change=True)
            run.summary["longstraw/plan/device_gib"] = self.plan.device_bytes / GIB

    def on_log(self, args, state, control, logs=None, **kwargs):
        run = self._wandb_run(args, state)
        columns, rows = phase_rows(logs or {})
        if run is None or not rows:
            return
        import wandb

        table = wandb.Table(columns=columns, data=rows)
        charts = {
            f"longstraw/phases/{metric}": wandb.plot.bar(table, "phase", metric, title=f"LongStraw phases: {metric}")
            for metric in columns[1:]
            if metric.endswith(("time_s", "peak_gib"))
        }
        run.log(charts, commit=False)
        for metric in columns[1:]:
            if metric.endswith("peak_gib"):
                peak = max(row[columns.index(metric)] for row in rows)
                key = f"longstraw/measured/{metric}"
                run.summary[key] = max(peak, run.summary.get(key, 0.0))
