"""Runs of `tests/test_preemption.py`, each in its own process (`python this.py OUT CP RUN [RESUME_DIR ...]`, or on
2 ranks under `accelerate launch` with CP = 2): 4 optimizer steps of a tiny Qwen3, a checkpoint every 2 steps.

RUN is one of:

- `replay`: the process signals itself (SIGTERM) in the replay of optimizer step 3, from a forward hook;
- `save`: the process signals itself while checkpoint-2 is being written (between the weights and the optimizer);
- `wait`: each rank writes `OUT/ready-rank{r}` in the replay of step 3 and waits there for a SIGTERM from outside
  (the test signals the launcher's process group, as a scheduler does);
- `reference`: the uninterrupted run, then one run resuming (`resume_from_checkpoint=True`) from each RESUME_DIR's
  last checkpoint; each run's final weights and per-step logs are saved in `OUT/results-rank{r}.pt`.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import TrainerCallback

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.embedded import build_model, build_tokenizer
from trl_longstraw.faults import current_phase

PROMPTS = [f"the key is {4217 + i}. " + "lorem ipsum " * (i % 3 + 1) + "what is the key?" for i in range(8)]
SIGNAL_STEP = 3  # the optimizer step the signal interrupts (checkpoint-2 is the last before it)


def char_code_reward(prompts, completions, **kwargs):
    return [float(sum(map(ord, str(completion))) % 7) for completion in completions]


class SignalledWhileSaving(LongStrawGRPOTrainer):
    """Signals itself while writing checkpoint-2: the weights are on disk, the optimizer and the rest are not yet."""

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.state.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        super()._save_optimizer_and_scheduler(output_dir)


class StepOf(TrainerCallback):
    """The optimizer step in progress (for the forward hook), and how many steps this `train()` took."""

    step = 0

    def __init__(self):
        self.steps_run = 0

    def on_step_begin(self, args, state, control, **kwargs):
        StepOf.step = state.global_step + 1
        self.steps_run += 1


def signal_in_replay(model, run: str, out: str) -> None:
    """A SIGTERM in the replay of step SIGNAL_STEP: sent by this process (`replay`) or by the test (`wait`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0

    def hook(module, args):
        if StepOf.step != SIGNAL_STEP or current_phase() != "replay":
            return
        if run == "replay":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        open(os.path.join(out, f"ready-rank{rank}"), "w").close()
        time.sleep(120)  # a signal handler that raises ends the sleep

    model.model.layers[0].register_forward_pre_hook(hook)


def train(out_dir: str, cp: int, run: str, resume: bool = False) -> LongStrawGRPOTrainer:
    args = LongStrawGRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=5,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        bf16=False,
        use_cpu=True,
        seed=0,
        prefill_chunk_size=8,
        attention_chunk_size=8,
        context_parallel_size=cp,
    )
    model = build_model("qwen3", seed=0)
    if run in ("replay", "wait"):
        signal_in_replay(model, run, out_dir)
    trainer = (SignalledWhileSaving if run == "save" else LongStrawGRPOTrainer)(
        model=model,
        reward_funcs=char_code_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=build_tokenizer(),
        callbacks=[StepOf()],
    )
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


def result(trainer: LongStrawGRPOTrainer) -> dict:
    logs = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
    steps = next(callback for callback in trainer.callback_handler.callbacks if isinstance(callback, StepOf))
    return {
        "steps_run": steps.steps_run,
        "weights": {name: p.detach().clone() for name, p in trainer.model.named_parameters()},
        "logs": {step: {key: entry[key] for key in ("loss", "grad_norm", "reward")} for step, entry in logs.items()},
    }


def main(out: str, cp: int, run: str, resume_dirs: list[str]) -> None:
    try:
        if run != "reference":
            train(out, cp, run)
            raise SystemExit(f"run {run!r} was not preempted")
        results = {"reference": result(train(os.path.join(out, "reference"), cp, run))}
        for directory in resume_dirs:
            results[directory] = result(train(directory, cp, run, resume=True))
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(results, os.path.join(out, f"results-rank{rank}.pt"))
    finally:
        if dist.is_initialized():  # every group's gloo threads stopped before the interpreter tears down
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
