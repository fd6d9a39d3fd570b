"""`trl-longstraw`: the project's console script. `trl-longstraw plan MODEL ...` prints a run's memory per device
(`plan.py`) before anything is launched, and with `--simulate` one update simulated at full size on fake CUDA tensors
(`simulation/`); exit status 0 when it fits, 1 when it does not (by the simulation's peak when simulated), 2 on bad
input, 3 when the simulation failed."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import warnings

from . import __version__

GIB = 1024**3

# The trainer's defaults (`LongStrawGRPOConfig`, with TRL's `GRPOConfig` fields), written out so that `--help` and
# `--version` import neither torch nor TRL; tests/test_plan.py checks each against the config.
TRAINER_DEFAULTS = {
    "num_generations": 8,
    "max_completion_length": 512,
    "per_device_train_batch_size": 8,
    "beta": 0.0,
    "num_iterations": 1,
    "prefill_chunk_size": 1024,
    "attention_chunk_size": 4096,
    "replay_segment_size": None,
    "prompt_gradient": "detach",
}


class OneLineErrors(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the flag and the fix (exit status 2), not the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def plan_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan",
        help="a run's memory per device, and the settings that would fit",
        description="A LongStraw run's memory per device (detach mode), from a model config: no weights are loaded. "
        "Run settings default to the trainer's (LongStrawGRPOConfig).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "model",
        nargs="?",
        help="a local model folder, a config .json, a Hub id in the local Hugging Face cache, or an architecture "
        "name of trl_longstraw/accounting/architectures/",
    )
    parser.add_argument(
        "--config",
        help="a recipe YAML (recipes/grpo_longstraw.py --config): its model and settings replace the run-setting "
        "flags; --prompt-length and the machine's flags still apply",
    )
    parser.add_argument("--prompt-length", type=int, required=True, help="prompt tokens (P)")
    parser.add_argument(
        "--num-generations", type=int, default=TRAINER_DEFAULTS["num_generations"], help="completions per prompt"
    )
    parser.add_argument(
        "--max-completion-length", type=int, default=TRAINER_DEFAULTS["max_completion_length"], help="tokens"
    )
    parser.add_argument(
        "--rope-scaling",
        metavar="yarn:FACTOR",
        help="extend the model's context with YaRN by FACTOR over its max_position_embeddings (what model_init_kwargs "
        "rope_parameters and max_position_embeddings load)",
    )
    parser.add_argument(
        "--lora-r", type=int, default=0, help="LoRA rank; 0: full fine-tuning (TRL's default: no peft_config)"
    )
    parser.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        help="PEFT's target_modules, e.g. all-linear (default: PEFT's for the model type, as TRL's lora_target_modules)",
    )
    parser.add_argument("--load-in-4bit", action="store_true", help="NF4 base weights (QLoRA)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="weights")
    parser.add_argument("--prompt-state-dtype", choices=("auto", "float8_e4m3fn"), default="auto", help="its pages")
    parser.add_argument(
        "--prompt-state-device", choices=("device", "cpu"), default="device", help="where the prompt state lives"
    )
    parser.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=TRAINER_DEFAULTS["prefill_chunk_size"],
        help="tokens per capture chunk",
    )
    parser.add_argument(
        "--attention-chunk-size",
        type=int,
        default=TRAINER_DEFAULTS["attention_chunk_size"],
        help="prompt keys per attention block",
    )
    parser.add_argument(
        "--replay-segment-size",
        type=int,
        default=TRAINER_DEFAULTS["replay_segment_size"],
        help="replay a longer member in segments of this many tokens (default: every member whole)",
    )
    parser.add_argument("--activation-checkpointing", action="store_true", help="checkpoint the replay's layers")
    parser.add_argument("--context-parallel-size", type=int, default=1, help="ranks sharing one prompt (CP)")
    parser.add_argument(
        "--weight-shards",
        type=int,
        default=1,
        help="ranks the weights, gradients and AdamW state are sharded over (FSDP2, `shard_weights=True`)",
    )
    parser.add_argument(
        "--per-device-train-batch-size",
        type=int,
        default=TRAINER_DEFAULTS["per_device_train_batch_size"],
        help="rows per micro-batch (stock back-propagates them at once)",
    )
    parser.add_argument("--gpus", type=int, default=None, help="devices available (bounds the CP suggestion)")
    parser.add_argument("--gpu-memory", type=float, default=None, help="usable memory per device, GiB")
    parser.add_argument(
        "--prompt-gradient",
        choices=("detach", "exact"),
        default=TRAINER_DEFAULTS["prompt_gradient"],
        help="the plan models detach mode (exact: a lower bound); --simulate runs either",
    )
    parser.add_argument("--beta", type=float, default=TRAINER_DEFAULTS["beta"], help="KL coefficient (reference)")
    parser.add_argument(
        "--num-iterations", type=int, default=TRAINER_DEFAULTS["num_iterations"], help="updates per generation"
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="for a model with its own code")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    simulation = parser.add_argument_group(
        "simulation", "run one real update at full size on fake CUDA tensors (docs/simulation.md)"
    )
    simulation.add_argument(
        "--simulate", action="store_true", help="also simulate the update, and judge the fit by its peak"
    )
    simulation.add_argument(
        "--simulate-rank", type=int, default=None, help="the rank to play in a world of several (default: the busiest)"
    )
    simulation.add_argument(
        "--device-spec", default="H200", help="the device of the roofline times: H200, H100, H20, B200 or A100"
    )
    simulation.add_argument("--decode-steps", type=int, default=0, help="rollout steps to simulate before the update")
    return parser


def check_plan_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, naming the flag and the fix, what the planner cannot model: before any config is read."""
    if (args.model is None) == (args.config is None):
        parser.error("give a model, or a recipe with --config (not both)")
    positive = (
        "prompt_length",
        "num_generations",
        "max_completion_length",
        "prefill_chunk_size",
        "attention_chunk_size",
        "per_device_train_batch_size",
    )
    for flag in positive:
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.lora_r < 0:
        parser.error(f"--lora-r must be 0 (full fine-tuning) or a LoRA rank, got {args.lora_r}")
    if args.gpus is not None and args.gpus < 1:
        parser.error(f"--gpus must be at least 1, got {args.gpus}")
    if args.context_parallel_size < 1:
        parser.error(f"--context-parallel-size must be at least 1, got {args.context_parallel_size}")
    if args.replay_segment_size is not None and args.replay_segment_size < 2:
        parser.error(f"--replay-segment-size must be at least 2, got {args.replay_segment_size}")
    if args.weight_shards < 1:
        parser.error(f"--weight-shards must be at least 1, got {args.weight_shards}")
    if args.gpus is not None and args.gpus % args.weight_shards:
        parser.error(
            f"--weight-shards {args.weight_shards} does not divide --gpus {args.gpus}: FSDP2's mesh spans every rank "
            "(the shards over all of them, or replicas x shards)"
        )
    if args.gpus is not None and args.context_parallel_size > args.gpus:
        parser.error(f"--context-parallel-size {args.context_parallel_size} exceeds --gpus {args.gpus}")
    if args.lora_target_modules is not None and args.lora_r == 0:
        parser.error("--lora-target-modules needs --lora-r > 0: a LoRA rank (0, the default, is a full fine-tune)")
    if args.load_in_4bit and args.lora_r == 0:
        parser.error("--load-in-4bit trains adapters only (QLoRA): give --lora-r > 0, or drop --load-in-4bit")
    if args.prompt_state_dtype != "auto" and args.dtype == "float32":
        parser.error("--prompt-state-dtype float8_e4m3fn is for bf16/fp16 runs: drop it with --dtype float32")
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        parser.error(f"--gpu-memory must be positive (GiB), got {args.gpu_memory}")
    if args.num_iterations < 1:
        parser.error(f"--num-iterations must be at least 1, got {args.num_iterations}")
    if args.rope_scaling is not None:
        method, _, factor = args.rope_scaling.partition(":")
        try:
            valid = method == "yarn" and float(factor) > 1
        except ValueError:
            valid = False
        if not valid:
            parser.error(f"--rope-scaling {args.rope_scaling!r}: give yarn:FACTOR with a factor above 1, e.g. yarn:4")
    if args.decode_steps < 0:
        parser.error(f"--decode-steps must be 0 or more, got {args.decode_steps}")
    from .simulation.devices import DEVICE_SPECS, device_spec

    try:
        device_spec(args.device_spec)
    except ValueError:
        parser.error(f"--device-spec {args.device_spec!r}: choose one of {', '.join(DEVICE_SPECS)}")


def unsupported(name: str, error: Exception) -> str:
    """One line for a model the trainer would refuse, without the registry's note for the library's developers."""
    reason = str(error).split(" Registered kinds:")[0]
    return (
        f"trl-longstraw plan: {name} is not a model LongStraw trains: {reason} The models it trains: "
        "docs/supported-models.md."
    )


def run_plan(args: argparse.Namespace) -> int:
    # bitsandbytes warns at import, on a CPU with AVX512-BF16, that it could not fetch an optional kernel from the Hub:
    # nothing the plan uses
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import yaml

    from .architectures import check_supported, with_yarn
    from .plan import (
        ModelSourceError,
        fitting_recipes,
        format_plan,
        load_model_config,
        plan_run,
        recipe_plan_inputs,
    )
    from .state import UnsupportedModelError
    from .validation import check_context

    # transformers' notes while the skeletons are built (a BERT's `is_decoder`): the plan says what matters
    logging.getLogger("transformers").setLevel(logging.ERROR)
    weight_shards = args.weight_shards
    try:
        if args.config is not None:
            try:
                config, name, setup, context_parallel, shards_weights = recipe_plan_inputs(
                    args.config, args.prompt_length
                )
            except (OSError, yaml.YAMLError) as error:  # a recipe file that is missing or not YAML: one line
                raise ModelSourceError(
                    f"cannot read the recipe {args.config}: {' '.join(str(error).split())}"
                ) from error
            if weight_shards == 1 and shards_weights:
                if args.gpus is None:
                    raise ValueError(
                        f"{args.config} shards the weights over every rank (shard_weights: true): give the number of "
                        "ranks with --weight-shards N or --gpus N."
                    )
                weight_shards = args.gpus
        else:
            config, name = load_model_config(args.model, args.trust_remote_code), args.model
            setup, context_parallel = setup_from_flags(args), args.context_parallel_size
        if args.rope_scaling is not None:
            with_yarn(config, float(args.rope_scaling.partition(":")[2]))
        # the trainer's checks (validation.py), in its order: the model, then the positions the run spans
        check_supported(config, trust_remote_code=args.trust_remote_code)
        check_context(config, setup.prompt_tokens, setup.completion_tokens)
    except UnsupportedModelError as error:
        print(unsupported(name, error), file=sys.stderr)
        return 2
    except (ModelSourceError, ValueError) as error:  # ValueError: a recipe setting LongStrawGRPOConfig refuses
        print(f"trl-longstraw plan: {error}", file=sys.stderr)
        return 2
    budget = None if args.gpu_memory is None else int(args.gpu_memory * GIB)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' and PEFT's notes while building the meta-device skeleton
            plan = plan_run(
                config,
                setup,
                context_parallel,
                budget,
                args.per_device_train_batch_size,
                model=name,
                devices=args.gpus,
                weight_shards=weight_shards,
            )
    except UnsupportedModelError as error:
        print(unsupported(name, error), file=sys.stderr)
        return 2
    simulated = None
    if args.simulate:
        from .simulation import SimulationFailed, simulate

        try:
            simulated = simulate(
                config,
                setup,
                model=name,
                context_parallel=context_parallel,
                weight_shards=weight_shards,
                rank=args.simulate_rank,
                device=args.device_spec,
                decode_steps=args.decode_steps,
                progress=not args.json,
            )
        except ValueError as error:  # a rank outside the world, shards that do not span it
            print(f"trl-longstraw plan: {error}", file=sys.stderr)
            return 2
        except SimulationFailed as error:
            print(f"trl-longstraw plan: {error}", file=sys.stderr)
            return 3
    if args.json:
        result = plan.to_dict()
        if simulated is not None:
            result["simulated"] = simulated.to_dict()
        print(json.dumps(result, indent=2))
    else:
        print(format_plan(plan))
        if plan.fits is False and simulated is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # as for the plan above
                recipes = fitting_recipes(
                    name, args.prompt_length, budget, args.gpus, args.per_device_train_batch_size, besides=args.config
                )
            if recipes:
                other = "Other recipes" if args.config is not None else "Recipes"
                print(f"{other} of configs/ for this model that fit, each with its own settings:")
            for path, fitting in recipes:
                machine = f" --gpus {args.gpus}" if args.gpus is not None else ""
                print(
                    f"  {path.relative_to(path.parent.parent)}: {fitting.device_bytes / GIB:,.2f} GiB (trl-longstraw "
                    f"plan --config {path.relative_to(path.parent.parent)} --prompt-length {args.prompt_length} "
                    f"--gpu-memory {args.gpu_memory:g}{machine})"
                )
        if simulated is not None:
            print()
            print(simulated.format())
            if budget is not None:
                verdict = "FITS" if simulated.peak_gib * GIB <= budget else "DOES NOT FIT"
                print(f"{verdict} by the simulation: {simulated.peak_gib:,.2f} of {budget / GIB:,.2f} GiB per device.")
    if simulated is not None and budget is not None:
        return 1 if simulated.peak_gib * GIB > budget else 0
    return 1 if plan.fits is False else 0


def setup_from_flags(args: argparse.Namespace):
    from .accounting import UpdateSetup

    targets = args.lora_target_modules
    return UpdateSetup(
        prompt_tokens=args.prompt_length,
        completion_tokens=args.max_completion_length,
        group_size=args.num_generations,
        quantization="nf4" if args.load_in_4bit else "none",
        lora_rank=args.lora_r or None,
        lora_targets=None if targets is None else targets[0] if targets == ["all-linear"] else tuple(targets),
        state_dtype=args.prompt_state_dtype,
        state_device=args.prompt_state_device,
        activation_checkpointing=args.activation_checkpointing,
        prefill_chunk_size=args.prefill_chunk_size,
        attention_chunk_size=args.attention_chunk_size,
        replay_segment_size=args.replay_segment_size,
        dtype_bytes=4 if args.dtype == "float32" else 2,
        prompt_gradient=args.prompt_gradient,
        beta=args.beta,
        num_iterations=args.num_iterations,
    )


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrors(prog="trl-longstraw", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrors)
    plan = plan_parser(subparsers)
    args = parser.parse_args(argv)
    check_plan_arguments(plan, args)
    try:
        status = run_plan(args)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader stopped early (`| head`): no traceback, and the shell's status for it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would raise again
        return 128 + signal.SIGPIPE
    return status


if __name__ == "__main__":
    sys.exit(main())
