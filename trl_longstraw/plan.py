"""Know before you launch: one LongStraw run's memory per device, from a model config, before any model work.

`plan_run` turns a config and the run's settings into a `Plan`: per device, the weights, the trainable values with
their gradients and AdamW state, the prompt state (this rank's share under context parallelism; host-resident state
counted apart), the working sets of the capture, the replay and the rollout, and their peak (`UpdateAccount`'s two
peaks: the update's and the rollout's) against the device's memory; stock `GRPOTrainer`'s lower bound for the same
run; and, when the run does not fit, the single settings that would (`Plan.suggestions`: fp8 state pages, host
placement, smaller chunks, the smallest context-parallel size, weights sharded over the devices). With the weights
sharded by FSDP2 (`weight_shards`), each device holds its share of the weights, the trainable values and their AdamW
state, the whole gradient (held unsharded through the accumulation window), and what FSDP2 gathers at once: the root
module (embeddings, final norm, head) and one decoder layer. Detach mode: exact mode's prompt backward is not
modelled. `trl-longstraw plan` (`cli.py`) prints it; the byte counts are `accounting`'s (weights, adapters and state
checked against real allocations, working sets estimated).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.utils import logging

from .accounting import (
    UpdateAccount,
    UpdateSetup,
    prompt_state_bytes,
    replay_in_steps_account,
    step_attention_bytes,
    stock_activation_bytes,
    update_account,
)
from .context_parallel import ShardLayout
from .context_parallel.state import CONTINUATION_CHUNK_TOKENS
from .fsdp import is_sharded, shard_count
from .segments import segments

logger = logging.get_logger(__name__)

GIB = 1024**3
ARCHITECTURES = Path(__file__).resolve().parent / "accounting" / "architectures"  # shipped in the wheel
RECIPES = Path(__file__).resolve().parent.parent / "configs"  # a source checkout's recipes (not in the wheel)
SMALLEST_CHUNK = 512  # chunk sizes the suggestions go down to
LARGEST_CONTEXT_PARALLEL = 64


class ModelSourceError(ValueError):
    """The planner could not read a model config from what it was given."""


def load_model_config(source: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """A config from a local model folder, a config `.json` file (a `config.json`, or an architecture file with a
    `model_type`), the name of a file in `trl_longstraw/accounting/architectures/`, or a Hub id already in the local Hugging Face cache
    (nothing is downloaded)."""
    path = Path(source)
    architecture = ARCHITECTURES / f"{source}.json"
    if architecture.is_file() and not path.exists():
        path = architecture
    try:
        if path.is_file():
            values = json.loads(path.read_text())
            if "model_type" not in values:
                raise ModelSourceError(f"{source}: the JSON file has no `model_type`, so it is no model config")
            return AutoConfig.for_model(**{key: value for key, value in values.items() if not key.startswith("_")})
        try:
            return AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=trust_remote_code)
        except OSError:  # not in the local cache: an architecture file written from that Hub model, if one is
            written_from = [
                file
                for file in sorted(ARCHITECTURES.glob("*.json"))
                if json.loads(file.read_text()).get("_source") == source
            ]
            if not written_from:
                raise
            return load_model_config(str(written_from[0]))
    except ModelSourceError:
        raise
    except Exception as error:  # transformers' many ways of not finding a config, re-raised as one
        known = ", ".join(sorted(file.stem for file in ARCHITECTURES.glob("*.json"))) or "none here"
        raise ModelSourceError(
            f"Cannot read a model config from {source!r} ({type(error).__name__}: {str(error).splitlines()[0]}). "
            "Give a local model folder, a config .json file, a Hub id already in the local Hugging Face cache "
            f"(`huggingface-cli download ID config.json` fetches only the config), or an architecture name ({known})."
        ) from error


@dataclass(frozen=True)
class Plan:
    """One device's memory for a run (see the module docstring). Bytes throughout; `budget` None: not checked."""

    model: str
    setup: UpdateSetup
    context_parallel: int
    account: UpdateAccount
    sharded_state: int  # this rank's share of what CP shards (the largest rank's)
    replicated_state: int  # what every rank holds whole (recurrent states, windows)
    refused_under_cp: tuple[str, ...]
    trainable_bytes: int  # LoRA adapters, or every weight under full fine-tuning, with gradients and AdamW state
    stock_lower_bound: int
    budget: int | None
    suggestions: tuple[dict, ...] = ()
    weight_shards: int = 1  # ranks sharing the weights' shards (FSDP2)
    gathered_bytes: int = 0  # what FSDP2 gathers at once: the root module and one decoder layer (0 unsharded)

    @property
    def state_bytes(self) -> int:
        return self.sharded_state + self.replicated_state

    @property
    def state_on_device(self) -> int:
        return self.state_bytes if self.setup.state_device == "device" else 0

    @property
    def host_bytes(self) -> int:
        return self.state_bytes - self.state_on_device

    @property
    def weight_share(self) -> int:
        """This device's share of the weights (all of them unsharded): NF4 weights' quantisation states stay whole."""
        weights = self.account.weights
        return -(-weights.shardable_bytes() // self.weight_shards) + weights.quantization_state_bytes

    @property
    def weight_bytes(self) -> int:
        """This device's share of the weights, with what FSDP2 gathers at once."""
        return self.weight_share + self.gathered_bytes

    @property
    def gradient_bytes(self) -> int:
        """The trainable values' gradients (part of `trainable_bytes`): one value each."""
        lora = self.account.lora
        return lora.params * lora.value_bytes if lora else self.trainable_bytes // 3

    @property
    def trainable_share(self) -> int:
        """This device's trainable bytes: under FSDP2 its share of the values and AdamW state, and the whole gradient,
        which LongStraw accumulates unsharded through the accumulation window and reduce-scatters once at its end."""
        if self.weight_shards == 1:
            return self.trainable_bytes
        return -(-(self.trainable_bytes - self.gradient_bytes) // self.weight_shards) + self.gradient_bytes

    @property
    def phases(self) -> dict[str, int]:
        """What the device holds, term by term; `device_bytes` is the peak over the update and the rollout."""
        account = self.account
        if self.weight_shards == 1:
            weights = {
                "weights": account.weights.bytes,
                "trainable values, gradients and AdamW state": self.trainable_bytes,
            }
        else:
            share = f" (1/{self.weight_shards})"
            weights = {
                f"weights{share}": self.weight_share,
                "weights gathered at once (root module + one layer)": self.gathered_bytes,
                f"trainable values and AdamW state{share}": self.trainable_share - self.gradient_bytes,
                "gradients (whole until the window's reduce-scatter)": self.gradient_bytes,
            }
        return {
            **weights,
            "prompt state": self.state_on_device,
            "capture working set (one chunk)": account.capture.bytes,
            "replay working set (one member)": account.replay.bytes - account.replay.member_state,
            "a member's earlier segments: state and its gradient": account.replay.member_state,
            "merged expert stack, once per forward (PEFT's check)": account.merge_check,
            "rollout (decoded rows of the generation batch)": account.rollout_bytes(0),
            "group scalars": account.group_scalars,
        }

    @property
    def update_peak(self) -> int:
        account = self.account
        return self.state_on_device + account.working_set.bytes + account.merge_check + account.group_scalars

    @property
    def rollout_peak(self) -> int:
        return self.account.rollout_bytes(self.state_on_device)

    @property
    def device_bytes(self) -> int:
        return self.weight_bytes + self.trainable_share + max(self.update_peak, self.rollout_peak)

    @property
    def fits(self) -> bool | None:
        if self.refused_under_cp:
            return False
        return None if self.budget is None else self.device_bytes <= self.budget

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "settings": {
                **dataclasses.asdict(self.setup),
                "context_parallel_size": self.context_parallel,
                "weight_shards": self.weight_shards,
            },
            "per_device_bytes": self.phases,
            "update_peak_bytes": self.update_peak,
            "rollout_peak_bytes": self.rollout_peak,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "budget_bytes": self.budget,
            "fits": self.fits,
            "refused_under_context_parallelism": list(self.refused_under_cp),
            "stock_grpo_lower_bound_bytes": self.stock_lower_bound,
            "suggestions": list(self.suggestions),
        }


def plan_run(
    config: PretrainedConfig,
    setup: UpdateSetup,
    context_parallel: int = 1,
    budget: int | None = None,
    stock_rows: int = 8,
    model: str = "",
    devices: int | None = None,
    suggest: bool = True,
    weight_shards: int = 1,
) -> Plan:
    """The `Plan` of `setup` on `config` with `context_parallel` ranks per group and the weights sharded over
    `weight_shards` ranks (FSDP2), against `budget` bytes per device. `stock_rows`: the sequences stock GRPOTrainer
    backpropagates at once (`per_device_train_batch_size`); `devices` bounds the context-parallel sizes and shards
    suggested."""
    account = update_account(config, setup)
    captured = setup.prompt_tokens - 1  # all but the last prompt token are captured
    if context_parallel > 1:  # every rank's partials at once: the step attention's share of both working sets
        step = functools.partial(
            step_attention_bytes, config, context_parallel=context_parallel, dtype_bytes=setup.dtype_bytes
        )
        capture, replay = account.capture, account.replay
        replayed = setup.completion_tokens + 1
        size = setup.replay_segment_size
        if len(segments(0, replayed, size)) > 1 and replayed >= CONTINUATION_CHUNK_TOKENS * context_parallel:
            # the CP group replays each member in steps, every rank a chunk of it (`ContextParallel.in_steps`)
            member = ShardLayout.of(replayed, context_parallel, size, CONTINUATION_CHUNK_TOKENS)
            chunk = max(end - start for start, end in member.bounds)
            held = max(member.held_tokens(rank) for rank in range(context_parallel))
            replay = replay_in_steps_account(config, setup, chunk, held)
        account = dataclasses.replace(
            account,
            capture=dataclasses.replace(capture, step_attention=step(capture.tokens, grad=False)),
            replay=dataclasses.replace(replay, step_attention=step(replay.tokens, grad=True)),
        )
    layout = ShardLayout.of(captured, context_parallel, setup.prefill_chunk_size)
    shard = max(layout.held_tokens(rank) for rank in range(context_parallel))
    per_shard = prompt_state_bytes(config, shard, setup.dtype_bytes, setup.state_dtype)
    held = account.state_under_context_parallelism  # each label as its state kinds answer
    sharded = sum(n for label, n in per_shard.items() if held[label] == "split")
    replicated = sum(n for label, n in account.state.items() if held[label] != "split")
    refused = tuple(label for label in account.state if held[label] == "refused") if context_parallel > 1 else ()
    trainable = account.lora.bytes if account.lora else full_fine_tuning_bytes(account)
    gathered = gathered_weight_bytes(config, account, setup.dtype_bytes) if weight_shards > 1 else 0
    # stock under FSDP2 shards the same bytes and gathers the same modules
    weights = account.weights
    stock = -(-(weights.shardable_bytes() + trainable) // weight_shards) + weights.quantization_state_bytes + gathered
    stock += stock_activation_bytes(
        config, setup.prompt_tokens, setup.completion_tokens, stock_rows, setup.dtype_bytes
    )
    plan = Plan(
        model, setup, context_parallel, account, sharded, replicated, refused, trainable, stock, budget,
        weight_shards=weight_shards, gathered_bytes=gathered,
    )  # fmt: skip
    if suggest and plan.fits is False and budget is not None:
        plan = dataclasses.replace(plan, suggestions=tuple(_suggestions(config, plan, stock_rows, devices)))
    return plan


def gathered_weight_bytes(config: PretrainedConfig, account: UpdateAccount, dtype_bytes: int) -> int:
    """What FSDP2 holds gathered at once under LongStraw's sharding (`fully_shard` on each decoder layer, then on the
    causal LM): the root module's weights (input embeddings, the head unless tied; FSDP2 keeps the root gathered
    between its forward and backward) and one decoder layer's, the rest of the weights spread evenly over the layers."""
    text = config.get_text_config()
    embedding = text.vocab_size * text.hidden_size * dtype_bytes
    root = embedding * (1 if getattr(text, "tie_word_embeddings", False) else 2)
    layer = max(account.weights.bytes - root, 0) // max(text.num_hidden_layers, 1)
    return root + layer


def full_fine_tuning_bytes(account: UpdateAccount) -> int:
    """Every weight trainable: its gradient and AdamW's `exp_avg` and `exp_avg_sq`, each as wide as the weight
    (torch's AdamW keeps its state in the parameter's dtype)."""
    return 3 * account.weights.dense_bytes


def _suggestions(config, plan: Plan, stock_rows: int, devices: int | None) -> list[dict]:
    """What would fit `plan`'s budget: single changes of its settings (fp8 state, host placement, activation
    checkpointing, the largest chunk sizes that fit, the smallest context-parallel size that fits, at most `devices`,
    FSDP2 over the devices); when none does alone, the fewest of them together that fit (searched over pairs, then
    triples, each change at its strongest), the smallest such plan first."""
    setup, found = plan.setup, []

    def planned(change: dict) -> Plan:
        fields = {key: value for key, value in change.items() if key not in ("context_parallel", "weight_shards")}
        return plan_run(
            config,
            dataclasses.replace(setup, **fields),
            change.get("context_parallel", plan.context_parallel),
            plan.budget,
            stock_rows,
            suggest=False,
            weight_shards=change.get("weight_shards", plan.weight_shards),
        )

    def record(change: dict, candidate: Plan) -> None:
        settings = {_CONFIG_FIELDS.get(key, key): value for key, value in change.items() if key != "weight_shards"}
        if "weight_shards" in change:
            settings["shard_weights"] = True
        found.append(
            {"settings": settings, "weight_shards": candidate.weight_shards, "device_bytes": candidate.device_bytes}
        )

    strongest = []  # each change at its strongest: the candidates of the combination search
    if setup.state_dtype == "auto" and setup.state_device == "device":
        strongest.append({"state_dtype": "float8_e4m3fn"})
    if setup.state_device == "device":
        strongest.append({"state_device": "cpu"})
    if not setup.activation_checkpointing:
        strongest.append({"activation_checkpointing": True})
    for change in strongest:
        if (candidate := planned(change)).fits:
            record(change, candidate)
    # a long member in segments (under context parallelism spread over the CP group)
    size = min(setup.replay_segment_size or setup.completion_tokens, setup.completion_tokens) // 2
    if size >= SMALLEST_CHUNK:
        strongest.append({"replay_segment_size": SMALLEST_CHUNK})
    while size >= SMALLEST_CHUNK:
        if (candidate := planned({"replay_segment_size": size})).fits:
            record({"replay_segment_size": size}, candidate)
            break
        size //= 2
    for field in ("prefill_chunk_size", "attention_chunk_size"):
        size = getattr(setup, field) // 2
        if size >= SMALLEST_CHUNK:
            strongest.append({field: SMALLEST_CHUNK})
        while size >= SMALLEST_CHUNK:
            if (candidate := planned({field: size})).fits:
                record({field: size}, candidate)
                break
            size //= 2
    largest = min(devices or LARGEST_CONTEXT_PARALLEL, LARGEST_CONTEXT_PARALLEL)
    size = plan.context_parallel * 2

    def context_parallel(ranks: int) -> dict:
        return {"context_parallel": ranks}

    if size <= largest:
        strongest.append(context_parallel(largest))
    while size <= largest:
        if (candidate := planned(context_parallel(size))).fits:
            record(context_parallel(size), candidate)
            break
        size *= 2
    if plan.weight_shards == 1 and setup.quantization == "none" and devices is not None and devices > 1:
        strongest.append({"weight_shards": devices})  # FSDP2 over every device (data parallel: its own rows each)
        if (candidate := planned({"weight_shards": devices})).fits:
            record({"weight_shards": devices}, candidate)
    for count in (2, 3):
        if found:
            break
        fitting = []
        for changes in itertools.combinations(strongest, count):
            change = {key: value for single in changes for key, value in single.items()}
            if (candidate := planned(change)).fits:
                fitting.append((candidate.device_bytes, change, candidate))
        for _, change, candidate in sorted(fitting, key=lambda entry: entry[0]):
            record(change, candidate)
    return found


def suggestion_flags(suggestion: dict) -> str:
    """A suggestion as `trl-longstraw plan` flags."""
    flags = []
    for key, value in suggestion["settings"].items():
        if key == "shard_weights":
            flags.append(f"--weight-shards {suggestion['weight_shards']}")
        elif value is None:
            flags.append(f"without --{key.replace('_', '-')}")
        elif value is True:
            flags.append(f"--{key.replace('_', '-')}")
        else:
            flags.append(f"--{key.replace('_', '-')} {value}")
    return " ".join(flags)


def suggestion_yaml(suggestion: dict) -> str:
    """A suggestion as recipe YAML lines (`LongStrawGRPOConfig` fields), on one line."""
    return "; ".join(
        f"{key}: {'null' if value is None else str(value).lower() if isinstance(value, bool) else value}"
        for key, value in suggestion["settings"].items()
    )


# UpdateSetup fields under the names a user sets (LongStrawGRPOConfig's).
_CONFIG_FIELDS = {
    "state_dtype": "prompt_state_dtype",
    "state_device": "prompt_state_device",
    "context_parallel": "context_parallel_size",
}


def recipe_plan_inputs(path: str | Path, prompt_tokens: int) -> tuple[PretrainedConfig, str, UpdateSetup, int, bool]:
    """(config, model name, setup, context-parallel size, whether it shards the weights over every rank) of a recipe
    YAML (`recipes/grpo_longstraw.py --config`: the fields of `LongStrawGRPOConfig` and TRL's `ModelConfig`, defaults
    as those dataclasses have them) at `prompt_tokens` prompt tokens. The number of ranks is the launch's, not the
    recipe's: the caller gives it."""
    import yaml
    from trl import ModelConfig, get_peft_config, get_quantization_config

    from .config import LongStrawGRPOConfig, context_overrides

    recipe = yaml.safe_load(Path(path).read_text()) or {}
    model_fields = {field.name for field in dataclasses.fields(ModelConfig)}
    grpo_fields = {field.name for field in dataclasses.fields(LongStrawGRPOConfig)}
    unknown = sorted(set(recipe) - model_fields - grpo_fields - RECIPE_SCRIPT_FIELDS)
    if unknown:
        raise ModelSourceError(f"{path}: fields neither LongStrawGRPOConfig nor ModelConfig has: {', '.join(unknown)}")
    model_args = ModelConfig(**{key: value for key, value in recipe.items() if key in model_fields})
    settings = {key: value for key, value in recipe.items() if key in grpo_fields}
    settings.update(output_dir=settings.get("output_dir", "outputs"), report_to="none", use_cpu=True, bf16=False)
    shards_weights = bool(settings.pop("shard_weights", False))
    settings.pop("memory_plan_prompt_length", None)  # the prompt length planned is the caller's
    args = LongStrawGRPOConfig(**settings, memory_plan_prompt_length=prompt_tokens)
    args.model_init_kwargs = {"dtype": model_args.dtype or "auto", **(args.model_init_kwargs or {})}
    name = model_args.model_name_or_path
    config = load_model_config(name, args.trust_remote_code)
    for key, value in context_overrides(args).items():  # as transformers applies them when it loads the model
        setattr(config.get_text_config(), key, value)
    setup = trainer_setup(config, name, args, get_peft_config(model_args), get_quantization_config(model_args))
    return config, name, setup, args.context_parallel_size, shards_weights


# The recipe script's own arguments (recipes/grpo_longstraw.py's LongStrawScriptArguments and TRL's ScriptArguments).
RECIPE_SCRIPT_FIELDS = frozenset(
    {"dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split", "embedded_model_type",
     "num_prompts", "prompt_chars", "compare_with_stock_prompt_chars", "dataset_streaming",
     "gradient_checkpointing_use_reentrant", "ignore_bias_buffers", "reward_funcs", "reward_model_name_or_path",
     "tools", "report_chars"}
)  # fmt: skip


class MemoryPlanError(RuntimeError):
    """A run's plan does not fit its device (`LongStrawGRPOConfig.memory_plan="error"`)."""


def trainer_setup(config: PretrainedConfig, model, args, peft_config=None, quantization_config=None) -> UpdateSetup:
    """The `UpdateSetup` of a trainer about to be built: `args` (a `LongStrawGRPOConfig` with
    `memory_plan_prompt_length` set), the model (a name or a loaded model), and the PEFT and quantization configs it
    was given (GRPOTrainer's `peft_config` and `quantization_config` arguments)."""
    from peft import PeftModel

    from .config import loading_quantization, model_init_kwargs

    if peft_config is None and isinstance(model, PeftModel):
        peft_config = model.active_peft_config
    if isinstance(model, str):
        quantization = loading_quantization(args, quantization_config)
        dtype = model_init_kwargs(args).get("dtype", "auto")
        dtype = (getattr(config, "dtype", None) or torch.get_default_dtype()) if dtype == "auto" else dtype
    else:
        quantization = getattr(model.config, "quantization_config", None)
        dtype = model.dtype
    if isinstance(quantization, dict):
        quantization = SimpleNamespace(**quantization)
    nf4 = bool(quantization) and getattr(quantization, "load_in_4bit", False)
    nf4 = nf4 and getattr(quantization, "bnb_4bit_quant_type", "fp4") == "nf4"
    full_width = str(dtype).removeprefix("torch.") == "float32"
    targets = getattr(peft_config, "target_modules", None)
    group = args.num_generations
    rows = args.per_device_train_batch_size * (args.steps_per_generation or args.gradient_accumulation_steps)
    rollout = args.rollout_from_prompt_state is not False and not args.use_vllm
    rollout = rollout and not args.use_transformers_continuous_batching
    return UpdateSetup(
        prompt_tokens=args.memory_plan_prompt_length,
        completion_tokens=args.max_completion_length,
        group_size=group,
        quantization="nf4" if nf4 else "none",
        double_quant=bool(getattr(quantization, "bnb_4bit_use_double_quant", False)),
        lora_rank=getattr(peft_config, "r", None),
        lora_targets=tuple(targets) if isinstance(targets, (list, set, tuple)) else targets,
        state_dtype=args.prompt_state_dtype,
        state_device="cpu" if args.prompt_state_device == "cpu" else "device",
        activation_checkpointing=bool(args.activation_checkpointing or args.gradient_checkpointing),
        prefill_chunk_size=args.prefill_chunk_size,
        attention_chunk_size=args.attention_chunk_size,
        replay_segment_size=args.replay_segment_size,
        dtype_bytes=4 if full_width else 2,
        # a process's rows that do not hold whole groups can start mid-group: one more prompt at most
        prompts_per_generation=(-(-rows // group) + (1 if rows % group else 0)) if rollout else 0,
        prompt_gradient=args.prompt_gradient,
        beta=args.beta,
        num_iterations=args.num_iterations,
    )


def plan_at_construction(
    config: PretrainedConfig, model, args, peft_config=None, quantization_config=None
) -> Plan | None:
    """The trainer's pre-flight plan (`LongStrawGRPOConfig.memory_plan*`): None when not asked for; printed on the
    main process's console when it fits; raises `MemoryPlanError` (or warns, on every process) when it does not."""
    if args.memory_plan == "off" or args.memory_plan_prompt_length is None:
        return None
    gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    budget = None  # a CPU host's memory is not checked unless given
    if args.memory_plan_device_gib is not None or gpu is not None:
        budget = memory_budget(gpu, args.memory_plan_device_gib)
    name = model if isinstance(model, str) else config._name_or_path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' and PEFT's notes while building the meta-device skeleton
        plan = plan_run(
            config,
            trainer_setup(config, model, args, peft_config, quantization_config),
            args.context_parallel_size,
            budget,
            args.per_device_train_batch_size,
            model=name,
            weight_shards=weight_shards_at_construction(model, args),
        )
    text = format_plan(plan)
    if args.prompt_gradient == "exact":
        text += "\n(prompt_gradient='exact': its prompt backward is not modelled; the plan is a lower bound.)"
    if plan.fits is not False and int(os.environ.get("RANK", "0")) == 0:  # the main process's console, once
        print(f"LongStraw memory plan (memory_plan_prompt_length={args.memory_plan_prompt_length}):\n{text}")
    if plan.fits is False:
        message = (
            f"The run does not fit the device by its memory plan (memory_plan_prompt_length="
            f"{args.memory_plan_prompt_length}):\n{text}\nChange a setting above, or set memory_plan='warn' to go on."
        )
        if args.memory_plan == "error":
            raise MemoryPlanError(message)
        logger.warning(message)
    return plan


CGROUP_MEMORY_MAX = "/sys/fs/cgroup/memory.max"  # cgroup v2: the container's memory limit, or "max"


def memory_budget(device: torch.device | None, device_gib: float | None = None) -> int:
    """The bytes a run may use on `device`: `device_gib` where given (`memory_plan_device_gib`), else the GPU's total
    memory, else the host's: its physical memory, or the lowest of the process's address-space limit and its
    container's (cgroup v2) memory limit."""
    if device_gib is not None:
        return int(device_gib * GIB)
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import resource

    limits = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    if address_space != resource.RLIM_INFINITY:
        limits.append(address_space)
    with contextlib.suppress(OSError, ValueError), open(CGROUP_MEMORY_MAX) as handle:  # no cgroup v2, or "max"
        limits.append(int(handle.read()))
    return min(limits)


def explain_out_of_memory(
    config: PretrainedConfig,
    setup: UpdateSetup,
    phase: str,
    context_parallel: int,
    budget: int,
    stock_rows: int,
    exact: bool = False,
    weight_shards: int = 1,
) -> str:
    """What an allocation failure in `phase` says: the run's size and settings (`weight_shards`: the ranks FSDP2 splits
    each weight over), the plan's predicted state and peak, and each single setting that would fit (`_suggestions`).
    Where the plan itself fits `budget` (it does not model everything: exact mode's prompt backward, other processes
    on the device), the settings that cut its predicted peak by a quarter."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' and PEFT's notes while building the meta-device skeletons
        plan = plan_run(
            config, setup, context_parallel, budget, stock_rows, suggest=False, weight_shards=weight_shards
        )
        target = plan if not plan.fits else dataclasses.replace(plan, budget=int(plan.device_bytes * 0.75))
        suggestions = _suggestions(config, target, stock_rows, None)
    state = "fp8 pages" if setup.state_dtype == "float8_e4m3fn" else "the model's dtype"
    lines = [
        (
            f"Out of memory in LongStraw phase {phase!r}: a prompt of P = {setup.prompt_tokens:,} tokens, G = "
            f"{setup.group_size} completions of up to {setup.completion_tokens:,} tokens; prefill_chunk_size="
            f"{setup.prefill_chunk_size}, attention_chunk_size={setup.attention_chunk_size}, prompt_state_dtype="
            f"{setup.state_dtype!r}, prompt_state_device={'cpu' if setup.state_device == 'cpu' else 'auto'!r}, "
            f"context_parallel_size={context_parallel}."
        ),
        f"The memory plan predicts {_size(plan.state_bytes)} of prompt state on this rank (in {state}, "
        + ("on the host" if setup.state_device == "cpu" else "on the device")
        + f") and a peak of {_size(plan.device_bytes)} against {_size(budget)}"
        + (" (exact mode's prompt backward comes on top: not modelled)." if exact else "."),
    ]
    if plan.fits:
        lines.append(
            "The plan fits: what it does not model took the rest (exact mode's prompt backward, other processes on "
            "the device, fragmentation)."
        )
    if suggestions:
        if plan.fits:
            lines.append("Each of these settings alone cuts the predicted peak by a quarter or more:")
        elif len(suggestions[0]["settings"]) == 1:
            lines.append("Each of these settings alone would fit:")
        else:
            lines.append("No single setting would fit; these together would:")
        for suggestion in suggestions:
            settings = ", ".join(f"{key}={value!r}" for key, value in suggestion["settings"].items())
            lines.append(f"  {settings}: {_size(suggestion['device_bytes'])}")
    else:
        lines.append(
            "No setting, nor two or three together, would fit: use more devices (context_parallel_size, "
            "shard_weights) or shorten max_prompt_length."
        )
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:,.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:,.1f} MiB"


def weight_shards_at_construction(model, args) -> int:
    """The ranks the trainer shards the weights over: every rank with `shard_weights`, or as many as a model already
    sharded with `fully_shard` spans; 1 otherwise."""
    if not isinstance(model, str) and is_sharded(model):
        return shard_count(model)
    if args.shard_weights:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return 1


def model_names(source: str) -> set[str]:
    """The names a recipe may give the model `source` names: itself, and the Hub id an architecture file was written
    from (`_source`)."""
    architecture = ARCHITECTURES / f"{source}.json"
    names = {source}
    if architecture.is_file() and not Path(source).exists():
        names.add(json.loads(architecture.read_text()).get("_source", source))
    return names


def fitting_recipes(
    source: str,
    prompt_tokens: int,
    budget: int,
    devices: int | None,
    per_device_train_batch_size: int,
    besides: str | None = None,
) -> list[tuple[Path, Plan]]:
    """The recipes of `configs/` for the model `source` names that fit `budget` bytes per device at `prompt_tokens`,
    each with its own settings (`recipe_plan_inputs`), its weights sharded over `devices` where it shards them (skipped
    without `devices`), and its context checked as the trainer checks it; `besides` (a recipe's path) left out. None
    outside a source checkout."""
    import yaml

    from .validation import check_context

    names, fitting = model_names(source), []
    for path in sorted(RECIPES.glob("*.yaml")):
        if besides is not None and path.resolve() == Path(besides).resolve():
            continue
        if (yaml.safe_load(path.read_text()) or {}).get("model_name_or_path") not in names:
            continue
        try:
            config, name, setup, context_parallel, shards_weights = recipe_plan_inputs(path, prompt_tokens)
            check_context(config, setup.prompt_tokens, setup.completion_tokens)
        except ValueError:  # past the recipe's context, or a setting refused at this length
            continue
        if shards_weights and devices is None:
            continue
        if devices is not None and context_parallel > devices:
            continue
        plan = plan_run(
            config,
            setup,
            context_parallel,
            budget,
            per_device_train_batch_size,
            model=name,
            suggest=False,
            devices=devices,
            weight_shards=devices if shards_weights else 1,
        )
        if plan.fits:
            fitting.append((path, plan))
    return fitting


def format_plan(plan: Plan) -> str:
    """The plan as the console shows it: one table per device, stock's lower bound, the verdict and suggestions."""
    setup = plan.setup
    mode = f"LoRA r{setup.lora_rank}" if setup.lora_rank else "full fine-tuning"
    weights = "NF4" if setup.quantization == "nf4" else f"{8 * setup.dtype_bytes}-bit"
    state = "fp8 pages" if setup.state_dtype == "float8_e4m3fn" else "model dtype"
    place = "device" if setup.state_device == "device" else "host"
    lines = [
        (
            f"{plan.model or 'model'}: P = {setup.prompt_tokens:,}, G = {setup.group_size}, R = "
            f"{setup.completion_tokens:,}, {weights} weights, {mode}, state in {state} on the {place}, context "
            f"parallel {plan.context_parallel}, "
            + (f"weights sharded over {plan.weight_shards} ranks (FSDP2), " if plan.weight_shards > 1 else "")
            + "detach mode"
        ),
        "",
        "per device                                           GiB",
    ]
    for name, value in plan.phases.items():
        lines.append(f"  {name:<50}{value / GIB:>10,.2f}")
    lines += [
        f"  {'peak of the update (state + working set)':<50}{plan.update_peak / GIB:>10,.2f}",
        f"  {'peak of the rollout (states + decoded rows)':<50}{plan.rollout_peak / GIB:>10,.2f}",
        f"  {'total (weights + trainable + larger peak)':<50}{plan.device_bytes / GIB:>10,.2f}",
    ]
    if plan.host_bytes:
        lines.append(f"  {'host memory (prompt state)':<50}{plan.host_bytes / GIB:>10,.2f}")
    lines.append(f"  {'stock GRPOTrainer, lower bound':<50}{plan.stock_lower_bound / GIB:>10,.2f}")
    lines.append("")
    if plan.refused_under_cp:
        lines.append(f"REFUSED: context parallelism does not serve {', '.join(plan.refused_under_cp)} layers.")
    elif plan.budget is None:
        lines.append("No device memory given (--gpu-memory): not checked against a budget.")
    elif plan.fits:
        lines.append(f"FITS: {plan.device_bytes / GIB:,.2f} of {plan.budget / GIB:,.2f} GiB per device.")
    else:
        lines.append(
            f"DOES NOT FIT: {plan.device_bytes / GIB:,.2f} GiB needed, {plan.budget / GIB:,.2f} GiB per device."
        )
        if plan.suggestions:
            alone = len(plan.suggestions[0]["settings"]) == 1
            lines.append("Each of these settings alone would fit:" if alone else "No single setting fits; together:")
            for suggestion in plan.suggestions:
                lines.append(f"  {suggestion_flags(suggestion)}: {suggestion['device_bytes'] / GIB:,.2f} GiB")
                lines.append(f"    (recipe: {suggestion_yaml(suggestion)})")
        else:
            lines.append("No setting, nor two or three together, fits: use more devices or a shorter prompt.")
    return "\n".join(lines)


__all__ = [
    "MemoryPlanError",
    "ModelSourceError",
    "Plan",
    "explain_out_of_memory",
    "format_plan",
    "load_model_config",
    "memory_budget",
    "plan_at_construction",
    "plan_run",
    "trainer_setup",
]
