"""One GRPO update of one group, in this (fresh) process, measured; prints ONE JSON line on stdout.

    .venv/bin/python benchmarks/update_worker.py --mode longstraw-detach --prompt-length 8192 --group-size 8 \
        --completion-length 128 [--preset dense-tiny | --model-config cfg.json] [--profile out.prof]

Modes (same model, seed, inputs and GRPO loss in all of them):
  stock-batched       GRPOTrainer.compute_loss(all G rows) + backward()           (gradient checkpointing off)
  stock-serialized    G x [compute_loss(1 row) + backward()], current_gradient_accumulation_steps = G,
                      per_device_train_batch_size 1 x gradient_accumulation_steps G (checkpointing ON)
  prefix-grouper      GRPOTrainer with the Prefix Grouper forward (benchmarks/prefix_grouper_mode.py), one backward
  longstraw-detach    LongStrawGRPOTrainer.replay_and_backward, prompt_gradient="detach"
  longstraw-exact     LongStrawGRPOTrainer.replay_and_backward, prompt_gradient="exact"
  reference           the naive capture-and-replay on HF's own cache: one no-grad prompt forward into a
                      DynamicCache, then per member a deep copy of the cache and a [last prompt token, completion]
                      forward+backward (detach-mode gradient, d loss/d logp = -A_i / num_items: dapo on policy)
Every mode is followed by one plain `torch.optim.AdamW` step over the trainable parameters (in the totals, and
reported on its own).

Memory: on CPU the process resident-set high-water mark (Linux VmHWM, reset through /proc/self/clear_refs just before
the update) minus the RSS right before it ("peak_rss_above_baseline"); on CUDA `max_memory_allocated` minus the
allocated bytes before it (LongStraw's own telemetry resets neither).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODES = ("stock-batched", "stock-serialized", "prefix-grouper", "longstraw-detach", "longstraw-exact", "reference")
GC_DEFAULT = {  # gradient checkpointing per mode unless --gradient-checkpointing on/off
    "stock-batched": False,
    "stock-serialized": True,
    "prefix-grouper": False,
    "longstraw-detach": False,
    "longstraw-exact": False,
    "reference": False,
}
GIB = 1024**3


# ------------------------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------------------------
def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakTracker:
    """Whole-span peak on CPU (VmHWM) or CUDA (max_memory_allocated); `fold` keeps the peak so far across a reset."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.device = device
        self.folded = 0
        self.kind = "peak_cuda_allocated_above_baseline" if self.cuda else "peak_rss_above_baseline"

    def current(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            return self.torch.cuda.memory_allocated(self.device)
        return _status_bytes("VmRSS") or 0

    def high_water(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            return self.torch.cuda.max_memory_allocated(self.device)
        return _status_bytes("VmHWM") or 0

    def fold(self) -> None:
        self.folded = max(self.folded, self.high_water())

    def reset(self) -> None:
        self.folded = 0
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            self.kind = "peak_rss_lifetime_minus_baseline"  # could not reset: lifetime peak, says so

    def peak(self) -> int:
        return max(self.folded, self.high_water())


# ------------------------------------------------------------------------------------------------------------------
# Model, inputs, trainer
# ------------------------------------------------------------------------------------------------------------------
def synthetic_group(
    vocab_size: int, prompt_length: int, group_size: int, completion_length: int, seed: int, device, shared_prefix=0
):
    """One group: a P-token prompt shared by G rows, G completions of R tokens (their first `shared_prefix` alike),
    nonzero zero-mean advantages."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, vocab_size, (prompt_length,), generator=generator)
    prompt_ids = prompt[None].expand(group_size, -1).clone()
    completion_ids = torch.randint(2, vocab_size, (group_size, completion_length), generator=generator)
    completion_ids[:, :shared_prefix] = completion_ids[0, :shared_prefix]
    rewards = torch.randn(group_size, generator=generator)
    advantages = rewards - rewards.mean()
    advantages = torch.where(advantages.abs() < 1e-3, torch.full_like(advantages, 0.1), advantages)
    completion_mask = torch.ones(group_size, completion_length, dtype=torch.long)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }
    return {k: v.to(device) for k, v in inputs.items()}


def rows_of(inputs, index: int):
    out = {}
    for key, value in inputs.items():
        out[key] = value if value.ndim == 0 else value[index : index + 1]
    return out


def build_trainer(args, model, tokenizer, output_dir):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer

    G, R = args.group_size, args.completion_length
    longstraw = args.mode.startswith("longstraw")
    serialized = args.mode == "stock-serialized"
    fields = {
        "output_dir": output_dir,
        "per_device_train_batch_size": 1 if serialized else G,
        "gradient_accumulation_steps": G if serialized else 1,
        "num_generations": G,
        "max_completion_length": R,
        "report_to": "none",
        "use_cpu": args.device == "cpu",
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_dropout": True,
        "seed": args.seed,
        "bf16": False,
        "beta": args.beta,
        "loss_type": args.loss_type,
        "gradient_checkpointing": args.gc,
        "router_aux_loss_coef": args.router_aux_loss_coef,
    }
    if longstraw:
        fields.update(
            prompt_gradient=args.mode.split("-", 1)[1],
            prefill_chunk_size=args.prefill_chunk_size,
            attention_chunk_size=args.attention_chunk_size,
            replay_segment_size=args.replay_segment_size,
        )
        config_class, trainer_class = LongStrawGRPOConfig, LongStrawGRPOTrainer
    elif args.mode == "prefix-grouper":
        from prefix_grouper_mode import PrefixGrouperGRPOTrainer

        config_class, trainer_class = GRPOConfig, PrefixGrouperGRPOTrainer
    else:
        config_class, trainer_class = GRPOConfig, GRPOTrainer
    trainer = trainer_class(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=config_class(**fields),
        train_dataset=Dataset.from_dict({"prompt": ["x"] * max(2, G)}),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = G if serialized else 1
    if longstraw and args.no_shared_spans:
        trainer.engine.shared_span_tokens = None
    if args.gc:
        # Trainer turns activation checkpointing on in `train()`, which this benchmark never calls: do what it does.
        kwargs = dict(trainer.args.activation_checkpointing_kwargs or {})
        trainer.accelerator.unwrap_model(trainer.model).activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None,
            every_n_layers=kwargs.pop("every_n_layers", 1),
            offload=kwargs.pop("offload", False),
        )
    trainer.model.train()
    return trainer


# ------------------------------------------------------------------------------------------------------------------
# The updates; each returns (loss, {phase: seconds})
# ------------------------------------------------------------------------------------------------------------------
def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def update_stock_batched(trainer, inputs, device):
    t0 = time.perf_counter()
    loss = trainer.compute_loss(trainer.model, inputs)
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    return loss.detach(), {"forward_loss": t1 - t0, "backward": time.perf_counter() - t1}


def update_stock_serialized(trainer, inputs, device):
    G = inputs["prompt_ids"].shape[0]
    phases = {"forward_loss": 0.0, "backward": 0.0}
    total = 0.0
    for index in range(G):
        loss, micro_phases = update_stock_batched(trainer, rows_of(inputs, index), device)
        for name, seconds in micro_phases.items():
            phases[name] += seconds
        total += float(loss)
        del loss
    return total, phases


def update_longstraw(trainer, inputs, device):
    t0 = time.perf_counter()
    loss = trainer.replay_and_backward(trainer.model, inputs)
    _sync(device)
    elapsed = time.perf_counter() - t0
    telemetry = trainer._telemetry.flush()
    phases = {}
    for key, value in telemetry.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "time_s":
            phases[parts[1]] = value
    phases["loss_and_other"] = max(0.0, elapsed - sum(phases.values()))
    return loss, phases, telemetry


def update_reference(trainer, inputs, device):
    """Naive capture-and-replay on HF's DynamicCache: no-grad prompt forward, G replays.

    The reference that detach mode's time and grad norm are compared with.
    """
    import torch
    from transformers import DynamicCache

    model = trainer.model
    prompt = inputs["prompt_ids"][0]
    completions = inputs["completion_ids"]
    G, R = completions.shape
    P = prompt.numel()
    positions = torch.arange(P + R, device=device)
    weights = -inputs["advantages"].float() / inputs["num_items_in_batch"].float()  # dapo on policy: d loss/d logp
    t0 = time.perf_counter()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.base_model(
            input_ids=prompt[None, :-1], position_ids=positions[None, : P - 1], cache=cache, use_cache=True
        )
    _sync(device)
    t1 = time.perf_counter()
    total = 0.0
    for member in range(G):
        replay = torch.cat([prompt[-1:], completions[member, :-1]])
        out = model(
            input_ids=replay[None],
            position_ids=positions[None, P - 1 : P - 1 + R],
            cache=copy.deepcopy(cache),
            shift_labels=completions[member][None],
            fused_lm_head=True,
        )
        logps = out.log_probs[0]
        (logps * weights[member]).sum().backward()
        total += float((logps.detach() * weights[member]).sum())
    _sync(device)
    return total, {"prompt_forward": t1 - t0, "replays": time.perf_counter() - t1}


# ------------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--prompt-length", type=int, required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument("--preset", default="dense-tiny")
    parser.add_argument("--model-config", default=None, help="JSON/YAML of config kwargs with model_type")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--loss-type", default="dapo")
    parser.add_argument(
        "--router-aux-loss-coef",
        type=float,
        default=None,
        help="GRPOConfig's router_aux_loss_coef (MoE load-balancing loss; default: the model config's, as TRL)",
    )
    parser.add_argument("--gradient-checkpointing", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--prefill-chunk-size", type=int, default=2048)
    parser.add_argument("--attention-chunk-size", type=int, default=4096)
    parser.add_argument(
        "--replay-segment-size",
        type=int,
        default=None,
        help="LongStraw modes: replay (and score) members longer than this in segments (default: whole)",
    )
    parser.add_argument(
        "--shared-prefix", type=int, default=0, help="the completions' first tokens alike (a shared turn), this many"
    )
    parser.add_argument(
        "--no-shared-spans",
        action="store_true",
        help="LongStraw modes: replay every member from the prompt, never a span members share once",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="model weights (and so activations) dtype; bfloat16 for GPU-scale runs",
    )
    parser.add_argument("--no-warmup", action="store_true", help="skip the tiny warm-up update before measuring")
    parser.add_argument(
        "--profile",
        default=None,
        help="cProfile the measured update: stats to PATH, top --profile-top lines to PATH.txt",
    )
    parser.add_argument("--profile-top", type=int, default=25)
    args = parser.parse_args(argv)
    args.gc = GC_DEFAULT[args.mode] if args.gradient_checkpointing == "auto" else args.gradient_checkpointing == "on"
    return args


def run(args) -> dict:
    import torch
    from presets import build_config, load_config_kwargs
    from transformers import AutoModelForCausalLM

    from trl_longstraw.embedded import build_tokenizer

    device = torch.device(args.device)
    P, G, R = args.prompt_length, args.group_size, args.completion_length
    record = {
        "mode": args.mode,
        "P": P,
        "G": G,
        "R": R,
        "replay_segment_size": args.replay_segment_size,
        "shared_prefix": args.shared_prefix,
        "shared_spans": not args.no_shared_spans,
        "gradient_checkpointing": args.gc,
        "beta": args.beta,
        "loss_type": args.loss_type,
        "router_aux_loss_coef": args.router_aux_loss_coef,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
    }
    import hashlib
    from pathlib import Path

    import trl_longstraw

    package = Path(trl_longstraw.__file__).parent
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.read_bytes())
    record.update(longstraw_path=str(package), longstraw_sources_sha256=digest.hexdigest()[:16])
    model_name, kwargs = load_config_kwargs(args.preset, args.model_config)
    record["model"] = model_name
    config, raised = build_config(kwargs, min_positions=P + R)
    if raised:
        record["max_position_embeddings_raised"] = list(raised)
    layer_types = set(getattr(config.get_text_config(), "layer_types", None) or ["full_attention"])
    if args.mode == "prefix-grouper" and not layer_types <= {"full_attention"}:
        record.update(
            status="unsupported",
            reason=f"Prefix Grouper packs G completions in one row: only softmax "
            f"attention can keep them apart; this model has layer types {sorted(layer_types)}",
        )
        return record
    if args.mode == "prefix-grouper":
        try:
            import prefix_grouper

            record["prefix_grouper_version"] = getattr(prefix_grouper, "__version__", "?")
        except ImportError as error:
            record.update(status="unsupported", reason=f"prefix-grouper not importable: {error}")
            return record
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    num_params = sum(p.numel() for p in model.parameters())
    tokenizer = build_tokenizer()
    vocab = config.get_text_config().vocab_size
    with tempfile.TemporaryDirectory() as output_dir:
        try:
            trainer = build_trainer(args, model, tokenizer, output_dir)
        except (ValueError, NotImplementedError) as error:  # e.g. LongStraw refusing an architecture
            record.update(status="unsupported", reason=f"{type(error).__name__}: {error}")
            return record
        model = trainer.model
        layers_checkpointed = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
        record["gradient_checkpointing_active_layers"] = len(layers_checkpointed)
        if args.gc and not layers_checkpointed:
            raise RuntimeError("gradient checkpointing was requested but no layer has it enabled")
        trainable = [p for p in model.parameters() if p.requires_grad]
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
        record.update(
            num_params=num_params,
            weight_bytes=param_bytes,
            grad_bytes=trainable_bytes,
            adam_state_bytes=2 * sum(p.numel() * 4 for p in trainable),
        )
        optimizer = torch.optim.AdamW(trainable, lr=1e-6)
        update = {
            "stock-batched": update_stock_batched,
            "stock-serialized": update_stock_serialized,
            "prefix-grouper": update_stock_batched,
            "longstraw-detach": update_longstraw,
            "longstraw-exact": update_longstraw,
            "reference": update_reference,
        }[args.mode]

        if not args.no_warmup:  # first-call costs (kernel selection, lazy inits) out of the measurement
            tiny = synthetic_group(vocab, min(32, P), G, min(8, R), args.seed + 1, device)
            update(trainer, tiny, device)
            model.zero_grad(set_to_none=True)
            if hasattr(trainer, "_telemetry"):
                trainer._telemetry.flush()
        inputs = synthetic_group(vocab, P, G, R, args.seed, device, args.shared_prefix)
        tracker = PeakTracker(device)
        gc.collect()
        _malloc_trim()
        baseline = tracker.current()
        record["baseline_bytes"] = baseline
        profiler = None
        if args.profile:
            import cProfile

            profiler = cProfile.Profile()
        tracker.reset()
        load_start = os.getloadavg()[0]
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        result = update(trainer, inputs, device)
        if profiler:
            profiler.disable()
        _sync(device)
        update_time = time.perf_counter() - t0
        update_cpu = time.process_time() - cpu0
        update_peak = tracker.peak()
        loss, phases = result[0], result[1]
        telemetry = result[2] if len(result) > 2 else {}
        grad_sq = sum(float(p.grad.double().pow(2).sum()) for p in trainable if p.grad is not None)
        # optimizer step, measured on its own (its peak includes the Adam state allocated by this first step)
        tracker.fold()
        peak_before_optimizer = tracker.peak()
        tracker.reset()
        t1 = time.perf_counter()
        optimizer.step()
        _sync(device)
        optimizer_time = time.perf_counter() - t1
        optimizer_peak = tracker.peak()
        if profiler:
            import io
            import pstats

            profiler.dump_stats(args.profile)
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.profile_top)
            with open(args.profile + ".txt", "w") as handle:
                handle.write(text.getvalue())
        phases["optimizer"] = optimizer_time
        peak = max(peak_before_optimizer, optimizer_peak)
        state_gib = telemetry.get("longstraw/prompt_state_gib")
        record.update(
            status="ok",
            loss=float(loss),
            grad_norm=grad_sq**0.5,
            time_s=update_time + optimizer_time,
            update_cpu_s=update_cpu,
            loadavg_1m_start=load_start,
            loadavg_1m_end=os.getloadavg()[0],
            update_time_s=update_time,
            optimizer_time_s=optimizer_time,
            memory_metric=tracker.kind,
            peak_bytes=peak - baseline,
            update_peak_bytes=update_peak - baseline,
            optimizer_peak_bytes=optimizer_peak - baseline,
            peak_absolute_bytes=peak,
            durable_state_bytes=round(state_gib * GIB) if state_gib is not None else 0,
            phases_s=phases,
            telemetry=telemetry,
        )
    return record


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        record = run(args)
    except Exception as error:  # noqa: BLE001 - every failure becomes a recorded row
        text = f"{type(error).__name__}: {error}"
        status = (
            "oom(alloc)"
            if ("can't allocate memory" in text or isinstance(error, MemoryError) or "out of memory" in text.lower())
            else "error"
        )
        record = {
            "mode": args.mode,
            "P": args.prompt_length,
            "G": args.group_size,
            "R": args.completion_length,
            "status": status,
            "reason": text[:500],
        }
        traceback.print_exc(file=sys.stderr)
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
