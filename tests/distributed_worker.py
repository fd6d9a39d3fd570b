"""Run under `accelerate launch --num_processes 2`: one LongStraw training step of data parallelism on gloo.

Each rank trains on its own groups; afterwards every rank must hold the same weights (gradients were averaged
across ranks, as DDP would) and those weights must have moved. Prints one JSON line per rank for the test.
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from datasets import Dataset

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.embedded import build_model, build_tokenizer


def char_code_reward(completions, **kwargs):
    return [float(sum(map(ord, completion)) % 7) for completion in completions]


def main(prompt_gradient: str) -> None:
    # Rank-dependent prompts: each rank's groups differ, so identical weights afterwards prove the averaging.
    rank = int(os.environ["RANK"])
    dataset = Dataset.from_dict({"prompt": [f"rank {rank} prompt {i}: " + "xyz" * (i + rank + 1) for i in range(8)]})
    args = LongStrawGRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=5,
        max_steps=1,
        learning_rate=1e-2,
        report_to="none",
        save_strategy="no",
        bf16=False,
        seed=0,
        prompt_gradient=prompt_gradient,
        prefill_chunk_size=8,
    )
    model = build_model("qwen3", seed=0)
    initial = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    trainer = LongStrawGRPOTrainer(
        model=model,
        reward_funcs=char_code_reward,
        args=args,
        train_dataset=dataset,
        processing_class=build_tokenizer(),
    )
    trainer.train()
    weights = torch.nn.utils.parameters_to_vector(trainer.model.parameters()).detach()
    gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, weights)
    print(
        "DP_REPORT "
        + json.dumps(
            {
                "rank": dist.get_rank(),
                "max_rank_difference": max((g - gathered[0]).abs().max().item() for g in gathered),
                "moved": (weights - initial).abs().max().item(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1])
