"""One LongStraw training step, run alone (`python this.py OUT 1`) or on 2 ranks with context_parallel_size=2
(`accelerate launch --num_processes 2 this.py OUT 2`), in detach and exact mode; saves what the test compares.

The CP group draws the rows one process draws (`SharedRowsSampler`: a generation batch of one prompt, from the same
seed), so the two runs must take the same optimizer step; each rank also reports the first rows a fresh dataloader
hands it, which must be the same on both ranks, and then evaluates: the CP group must evaluate every eval prompt once
per member, as one process does. A MoE family with an expert count trains with TRL's load-balancing loss;
"tool_calling" is the embedded tool-calling Qwen3 with `tools=[add]`, its prompts conversational: every rank runs the
tools, and the tool turns decode from the sharded prompt state.
"""

import sys
import tempfile

import torch
import torch.distributed as dist
from datasets import Dataset

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.embedded import (
    add,
    build_model,
    build_tokenizer,
    build_tool_calling_model,
    build_tool_calling_tokenizer,
)

PROMPTS = [f"the key is {4217 + i}. " + "lorem ipsum " * (i % 3 + 1) + "what is the key?" for i in range(8)]


EVAL_PROMPTS = [f"the key is {90 + i}. what is the key?" for i in range(4)]
SEEN_PROMPTS: list[str] = []


def char_code_reward(prompts, completions, **kwargs):
    SEEN_PROMPTS.extend(map(str, prompts))
    return [float(sum(map(ord, str(completion))) % 7) for completion in completions]


def conversational(prompts: list[str]) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": prompt}] for prompt in prompts]})


def step(prompt_gradient: str, context_parallel_size: int, family: str) -> dict:
    tools = family == "tool_calling"  # ~750 prompt tokens (the tool schema), room for a call and its result
    args = LongStrawGRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=3,
        per_device_eval_batch_size=3,
        num_generations=3,
        max_completion_length=48 if tools else 5,
        max_steps=1,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        seed=0,
        prompt_gradient=prompt_gradient,
        prefill_chunk_size=128 if tools else 8,
        attention_chunk_size=128 if tools else 8,
        context_parallel_size=context_parallel_size,
        router_aux_loss_coef=0.5 if family == "qwen3_moe" else None,
        # a quantile over each row's tokens once (each CP rank holds the group's rows)
        top_entropy_quantile=0.9 if family == "glm_moe_dsa" else 1.0,
        # members of 5 tokens (6 replayed) in segments of 3: under CP each is run by the group in steps
        replay_segment_size=None if tools else 3,
    )
    if tools:
        tokenizer = build_tool_calling_tokenizer()
        model, dataset, eval_dataset = (
            build_tool_calling_model(tokenizer),
            conversational(PROMPTS),
            conversational(EVAL_PROMPTS),
        )
    else:
        tokenizer, model = build_tokenizer(), build_model(family, seed=0)
        dataset, eval_dataset = Dataset.from_dict({"prompt": PROMPTS}), Dataset.from_dict({"prompt": EVAL_PROMPTS})
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = LongStrawGRPOTrainer(
        model=model,
        reward_funcs=char_code_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[add] if tools else None,
    )
    trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    first_rows = [row["prompt"] for row in next(iter(trainer.get_train_dataloader()))]  # after training: no effect
    SEEN_PROMPTS.clear()
    metrics = trainer.evaluate(eval_dataset)
    return {
        "eval_prompts": sorted(SEEN_PROMPTS),
        "eval_reward": metrics["eval_reward"],
        "eval_aux_loss": metrics.get("eval_aux_loss"),
        "aux_loss": logged.get("aux_loss"),
        "first_rows": first_rows,
        "update": {name: (p.detach() - initial[name]).clone() for name, p in trainer.model.named_parameters()},
        "loss": logged["loss"],
        "grad_norm": logged["grad_norm"],
        "rollouts": logged.get("longstraw/rollout/count"),
        "tool_calls": logged.get("tools/call_frequency"),
    }


def main(out: str, context_parallel_size: int, families: list[str]) -> None:
    for family in families:
        results = {mode: step(mode, context_parallel_size, family) for mode in ("detach", "exact")}
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.save(results, f"{out}/{family}-cp{context_parallel_size}-rank{rank}.pt")
    if dist.is_initialized():  # every group's gloo threads stopped before the interpreter tears down
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
