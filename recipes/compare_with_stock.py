"""Peak memory of one GRPO step, stock `GRPOTrainer` vs `LongStrawGRPOTrainer`, on the demo's model and task.

    python recipes/compare_with_stock.py --trainer stock --prompt_chars 2048    # one measurement, one JSON line

Each measurement is one optimizer step (generation, scoring, loss, backward, optimizer) of the embedded tiny model on
the embedded needle task, in a fresh process: the resident set's high-water mark during `trainer.train()` (VmHWM,
reset through `/proc/self/clear_refs` right before it: this process's own counter) minus the resident set right
before it, i.e. what the step added over the loaded model and data. `compare(...)` runs stock at two sizes it can run and
LongStraw at the larger of them and at the demo's size, and predicts stock at the demo's size from its two
measurements (linear in P) beside the state accounting's lower bound: G generation caches of the prompt (`G x P x
bytes per token`, plus fixed recurrent bytes) plus the checkpointed layer inputs of its backward
(`stock_activation_bytes`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GIB = 1024**3


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_step(trainer_kind: str, family: str, prompt_chars: int, group_size: int, completion_length: int) -> dict:
    """One optimizer step in this process; returns the peak bytes it added over the loaded model and data."""
    os.environ.setdefault("WANDB_MODE", "disabled")
    from needle_task import build_needle_dataset, digits_only_reward, needle_reward
    from trl import GRPOConfig, GRPOTrainer

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
    from trl_longstraw.embedded import build_model, build_tokenizer

    longstraw = trainer_kind == "longstraw"
    config_class, trainer_class = (
        (LongStrawGRPOConfig, LongStrawGRPOTrainer) if longstraw else (GRPOConfig, GRPOTrainer)
    )
    with tempfile.TemporaryDirectory() as output_dir:
        args = config_class(
            output_dir=output_dir,
            num_generations=group_size,
            per_device_train_batch_size=group_size,
            max_completion_length=completion_length,
            max_steps=1,
            learning_rate=1e-4,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = trainer_class(
            model=build_model(family, seed=0),
            reward_funcs=[needle_reward, digits_only_reward],
            args=args,
            train_dataset=build_needle_dataset(2, prompt_chars, seed=0),
            processing_class=build_tokenizer(),
        )
        baseline = _status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        trainer.train()
        peak = _status_bytes("VmHWM") - baseline
        encoded = build_tokenizer().apply_chat_template(
            trainer.train_dataset[0]["prompt"], tokenize=True, add_generation_prompt=True, return_dict=True
        )
        prompt_tokens = len(encoded["input_ids"])
    return {"trainer": trainer_kind, "prompt_tokens": prompt_tokens, "peak_added_bytes": peak}


def _run(trainer_kind: str, family: str, prompt_chars: int, group_size: int, completion_length: int) -> dict:
    command = [
        sys.executable, __file__, "--trainer", trainer_kind, "--family", family, "--prompt_chars", str(prompt_chars),
        "--group_size", str(group_size), "--completion_length", str(completion_length),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def predicted_stock_bytes(family: str, prompt_tokens: int, group_size: int, completion_length: int) -> int:
    """Stock's step at `prompt_tokens`, a lower bound: G generation caches plus checkpointed backward activations."""
    from trl_longstraw.accounting import prompt_state_account, stock_activation_bytes
    from trl_longstraw.embedded import tiny_config

    config = tiny_config(family)
    account = prompt_state_account(config, dtype_bytes=4)  # the demo runs in fp32
    caches = group_size * account.bytes(prompt_tokens + completion_length)
    return caches + stock_activation_bytes(config, prompt_tokens, completion_length, group_size, dtype_bytes=4)


def compare(family: str, small_chars: int, demo_chars: int, group_size: int, completion_length: int) -> str:
    """The comparison table the demo prints (each measurement in a fresh process).

    Stock at the demo's size is predicted twice: linearly in P from its measurements at `small_chars / 2` and
    `small_chars` (its activations, caches and the attention kernels it runs grow linearly in P), and as the state
    accounting's lower bound (G generation caches plus checkpointed layer inputs), which leaves out the kernels'
    temporaries and so sits well under the measurement.
    """
    stock_half = _run("stock", family, small_chars // 2, group_size, completion_length)
    stock_small = _run("stock", family, small_chars, group_size, completion_length)
    ours_small = _run("longstraw", family, small_chars, group_size, completion_length)
    ours_demo = _run("longstraw", family, demo_chars, group_size, completion_length)
    demo_tokens = ours_demo["prompt_tokens"]
    slope = (stock_small["peak_added_bytes"] - stock_half["peak_added_bytes"]) / (
        stock_small["prompt_tokens"] - stock_half["prompt_tokens"]
    )
    extrapolated = stock_small["peak_added_bytes"] + slope * (demo_tokens - stock_small["prompt_tokens"])
    bound = predicted_stock_bytes(family, demo_tokens, group_size, completion_length)

    def gib(value: float) -> str:
        return f"{value / GIB:.3f} GiB"

    width = 64
    header = (
        f"Peak memory one GRPO step adds over the loaded model (G = {group_size}, {completion_length} completion "
        f"tokens, {family}, fp32; fresh process each; recipes/compare_with_stock.py):"
    )
    rows = [header, f"{'prompt tokens':<16}{'stock GRPOTrainer':<{width}}LongStrawGRPOTrainer"]
    rows.append(f"{stock_half['prompt_tokens']:<16}{gib(stock_half['peak_added_bytes']) + ' measured':<{width}}-")
    rows.append(
        f"{stock_small['prompt_tokens']:<16}{gib(stock_small['peak_added_bytes']) + ' measured':<{width}}"
        f"{gib(ours_small['peak_added_bytes'])} measured"
    )
    demo_cell = f"{gib(extrapolated)} predicted (linear in P; accounting >= {gib(bound)})"
    rows.append(f"{demo_tokens:<16}{demo_cell:<{width}}{gib(ours_demo['peak_added_bytes'])} measured")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from trl_longstraw.embedded import FAMILIES

    parser.add_argument(
        "--trainer", choices=("stock", "longstraw"), required=True, help="which trainer takes the step"
    )
    parser.add_argument("--family", default="qwen3_5", choices=list(FAMILIES), help="the embedded tiny model's family")
    parser.add_argument("--prompt_chars", type=int, default=2048, help="needle-task prompt length, in characters")
    parser.add_argument("--group_size", type=int, default=8, help="num_generations (G)")
    parser.add_argument("--completion_length", type=int, default=8, help="max_completion_length")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    result = measure_step(args.trainer, args.family, args.prompt_chars, args.group_size, args.completion_length)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
