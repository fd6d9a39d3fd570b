"""The embedded default: a character-level tokenizer and tiny random-weight decoders built in code.

Used by `make demo` and by the tests, so nothing is downloaded: the tokenizer is a `tokenizers` WordLevel model over
single characters with a chat template, and models are built from configs with random weights.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GlmMoeDsaConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen3_5TextConfig,
    Qwen3Config,
)

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


def tiny_config(model_type: str = "qwen3", vocab_size: int = 102, **overrides):
    """A few-layer decoder config for random weights: GQA `qwen3`/`llama`, or a `qwen3_5` GatedDeltaNet hybrid."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32768,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    if model_type == "qwen3":
        return Qwen3Config(**{**common, **overrides})
    if model_type == "llama":
        return LlamaConfig(**{**common, **overrides})
    if model_type == "qwen3_5":
        # The paper's hybrid in miniature: GatedDeltaNet layers with a full-attention layer every 4th (the last).
        hybrid = dict(
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
        )
        return Qwen3_5TextConfig(**{**common, **hybrid, **overrides})
    if model_type == "glm_moe_dsa":
        # GLM-5 in miniature: MLA (latent 16 + rope 8 per token), a DSA indexer on layers 0 and 2 with IndexShare on
        # layer 1, one dense then MoE FFNs.
        glm = dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            index_topk=64,
            index_n_heads=4,
            index_head_dim=16,
            indexer_types=["full", "shared", "full"],
            first_k_dense_replace=1,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
        )
        common.pop("head_dim")
        return GlmMoeDsaConfig(**{**common, **glm, **overrides})
    raise ValueError(
        f"model_type={model_type!r}: the embedded configs are 'qwen3', 'llama', 'qwen3_5' and 'glm_moe_dsa'"
    )


def build_model(model_type: str = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random-weight causal LM (deterministic for a given seed)."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)
