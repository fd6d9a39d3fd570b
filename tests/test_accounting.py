"""State accounting from a config agrees with what a capture actually keeps, and with the paper's GLM-5 figure."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig

from trl_longstraw.accounting import prompt_state_account, stock_activation_bytes
from trl_longstraw.embedded import build_model
from trl_longstraw.engine import LongStrawEngine

from .test_engine import MISTRAL_SLIDING, case, prepared


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5", "mistral-sliding"])
def test_accounting_matches_a_captured_state(model_type):
    if model_type == "mistral-sliding":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(MistralConfig(**MISTRAL_SLIDING))
    else:
        model = build_model(model_type)
    prompt, _, _ = case(prompt_length=45)
    state = LongStrawEngine(16, 16).capture(prepared(model), prompt, first_position=0)
    assert prompt_state_account(model.config, dtype_bytes=4).bytes(44) == state.nbytes()


def test_glm5_keeps_576_latent_values_per_token_per_layer():
    kwargs = json.load(open("configs/architectures/glm5.json"))
    config = AutoConfig.for_model(**{k: v for k, v in kwargs.items() if not k.startswith("_")})
    account = prompt_state_account(config, dtype_bytes=2)
    assert account.by_layer_type["mla_latent"].per_token == 576 * 2
    assert account.by_layer_type["mla_latent"].layers == 78
    assert account.by_layer_type["dsa_indexer_keys"].layers == 21


def test_state_is_far_below_stock_at_long_prompts():
    kwargs = json.load(open("configs/architectures/qwen3_6_27b.json"))
    config = AutoConfig.for_model(**{k: v for k, v in kwargs.items() if not k.startswith("_")})
    account = prompt_state_account(config)
    assert account.by_layer_type["linear_attention"].per_token == 0  # GatedDeltaNet state does not grow with P
    assert account.bytes(2_097_152) * 50 < stock_activation_bytes(config, 2_097_152, 8192, group_size=8)


def test_unknown_layer_type_is_refused():
    config = build_model("qwen3").config
    config.layer_types = ["full_attention", "mamba"]
    with pytest.raises(ValueError, match="layer 1: no prompt-state accounting for layer type 'mamba'"):
        prompt_state_account(config)
