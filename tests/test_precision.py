"""Precision conformance: under bf16 autocast (TRL's default precision, here on CPU), LongStraw's gradient is as close
to the fp32 gradient as stock's own bf16 gradient is, for every verified family in both gradient modes (exact mode
against stock `GRPOTrainer`, detach mode against the detached reference)."""

import pytest

from trl_longstraw import LongStrawGRPOTrainer
from trl_longstraw.embedded import FAMILIES

from .conftest import add_old_and_ref_logps, grads_of, make_trainer, synthetic_inputs
from .reference import AGAINST_THE_REFERENCE

# Two groups of 3 with prompts of 40 and 23 tokens and ragged completions: long enough that bf16 rounding reaches
# every kind of layer state, and MoE routing sees near-ties.
SHAPE = {"prompt_lengths": (40, 23), "completion_lengths": ((12, 5, 9), (3, 12, 7))}


def update_gradients(trainer_class, fresh_model, tokenizer, dataset, path, bf16, family, **args):
    trainer = make_trainer(
        trainer_class, fresh_model(model_type=family), tokenizer, dataset, path, bf16=bf16, loss_type="dapo", **args
    )
    inputs = add_old_and_ref_logps(trainer, synthetic_inputs(len(tokenizer), **SHAPE))
    with trainer.accelerator.autocast():
        if trainer_class is LongStrawGRPOTrainer:
            trainer.replay_and_backward(trainer.model, inputs)
        else:
            trainer.compute_loss(trainer.model, inputs).backward()
    return grads_of(trainer.model)


def relative_error(got, want):
    difference = sum(((got[name].float() - want[name]) ** 2).sum() for name in want) ** 0.5
    return (difference / sum((want[name] ** 2).sum() for name in want) ** 0.5).item()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
@AGAINST_THE_REFERENCE
def test_bf16_gradients_are_within_twice_the_references_own_bf16_error(
    family, prompt_gradient, reference_class, fresh_model, tokenizer, prompt_dataset, tmp_path
):
    common = (fresh_model, tokenizer, prompt_dataset)
    truth = update_gradients(reference_class, *common, tmp_path / "fp32", False, family)
    reference = update_gradients(reference_class, *common, tmp_path / "bf16", True, family)
    ours = update_gradients(
        LongStrawGRPOTrainer, *common, tmp_path / "ours", True, family, prompt_gradient=prompt_gradient
    )
    assert relative_error(ours, truth) <= 2 * relative_error(reference, truth)
