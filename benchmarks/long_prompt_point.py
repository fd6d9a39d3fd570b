"""The long-prompt point: one group's capture, scoring and one replay with fp8 prompt-state pages, at growing P.

    # GPU (benchmarks/gpu_check.sh): the Qwen3.5/3.6-27B layer geometry at full width, 4 layers, up to 2M positions
    python benchmarks/long_prompt_point.py --preset hybrid-qwen35-gpu --device cuda --dtype bfloat16 \
        --prompt-lengths 131072,262144,524288,1048576,2097152 --budget-s 150 --out "$OUT/long_prompt.json"
    # CPU smoke test (seconds):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_prompt_point.py --preset dense-micro \
        --prompt-lengths 1024,4096 --completion-length 32 --group-size 4 --out /tmp/long_prompt.json

Engine level, no trainer: the preset model (random weights, `benchmarks/presets.py`) is prepared for LongStraw, a
random prompt of P tokens is captured with `LongStrawEngine(prompt_state_dtype="float8_e4m3fn")` (detach mode),
G completions of R tokens are scored from the state without grad, and one member is replayed under autograd and
back-propagated. Per P it records the phase times (device-synchronised on CUDA), the state's bytes next to
`trl_longstraw.accounting.prompt_state_bytes`, and the peak memory: on CUDA `max_memory_allocated` of each phase
(reset per phase: this is a benchmark process of its own), on CPU the process's peak RSS (VmHWM, whole process).

P values run in increasing order while the time budget allows: a point is skipped when the last point's time,
scaled quadratically in P (attention), would overrun the remaining budget. The JSON is rewritten after every point,
so a run killed by its caller still leaves every finished point.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def peak_rss_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Phases:
    """Wall time and peak memory per phase; on CUDA synchronised and measured by the allocator."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self.cuda = device.type == "cuda"
        self.record: dict[str, dict[str, float]] = {}

    def run(self, name, fn):
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        begin = time.perf_counter()
        result = fn()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        entry = {"time_s": time.perf_counter() - begin}
        if self.cuda:
            entry["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        else:
            rss = peak_rss_bytes()
            if rss is not None:
                entry["process_peak_rss_gib"] = rss / 2**30
        self.record[name] = entry
        return result


def build_prepared_model(args, min_positions: int):
    from presets import build_model, load_config_kwargs
    from trl.trainer.utils import add_fused_lm_head

    from trl_longstraw.engine import prepare_model

    name, kwargs = load_config_kwargs(args.preset, args.model_config)
    _, model = build_model(kwargs, min_positions=min_positions, dtype=args.dtype, seed=args.seed)
    model = model.to(args.device)
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs",))
    return name, model


def point(args, torch, model, prompt_length: int) -> dict:
    from trl_longstraw.accounting import UpdateSetup, prompt_state_bytes
    from trl_longstraw.engine import LongStrawEngine
    from trl_longstraw.plan import plan_run

    device = torch.device(args.device)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(args.seed + prompt_length)
    prompt = torch.randint(2, vocab, (prompt_length,), generator=generator)
    completions = torch.randint(2, vocab, (args.group_size, args.completion_length), generator=generator)
    lengths = torch.full((args.group_size,), args.completion_length)
    engine = LongStrawEngine(
        args.prefill_chunk_size, args.attention_chunk_size, prompt_state_dtype=args.prompt_state_dtype
    )
    phases = Phases(torch, device)
    state = phases.run("capture", lambda: engine.capture(model, prompt, first_position=0))
    model.zero_grad(set_to_none=True)
    phases.run("score", lambda: engine.score(model, state, prompt[-1:], completions, lengths, 1))

    def replay():
        logps, _ = engine.replay(model, state, prompt[-1:], completions[0], args.completion_length)
        logps.sum().backward()

    phases.run("replay", replay)
    dtype_bytes = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    predicted = prompt_state_bytes(model.config, prompt_length - 1, dtype_bytes, args.prompt_state_dtype)
    plan = plan_run(  # the planner's terms, for the measured peaks beside them (no optimizer runs here)
        model.config,
        UpdateSetup(
            prompt_tokens=prompt_length,
            completion_tokens=args.completion_length,
            group_size=args.group_size,
            lora_rank=None,
            state_dtype=args.prompt_state_dtype,
            activation_checkpointing=False,
            prefill_chunk_size=args.prefill_chunk_size,
            attention_chunk_size=args.attention_chunk_size,
            dtype_bytes=dtype_bytes,
            prompts_per_generation=0,
        ),
    )
    record = {
        "P": prompt_length,
        "G": args.group_size,
        "R": args.completion_length,
        "state_gib": state.nbytes() / 2**30,
        "state_gib_predicted": sum(predicted.values()) / 2**30,
        "plan_gib": {
            "weights": plan.account.weights.bytes / 2**30,
            "capture_working_set": plan.account.capture.bytes / 2**30,
            "replay_working_set": plan.account.replay.bytes / 2**30,
            "update_peak_with_gradients": (2 * plan.account.weights.bytes + plan.update_peak) / 2**30,
        },
        "phases": phases.record,
        "total_time_s": sum(entry["time_s"] for entry in phases.record.values()),
    }
    state = None  # release the pages before the next point
    model.zero_grad(set_to_none=True)
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="hybrid-qwen35-gpu")
    parser.add_argument("--model-config", default=None, help="JSON/YAML of config kwargs with model_type")
    parser.add_argument("--prompt-lengths", type=int_list, default=int_list("131072,262144,524288,1048576,2097152"))
    parser.add_argument("--completion-length", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prefill-chunk-size", type=int, default=8192)
    parser.add_argument("--attention-chunk-size", type=int, default=8192)
    parser.add_argument("--prompt-state-dtype", default="float8_e4m3fn", choices=("auto", "float8_e4m3fn"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop starting new points past this")
    parser.add_argument("--allow-tf32", action="store_true", help="TF32 matmuls on CUDA (the fp32 attention tiles)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32

    started = time.perf_counter()
    lengths = sorted(args.prompt_lengths)
    result = {
        "script": "benchmarks/long_prompt_point.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda")
        else platform.processor(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "allow_tf32": args.allow_tf32,
        "prompt_state_dtype": args.prompt_state_dtype,
        "prefill_chunk_size": args.prefill_chunk_size,
        "attention_chunk_size": args.attention_chunk_size,
        "points": [],
        "skipped": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    name, model = build_prepared_model(args, min_positions=lengths[-1] + args.completion_length + 1)
    result.update(model=name, num_params=sum(p.numel() for p in model.parameters()))
    result["build_s"] = time.perf_counter() - started
    last = None
    for prompt_length in lengths:
        remaining = args.budget_s - (time.perf_counter() - started)
        if last is not None:
            projected = last["total_time_s"] * (prompt_length / last["P"]) ** 2
            if projected > remaining:
                result["skipped"].append(
                    {"P": prompt_length, "reason": f"projected {projected:.0f} s > {remaining:.0f} s left"}
                )
                continue
        try:
            last = point(args, torch, model, prompt_length)
        except torch.OutOfMemoryError as error:
            result["skipped"].append({"P": prompt_length, "reason": f"out of memory: {str(error)[:200]}"})
            break
        result["points"].append(last)
        args.out.write_text(json.dumps(result, indent=2))
        print(json.dumps(last), flush=True)
    result["wall_s"] = time.perf_counter() - started
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
