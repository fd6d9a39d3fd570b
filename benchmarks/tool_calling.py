"""Tool-calling GRPO steps on a long prompt: GRPOTrainer's tool loop, stock against LongStraw, phase by phase.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tool_calling.py --prompt-length 8192 --group-size 8 \
        --out benchmarks/results/cpu-2core-tool-calling

Each trainer runs in a fresh process (`--worker`) on the same model, prompt, seed and settings: the embedded
tool-calling model (`trl_longstraw.embedded.build_tool_calling_model`: a tiny Qwen3 that calls `add`, most turns
with the default `--call-logit`), one conversational prompt of about `--prompt-length` tokens, `--group-size`
completions per step, `--steps` optimizer steps with `tools=[add]`. Modes:
  stock      GRPOTrainer (transformers' `generate`: the prompt prefilled once per row, and for every tool turn a
             prefill of each calling row's whole history)
  longstraw  LongStrawGRPOTrainer, prompt_gradient="detach" (one capture; tool turns decode from it)
Reported per step (after the first, which warms up): step time, LongStraw's phases (capture count and time, rollout,
score, replay), tool calls per row, and the process's resident-set high-water mark over the whole run (VmHWM, reset
through /proc/self/clear_refs before training) above the resident set before it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("WANDB_MODE", "disabled")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
GIB = 1024**3
MODES = ("stock", "longstraw")
FILLER = "the value of key is 42. "


def worker(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from update_worker import _malloc_trim, _status_bytes

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
    from trl_longstraw.embedded import add, build_tool_calling_model, build_tool_calling_tokenizer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tokenizer = build_tool_calling_tokenizer()
    content = (FILLER * (args.prompt_length // len(FILLER) + 1))[: args.prompt_length] + " add one and two"
    prompt = [{"role": "user", "content": content}]
    dataset = Dataset.from_dict({"prompt": [prompt] * args.group_size * args.steps})
    settings = {
        "output_dir": tempfile.mkdtemp(),
        "per_device_train_batch_size": args.group_size,
        "num_generations": args.group_size,
        "max_completion_length": args.completion_length,
        "max_steps": args.steps,
        "learning_rate": 1e-3,
        "report_to": "none",
        "use_cpu": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_dropout": True,
        "seed": 0,
        "bf16": False,
    }
    with tempfile.TemporaryDirectory() as saved:
        build_tool_calling_model(tokenizer, call_logit=args.call_logit).save_pretrained(saved)
        model = AutoModelForCausalLM.from_pretrained(saved)
    if args.mode == "longstraw":
        trainer_class, config = LongStrawGRPOTrainer, LongStrawGRPOConfig(prompt_gradient="detach", **settings)
    else:
        trainer_class, config = GRPOTrainer, GRPOConfig(**settings)

    def reward(completions, **kwargs):
        return [float(len(set(str(completion)))) for completion in completions]

    trainer = trainer_class(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer, tools=[add]
    )
    prompt_tokens = len(trainer._tokenize_prompts([prompt])[0][0])
    _malloc_trim()
    baseline = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM") - baseline
    steps = [log for log in trainer.state.log_history if "loss" in log][1:]  # the first step warms up

    def mean(key: str) -> float:
        return round(sum(log.get(key, 0.0) for log in steps) / len(steps), 4)

    phases = ("capture", "rollout", "score", "replay")
    return {
        "mode": args.mode,
        "prompt_tokens": prompt_tokens,
        "G": args.group_size,
        "R": args.completion_length,
        "steps_measured": len(steps),
        "step_time_s": mean("step_time"),
        "tool_calls_per_row": mean("tools/call_frequency"),
        "completion_tokens_per_row": mean("completions/mean_length"),
        **{f"{phase}_s": mean(f"longstraw/{phase}/time_s") for phase in phases},
        "captures_per_step": mean("longstraw/capture/count"),
        "train_s": round(seconds, 3),
        "peak_added_gib": round(peak / GIB, 4),
        "threads": torch.get_num_threads(),
    }


def run_point(mode: str, args) -> dict:
    command = [
        sys.executable, __file__, "--worker", "--mode", mode, "--prompt-length", str(args.prompt_length),
        "--group-size", str(args.group_size), "--completion-length", str(args.completion_length),
        "--steps", str(args.steps), "--call-logit", str(args.call_logit),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"mode": mode, "error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict]) -> str:
    keys = [
        "prompt_tokens", "G", "R", "tool_calls_per_row", "completion_tokens_per_row", "step_time_s",
        "captures_per_step", "capture_s", "rollout_s", "score_s", "replay_s", "peak_added_gib",
    ]  # fmt: skip
    lines = [
        (
            f"Command: `{' '.join(sys.argv)}` ({rows[0].get('threads', '?')} thread(s); per-step means after the "
            "first step)."
        ),
        "",
        "| mode | " + " | ".join(keys) + " |",
        "| --- |" + " --- |" * len(keys),
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | " + " | ".join(str(row.get(key, row.get("error", "-"))) for key in keys) + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--prompt-length", type=int, default=8192, help="characters of filler in the user turn")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--call-logit", type=float, default=10.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step warms up and is not measured")
    if args.worker:
        print(json.dumps(worker(args)))
        return
    rows = [run_point(mode, args) for mode in args.modes.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / "summary.md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
