"""Which models the LongStraw engine can drive, checked from the config before any expensive work."""

from __future__ import annotations

from transformers import PretrainedConfig

# Decoders whose every token mixer is softmax attention routed through transformers' AttentionInterface with
# standard GQA shapes, no logit soft-capping and no attention sinks.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """The model's architecture or one of its layer types has no LongStraw prompt state."""


def check_supported(config: PretrainedConfig) -> None:
    """Raise `UnsupportedModelError` naming what is unsupported and what is, or return silently."""
    text_config = config.get_text_config()
    model_type = text_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"LongStrawGRPOTrainer has no prompt state for model_type={model_type!r}. Supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (layer types: {', '.join(SUPPORTED_LAYER_TYPES)})."
        )
    for index, layer_type in enumerate(getattr(text_config, "layer_types", None) or []):
        if layer_type not in SUPPORTED_LAYER_TYPES:
            raise UnsupportedModelError(
                f"Layer {index} of this {model_type} model is a {layer_type!r} layer, which LongStraw cannot capture. "
                f"Supported layer types: {', '.join(SUPPORTED_LAYER_TYPES)}."
            )
    if getattr(text_config, "attention_dropout", 0.0):
        raise UnsupportedModelError(
            f"The model config sets attention_dropout={text_config.attention_dropout}: the replay must reproduce "
            "the scoring pass exactly, so set attention_dropout=0.0 in the model config."
        )
