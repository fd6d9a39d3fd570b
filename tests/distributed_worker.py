"""Run under `accelerate launch --num_processes 2` with one or more cases (`detach`, `exact`, `gradient`, `reached`),
one after the other in the same ranks: data parallelism on gloo.

`detach` / `exact`: one LongStraw training step in that mode; each rank trains on its own groups, and afterwards every
rank must hold the same weights (gradients were averaged across ranks, as DDP would) and those weights must have
moved. `gradient`: each rank's exact-mode gradient on its own batch, averaged, against the mean of stock's gradients
over both batches. `reached`: a parameter only one rank's backward reaches. Prints one JSON line per rank and case.
"""

import copy
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from datasets import Dataset
from trl import GRPOTrainer

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.embedded import build_model, build_tokenizer


def char_code_reward(completions, **kwargs):
    return [float(sum(map(ord, completion)) % 7) for completion in completions]


def report(case: str, **values) -> None:
    print("DP_REPORT " + json.dumps({"case": case, "rank": dist.get_rank(), **values}), flush=True)


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
    report(
        prompt_gradient,
        max_rank_difference=max((g - gathered[0]).abs().max().item() for g in gathered),
        moved=(weights - initial).abs().max().item(),
    )


def gradient_against_stock() -> None:
    """Exact mode, rank r backward on its own synthetic batch (`replay_and_backward`, which averages across the ranks):
    every rank must hold the mean of stock GRPOTrainer's gradients over both ranks' batches, each computed here."""
    from tests.conftest import grads_of, make_trainer, max_relative_error, synthetic_inputs

    tokenizer = build_tokenizer()
    model = build_model("qwen3", seed=0)
    dataset = Dataset.from_dict({"prompt": ["unused"] * 4})
    stock = make_trainer(GRPOTrainer, copy.deepcopy(model), tokenizer, dataset, tempfile.mkdtemp())
    ours = make_trainer(
        LongStrawGRPOTrainer,
        model,
        tokenizer,
        dataset,
        tempfile.mkdtemp(),
        prompt_gradient="exact",
        prefill_chunk_size=4,
    )
    batches = [synthetic_inputs(len(tokenizer), seed=seed) for seed in range(dist.get_world_size())]
    wanted = []
    for batch in batches:
        stock.model.zero_grad(set_to_none=True)
        stock.compute_loss(stock.model, batch).backward()
        wanted.append(grads_of(stock.model))
    mean = {name: sum(grads[name] for grads in wanted) / len(wanted) for name in wanted[0]}
    ours.replay_and_backward(ours.model, batches[dist.get_rank()])
    got = grads_of(ours.model)
    report(
        "gradient",
        error_vs_stock_mean=max_relative_error(got, mean),
        error_vs_own_batch=max_relative_error(got, wanted[dist.get_rank()]),
    )


def reached_on_one_rank_only() -> None:
    """Routing can reach a parameter on one rank and not on another (an expert one rank's tokens choose): both ranks
    must still average the same parameters, that one included (rank 1's backward here never reaches layer 1's MLP)."""
    from tests.conftest import make_trainer, synthetic_inputs

    tokenizer = build_tokenizer()
    dataset = Dataset.from_dict({"prompt": ["unused"] * 4})
    trainer = make_trainer(LongStrawGRPOTrainer, build_model("qwen3", seed=0), tokenizer, dataset, tempfile.mkdtemp())
    mlp = trainer.model.model.layers[1].mlp
    if dist.get_rank() == 1:
        mlp.register_forward_hook(lambda module, inputs, output: output.detach())
    trainer.replay_and_backward(trainer.model, synthetic_inputs(len(tokenizer), seed=dist.get_rank()))
    reached = sorted(name for name, p in trainer.model.named_parameters() if any(p is q for q in trainer._reached))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, reached)
    report(
        "reached",
        same_reached=all(names == reached for names in everyone),
        mlp_reached="model.layers.1.mlp.down_proj.weight" in reached,
        mlp_grad_norm=float(mlp.down_proj.weight.grad.norm()),
    )


if __name__ == "__main__":
    for case in sys.argv[1:]:
        if case == "gradient":
            gradient_against_stock()
        elif case == "reached":
            reached_on_one_rank_only()
        else:
            main(case)
