"""The trainer's checks of its inputs: each refuses, naming the field and the fix, before the work it would spoil.

Checks of the model's own forward (that a capture reproduces it) are `preflight.py`'s; the planner's checks of a run's
settings are `plan.py`'s.
"""

from __future__ import annotations

import torch
from accelerate.utils import is_peft_model
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from .architectures import check_supported, longrope_switch_length, uses_rope, yarn_extension
from .config import FP16_REFUSED, LongStrawGRPOConfig, context_overrides, remote_code_trusted
from .fsdp import check_weights_loaded


def check_adapter(peft_config) -> None:
    """Refuse a PEFT prompt-learning adapter (prompt, prefix or p-tuning): its virtual tokens are added by the PEFT
    wrapper's forward, which the capture and replay of the base model never run."""
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        raise ValueError(
            f"peft_config is a {type(peft_config).__name__} (prompt learning): its virtual tokens are prepended by "
            "PEFT's forward, which LongStraw's capture and replay of the base model bypass, so they would never be "
            "trained. Use an adapter on the weights (LoraConfig, for example)."
        )


def check_trainer_args(args) -> None:
    """The trainer's `args`: a `LongStrawGRPOConfig`, without fp16 (which a field set after construction can turn
    on)."""
    if not isinstance(args, LongStrawGRPOConfig):
        raise TypeError(
            f"args is a {type(args).__name__}; LongStrawGRPOTrainer needs a LongStrawGRPOConfig: build it with "
            "the arguments you gave GRPOConfig (it accepts every GRPOConfig field)."
        )
    if args.fp16:
        raise ValueError(FP16_REFUSED)


def check_model(model, args: LongStrawGRPOConfig, peft_config) -> PretrainedConfig:
    """The model's config, once what the trainer cannot drive is refused, before any weights load: the adapter, the
    architecture (a model id's from its meta-device skeleton), and for a model object its device map, its weights
    on this rank (under `shard_weights`) and the adapter it carries."""
    check_adapter(peft_config)
    if isinstance(model, str):
        trust_remote_code = remote_code_trusted(args)
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, **context_overrides(args))
        check_supported(config, trust_remote_code=trust_remote_code)
        return config
    check_supported(model)
    check_device_map(model)
    if args.shard_weights:
        check_weights_loaded(model)
    if is_peft_model(model):
        check_adapter(model.active_peft_config)
    return model.config


def check_device_map(model) -> None:
    """Refuse layers offloaded by `device_map` ("disk" anywhere, "cpu" beside GPUs): their weights are brought in per
    forward (the captured state could not tell whether they moved), and PEFT cannot train adapters on them."""
    device_map = {name: str(where) for name, where in (getattr(model, "hf_device_map", None) or {}).items()}
    on_gpus = any(where not in ("cpu", "disk") for where in device_map.values())
    offloaded = sorted(name for name, where in device_map.items() if where == "disk" or (where == "cpu" and on_gpus))
    if offloaded:
        raise ValueError(
            f"The model's device_map offloads {offloaded[:3]}{' ...' if len(offloaded) > 3 else ''} to cpu/disk. "
            "LongStrawGRPOTrainer needs every layer's weights on a device it computes on: give the model more GPUs "
            "or memory (device_map='auto' with max_memory in model_init_kwargs), or quantise it (load_in_4bit)."
        )


def check_dropout_off(model) -> None:
    """Refuse active dropout: a replay must reproduce the log-probs its loss gradient was computed from, and a new
    dropout sample per forward would not."""
    active = next(((name, m.p) for name, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0), None)
    if active is not None:
        raise ValueError(
            f"Dropout {active[0]} has p={active[1]}: LongStraw scores each member once and replays it under "
            "autograd, so both must see the same network. Set disable_dropout=True (the LongStrawGRPOConfig default)."
        )


def check_positions(config, args: LongStrawGRPOConfig, prompt_width: int) -> None:
    """Refuse prompts that, with the tokens generation may add (`max_completion_length`, or a `max_new_tokens` /
    vLLM `max_tokens` in `generation_kwargs`, which override it as in GRPOTrainer), would run past the model's
    positions.

    Called at construction (a one-token prompt) and on the tokenized prompts before each generation, so the
    costliest part of a long-prompt step never runs for a batch the update would refuse.
    """
    generated, field_name = args.max_completion_length or 0, "max_completion_length"
    for key in ("max_tokens",) if args.use_vllm else ("max_new_tokens",):  # vLLM's, or generate's
        if (args.generation_kwargs or {}).get(key) is not None:
            generated, field_name = args.generation_kwargs[key], f"generation_kwargs {key}"
    multiple = args.pad_to_multiple_of

    def padded(width: int) -> int:
        return -(-width // multiple) * multiple if multiple else width

    check_context(config, prompt_width, generated, field_name, total=padded(prompt_width) + padded(generated))


def check_context(
    config, prompt_tokens: int, generated: int, generated_field: str = "max_completion_length", total=None
) -> None:
    """Refuse a prompt of `prompt_tokens` tokens plus `generated` tokens of completion (`total` positions with their
    padding) past the model's positions (`max_position_embeddings`), or past the length where a longrope model
    changes its factors: the trainer's check and the planner's (`trl-longstraw plan`), one message naming the fix."""
    total = prompt_tokens + generated if total is None else total
    spans = f"A prompt of {prompt_tokens} tokens plus {generated_field}={generated} spans {total}"
    max_positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if max_positions is not None and total > max_positions and not uses_rope(config):
        raise ValueError(
            f"{spans} positions, more than the model's max_position_embeddings={max_positions}: its positions are "
            f"learned embeddings, which no RoPE scaling extends. Truncate the prompts or lower {generated_field}."
        )
    if max_positions is not None and total > max_positions:
        factor, parameters = yarn_extension(config, total)
        raise ValueError(
            f"{spans} positions, more than the model's max_position_embeddings={max_positions}. Truncate the "
            f"prompts, lower {generated_field}, or extend the model's context with the RoPE scaling its model card "
            f"gives, such as YaRN: model_init_kwargs rope_parameters={parameters} and max_position_embeddings="
            f"{int(factor * parameters['original_max_position_embeddings'])} (the planner: --rope-scaling "
            f"yarn:{factor:g})."
        )
    switch = longrope_switch_length(config)
    if switch is not None and total > switch:
        raise ValueError(
            f"{spans} positions, more than this longrope model's original_max_position_embeddings={switch}. "
            "longrope rotates a whole forward with its long factors once the forward is longer than that, so "
            "stock's one forward of prompt + completion and LongStraw's chunked capture would rotate the prompt "
            f"differently. Keep prompt + {generated_field} within {switch} positions, or use a model whose RoPE "
            "does not depend on the forward's length."
        )


def check_sharded_checkpointing(args: LongStrawGRPOConfig) -> None:
    """Under FSDP2 (fsdp.py) a checkpoint holds the gathered weights only: refuse one that would be resumed."""
    save_strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    if save_strategy != "no" and not args.save_only_model:
        raise ValueError(
            f"save_strategy={save_strategy!r} with weights sharded by FSDP2: the optimizer's sharded state is "
            "not checkpointed, so a checkpoint could not be resumed. Set save_only_model=True (the weights, "
            "gathered, are saved) or save_strategy='no'."
        )


def check_eval_dataset(dataset, context_parallel_size: int, args, num_generations_eval: int) -> None:
    """Under context parallelism an eval set must be map-style (an iterable one reaches each rank with its own
    rows, of which a CP group would evaluate only its first rank's) and fill whole batches of whole groups."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"context_parallel_size={context_parallel_size} with an iterable eval dataset: each rank would "
            "draw its own rows and a CP group would evaluate only its first rank's. Pass a map-style Dataset "
            "(e.g. `Dataset.from_list(list(iterable))`) to evaluate every row."
        )
    check_eval_batches(len(dataset), context_parallel_size, args, num_generations_eval)


def check_eval_batches(num_prompts: int, context_parallel_size: int, args, num_generations_eval: int) -> None:
    """Under context parallelism every eval batch must hold whole groups, and the batches must not end with a
    partial one (the ranks of a CP group must draw identical batches, `SharedRowsSampler`). `args` gives
    `per_device_eval_batch_size` and `dataloader_drop_last`."""
    cp, batch, generations = context_parallel_size, args.per_device_eval_batch_size, num_generations_eval
    if batch % generations:
        raise ValueError(
            f"context_parallel_size={cp} needs per_device_eval_batch_size={batch} to hold whole groups of "
            f"num_generations_eval={generations}: make it a multiple of {generations}."
        )
    if num_prompts * generations % batch and not args.dataloader_drop_last:
        raise ValueError(
            f"context_parallel_size={cp}: the eval dataset's {num_prompts} prompts x num_generations_eval="
            f"{generations} rows do not fill whole batches of per_device_eval_batch_size={batch}, and the ranks "
            "of a CP group must draw identical batches. Choose a per_device_eval_batch_size that divides "
            f"{num_prompts * generations}, or set dataloader_drop_last=True."
        )
