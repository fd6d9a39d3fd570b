"""The embedded default: a character-level tokenizer and tiny random-weight decoders built in code.

Used by `make demo` and by the tests, so nothing is downloaded: the tokenizer is a `tokenizers` WordLevel model over
single characters with a chat template, and models are built from configs with random weights.
"""

from __future__ import annotations

import string
from importlib.resources import files

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

PAD, EOS = "<pad>", "<eos>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _characters(vocab: dict[str, int]) -> Tokenizer:
    for char in string.printable:
        vocab.setdefault(char, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=" "))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus `<pad>` and `<eos>`, with a minimal chat template."""
    fast = PreTrainedTokenizerFast(tokenizer_object=_characters({PAD: 0, EOS: 1}), pad_token=PAD, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Tool calling: GRPOTrainer's tool loop needs a chat template it can parse tool calls from and a model that emits them.
TOOL_CALL = '\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'  # between <tool_call> and </tool_call>
_CHAT_MARKERS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def build_tool_calling_tokenizer(tool_call: str = TOOL_CALL) -> PreTrainedTokenizerFast:
    """The character-level tokenizer with TRL's copy of the Qwen2.5 chat template (whose tool calls TRL knows how to
    parse), its markers as special tokens (`<|im_end|>` ends a turn) and one whole tool call (`tool_call`, the JSON
    between `<tool_call>` and `</tool_call>`; by default a call of [`add`]) as one token."""
    tokenizer = _characters({PAD: 0})
    tokenizer.add_special_tokens([AddedToken(marker, special=True, normalized=False) for marker in _CHAT_MARKERS])
    tokenizer.add_tokens([AddedToken(tool_call, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token="<|im_end|>")
    fast.chat_template = (files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    return fast


def build_tool_calling_model(
    tokenizer: PreTrainedTokenizerFast,
    family: str = "qwen3",
    seed: int = 0,
    call_logit: float = 6.0,
    tool_call: str = TOOL_CALL,
    **overrides,
) -> torch.nn.Module:
    """A tiny random-weight model of `family` that makes `tool_call` (by default a call of [`add`]; the tokenizer's
    from `build_tool_calling_tokenizer(tool_call)`) the way a tool-calling model does: at the start of an assistant
    turn (after `<|im_start|>assistant\\n`) it opens a tool call (with probability 0.18 for Qwen3's default
    `call_logit`), and once open completes it (`tool_call`, `</tool_call>`, `<|im_end|>`) almost surely; other tokens
    follow at random.

    The embeddings are one-hot (hidden size above the vocabulary) and the LM head is a next-token table on them: the
    residual stream carries the current token, which the random layers (`initializer_range` 0.04) perturb by what
    came before it (up to ~0.2 in a next-token log-prob), so that decoding from a wrong history changes samples.
    """
    torch.manual_seed(seed)
    vocab_size = len(tokenizer)
    hidden = 128
    config = tiny_config(
        family,
        vocab_size=vocab_size,
        hidden_size=hidden,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
        **{"initializer_range": 0.04, **overrides},
    )
    model = AutoModelForCausalLM.from_config(config)
    next_token = {
        "\n": ("<tool_call>", call_logit),
        "<tool_call>": (tool_call, 30.0),
        tool_call: ("</tool_call>", 30.0),
        "</tool_call>": ("<|im_end|>", 30.0),
    }
    head = torch.zeros(vocab_size, hidden)
    for current, (following, logit) in next_token.items():
        head[tokenizer.convert_tokens_to_ids(following), tokenizer.convert_tokens_to_ids(current)] = logit
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(torch.eye(vocab_size, hidden))
        model.get_output_embeddings().weight.copy_(head / hidden**0.5)  # the final norm scales a one-hot by sqrt(h)
    return model


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
    "opt": (
        "opt",
        {
            "num_key_value_heads": 4,  # multi-head attention
            "ffn_dim": 128,
            "word_embed_proj_dim": 64,
            "dropout": 0.0,
            "max_position_embeddings": 2048,
        },
        "learned absolute positions, counted from the attention mask",
    ),
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
