"""Which models the LongStraw engine can drive, checked from the config before any expensive work."""

from __future__ import annotations

from transformers import PretrainedConfig

# Decoders whose token mixers LongStraw has a prompt state for, with the layer types each may use. Softmax attention
# must go through transformers' AttentionInterface with standard GQA shapes (no logit soft-capping, no sinks);
# GatedDeltaNet layers go through the Cache API (`get/update_conv_state`, `get/update_recurrent_state`); MLA/DSA
# layers (`glm_moe_dsa`) cache their latent through `Cache.update` and their indexer keys through `update_indexer`.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_LAYER_TYPES = {
    "llama": ATTENTION_LAYER_TYPES,
    "mistral": ATTENTION_LAYER_TYPES,
    "qwen2": ATTENTION_LAYER_TYPES,
    "qwen3": ATTENTION_LAYER_TYPES,
    "qwen3_5_text": ("full_attention", "linear_attention"),
    "glm_moe_dsa": ("indexed_attention",),
}
SUPPORTED_MODEL_TYPES = tuple(SUPPORTED_LAYER_TYPES)


class UnsupportedModelError(ValueError):
    """The model's architecture or one of its layer types has no LongStraw prompt state."""


def check_supported(config: PretrainedConfig) -> None:
    """Raise `UnsupportedModelError` naming what is unsupported and what is, or return silently."""
    text_config = config.get_text_config()
    model_type = text_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"LongStrawGRPOTrainer has no prompt state for model_type={model_type!r}. Supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    for index, layer_type in enumerate(getattr(text_config, "layer_types", None) or []):
        if layer_type not in SUPPORTED_LAYER_TYPES[model_type]:
            raise UnsupportedModelError(
                f"Layer {index} of this {model_type} model is a {layer_type!r} layer, which LongStraw cannot capture. "
                f"Supported layer types for {model_type}: {', '.join(SUPPORTED_LAYER_TYPES[model_type])}."
            )
    if getattr(text_config, "attention_dropout", 0.0):
        raise UnsupportedModelError(
            f"The model config sets attention_dropout={text_config.attention_dropout}: the replay must reproduce "
            "the scoring pass exactly, so set attention_dropout=0.0 in the model config."
        )
