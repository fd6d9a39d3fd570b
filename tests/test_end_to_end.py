"""`trainer.train()` end to end: TRL generation, rewards, LoRA and QLoRA, telemetry in the logs and in W&B."""

import glob
import os

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.embedded import build_model

from .conftest import make_trainer, trainer_args

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
PHASE_KEYS = [
    "longstraw/capture/time_s",
    "longstraw/capture/count",
    "longstraw/score/time_s",
    "longstraw/replay/time_s",
    "longstraw/replay/rss_added_gib",
    "longstraw/optimizer/time_s",
    "longstraw/prompt_state_gib",
]


def distinct_reward(completions, **kwargs):
    """Rewards that differ within a group, so advantages (and gradients) are non-zero."""
    return [float(len(set(completion))) for completion in completions]


def train(trainer):
    """Train; the names of every parameter that changed (trainable or not), and the training log entries."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    return changed, [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow
@pytest.mark.parametrize("prompt_gradient", ["detach", "exact"])
def test_lora_training_updates_the_adapter_and_logs_phases(
    prompt_gradient, fresh_model, tokenizer, prompt_dataset, tmp_path
):
    trainer = make_trainer(
        LongStrawGRPOTrainer,
        fresh_model(),
        tokenizer,
        prompt_dataset,
        tmp_path,
        peft_config=LoraConfig(**LORA),
        reward_funcs=distinct_reward,
        max_steps=2,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=3,
        beta=0.04,
        learning_rate=1e-2,
        prompt_gradient=prompt_gradient,
        prefill_chunk_size=16,
    )
    changed, logs = train(trainer)
    assert changed and all("lora_" in name for name in changed)
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logs)
    for key in PHASE_KEYS + ["longstraw/capture_ref/time_s"]:
        assert all(key in entry for entry in logs), key
    assert all(entry["longstraw/replay/rss_peak_gib"] > 0 for entry in logs)
    assert ("longstraw/prompt_backward/time_s" in logs[0]) == (prompt_gradient == "exact")


@pytest.mark.slow
@pytest.mark.parametrize("prompt_gradient", ["detach", "exact"])
def test_lora_training_on_a_gated_deltanet_hybrid(prompt_gradient, fresh_model, tokenizer, prompt_dataset, tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "in_proj_qkv", "out_proj"])
    trainer = make_trainer(
        LongStrawGRPOTrainer,
        fresh_model("qwen3_5"),
        tokenizer,
        prompt_dataset,
        tmp_path,
        peft_config=lora,
        reward_funcs=distinct_reward,
        max_steps=1,
        beta=0.04,
        learning_rate=1e-2,
        prompt_gradient=prompt_gradient,
        prefill_chunk_size=16,
    )
    changed, logs = train(trainer)
    assert any("in_proj_qkv" in name for name in changed) and any("q_proj" in name for name in changed)
    assert len(logs) == 1 and torch.isfinite(torch.tensor(logs[0]["loss"]))
    assert logs[0]["longstraw/capture_ref/time_s"] > 0


@pytest.mark.slow
def test_qlora_nf4_training(tokenizer, prompt_dataset, tmp_path):
    build_model("qwen3").save_pretrained(tmp_path / "base")
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quantization)
    trainer = make_trainer(
        LongStrawGRPOTrainer,
        model,
        tokenizer,
        prompt_dataset,
        tmp_path / "run",
        peft_config=LoraConfig(**LORA),
        reward_funcs=distinct_reward,
        max_steps=1,
        learning_rate=1e-2,
        prompt_gradient="exact",
    )
    changed, logs = train(trainer)
    assert changed and len(logs) == 1 and torch.isfinite(torch.tensor(logs[0]["loss"]))


@pytest.mark.slow
def test_multiple_iterations_recapture_under_the_new_weights(fresh_model, tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(
        LongStrawGRPOTrainer,
        fresh_model(),
        tokenizer,
        prompt_dataset,
        tmp_path,
        reward_funcs=distinct_reward,
        max_steps=3,
        num_iterations=2,
        learning_rate=1e-3,
    )
    changed, logs = train(trainer)
    assert changed and len(logs) == 3
    # every step captures under its own weights: the second iteration reuses the generation batch, never a state
    # captured before the optimizer step (test_drop_in's test_a_kept_state_is_captured_again_once_the_weights_moved;
    # a stale state itself is refused: test_engine's test_stale_state_is_refused)
    assert all(entry["longstraw/capture/count"] >= 1 for entry in logs)


@pytest.mark.slow
def test_wandb_offline_run_records_the_phase_metrics_under_train_and_eval(
    fresh_model, tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    trainer = LongStrawGRPOTrainer(
        model=fresh_model(),
        reward_funcs=distinct_reward,
        args=trainer_args(
            LongStrawGRPOConfig,
            tmp_path / "run",
            max_steps=1,
            report_to="wandb",
            eval_strategy="steps",
            eval_steps=1,
            per_device_eval_batch_size=3,
            memory_plan_prompt_length=64,
        ),
        train_dataset=prompt_dataset,
        eval_dataset=prompt_dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    run_dir = wandb.run.dir
    assert wandb.run.summary["longstraw/plan/device_gib"] == trainer._memory_plan.device_bytes / 2**30
    assert wandb.run.summary["longstraw/measured/rss_peak_gib"] > 0
    wandb.finish()
    wandb.teardown()
    # Offline runs keep their history in the run's transaction log (protobuf records): the keys are stored verbatim.
    # transformers' W&B callback prefixes training metrics with "train/" and turns TRL's "eval_" into "eval/".
    [log_file] = glob.glob(os.path.join(os.path.dirname(run_dir), "*.wandb"))
    with open(log_file, "rb") as log:
        records = log.read()
    for key in PHASE_KEYS:
        assert f"train/{key}".encode() in records, key
    for key in ("longstraw/capture/time_s", "longstraw/score/time_s", "longstraw/prompt_state_gib"):
        assert f"eval/{key}".encode() in records, key
    # the memory plan in the run's config, the phases as bar charts (W&B custom-chart tables)
    for key in ("longstraw_memory_plan", "longstraw/phases/time_s", "longstraw/phases/rss_peak_gib"):
        assert key.encode() in records, key
