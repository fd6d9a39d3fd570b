"""The embedded default: a character-level tokenizer and tiny random-weight decoders built in code.

Used by `make demo` and by the tests, so nothing is downloaded: the tokenizer is a `tokenizers` WordLevel model over
single characters with a chat template, and models are built from configs with random weights.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

PAD, EOS = "<pad>", "<eos>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus `<pad>` and `<eos>`, with a minimal chat template."""
    vocab = {PAD: 0, EOS: 1}
    for char in string.printable:
        vocab.setdefault(char, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=" "))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Tiny configs per family (random weights; attention dropout 0 everywhere). MoE families set their
# `router_aux_loss_coef` to 0, so that a family's parity tests check its routing alone; the tests of the
# load-balancing loss turn it on through GRPOConfig's `router_aux_loss_coef`.
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "router_aux_loss_coef": 0.0}
_GATED_DELTANET = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
_MLA = {
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "head_dim": None,
    "first_k_dense_replace": 1,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
}
_DSA = {"index_topk": 64, "index_n_heads": 4, "index_head_dim": 16}

# family name -> (transformers model_type, overrides of the common tiny shape, what the family exercises)
FAMILIES: dict[str, tuple[str, dict, str]] = {
    "qwen3": ("qwen3", {}, "GQA, QK-norm"),
    "llama": ("llama", {}, "GQA"),
    "mistral": ("mistral", {"num_key_value_heads": 1, "sliding_window": 6}, "MQA, sliding window on every layer"),
    "qwen3_moe": ("qwen3_moe", _MOE, "GQA + MoE"),
    "mixtral": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0, "sliding_window": None},
        "GQA + MoE",
    ),
    "phi3": ("phi3", {"pad_token_id": 0}, "fused QKV projection"),
    "olmo3": (
        "olmo3",
        {"sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
        "sliding + full layers, QK-norm",
    ),
    "gemma3_text": (
        "gemma3_text",
        {
            "num_hidden_layers": 3,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 16,
        },
        "sliding + global layers, per-type RoPE",
    ),
    "gemma2": (
        "gemma2",
        {
            "sliding_window": 6,
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
        "attention logit soft-capping, sliding + global",
    ),
    "gpt_oss": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.0,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": 131072,  # what its default YaRN scaling (32x of 4096) implies
        },
        "attention sinks, alternating sliding window, MoE",
    ),
    "qwen3_5": (
        "qwen3_5_text",
        dict(num_hidden_layers=4, **_GATED_DELTANET),
        "3 GatedDeltaNet + 1 full attention (the paper's hybrid)",
    ),
    "qwen3_5_moe": (
        "qwen3_5_moe_text",
        dict(num_hidden_layers=4, **_GATED_DELTANET, **_MOE, shared_expert_intermediate_size=32),
        "GatedDeltaNet hybrid + MoE",
    ),
    "qwen3_next": (
        "qwen3_next",
        dict(
            num_hidden_layers=4,
            **_GATED_DELTANET,
            **_MOE,
            shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        ),
        "GatedDeltaNet + gated attention + MoE",
    ),
    "nemotron_h": (
        "nemotron_h",
        {
            "num_hidden_layers": 4,
            "layers_block_type": ["mamba", "attention", "mamba", "moe"],
            "ssm_state_size": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "conv_kernel": 4,
            "expand": 1,
            "chunk_size": 8,
            "n_routed_experts": 4,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
            "num_experts_per_tok": 2,
        },
        "Mamba2 + attention + MoE blocks",
    ),
    "deepseek_v3": ("deepseek_v3", dict(num_hidden_layers=3, **_MLA), "MLA + MoE"),
    "deepseek_v32": ("deepseek_v32", dict(num_hidden_layers=3, **_MLA, **_DSA), "MLA + DSA + MoE"),
    "glm_moe_dsa": (
        "glm_moe_dsa",
        dict(num_hidden_layers=3, **_MLA, **_DSA, indexer_types=["full", "shared", "full"]),
        "MLA + DSA with IndexShare + MoE (GLM-5)",
    ),
}


def tiny_config(family: str = "qwen3", vocab_size: int = 102, **overrides):
    """A few-layer config of `family` (a key of `FAMILIES`) for random weights, hidden size 64."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: the embedded configs are {', '.join(FAMILIES)}")
    model_type, family_overrides, _ = FAMILIES[family]
    common = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 32768,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    }
    kwargs = {**common, **family_overrides, **overrides}
    if kwargs.get("head_dim", 0) is None:
        del kwargs["head_dim"]
    return AutoConfig.for_model(model_type, **kwargs)


def build_model(family: str = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random-weight causal LM of `family` (deterministic for a given seed)."""
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)
