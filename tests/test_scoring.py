"""Old and reference log-probs scored from captures equal stock GRPOTrainer's (ladder 2, through the trainer)."""

import copy

import pytest
import torch
from peft import LoraConfig
from trl import GRPOTrainer

from trl_longstraw import LongStrawGRPOTrainer

from .conftest import GROUP_SIZE, make_trainer


def perturb_lora(model, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))


def scored_batch(trainer, dataset):
    rows = [dataset[i] for i in range(4) for _ in range(GROUP_SIZE)]  # RepeatSampler's layout: groups consecutive
    torch.manual_seed(123)
    return trainer._generate_and_score_completions(rows)


@pytest.mark.parametrize("use_peft", [False, True], ids=["ref_model", "peft_adapter_disabled"])
def test_old_and_reference_logps_equal_stock(use_peft, fresh_model, tokenizer, prompt_dataset, tmp_path):
    model = fresh_model()
    settings = {"beta": 0.04, "steps_per_generation": 2}  # misaligned generation: old log-probs are scored too
    if use_peft:
        settings["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"])
    trainers = []
    for trainer_class in (GRPOTrainer, LongStrawGRPOTrainer):
        peft_config = settings.get("peft_config")
        args = {k: v for k, v in settings.items() if k != "peft_config"}
        trainer = make_trainer(
            trainer_class,
            copy.deepcopy(model),
            tokenizer,
            prompt_dataset,
            tmp_path / trainer_class.__name__,
            peft_config=peft_config,
            **args,
        )
        if use_peft:
            perturb_lora(trainer.model)
        trainers.append(trainer)
    stock, ours = (scored_batch(t, prompt_dataset) for t in trainers)
    assert torch.equal(stock["completion_ids"], ours["completion_ids"])  # same samples, same scoring inputs
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        assert (stock[key] - ours[key]).abs().max() <= 1e-5, key
    metrics = trainers[1]._telemetry.flush()
    assert metrics["longstraw/capture_ref/time_s"] > 0 and metrics["longstraw/score/time_s"] > 0
