"""Which models the LongStraw engine can drive, decided by the state-kind registry before any expensive work.

A model is supported when every decoder layer maps to a registered state kind (`state/registry.py`) and its
attention-like mixers route through transformers' `AttentionInterface`. There is no model-type allowlist: a config
is checked by planning the layers of its skeleton, built on the meta device (no weights, no memory), so a Hub model
id is checked before its weights are downloaded, and remote-code models are judged by their modules like any other.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from .state import LayerPlan, UnsupportedModelError, plan_layers
from .state.registry import check_deterministic_forward

__all__ = ["UnsupportedModelError", "check_supported", "longrope_switch_length", "model_skeleton", "shared_skeleton"]


def model_skeleton(config: PretrainedConfig, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of `config` with its parameters on the meta device: its modules, none of its memory. A new one
    per call, the caller's to change (PEFT wraps its modules); `shared_skeleton` to read one."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


_SHARED_SKELETONS: dict[tuple, nn.Module] = {}
_SHARED_SKELETONS_KEPT = 4


def config_key(config: PretrainedConfig, trust_remote_code: bool = False) -> tuple:
    """A key equal for configs of equal class and values (a config changed in place gets another): what a skeleton,
    or a count made on one, is cached by."""
    return type(config), config.to_json_string(use_diff=False), trust_remote_code


def shared_skeleton(config: PretrainedConfig, trust_remote_code: bool = False) -> nn.Module:
    """`model_skeleton` of `config`, built once per config (`config_key`) and shared by every reader: never change
    it. A plan reads its model's skeleton dozens of times (its settings, its suggestions), and GLM-5's 78 layers take
    0.17 s to build each time. The last few configs' skeletons are kept."""
    key = config_key(config, trust_remote_code)
    skeleton = _SHARED_SKELETONS.pop(key, None)
    if skeleton is None:
        skeleton = model_skeleton(config, trust_remote_code=trust_remote_code)
    _SHARED_SKELETONS[key] = skeleton  # the most recent last
    while len(_SHARED_SKELETONS) > _SHARED_SKELETONS_KEPT:
        del _SHARED_SKELETONS[next(iter(_SHARED_SKELETONS))]
    return skeleton


def check_supported(model_or_config: nn.Module | PretrainedConfig, trust_remote_code: bool = False) -> list[LayerPlan]:
    """The layer plan of a model (or of a config's skeleton); raise `UnsupportedModelError` naming what is missing."""
    is_config = isinstance(model_or_config, PretrainedConfig)
    config = model_or_config if is_config else model_or_config.config
    check_deterministic_forward(config)
    check_positions_from_the_model(config)
    if is_config:
        try:
            model = shared_skeleton(config, trust_remote_code=trust_remote_code)
        except ValueError as error:  # no causal-LM class for this config
            raise UnsupportedModelError(
                f"model_type={config.model_type!r} has no causal language model class in transformers "
                f"({error}); LongStrawGRPOTrainer trains causal LMs."
            ) from error
    else:
        model = model_or_config
    return plan_layers(model)


def check_positions_from_the_model(config: PretrainedConfig) -> None:
    """Refuse a layer that numbers its tokens from the cache's length: a LongStraw forward reports none (its masks
    span its own keys only) and passes each forward's positions to the model instead."""
    config = config.get_text_config()
    no_rope = [index for index, rope in enumerate(getattr(config, "no_rope_layers", None) or []) if not rope]
    if getattr(config, "attn_temperature_tuning", False) and no_rope:
        raise UnsupportedModelError(
            f"attn_temperature_tuning=True: Llama 4's NoPE layers ({no_rope}) scale their queries by positions they "
            "count from the cache's length, which LongStraw's prompt state does not report, so past "
            f"floor_scale={config.floor_scale} positions their scores would differ from the model's. Set "
            "attn_temperature_tuning=False in the model config (which changes the model), or train without LongStraw."
        )


def longrope_switch_length(config: PretrainedConfig) -> int | None:
    """The longest sequence a longrope model rotates with its short factors, or None without longrope.

    transformers picks longrope's factors per forward, from that forward's largest position (`dynamic_rope_update`):
    past `original_max_position_embeddings` every token of the forward takes the long factors. Stock scores prompt +
    completion in one forward; LongStraw captures the prompt in chunks, so the two agree only while the whole
    sequence stays within that length.
    """
    config = config.get_text_config()
    parameters = getattr(config, "rope_parameters", None) or {}
    per_layer_type = parameters and all(isinstance(value, dict) for value in parameters.values())
    fallback = getattr(config, "original_max_position_embeddings", None)
    limits = [
        entry.get("original_max_position_embeddings") or fallback
        for entry in (parameters.values() if per_layer_type else [parameters])
        if entry.get("rope_type") == "longrope"
    ]
    return min((limit for limit in limits if limit is not None), default=None)


VERIFIED_LEVELS = "2, 3, 4, 6 in both modes"


def support_table() -> str:
    """The README's support table, generated from the registry over the embedded tiny config of every family.

    Every row is verified at `VERIFIED_LEVELS` by `tests/test_families.py`, which runs over the same families;
    `tests/test_support_table.py` fails when the README and this table disagree.
    """
    from .embedded import FAMILIES, tiny_config

    rows = [
        "| family | `model_type` | what it exercises | prompt state per layer (tiny config) | verified (ladder) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for family, (model_type, _, exercises) in FAMILIES.items():
        layers = []
        for plan in check_supported(tiny_config(family)):
            kinds = " + ".join(kind.name for kind, _ in plan.kinds)
            if layers and layers[-1][0] == kinds:
                layers[-1][1] += 1
            else:
                layers.append([kinds, 1])
        summary = ", ".join(f"{count} x {kinds}" for kinds, count in layers)
        rows.append(f"| {family} | `{model_type}` | {exercises} | {summary} | {VERIFIED_LEVELS} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(support_table())


def uses_rope(config: PretrainedConfig) -> bool:
    """Whether the model rotates its queries and keys (`rope_parameters`), which YaRN's scaling extends; a model
    without them numbers its positions by learned embeddings (OPT, GPT-2) or none."""
    return bool(getattr(config.get_text_config(), "rope_parameters", None))


def yarn_original(config: PretrainedConfig) -> tuple[int, dict]:
    """The context YaRN scales a model from (`max_position_embeddings`, or the original of a model already scaled by
    YaRN) and the model's own `rope_parameters` (none for per-layer-type ones, which are not extended here)."""
    text = config.get_text_config()
    own = getattr(text, "rope_parameters", None) or {}
    own = {} if any(isinstance(value, dict) for value in own.values()) else own
    if own.get("rope_type") == "yarn" and own.get("original_max_position_embeddings"):
        return own["original_max_position_embeddings"], own
    return text.max_position_embeddings, own


def yarn_extension(config: PretrainedConfig, positions: int) -> tuple[float, dict]:
    """YaRN's RoPE scaling that takes a model to at least `positions` positions: the factor (a whole number) over its
    original context (`yarn_original`) and the `rope_parameters` to load it with (the model's own, made YaRN)."""
    original, own = yarn_original(config)
    factor = float(-(-positions // original))
    return factor, {**own, "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}


def with_yarn(config: PretrainedConfig, factor: float) -> PretrainedConfig:
    """`config` with YaRN's RoPE scaling by `factor` over its original context (what `--rope-scaling yarn:F` plans,
    and what `model_init_kwargs` of `rope_parameters` and `max_position_embeddings` load)."""
    if not uses_rope(config):
        raise ValueError(
            f"model_type={config.model_type!r} has no RoPE (its positions are learned embeddings): YaRN's scaling does "
            "not apply to it."
        )
    original, own = yarn_original(config)
    text = config.get_text_config()
    text.rope_parameters = {
        **own,
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": original,
    }
    text.max_position_embeddings = int(factor * original)
    return config
