"""Prompt-state bytes from a model config, asked of each state kind, next to what stock GRPO keeps for backward.

Each registered state kind accounts for itself (`LayerState.account`): bytes per captured prompt token, per fp8 page
and fixed bytes, from the layer's own module. The account of a config is built on its meta-device skeleton through
the same layer plan the engine captures with, so it covers exactly the models the engine accepts:

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

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from torch import nn
from transformers import PretrainedConfig

from ..architectures import check_supported, shared_skeleton
from ..state.registry import LayerAccount, LayerPlan


def skeleton_of(model_or_config: nn.Module | PretrainedConfig, trust_remote_code: bool = False) -> nn.Module:
    """The meta-device skeleton of a config (`shared_skeleton`: read only), or the model given."""
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    return shared_skeleton(model_or_config, trust_remote_code=trust_remote_code)


def layer_accounts(
    plans: list[LayerPlan], config: PretrainedConfig, dtype_bytes: int, exact: bool, fp8_pages: bool = False
) -> list[LayerAccount]:
    """Every kind's account of every layer, in layer order, leaving out the kinds that keep nothing; each says how
    context parallelism holds it (`LayerState.under_context_parallelism`)."""
    parts = []
    for plan in plans:
        for kind, mixer in plan.kinds:
            part = kind.account(mixer, config, plan.layer_type, dtype_bytes, exact, fp8_pages)
            if part is not None:
                role = kind.under_context_parallelism(plan.layer_type, part)
                parts.append(dataclasses.replace(part, under_context_parallelism=role))
    return parts


@dataclass
class LayerTypeAccount:
    """`layers` layers of one kind and geometry, each keeping `part`'s bytes."""

    layers: int
    part: LayerAccount
    chunk_size: int | None = None  # the capture chunk (`prefill_chunk_size`), for kinds kept once per chunk

    @property
    def per_token(self) -> int:
        return self.part.per_token

    @property
    def fixed(self) -> int:
        return self.part.fixed

    def bytes(self, num_tokens: int) -> int:
        return self.layers * self.part.bytes(num_tokens, self.chunk_size)


@dataclass
class StateAccount:
    """The durable prompt state of one group for a config, by state label (`full_attention`, `mla_latent`, ...)."""

    by_layer_type: dict[str, LayerTypeAccount] = field(default_factory=dict)
    chunk_size: int | None = None

    def add(self, part: LayerAccount) -> None:
        label = part.label
        account = self.by_layer_type.setdefault(label, LayerTypeAccount(0, part, self.chunk_size))
        if account.part != part:  # same label, other geometry: keep both apart
            label = f"{label} ({part.per_token} B/token, {part.fixed} B)"
            account = self.by_layer_type.setdefault(label, LayerTypeAccount(0, part, self.chunk_size))
        account.layers += 1

    def bytes(self, num_tokens: int) -> int:
        return sum(account.bytes(num_tokens) for account in self.by_layer_type.values())

    def bytes_per_token(self) -> int:
        return sum(account.layers * account.per_token for account in self.by_layer_type.values())


def prompt_state_account(
    config: PretrainedConfig,
    dtype_bytes: int = 2,
    exact: bool = False,
    trust_remote_code: bool = False,
    prefill_chunk_size: int | None = None,
) -> StateAccount:
    """What LongStraw keeps for `config` (any config the engine accepts), in bytes, by state kind.

    `dtype_bytes` is the model's activation dtype (2 for bf16); recurrent states (GatedDeltaNet, Mamba2) are kept
    in fp32. `exact=True` accounts windowed layers at full length and the recurrent states at every capture chunk's
    boundary (the exact prompt gradient needs every entry), with chunks of `prefill_chunk_size` tokens (None: the
    prompt in one chunk). Raises `UnsupportedModelError` for a config the engine refuses.
    """
    plans = check_supported(config, trust_remote_code=trust_remote_code)
    account = StateAccount(chunk_size=prefill_chunk_size)
    for part in layer_accounts(plans, config.get_text_config(), dtype_bytes, exact):
        account.add(part)
    return account


def stock_activation_bytes(
    config: PretrainedConfig, prompt_tokens: int, completion_tokens: int, group_size: int, dtype_bytes: int = 2
) -> int:
    """Lower bound of what stock GRPO keeps for backward: checkpointed layer inputs of every member's sequence."""
    config = config.get_text_config()
    tokens = group_size * (prompt_tokens + completion_tokens)
    return config.num_hidden_layers * tokens * config.hidden_size * dtype_bytes


def prompt_state_bytes(
    config: PretrainedConfig | nn.Module,
    num_tokens: int,
    dtype_bytes: int = 2,
    state_dtype: Literal["auto", "float8_e4m3fn"] = "auto",
    exact: bool = False,
    trust_remote_code: bool = False,
    prefill_chunk_size: int | None = None,
) -> dict[str, int]:
    """Bytes of one captured state of `num_tokens` prompt tokens, by state label, as the capture allocates them
    (`exact`, `prefill_chunk_size`: as `prompt_state_account`).

    `state_dtype="float8_e4m3fn"` (detach mode only, as the engine): each kind's fp8 pages where it keeps them so
    (K/V pages of full-attention layers with per-(page, kv head) fp32 scales, MLA latent pages with one scale per
    page); windowed layers keep their few entries, recurrent states stay fp32, DSA indexer keys stay in the model
    dtype (they decide a discrete selection).
    """
    if exact and state_dtype != "auto":
        raise ValueError("fp8 prompt-state pages are detach mode only: the exact gradient needs full-width leaves")
    skeleton = skeleton_of(config, trust_remote_code)
    plans = check_supported(skeleton)
    fp8_pages = state_dtype == "float8_e4m3fn"
    by_label: dict[str, int] = {}
    for part in layer_accounts(plans, skeleton.config.get_text_config(), dtype_bytes, exact, fp8_pages):
        by_label[part.label] = by_label.get(part.label, 0) + part.bytes(num_tokens, prefill_chunk_size)
    return by_label


def under_context_parallelism(config: PretrainedConfig | nn.Module, trust_remote_code: bool = False) -> dict[str, str]:
    """How context parallelism holds each state label of `config` ("split", "replicated" or "refused"), as its state
    kinds answer (`LayerState.under_context_parallelism`); a label two answers share is as held as its most
    constrained layer ("refused" over "replicated" over "split")."""
    skeleton = skeleton_of(config, trust_remote_code)
    order = ("split", "replicated", "refused")
    roles: dict[str, str] = {}
    for part in layer_accounts(check_supported(skeleton), skeleton.config.get_text_config(), 2, exact=False):
        role = part.under_context_parallelism
        roles[part.label] = max(roles.get(part.label, role), role, key=order.index)
    return roles
