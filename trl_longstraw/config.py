"""`LongStrawGRPOConfig`: `GRPOConfig` plus the fields of the capture-once, replay-the-suffix update."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch
from transformers.utils import strtobool
from trl import GRPOConfig

PROMPT_GRADIENT_MODES = ("detach", "exact")
PROMPT_STATE_DTYPES = ("auto", "float8_e4m3fn")
MEMORY_PLAN_ACTIONS = ("error", "warn", "off")
# transformers' optimizers that update each parameter from a hook as its gradient is accumulated
OPTIMIZERS_THAT_STEP_INSIDE_BACKWARD = (
    "galore_adamw_layerwise",
    "galore_adamw_8bit_layerwise",
    "galore_adafactor_layerwise",
    "apollo_adamw_layerwise",
    "lomo",
    "adalomo",
)


FP16_REFUSED = "fp16=True is not supported: the per-member backward bypasses the fp16 loss scaler. Use bf16=True."

# Set once a config took FSDP2 from an accelerate launch (`ACCELERATE_USE_FSDP`, which it then turns off)
FSDP_TAKEN_FROM_ACCELERATE = "LONGSTRAW_FSDP_FROM_ACCELERATE"


def model_init_kwargs(args) -> dict:
    """The keyword arguments GRPOTrainer loads a model id with (`args.model_init_kwargs`, none if unset)."""
    return args.model_init_kwargs if isinstance(args.model_init_kwargs, dict) else {}


# `model_init_kwargs` that change the model's context (transformers applies a loading kwarg that names a config
# attribute to the config): what the trainer's and the planner's context checks read
CONTEXT_KWARGS = ("rope_parameters", "rope_scaling", "max_position_embeddings")


def context_overrides(args) -> dict:
    """The entries of `args.model_init_kwargs` that change the model's context (`CONTEXT_KWARGS`)."""
    return {key: value for key, value in (args.model_init_kwargs or {}).items() if key in CONTEXT_KWARGS}


def remote_code_trusted(args) -> bool:
    """Whether the model's own code may run: `model_init_kwargs`' `trust_remote_code`, else the config's."""
    return bool(model_init_kwargs(args).get("trust_remote_code", args.trust_remote_code))


def loading_quantization(args, quantization_config):
    """The quantization a model id is loaded with: the trainer's `quantization_config`, else `model_init_kwargs`'."""
    return quantization_config or model_init_kwargs(args).get("quantization_config")


def env_flag(name: str) -> bool:
    """An `accelerate launch` flag exported to the process (`ACCELERATE_USE_*`), read as transformers reads it."""
    return bool(strtobool(os.environ.get(name, "false")))


def accelerate_size(parallelism_config, name: str) -> int:
    """A `ParallelismConfig` size (`cp_size`, `dp_shard_size`, `tp_size`, ...) a user gave Accelerate, 1 if none:
    from `parallelism_config`, or from an accelerate config file, whose `parallelism_config` section reaches the
    process as `PARALLELISM_CONFIG_*` environment variables. (`accelerate launch --parallelism_config_cp_size N` alone
    exports nothing with accelerate 1.15.)"""
    if parallelism_config is not None:
        return getattr(parallelism_config, name) or 1
    if env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        return int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}", "1"))
    return 1


def accelerate_context_parallel_size(parallelism_config) -> int | None:
    """The cp size a user gave Accelerate (`accelerate_size`), or None if none above 1 was given."""
    size = accelerate_size(parallelism_config, "cp_size")
    return size if size > 1 else None


def accelerate_weight_sharding(parallelism_config) -> list[str]:
    """The weight-sharding sizes above 1 a user gave Accelerate (`accelerate_size`), as `name=size`
    (`dp_shard_size`: FSDP2, `tp_size`: tensor parallelism)."""
    sizes = {name: accelerate_size(parallelism_config, name) for name in ("dp_shard_size", "tp_size")}
    return [f"{name}={size}" for name, size in sizes.items() if size > 1]


@dataclass
class LongStrawGRPOConfig(GRPOConfig):
    r"""
    Configuration for [`LongStrawGRPOTrainer`]. Every [`~trl.GRPOConfig`] field keeps its meaning; a setting the
    LongStraw update cannot honour is rejected here with a `ValueError` that names it and the fix.

    Parameters:
        > Parameters that control the LongStraw update

        prompt_gradient (`str`, *optional*, defaults to `"detach"`):
            `"detach"` treats the captured prompt state as a constant (the paper's capacity mode); `"exact"` also
            pushes the gradient of the prompt state into the parameters, giving the same gradient as stock
            `GRPOTrainer`, at the cost of one prompt forward+backward per group and micro-step.
        prefill_chunk_size (`int`, *optional*, defaults to `1024`):
            Prompt tokens per no-grad capture forward (and per exact-mode recompute chunk). The default is measured
            (docs/benchmarks.md, "Chunk sizes"): at P = 8K on CPU, 1024 against 2048 lowers the exact-mode peak from 0.465 to
            0.269 GiB and detach's from 0.091 to 0.081 GiB at the same step time.
        attention_chunk_size (`int`, *optional*, defaults to `4096`):
            Prompt keys per step of the prefix attention.
        replay_segment_size (`int` or `None`, *optional*, defaults to `None`):
            A member whose replay (its completion plus the last prompt token) is longer is scored and replayed in
            segments of this many tokens: the earlier segments' state captured without autograd and read by the later
            ones, the gradient they send into it carried back exactly, segment by segment in reverse. The replay's
            peak is then the prompt state, the member's own state (and its gradient) and one segment's graph, instead
            of the whole completion's graph. Same gradients as a whole replay, in both prompt-gradient modes (see
            docs/long-completions.md). Under context parallelism the CP group runs a longer member together, in steps
            of one chunk of at most this many tokens per rank, recomputed without activation checkpointing as the
            prompt's chunks are. `None`: every member is replayed whole.
        prompt_state_device (`str`, *optional*, defaults to `"auto"`):
            Where the prompt state lives: `"auto"` (where each layer computes: the model's device, or each layer's own
            when `device_map` splits the model over GPUs), `"cpu"`, or any available torch device.
        prompt_state_dtype (`str`, *optional*, defaults to `"auto"`):
            `"auto"` keeps the prompt state in the model's dtype; `"float8_e4m3fn"` keeps attention K/V pages in fp8
            with one scale per (64-token page, kv head), and MLA latent pages with one scale per page, half the bytes
            of bf16, dequantised chunk by chunk as read. Detach mode only. Its cost in log-prob error is measured in
            docs/benchmarks.md ("fp8 prompt-state pages").
        rollout_from_prompt_state (`bool`, *optional*):
            Generate completions from the captured prompt state (each distinct prompt captured once, its rows decoding
            together against it) instead of transformers' `generate`. `None` (default): on, except with vLLM or
            continuous batching, or where the generation settings ask for what it does not implement (a warning says
            so); `True`: on, and such settings are an error; `False`: TRL's generation.
        context_parallel_size (`int`, *optional*):
            Ranks that share one prompt, each keeping its chunks of the prompt's state and doing its share of the
            capture, scoring and replay (see docs/context-parallel.md). The world must be a multiple of it:
            `world = data parallel x context parallel`. Unset: the
            `cp_size` of Accelerate's `parallelism_config` (in the training args, or in an accelerate config file's
            `parallelism_config` section), else 1. Set both and they must agree.
        shard_weights (`bool`, *optional*, defaults to `False`):
            Shard the weights, their gradients and the optimizer state over every rank with PyTorch's FSDP2: the
            trainer applies `fully_shard` to each decoder layer (the classes the model lists in `_no_split_modules`),
            then to the causal LM, after any PEFT wrapping (see docs/sharded-weights.md). A model passed by id is
            loaded sharded: each rank reads only its shards (transformers' `DistributedConfig(fsdp_size=world)`),
            unless it is quantized, `shard_layer_classes` names other modules than its decoder layers, or `beta > 0`
            without an adapter. A model already sharded with `fully_shard` (or loaded sharded) is used as it is,
            without this flag; an adapter added after the sharding is sharded too. Composes with
            `context_parallel_size` (the weights
            sharded over every rank of every CP group). An FSDP2 accelerate config (`distributed_type: FSDP`,
            `fsdp_version: 2`, TRL's fsdp2.yaml) or `fsdp`/`fsdp_config` arguments with version 2 set it, with the
            config's settings (refused where the trainer does not follow them).
        shard_layer_classes (`list[str]`, *optional*):
            With `shard_weights`: the class names of the modules sharded one by one before the causal LM (an FSDP2
            config's `fsdp_transformer_layer_cls_to_wrap` sets them). Unset: the model's `_no_split_modules`.

        > Parameters that control the LongStraw metrics

        memory_plan_prompt_length (`int`, *optional*):
            The longest prompt in tokens. Set, the trainer plans the run's memory per device before loading weights,
            logs the plan and checks it against the device (`memory_plan`).
        memory_plan (`str`, *optional*, defaults to `"error"`):
            `"error"`, `"warn"` or `"off"`: what a plan that does not fit the device does.
        memory_plan_device_gib (`float`, *optional*):
            Usable memory per device in GiB for the plan (unset: the CUDA device's total memory).
        log_phase_metrics (`bool`, *optional*, defaults to `True`):
            Log wall time, peak memory and run count of each phase, and the prompt-state size, under `longstraw/` (see
            docs/memory.md, "Logged metrics"); `False` logs none of them. Never resets a process-wide counter (CUDA peak
            stats, the kernel's RSS high-water mark).
        sync_phase_metrics (`bool`, *optional*, defaults to `False`):
            Synchronise the accelerator at each phase boundary so `time_s` is device time. Off by default: CUDA
            kernels run asynchronously, so without it a phase's time is the host time spent issuing its work.

    Overrides of `GRPOConfig` defaults: `disable_dropout` defaults to `True` (the replay must reproduce the scoring pass
    token for token) and `activation_checkpointing` (alias `gradient_checkpointing`) to `False` (only the completions
    run under autograd).
    """

    prompt_gradient: str = field(
        default="detach",
        metadata={
            "help": "Gradient through the captured prompt state. 'detach' (default, the paper's capacity mode): the "
            "state is a constant and gradients flow only through the replayed tokens. 'exact': the same gradient as "
            "stock GRPOTrainer, by accumulating the state's gradient over the group's members and back-propagating "
            "it through one chunked recompute of the prompt per group.",
            "choices": list(PROMPT_GRADIENT_MODES),
        },
    )
    prefill_chunk_size: int = field(
        default=1024,
        metadata={
            "help": "Prompt tokens per no-grad capture forward. Bounds the activations of the capture (and of the "
            "exact-mode prompt recompute) to one chunk."
        },
    )
    attention_chunk_size: int = field(
        default=4096,
        metadata={
            "help": "Prompt keys per step of the prefix attention (forward and recomputing backward). Bounds its "
            "score matrix to [query rows, attention_chunk_size] per kv head."
        },
    )
    replay_segment_size: int | None = field(
        default=None,
        metadata={
            "help": "Replay (and score) a member longer than this many tokens in segments: the earlier segments' "
            "state captured without autograd and read by the later ones, their gradient carried back exactly. Bounds "
            "the replay's graph to one segment. None: every member whole."
        },
    )
    prompt_state_device: str = field(
        default="auto",
        metadata={
            "help": "Where the captured prompt state lives: 'auto' (where each layer computes: the model's device, or "
            "each layer's own when device_map splits the model over GPUs), 'cpu' (host memory, staged chunk by chunk "
            "onto the compute device when read), or an available torch device such as 'cuda:1'."
        },
    )
    prompt_state_dtype: str = field(
        default="auto",
        metadata={
            "help": "Storage of the prompt state's attention K/V and MLA latent pages: 'auto' (the model's dtype) or "
            "'float8_e4m3fn' (fp8 with one scale per 64-token page and kv head, per page for MLA latents: half the "
            "bytes of bf16, dequantised chunk by chunk as read; prompt_gradient='detach' only). Windowed layers, "
            "recurrent states and DSA indexer keys stay in the model's dtype.",
            "choices": list(PROMPT_STATE_DTYPES),
        },
    )
    rollout_from_prompt_state: bool | None = field(
        default=None,
        metadata={
            "help": "Generate completions from the captured prompt state: each distinct prompt is captured once and "
            "its rows decode together against it (the prompt's pages shared, each row keeping only its own decoded "
            "tokens), instead of transformers' generate, which prefills and caches the prompt once per row. The same "
            "capture then serves scoring and the update while the weights stay put. Sampling follows the same "
            "generation settings (temperature, top_p, top_k, min_p, repetition_penalty, generation_kwargs) and a "
            "seeded run samples the same completions as stock with float32 weights. None (default): on, except with "
            "use_vllm or use_transformers_continuous_batching, which keep generating as in TRL (or where the "
            "generation settings ask for what it does not implement, e.g. beam search: a warning says so). True: on, "
            "and such settings are an error. False: TRL's generation."
        },
    )
    context_parallel_size: int | None = field(
        default=None,
        metadata={
            "help": "Ranks that share one prompt (context parallelism): each keeps its chunks of the prompt state "
            "(one per capture step, dealt in zigzag), captures them at the same time as the others, and scores and "
            "replays its share of the members; attention over the ranks' pages is merged by log-sum-exp, and every "
            "rank ends the step with the single-process gradient. The world size must be a multiple of it (world = data parallel x context "
            "parallel; consecutive ranks form a context-parallel group). Unset: the cp_size of Accelerate's "
            "parallelism_config if one is configured, else 1."
        },
    )
    shard_weights: bool = field(
        default=False,
        metadata={
            "help": "Shard the weights, gradients and optimizer state over every rank with FSDP2 (fully_shard on each "
            "decoder layer, then on the causal LM, after any PEFT wrapping). A model passed by id is loaded sharded, "
            "each rank reading only its shards (transformers' DistributedConfig), unless quantized, with other "
            "shard_layer_classes than its decoder layers, or with beta > 0 and no adapter. A model already sharded "
            "with fully_shard (or loaded sharded) is used as it is."
        },
    )
    shard_layer_classes: list[str] | None = field(
        default=None,
        metadata={
            "help": "With shard_weights: the class names of the modules sharded one by one before the causal LM (an "
            "FSDP2 accelerate config's fsdp_transformer_layer_cls_to_wrap sets them). Unset: the classes the model "
            "lists in `_no_split_modules`, its decoder layers."
        },
    )
    memory_plan_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "The longest prompt, in tokens, the run will see. Set, the trainer plans the run's memory per "
            "device at construction, before loading any weights (the plan of `trl-longstraw plan`: weights, "
            "adapters and optimizer state, prompt state, the capture's, replay's and rollout's working sets, detach "
            "mode), logs it once (console and the W&B run config) and, when it does not fit the device, does what "
            "`memory_plan` says. Unset: no plan."
        },
    )
    memory_plan: str = field(
        default="error",
        metadata={
            "help": "What a plan (memory_plan_prompt_length set) that does not fit the device does: 'error' (raise "
            "before any weights load, naming the settings that would fit), 'warn' (log it and go on) or 'off' (no "
            "plan).",
            "choices": list(MEMORY_PLAN_ACTIONS),
        },
    )
    memory_plan_device_gib: float | None = field(
        default=None,
        metadata={
            "help": "Usable memory per device for the plan, in GiB. Unset: the total memory of the CUDA device this "
            "process trains on; on a CPU-only machine the plan is printed but not checked."
        },
    )
    log_phase_metrics: bool = field(
        default=True,
        metadata={
            "help": "Log wall time, peak memory and run count of each phase (rollout, capture, capture_ref, score, "
            "replay, prompt_backward, optimizer) and the prompt-state size under 'longstraw/' in the trainer logs, "
            "train and eval separately; False logs none of them. Memory is sampled; no process-wide counter is ever "
            "reset."
        },
    )
    sync_phase_metrics: bool = field(
        default=False,
        metadata={
            "help": "Synchronise the accelerator at every phase boundary (once per phase and group, never per "
            "member) so that `time_s` measures device time. Off by default: without it, on CUDA a phase's time is "
            "the host time spent issuing its kernels."
        },
    )
    activation_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Activation checkpointing of the replayed completion (TRL turns it on by default). Off by default "
            "here: the prompt never goes through autograd, and for short completions recomputing the replay's layers "
            "costs time for no memory gain (measured at R = 128: same peak). Turn it on for long completions. "
            "Unset (and `gradient_checkpointing` unset) means False."
        },
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of `activation_checkpointing` (transformers), which takes precedence."},
    )
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Whether to disable dropout in the model. LongStraw needs it off (the default here): the replay "
            "of a member must reproduce the log-probs its loss gradient was computed from."
        },
    )

    def __post_init__(self):
        self._launch_environment: dict[str, str] = {}  # what adopting the launcher's settings implies (below)
        self._validate_types()
        if self.fp16:
            raise ValueError(FP16_REFUSED)
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = False
        self._adopt_accelerate_context_parallel_size()
        self._validate_longstraw_fields()
        try:
            super().__post_init__()
        except ValueError as error:  # TRL's message names neither the field to change nor the fix
            if "must be divisible by num_generations" not in str(error):
                raise
            raise ValueError(self._whole_groups_message()) from error
        self._adopt_accelerate_fsdp2()
        self._validate_context_parallel_batches()
        self._validate_context_parallel_statistics()

    def launch_environment(self) -> dict[str, str]:
        """The environment variables that carry out what this config adopted from the launcher, which the trainer sets
        at its construction, before it loads a model or builds its Accelerator: Accelerate's own context parallelism
        off where its size was taken (`PARALLELISM_CONFIG_CP_SIZE=1`), and Accelerate's FSDP off where FSDP2 was taken
        (`ACCELERATE_USE_FSDP=false`, read by the Accelerator and by transformers' loading, and a marker from which
        the process's later configs know it was taken). Creating a config changes no environment."""
        return dict(self._launch_environment)

    def _validate_replay_segment_size(self) -> None:
        size = self.replay_segment_size
        if size is None:
            return
        if size < 2:
            raise ValueError(
                f"replay_segment_size={size} must be at least 2 (a segment feeds linear-attention layers at least two "
                "tokens), e.g. 8192, or None to replay every member whole."
            )

    def _validate_types(self) -> None:
        """Each LongStraw field's type, before anything is derived from it (a YAML `yes` or a string `"true"` given
        from Python would otherwise pass as truthy)."""
        flags = ("shard_weights", "log_phase_metrics", "sync_phase_metrics", "disable_dropout")
        optional_flags = ("rollout_from_prompt_state", "activation_checkpointing", "gradient_checkpointing")
        for name in flags + optional_flags:
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name in optional_flags):
                unset = " or None (unset)" if name in optional_flags else ""
                raise ValueError(f"{name}={value!r} must be True or False{unset}.")
        integers = ("prefill_chunk_size", "attention_chunk_size")
        optional_integers = ("context_parallel_size", "memory_plan_prompt_length", "replay_segment_size")
        for name in integers + optional_integers:
            value = getattr(self, name)
            if isinstance(value, bool) or not (
                isinstance(value, int) or (value is None and name in optional_integers)
            ):
                unset = ", or None (unset)" if name in optional_integers else ""
                raise ValueError(f"{name}={value!r} must be a positive integer{unset}.")
        classes = self.shard_layer_classes
        if classes is not None and (isinstance(classes, str) or not all(isinstance(c, str) for c in classes)):
            raise ValueError(
                f"shard_layer_classes={classes!r} must be a list of module class names, e.g. ['Qwen3DecoderLayer']."
            )

    def _whole_groups_message(self) -> str:
        processes = self.generation_batch_size // (self.per_device_train_batch_size * self.steps_per_generation)
        return (
            f"per_device_train_batch_size={self.per_device_train_batch_size} x {processes} process(es) x "
            f"steps_per_generation={self.steps_per_generation} = {self.generation_batch_size} completions per "
            f"generation, which is not a multiple of num_generations={self.num_generations}: every prompt's group of "
            f"{self.num_generations} completions must be generated whole. Make per_device_train_batch_size (or "
            f"steps_per_generation) such that the product is a multiple of {self.num_generations}, e.g. "
            f"per_device_train_batch_size={self.num_generations}."
        )

    def _validate_context_parallel_batches(self) -> None:
        """The ranks of a CP group draw one rank's block of a generation batch (`context_parallel.SharedRowsSampler`)
        and train on their first rank's rows (`share_leader_inputs`), so a block must hold whole groups: a group
        spread over two blocks would be split between two CP groups (or, without the sampler, replaced by copies of
        its first part)."""
        if self.context_parallel_size == 1:
            return
        rows = self.per_device_train_batch_size * self.steps_per_generation
        if rows % self.num_generations:
            raise ValueError(
                f"context_parallel_size={self.context_parallel_size} needs every rank's generation batch "
                f"(per_device_train_batch_size x steps_per_generation = {rows} rows) to hold whole groups of "
                f"num_generations={self.num_generations}: make per_device_train_batch_size x steps_per_generation a "
                "multiple of num_generations."
            )

    def _validate_context_parallel_statistics(self) -> None:
        """TRL's batch-wide reward statistics are taken over every rank's rows, in which a CP group's rows appear once
        per rank (its ranks hold the same rows): a mean does not move, a standard deviation does. (The entropy
        quantile is taken over each row once: `LongStrawGRPOTrainer.get_high_entropy_mask`.)"""
        if self.context_parallel_size == 1:
            return
        for name, batch_std in (("scale_rewards", "batch"), ("multi_objective_aggregation", "normalize_then_sum")):
            if getattr(self, name) == batch_std:
                raise ValueError(
                    f"context_parallel_size={self.context_parallel_size} with {name}={getattr(self, name)!r}: TRL "
                    "scales the advantages by a standard deviation over every rank's rows, and the ranks of a "
                    "context-parallel group hold the same rows, so each would count context_parallel_size times and "
                    "the advantages would be scaled differently from one process. Use scale_rewards='group' or "
                    "'none' and multi_objective_aggregation='sum_then_normalize', or context_parallel_size=1."
                )

    def _adopt_accelerate_context_parallel_size(self) -> None:
        """Take the context-parallel size from Accelerate's `parallelism_config` where the user configured it there,
        and leave Accelerate's own CP off: its CP shards model inputs itself (FSDP2 + ring attention), which TRL's
        GRPO refuses and LongStraw's captured prompt replaces. A disagreement between the two sizes is refused."""
        accelerate_size = accelerate_context_parallel_size(self.parallelism_config)
        if accelerate_size is None:
            return
        if self.context_parallel_size is not None and self.context_parallel_size != accelerate_size:
            raise ValueError(
                f"context_parallel_size={self.context_parallel_size} but Accelerate's parallelism_config has "
                f"cp_size={accelerate_size}: set one of them, or the same value in both."
            )
        self.context_parallel_size = accelerate_size
        if self.parallelism_config is not None:
            self.parallelism_config.cp_size = 1
            self.parallelism_config.cp_handler = None
            if self.parallelism_config.total_size == 1:  # nothing else configured (and Accelerate refuses it on CPU)
                self.parallelism_config = None
        else:  # an accelerate config file's parallelism_config section: the Accelerator would build its CP from these
            self._launch_environment["PARALLELISM_CONFIG_CP_SIZE"] = "1"

    def _adopt_accelerate_fsdp2(self) -> None:
        """Take FSDP2 from Accelerate's FSDP plugin where the user configured it (an accelerate config with
        `distributed_type: FSDP` and `fsdp_version: 2`, such as TRL's fsdp2.yaml, or the `fsdp`/`fsdp_config`
        arguments): the trainer shards with the same engine under its own control (`shard_weights`, fsdp.py), and
        Accelerate is left without the plugin. Accelerate would wrap the model for one forward and one backward per
        micro-batch, and its `cpu_ram_efficient_loading` would have transformers load the weights on the first rank
        only, for Accelerate to broadcast them when it wraps the model. Settings the engine does not follow are
        refused, naming the accelerate config key."""
        from_launcher = env_flag("ACCELERATE_USE_FSDP") or env_flag(FSDP_TAKEN_FROM_ACCELERATE)
        if self.fsdp_plugin_args is None and not from_launcher:
            return
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import CPUOffloadPolicy

        source = "the fsdp_config argument" if self.fsdp_plugin_args is not None else "the accelerate config"
        version = (self.fsdp_plugin_args or {}).get("fsdp_version") or int(os.environ.get("FSDP_VERSION", "1"))
        if version != 2:  # before building FSDP1's plugin, which refuses some settings on a CPU
            raise ValueError(
                f"fsdp_version: {version} in {source}: LongStraw shards the weights with FSDP2 itself "
                "(docs/sharded-weights.md). Set fsdp_version: 2."
            )
        plugin = FullyShardedDataParallelPlugin(**(self.fsdp_plugin_args or {}))  # unset keys: the launcher's FSDP_*
        wrap = getattr(plugin.auto_wrap_policy, "__name__", None)
        refusals = [
            (
                plugin.reshard_after_forward is not True,
                f"fsdp_reshard_after_forward: {plugin.reshard_after_forward}",
                (
                    "fsdp_reshard_after_forward: true (LongStraw frees each layer's gathered weights after every forward "
                    "of its many passes, so no more than two layers are gathered at once)"
                ),
            ),
            (
                isinstance(plugin.cpu_offload, CPUOffloadPolicy),
                "fsdp_offload_params: true",
                (
                    "fsdp_offload_params: false (parameter offload is not verified with LongStraw; "
                    "prompt_state_device='cpu' moves the prompt state to the host instead)"
                ),
            ),
            (
                wrap != "transformer_auto_wrap_policy",
                f"fsdp_auto_wrap_policy: {wrap or 'NO_WRAP'}",
                (
                    "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP (each decoder layer its own FSDP2 module, gathered "
                    "one at a time)"
                ),
            ),
            (
                plugin.mixed_precision_policy is not None,
                "fsdp_config mixed_precision_policy",
                (
                    "no mixed_precision_policy: the layers compute in the weights' dtype, under autocast with "
                    "mixed_precision: bf16, as without FSDP"
                ),
            ),
            (bool(plugin.ignored_modules), "fsdp_ignored_modules", "no ignored modules"),
        ]
        for refused, setting, fix in refusals:
            if refused:
                raise ValueError(
                    f"{setting} in {source}: LongStraw shards the weights with FSDP2 itself (docs/sharded-weights.md) "
                    f"and does not follow this setting. Set {fix}."
                )
        if "FULL_STATE_DICT" not in str(plugin.state_dict_type):
            warnings.warn(
                f"fsdp_state_dict_type: {plugin.state_dict_type.name} in {source} is not followed: a LongStraw "
                "checkpoint under FSDP2 holds the whole model's weights, gathered onto the first rank "
                "(save_only_model=True; docs/sharded-weights.md).",
                stacklevel=3,
            )
        self.shard_weights = True
        if plugin.transformer_cls_names_to_wrap:
            self.shard_layer_classes = list(plugin.transformer_cls_names_to_wrap)
        if plugin.activation_checkpointing:  # FSDP's checkpointing of each wrapped layer: transformers' own
            self.activation_checkpointing = self.gradient_checkpointing = True
        self.fsdp, self.fsdp_plugin_args = False, None
        if from_launcher:  # read by Accelerate (its Accelerator, its gradient clipping) and by transformers' loading
            self._launch_environment["ACCELERATE_USE_FSDP"] = "false"
            self._launch_environment[FSDP_TAKEN_FROM_ACCELERATE] = "true"  # for the process's later configs

    def _validate_longstraw_fields(self) -> None:
        if self.context_parallel_size is None:
            self.context_parallel_size = 1
        if not isinstance(self.context_parallel_size, int) or self.context_parallel_size < 1:
            raise ValueError(
                f"context_parallel_size={self.context_parallel_size!r} must be a positive integer (1: no context "
                "parallelism)."
            )
        if self.prompt_gradient not in PROMPT_GRADIENT_MODES:
            raise ValueError(
                f"prompt_gradient={self.prompt_gradient!r} is not supported: use one of {PROMPT_GRADIENT_MODES}."
            )
        for name in ("prefill_chunk_size", "attention_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer (e.g. 1024).")
        self._validate_replay_segment_size()
        if self.prompt_state_device != "auto":
            self._validate_state_device()
        if self.memory_plan not in MEMORY_PLAN_ACTIONS:
            raise ValueError(f"memory_plan={self.memory_plan!r} is not supported: use one of {MEMORY_PLAN_ACTIONS}.")
        for name in ("memory_plan_prompt_length", "memory_plan_device_gib"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name}={value!r} must be a positive number, or None (unset).")
        if self.prompt_state_dtype not in PROMPT_STATE_DTYPES:
            raise ValueError(
                f"prompt_state_dtype={self.prompt_state_dtype!r} is not supported: use one of {PROMPT_STATE_DTYPES}."
            )
        if self.prompt_state_dtype != "auto" and self.prompt_gradient == "exact":
            raise ValueError(
                f"prompt_state_dtype={self.prompt_state_dtype!r} with prompt_gradient='exact': the exact prompt "
                "gradient accumulates on the state's tensors and recomputes them in full precision, which fp8 pages "
                "cannot hold. Use prompt_state_dtype='auto' with 'exact', or prompt_gradient='detach' with fp8."
            )
        other_generators = ("use_vllm", "use_transformers_continuous_batching", "use_transformers_paged")
        engine = next((name for name in other_generators if getattr(self, name)), None)
        if self.rollout_from_prompt_state and engine is not None:
            raise ValueError(
                f"rollout_from_prompt_state=True with {engine}=True: completions come from one generator. Set "
                f"rollout_from_prompt_state=None (the default: {engine} generates, the capture serves scoring and the "
                f"update) or {engine}=False."
            )
        if self.use_vllm and self.context_parallel_size > 1:
            raise ValueError(
                f"context_parallel_size={self.context_parallel_size} with use_vllm=True: TRL hands every process its "
                "own slice of vLLM's completions, so the ranks of a context-parallel group would train on different "
                "rows of one sharded prompt. Set use_vllm=False (each rank group generates with its first rank's "
                "rows) or context_parallel_size=1."
            )
        sharded_by = accelerate_weight_sharding(self.parallelism_config)
        if self.deepspeed or env_flag("ACCELERATE_USE_DEEPSPEED") or sharded_by:
            if sharded_by:
                where = f"Accelerate's parallelism_config {', '.join(sharded_by)}"
            elif self.deepspeed:
                where = "`deepspeed`"
            else:
                where = "ACCELERATE_USE_DEEPSPEED set by an accelerate config"
            raise ValueError(
                "LongStrawGRPOTrainer shards weights with PyTorch's FSDP2 under its own control, not through "
                f"DeepSpeed, tensor parallelism or Accelerate's parallelism_config ({where}): its update runs a "
                "data-dependent number of forwards and backwards per rank, which those engines do not keep in step. "
                "Launch with an FSDP2 accelerate config (`accelerate launch --config_file "
                "configs/accelerate/fsdp2.yaml`, TRL's fsdp2.yaml) or set shard_weights=True; see "
                "docs/sharded-weights.md."
            )
        if self.shard_layer_classes is not None and not self.shard_weights:
            raise ValueError(
                f"shard_layer_classes={self.shard_layer_classes} without shard_weights=True: the classes name the "
                "modules the trainer shards. Set shard_weights=True, or unset shard_layer_classes."
            )
        if self.neftune_noise_alpha is not None:
            raise ValueError(
                f"neftune_noise_alpha={self.neftune_noise_alpha}: NEFTune adds fresh noise to the input embeddings in "
                "every training-mode forward, and LongStraw's replay must reproduce its scoring pass exactly (stock's "
                "loss and backward share one forward). Set neftune_noise_alpha=None."
            )
        optimizer = str(getattr(self.optim, "value", self.optim))
        if optimizer in OPTIMIZERS_THAT_STEP_INSIDE_BACKWARD:
            raise ValueError(
                f"optim={optimizer!r} is not supported: it updates the weights inside the backward pass, as each "
                "gradient arrives. LongStraw back-propagates once per replayed member, against a prompt state captured "
                "from the weights before the step, so the weights would move between the members of one step "
                "(stock runs one backward per micro-batch). Use an optimizer that steps after the backward: the default "
                "'adamw_torch_fused', or a GaLore/APOLLO optimizer without '_layerwise'."
            )
        if self.use_liger_kernel:
            raise ValueError(
                "use_liger_kernel=True is not supported: Liger's Triton kernels replace the model's RMSNorm, RoPE and "
                "MLP modules, and LongStraw's capture and replay are verified against stock only on transformers' own "
                "modules (Liger needs CUDA, which this project's tests do not have). TRL 1.16 also deprecates the "
                "flag. Set use_liger_kernel=False."
            )

    def _validate_state_device(self) -> None:
        """Refuse a device that does not exist here now, not at the first capture after a costly generation."""
        try:
            device = torch.device(self.prompt_state_device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(
                f"prompt_state_device={self.prompt_state_device!r} is not a device: use 'auto', 'cpu' or a torch "
                "device string such as 'cuda:0'."
            ) from error
        if device.type == "cuda":
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if available == 0 or (device.index is not None and device.index >= available):
                raise ValueError(
                    f"prompt_state_device={self.prompt_state_device!r} but this machine has {available} CUDA "
                    "device(s). Use prompt_state_device='auto' (the model's device) or 'cpu' (host memory), or a "
                    "CUDA device index below the device count."
                )
        elif device.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(
                f"prompt_state_device={self.prompt_state_device!r} but MPS is not available here. Use "
                "prompt_state_device='auto' or 'cpu'."
            )
