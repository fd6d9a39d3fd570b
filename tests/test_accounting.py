"""State accounting from the registry agrees with what a capture actually keeps, for every family, and with the
paper's figures for GLM-5 and Qwen3.6-27B."""

import json

import pytest
from transformers import AutoConfig

from trl_longstraw.accounting import prompt_state_account, stock_activation_bytes
from trl_longstraw.architectures import UnsupportedModelError
from trl_longstraw.embedded import FAMILIES, build_model, tiny_config
from trl_longstraw.engine import LongStrawEngine

from .test_engine import case, prepared


def architecture(name):
    kwargs = json.load(open(f"configs/architectures/{name}.json"))
    return AutoConfig.for_model(**{k: v for k, v in kwargs.items() if not k.startswith("_")})


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("prompt_gradient", ["detach", "exact"])
def test_accounting_matches_a_captured_state(family, prompt_gradient):
    model = prepared(build_model(family))
    prompt, _, _ = case(prompt_length=45)
    engine = LongStrawEngine(64, 16, prompt_gradient=prompt_gradient)  # one capture chunk: one exact-mode boundary
    state = engine.capture(model, prompt, first_position=0)
    account = prompt_state_account(model.config, dtype_bytes=4, exact=prompt_gradient == "exact")
    assert account.bytes(44) == state.nbytes()


def test_glm5_keeps_576_latent_values_per_token_per_layer():
    account = prompt_state_account(architecture("glm5"), dtype_bytes=2)
    assert account.by_layer_type["mla_latent"].per_token == 576 * 2
    assert account.by_layer_type["mla_latent"].layers == 78
    assert account.by_layer_type["dsa_indexer_keys"].layers == 21


def test_state_is_far_below_stock_at_long_prompts():
    config = architecture("qwen3_6_27b")
    account = prompt_state_account(config)
    assert account.by_layer_type["gated_deltanet"].per_token == 0  # GatedDeltaNet state does not grow with P
    assert account.bytes(2_097_152) * 50 < stock_activation_bytes(config, 2_097_152, 8192, group_size=8)


def test_a_config_the_engine_refuses_is_refused_by_the_accounting():
    config = tiny_config("qwen3")
    config.layer_types = ["full_attention", "linear_attention"]  # a layer type its modules do not have
    with pytest.raises(UnsupportedModelError, match="Layer 1 .*layer type 'linear_attention'"):
        prompt_state_account(config)
