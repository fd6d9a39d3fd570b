"""Durable prompt-state bytes from a model config, per state kind, next to what stock GRPO keeps for backward.

Each registered state kind accounts for itself (`LayerState.account`): bytes per captured prompt token and fixed
bytes, from the layer's own module. The account of a config is built on its meta-device skeleton through the same
layer plan the engine captures with, so it covers exactly the models the engine accepts:

| kind | kept | grows with P |
| --- | --- | --- |
| full attention (GQA/MQA) | K and V, `2 * kv_heads * head_dim` per token | yes |
| sliding-window / chunked attention | the last `window - 1` K/V / the current chunk | no |
| GatedDeltaNet | recurrent `[v_heads, k_dim, v_dim]` (fp32) + conv `[conv_dim, kernel - 1]` | no |
| Mamba2 | SSM `[heads, head_dim, state_size]` (fp32) + conv `[conv_dim, kernel - 1]` | no |
| MLA | latent `kv_lora_rank` + rope key `qk_rope_head_dim` per token | yes |
| DSA indexer (index-computing layers) | indexer key `index_head_dim` per token | yes |

Stock GRPO's lower bound is what autograd must keep with activation checkpointing at every layer boundary: one
hidden state per layer per token per member, `layers * G * (P + R) * hidden` values (without checkpointing it is
several times more). These are computed, not measured: the measured peaks are the telemetry's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PretrainedConfig

from .architectures import check_supported


@dataclass
class LayerTypeAccount:
    """Bytes one layer of a kind keeps: `per_token` for each prompt token, plus `fixed` whatever the length."""

    layers: int = 0
    per_token: int = 0
    fixed: int = 0

    def bytes(self, num_tokens: int) -> int:
        return self.layers * (self.per_token * num_tokens + self.fixed)


@dataclass
class StateAccount:
    """The durable prompt state of one group for a config, by state label (`full_attention`, `mla_latent`, ...)."""

    by_layer_type: dict[str, LayerTypeAccount] = field(default_factory=dict)

    def add(self, label: str, per_token: int = 0, fixed: int = 0) -> None:
        account = self.by_layer_type.setdefault(label, LayerTypeAccount(0, per_token, fixed))
        if (account.per_token, account.fixed) != (per_token, fixed):  # same label, other geometry: keep both apart
            label = f"{label} ({per_token} B/token, {fixed} B)"
            account = self.by_layer_type.setdefault(label, LayerTypeAccount(0, per_token, fixed))
        account.layers += 1

    def bytes(self, num_tokens: int) -> int:
        return sum(account.bytes(num_tokens) for account in self.by_layer_type.values())

    def bytes_per_token(self) -> int:
        return sum(account.layers * account.per_token for account in self.by_layer_type.values())


def prompt_state_account(
    config: PretrainedConfig, dtype_bytes: int = 2, exact: bool = False, trust_remote_code: bool = False
) -> StateAccount:
    """What LongStraw keeps for `config` (any config the engine accepts), in bytes, by state kind.

    `dtype_bytes` is the model's activation dtype (2 for bf16); recurrent states (GatedDeltaNet, Mamba2) are kept
    in fp32. `exact=True` accounts windowed layers at full length (the exact prompt gradient needs every entry).
    Raises `UnsupportedModelError` for a config the engine refuses.
    """
    plans = check_supported(config, trust_remote_code=trust_remote_code)
    text_config = config.get_text_config()
    account = StateAccount()
    for plan in plans:
        for kind, mixer in plan.kinds:
            part = kind.account(mixer, text_config, plan.layer_type, dtype_bytes, exact)
            if part.label != "feed_forward":
                account.add(part.label, part.per_token, part.fixed)
    return account


def stock_activation_bytes(
    config: PretrainedConfig, prompt_tokens: int, completion_tokens: int, group_size: int, dtype_bytes: int = 2
) -> int:
    """Lower bound of what stock GRPO keeps for backward: checkpointed layer inputs of every member's sequence."""
    config = config.get_text_config()
    tokens = group_size * (prompt_tokens + completion_tokens)
    return config.num_hidden_layers * tokens * config.hidden_size * dtype_bytes
