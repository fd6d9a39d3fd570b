"""Model presets for the update benchmarks: name -> Hub-style config kwargs (random weights, built in code).

Add a preset with one entry in `PRESETS`. A preset (or a `--model-config` JSON/YAML file) is a dict of config kwargs
with a `model_type`, exactly what `AutoConfig.for_model(model_type, **kwargs)` takes. A mode that cannot run a model
(LongStraw refusing an architecture, Prefix Grouper on non-attention token mixers) records `unsupported` with the
reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The embedded char tokenizer (`trl_longstraw.embedded.build_tokenizer`) has 102 tokens: <pad>=0, <eos>=1.
EMBEDDED_VOCAB = 102

PRESETS: dict[str, dict[str, Any]] = {
    # The CPU benchmarks' model (README's headline table): a 4-layer, hidden-256 Qwen3 (8 query / 4 kv heads of 32),
    # sized for a 2-core CPU.
    # intermediate_size 768 = 3x hidden (Qwen3's own ratio, e.g. 4096 -> 12288 for Qwen3-8B).
    "dense-tiny": {
        "model_type": "qwen3",
        "vocab_size": EMBEDDED_VOCAB,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": None,
        "attention_dropout": 0.0,
    },
    # A GatedDeltaNet hybrid at the dense preset's width: 3 GatedDeltaNet layers + 1 full-attention layer (the
    # qwen3_5 layout in miniature; trl_longstraw.embedded.tiny_config("qwen3_5") is the same shape at hidden 64).
    "hybrid-gdn-tiny": {
        "model_type": "qwen3_5_text",
        "vocab_size": EMBEDDED_VOCAB,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": None,
        "attention_dropout": 0.0,
    },
    # The test suite's 2-layer hidden-64 Qwen3 (trl_longstraw.embedded.tiny_config): for smoke runs of the harness.
    # GPU scale: the Qwen3.5/3.6-27B layer geometry at its real width (hidden 5120, 24/4 heads of 256, GatedDeltaNet
    # 16/48 heads of 128, FFN 17408) with 4 layers (3 GatedDeltaNet + 1 full attention) and the embedded tokenizer's
    # vocabulary, for benchmarks/gpu_check.sh on a lent H200 in bf16 (about 1.3B parameters).
    "hybrid-qwen35-gpu": {
        "model_type": "qwen3_5_text",
        "vocab_size": EMBEDDED_VOCAB,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": None,
        "attention_dropout": 0.0,
    },
    "dense-micro": {
        "model_type": "qwen3",
        "vocab_size": EMBEDDED_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": None,
    },
}


def load_config_kwargs(preset: str | None = None, config_path: str | None = None) -> tuple[str, dict[str, Any]]:
    """`(name, kwargs)` of a preset or of a JSON/YAML file of config kwargs (which must name its `model_type`)."""
    if config_path:
        path = Path(config_path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            kwargs = yaml.safe_load(text)
        else:
            kwargs = json.loads(text)
        if not isinstance(kwargs, dict) or "model_type" not in kwargs:
            raise ValueError(f"{config_path}: expected a mapping of config kwargs with a 'model_type' key")
        return path.stem, dict(kwargs)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {sorted(PRESETS)}")
    return preset, dict(PRESETS[preset])


def build_config(kwargs: dict[str, Any], min_positions: int | None = None):
    """A transformers config from kwargs; `max_position_embeddings` raised to `min_positions` if it is lower."""
    from transformers import AutoConfig

    kwargs = dict(kwargs)
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    raised = None
    text_config = config.get_text_config()
    current = getattr(text_config, "max_position_embeddings", None)
    if min_positions is not None and current is not None and current < min_positions:
        text_config.max_position_embeddings = min_positions
        raised = (current, min_positions)
    return config, raised


def build_model(kwargs: dict[str, Any], min_positions: int | None = None, dtype: str = "float32", seed: int = 0):
    """`(config, model)`: the config of `build_config` and a model with random weights from `seed`, in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    config, _ = build_config(kwargs, min_positions=min_positions)
    torch.manual_seed(seed)
    return config, AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
