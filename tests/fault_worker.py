"""Ranks of the fault-injection tests (forked by `tests/test_faults.py`, gloo on CPU, each rank its own process).

Every rank runs one context-parallel update of a GatedDeltaNet + attention hybrid in exact mode, phase by phase as the
trainer does (capture, score, replay, prompt backward, then a rollout from a sharded state). The faulty rank injects
its fault at its second collective of the chosen phase (after a collective of the phase went through): it raises, is
killed (SIGKILL), or stalls without exiting. Every rank records how it ended in `out_dir/rank{r}.json`.
"""

import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from trl.trainer.utils import add_fused_lm_head

from trl_longstraw.context_parallel import ContextParallelGroup, build_context_parallel_group, distribution_over
from trl_longstraw.embedded import build_model
from trl_longstraw.engine import LongStrawEngine, prepare_model
from trl_longstraw.faults import current_phase, in_phase

from .context_parallel_worker import case, rollouts, update

FAMILY = "qwen3_next"  # attention layers feeding GatedDeltaNet layers: every kind of hand-off, both directions
PHASES = ("capture", "score", "replay", "prompt_backward", "rollout")


def inject(phase: str, fault: str, out_dir: str) -> None:
    """Make this rank fail at its second collective in `phase`."""
    original = ContextParallelGroup.guarded
    seen = []

    def faulty(self, kind):
        if current_phase() == phase:
            seen.append(kind)
            if len(seen) == 2:
                with open(os.path.join(out_dir, "fault.json"), "w") as file:
                    json.dump({"time": time.time(), "kind": kind}, file)
                if fault == "raise":
                    raise ValueError("injected fault")
                if fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)  # stall: alive, never answering
        return original(self, kind)

    ContextParallelGroup.guarded = faulty


def update_and_roll_out(cp) -> None:
    """One exact-mode update, phase by phase, then a rollout from a sharded state."""
    from transformers import GenerationConfig

    model = build_model(FAMILY, seed=0)
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    engine = LongStrawEngine(8, 4, prompt_gradient="exact", distribution=distribution_over(cp))
    prompt, completions, lengths, weights = case()
    update(engine, model, prompt, completions, lengths, weights, phase=in_phase)
    config = GenerationConfig(max_new_tokens=4, pad_token_id=0, eos_token_id=[1], do_sample=False)
    with in_phase("rollout"), torch.no_grad():
        rollouts(engine, model, [prompt], 2, config)


def run(rank, world_size, init_file, out_dir, phase, fault, faulty_rank, timeout_s):
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    cp = build_context_parallel_group(world_size, timeout)
    if rank == faulty_rank:
        inject(phase, fault, out_dir)
    try:
        update_and_roll_out(cp)
        outcome = {"error": None}
    except BaseException as error:
        outcome = {"error": type(error).__name__, "message": str(error), "notes": getattr(error, "__notes__", [])}
        raise
    finally:
        outcome["time"] = time.time()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
            json.dump(outcome, file)


def train_with_a_stalled_rank(out_dir: str, timeout_s: int) -> None:
    """The trainer at context_parallel_size=2 under `accelerate launch`, `ddp_timeout=timeout_s`: rank 1 stalls at its
    second collective of the capture; rank 0 records how its `train()` ended."""
    import tempfile

    from datasets import Dataset

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
    from trl_longstraw.embedded import build_tokenizer

    from .conftest import trainer_args
    from .context_parallel_trainer_worker import PROMPTS, char_code_reward

    args = trainer_args(
        LongStrawGRPOConfig,
        tempfile.mkdtemp(),
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=5,
        max_steps=1,
        prompt_gradient="exact",
        prefill_chunk_size=8,
        attention_chunk_size=8,
        context_parallel_size=2,
        ddp_timeout=timeout_s,
    )
    trainer = LongStrawGRPOTrainer(
        model=build_model("qwen3", seed=0),
        reward_funcs=char_code_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=build_tokenizer(),
    )
    rank = dist.get_rank()
    if rank == 1:
        inject("capture", "stall", out_dir)
    try:
        trainer.train()
        outcome = {"error": None}
    except BaseException as error:
        outcome = {"error": type(error).__name__, "message": str(error)}
        raise
    finally:
        outcome["time"] = time.time()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
            json.dump(outcome, file)


if __name__ == "__main__":
    import sys

    train_with_a_stalled_rank(sys.argv[1], int(sys.argv[2]))
