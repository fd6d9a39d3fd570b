"""Long-context GRPO with `LongStrawGRPOTrainer`, launchable with `accelerate launch` like TRL's own `grpo.py`.

    accelerate launch recipes/grpo_longstraw.py --config configs/demo_embedded.yaml
    accelerate launch recipes/grpo_longstraw.py --model_name_or_path Qwen/Qwen3-8B --dataset_name ORG/DATA \
        --reward_funcs accuracy_reward my_lib.rewards.custom_reward --eval_strategy steps

TRL's script arguments (`trl.ScriptArguments`: `--dataset_name`, `--dataset_config`, `--dataset_train_split`,
`--dataset_test_split`, `--dataset_streaming`; an eval set from the test split when `--eval_strategy` is not "no"),
its rewards: `--reward_funcs` (TRL's by name, the embedded tasks' by name, or any dotted import path) and
`--reward_model_name_or_path`, and tools for TRL's tool loop: `--tools` (the embedded report task's `read_report`, or
dotted import paths). By default it trains the embedded tiny model on the embedded needle task with the needle rewards
(nothing is downloaded); `--dataset_name embedded:tools` trains the embedded tool-calling model on a multi-turn task
whose tool returns long reports (recipes/tool_task.py, configs/demo_tools_embedded.yaml).

After training, rank 0 prints the wall time and peak memory of each LongStraw phase, read back from the trainer's
logs, so the cost of a long prompt can be read off without a dashboard.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset, load_dataset
from needle_task import build_needle_dataset, digits_only_reward, needle_reward  # sibling module of this script
from tool_task import (  # sibling module of this script
    EMBEDDED_CALL_LOGIT,
    EMBEDDED_TOOL_CALL,
    ReportTask,
    report_key_reward,
    tool_use_reward,
)
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config
from trl.rewards import accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.embedded import (
    FAMILIES,
    build_model,
    build_tokenizer,
    build_tool_calling_model,
    build_tool_calling_tokenizer,
)
from trl_longstraw.telemetry import PHASES, PREFIX

EMBEDDED = "embedded"
EMBEDDED_NEEDLE = "embedded:needle"
EMBEDDED_TOOLS = "embedded:tools"
# TRL's grpo.py registry, and this task's rewards
TRL_REWARDS = {
    "accuracy_reward": accuracy_reward,
    "reasoning_accuracy_reward": reasoning_accuracy_reward,
    "think_format_reward": think_format_reward,
    "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
}
TASK_REWARDS = {
    "needle_reward": needle_reward,
    "digits_only_reward": digits_only_reward,
    "tool_use_reward": tool_use_reward,
    "report_key_reward": report_key_reward,
}
REWARDS = {**TRL_REWARDS, **TASK_REWARDS}
DEFAULT_REWARDS = {
    EMBEDDED_NEEDLE: ["needle_reward", "digits_only_reward"],
    EMBEDDED_TOOLS: ["tool_use_reward", "report_key_reward"],
}


@dataclass
class LongStrawScriptArguments(ScriptArguments):
    """TRL's script arguments (the dataset and its splits), `grpo.py`'s rewards and tools, with the embedded needle task
    as the default dataset."""

    dataset_name: str | None = field(
        default=EMBEDDED_NEEDLE,
        metadata={
            "help": f"'{EMBEDDED_NEEDLE}' builds the synthetic needle-in-a-haystack task in code, '{EMBEDDED_TOOLS}' "
            "the multi-turn report task whose tool returns long reports (recipes/tool_task.py); anything else is "
            "loaded with `datasets.load_dataset(dataset_name, name=dataset_config)` and needs a `prompt` column "
            "(and, for `needle_reward` and `report_key_reward`, an `answer` column)."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": f"Reward functions: TRL's ({', '.join(TRL_REWARDS)}), the embedded tasks' "
            f"({', '.join(TASK_REWARDS)}), or any dotted import path (e.g. 'my_lib.rewards.custom_reward'). Default: "
            "the embedded task's own; required otherwise (or a reward model)."
        },
    )
    tools: list[str] | None = field(
        default=None,
        metadata={
            "help": "Tools for TRL's tool loop (GRPOTrainer's `tools`): the embedded report task's read_report, or "
            "dotted import paths of functions with a docstring TRL reads the schema from (e.g. "
            "'my_lib.tools.search'). Default: read_report for the embedded report task; none otherwise."
        },
    )
    report_chars: int = field(
        default=4096,
        metadata={
            "help": "Characters of every report `read_report` returns (embedded report task only); with the embedded "
            "character-level tokenizer, the tokens each tool call adds to a completion."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A reward model (a Hub id or a local folder), scored beside the reward functions."},
    )
    num_prompts: int = field(
        default=8,
        metadata={"help": "Number of needle prompts to build (embedded needle task only)."},
    )
    prompt_chars: int = field(
        default=16384,
        metadata={
            "help": "Characters of every needle prompt's user message (embedded needle task only); with the embedded "
            "character-level tokenizer, that is its length in tokens."
        },
    )
    compare_with_stock_prompt_chars: int = field(
        default=0,
        metadata={
            "help": "After training (embedded model and needle task only), measure the peak memory of one step of "
            "stock GRPOTrainer and of LongStrawGRPOTrainer at prompts of this many characters (a size stock can "
            "run), of LongStraw at `prompt_chars`, and print them beside stock's predicted peak at `prompt_chars` "
            "(recipes/compare_with_stock.py). 0: skip."
        },
    )
    embedded_model_type: str = field(
        default="qwen3_5",
        metadata={
            "help": "Family of the embedded tiny random-weight model (any of trl_longstraw.embedded.FAMILIES), used "
            f"when `model_name_or_path` is unset or '{EMBEDDED}'.",
            "choices": list(FAMILIES),
        },
    )


def save_reference_weights(model: PreTrainedModel, training_args: LongStrawGRPOConfig) -> None:
    """Save the embedded model's initial weights and point its config at them.

    With `beta != 0` and no PEFT adapter to disable, `GRPOTrainer` loads the reference model from the policy's
    `name_or_path`, which an in-memory model does not have. Rank 0 writes, the other ranks wait for it.
    """
    path = Path(training_args.output_dir) / "embedded_reference"
    with training_args.main_process_first(local=False, desc="saving the embedded reference weights"):
        if training_args.process_index == 0:
            model.save_pretrained(path)
    model.config._name_or_path = str(path)


def load_model_and_tokenizer(
    script_args: LongStrawScriptArguments, training_args: LongStrawGRPOConfig, model_args: ModelConfig
) -> tuple[PreTrainedModel | str, PreTrainedTokenizerBase]:
    """The embedded tiny model and tokenizer, or a Hub model id with its tokenizer.

    A Hub model is passed to the trainer as its id, with `model_init_kwargs`, so that the trainer loads it (with the
    quantization config) and applies PEFT exactly as stock `GRPOTrainer` does.
    """
    if model_args.model_name_or_path in (None, EMBEDDED):
        dtype = torch.float32 if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
        family, seed = script_args.embedded_model_type, training_args.seed
        if script_args.dataset_name == EMBEDDED_TOOLS:  # the tiny model that calls read_report
            tokenizer = build_tool_calling_tokenizer(EMBEDDED_TOOL_CALL)
            model = build_tool_calling_model(tokenizer, family, seed, EMBEDDED_CALL_LOGIT, EMBEDDED_TOOL_CALL).to(
                dtype
            )
        else:
            tokenizer, model = build_tokenizer(), build_model(family, seed=seed, dtype=dtype)
        if training_args.beta != 0.0 and not model_args.use_peft:
            save_reference_weights(model, training_args)
        return model, tokenizer
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        padding_side="left",
    )
    return model_args.model_name_or_path, tokenizer


def reward_functions(script_args: LongStrawScriptArguments) -> list:
    """`--reward_model_name_or_path` and `--reward_funcs` as TRL's grpo.py resolves them (a name of `REWARDS`, or a
    dotted import path); the needle task's two rewards by default for the embedded needle task."""
    names = script_args.reward_funcs
    if names is None:
        names = DEFAULT_REWARDS.get(script_args.dataset_name)
    rewards = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    rewards += [resolve("--reward_funcs", name, REWARDS, "my_lib.rewards.custom_reward") for name in names or []]
    if not rewards:
        raise ValueError(
            f"--dataset_name {script_args.dataset_name}: give its rewards with --reward_funcs (names or dotted import "
            "paths) or --reward_model_name_or_path."
        )
    return rewards


def resolve(flag: str, name: str, known: dict, example: str):
    """A function by name (one of `known`) or dotted import path, as TRL's grpo.py resolves its rewards."""
    if name in known:
        return known[name]
    if "." in name:
        module, function = name.rsplit(".", 1)
        sys.path.insert(0, os.getcwd())
        return getattr(importlib.import_module(module), function)
    raise ValueError(f"{flag} {name!r}: give one of {', '.join(known)}, or a dotted import path (e.g. {example}).")


def report_task(script_args: LongStrawScriptArguments, training_args: LongStrawGRPOConfig) -> ReportTask | None:
    """The embedded report task (its prompts and the tool that reads its reports), or None for another dataset."""
    if script_args.dataset_name != EMBEDDED_TOOLS:
        return None
    return ReportTask(script_args.num_prompts, script_args.report_chars, seed=training_args.seed)


def tool_functions(script_args: LongStrawScriptArguments, task: ReportTask | None) -> list | None:
    """`--tools` resolved (the report task's `read_report` by name, or dotted import paths); the report task's tool
    by default for the embedded report task."""
    known = {} if task is None else {"read_report": task.read_report}
    names = script_args.tools if script_args.tools is not None else list(known)
    return [resolve("--tools", name, known, "my_lib.tools.search") for name in names] or None


def load_datasets(
    script_args: LongStrawScriptArguments, training_args: LongStrawGRPOConfig, task: ReportTask | None = None
) -> tuple[Dataset, Dataset | None]:
    """The train split and, when evaluating (`eval_strategy` not "no"), the test split: the embedded needle task
    (its eval set built with the next seed), the embedded report task (`task`: its eval set is its train set, the
    reports its tool reads), or a Hub dataset (`load_dataset(dataset_name, name=dataset_config)`)."""
    evaluating = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) != "no"
    if task is not None:
        return task.dataset(), task.dataset() if evaluating else None
    if script_args.dataset_name == EMBEDDED_NEEDLE:
        count, chars = script_args.num_prompts, script_args.prompt_chars
        train = build_needle_dataset(count, chars, seed=training_args.seed)
        return train, build_needle_dataset(count, chars, seed=training_args.seed + 1) if evaluating else None
    dataset = load_dataset(
        script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
    )
    return dataset[script_args.dataset_train_split], dataset[script_args.dataset_test_split] if evaluating else None


def phase_table(log_history: list[dict[str, float]]) -> str:
    """Per phase over the logged training steps: mean wall time, the largest peak and what the phase added at its peak.

    The memory keys are whatever the telemetry logged (`cuda_allocated_*` on CUDA, `rss_*` on the host, see the
    docs/memory.md, "Logged metrics"), so the table names them rather than assuming one. Phases that never ran (e.g.
    `capture_ref` when `beta=0`, `prompt_backward` in detach mode) are shown as not logged. Evaluation's metrics
    (`eval_longstraw/...`) are not in this table.
    """
    rows = [f"{'phase':<16}{'steps':>6}{'mean time_s':>13}{'max peak GiB':>14}{'max added GiB':>15}  memory metric"]
    for phase in PHASES:
        times = [log[f"{PREFIX}/{phase}/time_s"] for log in log_history if f"{PREFIX}/{phase}/time_s" in log]
        if not times:
            rows.append(f"{phase:<16}{0:>6}{'-':>13}{'-':>14}{'-':>15}  (not logged)")
            continue
        columns = []
        for suffix in ("_peak_gib", "_added_gib"):
            keys = {key for log in log_history for key in log if key.startswith(f"{PREFIX}/{phase}/")}
            keys = sorted(key for key in keys if key.endswith(suffix))
            values = [log[key] for log in log_history for key in keys if key in log]
            columns.append((max(values) if values else float("nan"), ", ".join(k.rsplit("/", 1)[-1] for k in keys)))
        (peak, metric), (added, added_metric) = columns
        rows.append(
            f"{phase:<16}{len(times):>6}{statistics.mean(times):>13.3f}{peak:>14.3f}{added:>15.3f}  "
            f"{metric or '(not measured)'}{', ' + added_metric if added_metric else ''}"
        )
    states = [log[f"{PREFIX}/prompt_state_gib"] for log in log_history if f"{PREFIX}/prompt_state_gib" in log]
    rows.append(f"max prompt state: {max(states):.4f} GiB" if states else "max prompt state: (not logged)")
    return "\n".join(rows)


def save_reward_curve(log_history: list[dict[str, float]], path: Path) -> Path | None:
    """Plot the mean reward of each logged training step to `path` (PNG); None if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no reward curve (pip install matplotlib).")
        return None
    points = [(log["step"], log["reward"]) for log in log_history if "reward" in log and "step" in log]
    if not points:
        return None
    steps, rewards = zip(*points, strict=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, "o-", markersize=3)
    ax.set(xlabel="optimizer step", ylabel="mean reward of the step's group", title="LongStraw GRPO: reward")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(script_args: LongStrawScriptArguments, training_args: LongStrawGRPOConfig, model_args: ModelConfig) -> None:
    reward_funcs = reward_functions(script_args)  # before any model loads: a bad name fails at once
    task = report_task(script_args, training_args)
    tools = tool_functions(script_args, task)
    train_dataset, eval_dataset = load_datasets(script_args, training_args, task)
    model, tokenizer = load_model_and_tokenizer(script_args, training_args, model_args)
    trainer = LongStrawGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        tools=tools,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)

    if trainer.accelerator.is_main_process:
        history = trainer.state.log_history
        print(f"LongStraw phases over {trainer.state.global_step} steps:\n{phase_table(history)}")
        rewards = [f"{log['reward']:.2f}" for log in history if "reward" in log and "step" in log]
        print(f"reward per step: {' '.join(rewards)}")
        if tools:
            calls = [f"{log['tools/call_frequency']:.2f}" for log in history if "tools/call_frequency" in log]
            print(f"tool calls per completion per step: {' '.join(calls)}")
        curve = save_reward_curve(history, Path(training_args.output_dir) / "reward_curve.png")
        if curve is not None:
            print(f"reward curve: {curve}")
        embedded = model_args.model_name_or_path in (None, EMBEDDED) and script_args.dataset_name == EMBEDDED_NEEDLE
        if script_args.compare_with_stock_prompt_chars and embedded:
            from compare_with_stock import compare  # sibling module of this script

            print(
                compare(
                    script_args.embedded_model_type,
                    script_args.compare_with_stock_prompt_chars,
                    script_args.prompt_chars,
                    training_args.num_generations,
                    training_args.max_completion_length,
                )
            )
        if "wandb" in training_args.report_to:
            import wandb

            # The Trainer's W&B callback leaves the run open after training; log the curve, print where the run
            # lives, then close it.
            if wandb.run is not None:
                if curve is not None:
                    wandb.log({"longstraw/reward_curve": wandb.Image(str(curve))})
                print(f"W&B run directory: {wandb.run.dir}")
            wandb.finish()
    trainer.end()


if __name__ == "__main__":
    parser = TrlParser((LongStrawScriptArguments, LongStrawGRPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())
