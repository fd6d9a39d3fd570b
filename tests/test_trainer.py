"""Loss and gradient fidelity of `replay_and_backward` against stock `GRPOTrainer` (docs/design.md ladder 3, 4)."""

import pytest
import torch
from trl import GRPOTrainer

from .conftest import max_relative_error
from .reference import AGAINST_THE_REFERENCE, LOSS_TYPES, assert_matches_the_reference, run_pair


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@AGAINST_THE_REFERENCE
def test_loss_and_gradients_match_the_reference(
    prompt_gradient, reference_class, loss_type, beta, fresh_model, tokenizer, prompt_dataset, tmp_path
):
    ref_loss, loss, ref_grads, grads = run_pair(
        reference_class,
        fresh_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        loss_type=loss_type,
        beta=beta,
        prompt_gradient=prompt_gradient,
    )
    assert_matches_the_reference(ref_loss, loss, ref_grads, grads)


def test_exact_mode_float64(fresh_model, tokenizer, prompt_dataset, tmp_path):
    # TRL's fused LM head accumulates its statistics in fp32 on both sides, which bounds float64 agreement at ~1e-7.
    ref_loss, loss, ref_grads, grads = run_pair(
        GRPOTrainer,
        fresh_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        dtype=torch.float64,
        loss_type="grpo",
        beta=0.04,
        prompt_gradient="exact",
    )
    assert torch.allclose(loss, ref_loss, rtol=1e-7)
    assert max_relative_error(grads, ref_grads) <= 1e-6


@pytest.mark.parametrize(
    "setting",
    [
        {"importance_sampling_level": "sequence"},
        {"top_entropy_quantile": 0.5},
        {"entropy_coef": 0.05},
        {"off_policy_mask_threshold": 0.1},
        {"delta": 1.1},
    ],
)
def test_exact_mode_matches_stock_with_loss_options(setting, fresh_model, tokenizer, prompt_dataset, tmp_path):
    ref_loss, loss, ref_grads, grads = run_pair(
        GRPOTrainer, fresh_model, tokenizer, prompt_dataset, tmp_path, beta=0.04, prompt_gradient="exact", **setting
    )
    assert_matches_the_reference(ref_loss, loss, ref_grads, grads)
