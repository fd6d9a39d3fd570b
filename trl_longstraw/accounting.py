"""Durable prompt-state bytes from a model config, per layer type, next to what stock GRPO keeps for backward.

The state LongStraw keeps per layer (DESIGN.md's table):

| layer type | kept | grows with P |
| --- | --- | --- |
| full attention (GQA/MQA) | K and V, `2 * kv_heads * head_dim` per token | yes |
| sliding-window attention | the last `window - 1` K/V | no |
| GatedDeltaNet | recurrent `[v_heads, k_dim, v_dim]` (fp32) + conv `[conv_dim, kernel - 1]` | no |
| MLA | latent `kv_lora_rank` + rope key `qk_rope_head_dim` per token | yes |
| DSA indexer (index-computing layers) | indexer key `index_head_dim` per token | yes |

Stock GRPO's lower bound is what autograd must keep with activation checkpointing at every layer boundary: one
hidden state per layer per token per member, `layers * G * (P + R) * hidden` values (without checkpointing it is
several times more). These are computed, not measured: the measured peaks are the telemetry's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PretrainedConfig

FP32_BYTES = 4


@dataclass
class LayerTypeAccount:
    """Bytes one layer of a type keeps: `per_token` for each prompt token, plus `fixed` whatever the length."""

    layers: int = 0
    per_token: int = 0
    fixed: int = 0

    def bytes(self, num_tokens: int) -> int:
        return self.layers * (self.per_token * num_tokens + self.fixed)


@dataclass
class StateAccount:
    """The durable prompt state of one group for a config, by layer type."""

    by_layer_type: dict[str, LayerTypeAccount] = field(default_factory=dict)

    def add(self, layer_type: str, per_token: int = 0, fixed: int = 0) -> None:
        account = self.by_layer_type.setdefault(layer_type, LayerTypeAccount(0, per_token, fixed))
        account.layers += 1

    def bytes(self, num_tokens: int) -> int:
        return sum(account.bytes(num_tokens) for account in self.by_layer_type.values())

    def bytes_per_token(self) -> int:
        return sum(account.layers * account.per_token for account in self.by_layer_type.values())


def _layer_types(config: PretrainedConfig) -> list[str]:
    if config.model_type in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        return ["mla"] * config.num_hidden_layers
    if getattr(config, "layer_types", None):
        return list(config.layer_types)
    # Configs without layer types (Mistral) apply their sliding window, if any, to every layer.
    uniform = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return [uniform] * config.num_hidden_layers


def prompt_state_account(config: PretrainedConfig, dtype_bytes: int = 2, exact: bool = False) -> StateAccount:
    """What LongStraw keeps per layer type for `config` (any supported or planned family), in bytes.

    `dtype_bytes` is the model's activation dtype (2 for bf16); GatedDeltaNet recurrent states are kept in fp32.
    `exact=True` accounts sliding-window layers at full length (the exact prompt gradient needs every entry).
    """
    config = config.get_text_config()
    account = StateAccount()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_key_value_heads * head_dim * dtype_bytes
    indexer_types = getattr(config, "indexer_types", None)
    for index, layer_type in enumerate(_layer_types(config)):
        if layer_type == "full_attention" or (layer_type == "sliding_attention" and exact):
            account.add("full_attention", per_token=kv_per_token)
        elif layer_type == "sliding_attention":
            account.add("sliding_attention", fixed=kv_per_token * (config.sliding_window - 1))
        elif layer_type == "linear_attention":
            key_dim = config.linear_num_key_heads * config.linear_key_head_dim
            value_dim = config.linear_num_value_heads * config.linear_value_head_dim
            recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
            conv = (2 * key_dim + value_dim) * (config.linear_conv_kernel_dim - 1)
            account.add("linear_attention", fixed=recurrent * FP32_BYTES + conv * dtype_bytes)
        elif layer_type == "mla":
            account.add("mla_latent", per_token=(config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes)
            if indexer_types is not None and indexer_types[index] == "full":
                account.add("dsa_indexer_keys", per_token=config.index_head_dim * dtype_bytes)
        else:
            raise ValueError(f"layer {index}: no prompt-state accounting for layer type {layer_type!r}")
    return account


def stock_activation_bytes(
    config: PretrainedConfig, prompt_tokens: int, completion_tokens: int, group_size: int, dtype_bytes: int = 2
) -> int:
    """Lower bound of what stock GRPO keeps for backward: checkpointed layer inputs of every member's sequence."""
    config = config.get_text_config()
    tokens = group_size * (prompt_tokens + completion_tokens)
    return config.num_hidden_layers * tokens * config.hidden_size * dtype_bytes
