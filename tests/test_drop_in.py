"""A drop-in for `GRPOTrainer`: stock's samples, numbers and behaviour on the paths a TRL user takes.

Parity tests train stock `GRPOTrainer` and `LongStrawGRPOTrainer` (exact mode) from the same weights with the same
seed for several optimizer steps and compare what each step logs (loss, grad norm, reward), the completions sampled
and the final weights (fp32, relative 1e-4).
"""

import copy
import hashlib
import inspect
import os
import subprocess

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer

from .conftest import (
    GROUP_SIZE,
    TINY_PAGED_CACHE,
    add_old_and_ref_logps,
    grads_of,
    make_trainer,
    max_relative_error,
    synthetic_inputs,
    trainer_args,
)

REPOSITORY = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
FLAT_PROMPT = "say hi"


class RecordingReward:
    """Rewards that differ within a group (flat for FLAT_PROMPT); records every completion it is asked to score."""

    __name__ = "recording_reward"

    def __init__(self):
        self.completions = []

    def __call__(self, prompts, completions, **kwargs):
        self.completions.append(list(completions))
        return [  # a conversational completion (a list of messages) by its text
            1.0 if prompt == FLAT_PROMPT else float(len(set(str(completion))))
            for prompt, completion in zip(prompts, completions, strict=True)
        ]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny Qwen3 on disk (TRL builds a reference model from the policy's path)."""
    from trl_longstraw.embedded import build_model

    path = tmp_path_factory.mktemp("model") / "qwen3"
    build_model("qwen3", seed=0).save_pretrained(path)
    return path


def train_run(
    trainer_class,
    saved_model,
    tokenizer,
    dataset,
    tmp_path,
    peft_config=None,
    trainer_kwargs=None,
    resume_from_checkpoint=None,
    **args,
):
    """Train from the saved weights; returns (per-step train logs, eval logs, completions, final weights, trainer).
    `trainer_kwargs` go to the trainer (e.g. `tools`), `args` to its config."""
    from transformers import AutoModelForCausalLM

    reward = RecordingReward()
    model = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.float32)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    settings = {"max_steps": 3, "learning_rate": 1e-3, "prompt_gradient": "exact"}
    settings.update(args)
    config_class = LongStrawGRPOConfig if trainer_class is LongStrawGRPOTrainer else GRPOConfig
    if config_class is GRPOConfig:
        settings = {k: v for k, v in settings.items() if k in GRPOConfig.__dataclass_fields__}
    trainer = trainer_class(
        model=model,
        reward_funcs=reward,
        args=trainer_args(config_class, tmp_path / trainer_class.__name__, **settings),
        train_dataset=dataset,
        eval_dataset=dataset if settings.get("eval_strategy", "no") != "no" else None,
        processing_class=tokenizer,
        peft_config=peft_config,
        **(trainer_kwargs or {}),
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    history = trainer.state.log_history
    train_logs = [entry for entry in history if "loss" in entry]
    eval_logs = [entry for entry in history if "eval_loss" in entry]
    # the update each trainable tensor received (LoRA tensors: their final value, from an initial value of 0 for B)
    weights = {
        n: p.detach() - initial.get(n, torch.zeros_like(p))
        for n, p in trainer.model.named_parameters()
        if p.requires_grad
    }
    return train_logs, eval_logs, reward.completions, weights, trainer


def assert_same_run(stock, ours, rtol=1e-4, atol=1e-6, weights_rtol=1e-3):
    stock_logs, stock_eval, stock_completions, stock_weights, _ = stock
    logs, eval_logs, completions, weights, _ = ours
    assert completions == stock_completions  # same random stream: same samples, step after step
    assert len(logs) == len(stock_logs) and len(eval_logs) == len(stock_eval)
    for step, (got, want) in enumerate(zip(logs + eval_logs, stock_logs + stock_eval, strict=True)):
        for key in ("loss", "grad_norm", "reward", "eval_loss", "eval_reward"):
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=rtol, abs=atol), (step, key, got[key], want[key])
    # Per tensor, relative to the update stock made, at 1e-3: AdamW divides each gradient element by its own running
    # scale, so a rounding-level gradient difference on an element whose gradient is near zero moves that element by
    # up to lr (measured: one element of 8192 off by 3.7e-6 after 3 steps, 2.6e-5 of the tensor's update).
    assert weights.keys() == stock_weights.keys()
    for name, update in weights.items():
        error = (update - stock_weights[name]).norm() / stock_weights[name].norm().clamp(min=1e-12)
        assert error <= weights_rtol, (name, error.item())


# ---------------------------------------------------------------------------------------------------------------------
# Stock's numbers on every knob, over several optimizer steps
# ---------------------------------------------------------------------------------------------------------------------
KNOBS = {
    "gradient-accumulation": {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 2},
    "steps-per-generation": {"per_device_train_batch_size": 3, "steps_per_generation": 2},
    "num-iterations": {"num_iterations": 2, "loss_type": "grpo"},
    "reference-model": {"beta": 0.04, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 3},
    "peft-adapter-as-reference": {"beta": 0.04, "peft_config": LoraConfig(**LORA), "learning_rate": 1e-2},
    # PEFT's default targets: the first layer's keys then come from frozen weights alone
    "lora-on-q-and-v-only": {"peft_config": LoraConfig(r=4, lora_alpha=8), "learning_rate": 1e-2},
    # a group's rows in up to three micro-steps, rows of several groups in one micro-step
    "group-spans-micro-steps": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "max_steps": 2},
    "batch-not-a-multiple-of-the-group": {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 3,
        "max_steps": 2,
    },
    "flat-reward-groups-with-weight-decay": {"per_device_train_batch_size": 3, "weight_decay": 0.1, "max_steps": 4},
    "mask-truncated-completions": {"mask_truncated_completions": True, "max_completion_length": 3, "max_steps": 2},
    "evaluation": {
        "eval_strategy": "steps",
        "eval_steps": 2,
        "eval_on_start": True,
        "num_generations_eval": 2,
        "per_device_eval_batch_size": 4,
        "beta": 0.04,
    },
    # the fused head divides the logits by the sampling temperature; left padding to a multiple changes positions
    "sampling-temperature-top-p-top-k": {"temperature": 0.7, "top_p": 0.9, "top_k": 20},
    "pad-to-multiple-of": {"pad_to_multiple_of": 8},
    "lm-head-in-fp32": {"cast_lm_head_to_fp32": True},
    # the bonus applies while the entropy is at or below its target: above a random tiny model's, so it trains
    "adaptive-entropy-bonus": {"use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 20.0},
    "activation-checkpointing": {"gradient_checkpointing": True},
    # the reference model is mixed into from the policy every step: each reference capture must read its new weights
    "reference-model-sync": {
        "beta": 0.04,
        "sync_ref_model": True,
        "ref_model_sync_steps": 1,
        "ref_model_mixup_alpha": 0.5,
    },
    # TRL's generation backend (with the model's own attention), LongStraw's scoring and update
    "transformers-continuous-batching": {
        "use_transformers_continuous_batching": True,
        "transformers_continuous_batching_config": TINY_PAGED_CACHE,
        "max_steps": 2,
    },
    # completions of up to 6 tokens in segments of 2: every member of two tokens or more scored (old, reference,
    # second iteration) and replayed from its own earlier segments' state
    "replay-in-segments": {"replay_segment_size": 2, "beta": 0.04, "num_iterations": 2},
    "replay-in-segments-with-activation-checkpointing": {"replay_segment_size": 2, "gradient_checkpointing": True},
    # bnpo normalises by the micro-batch's token count: the split into micro-steps must be stock's
    "bnpo-group-spans-micro-steps": {
        "loss_type": "bnpo",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 3,
        "max_steps": 2,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("knob", list(KNOBS))
def test_exact_mode_trains_like_stock(knob, saved_model, tokenizer, prompt_dataset, tmp_path):
    args = dict(KNOBS[knob])
    peft_config = args.pop("peft_config", None)
    stock = train_run(
        GRPOTrainer, saved_model, tokenizer, prompt_dataset, tmp_path, copy.deepcopy(peft_config), **args
    )
    ours = train_run(LongStrawGRPOTrainer, saved_model, tokenizer, prompt_dataset, tmp_path, peft_config, **args)
    assert_same_run(stock, ours)


@pytest.mark.slow
def test_iterable_dataset_trains_like_stock(saved_model, tokenizer, prompt_dataset, tmp_path):
    iterable = prompt_dataset.to_iterable_dataset()
    args = {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 2}
    stock = train_run(GRPOTrainer, saved_model, tokenizer, iterable, tmp_path, **args)
    ours = train_run(LongStrawGRPOTrainer, saved_model, tokenizer, iterable, tmp_path, **args)
    assert_same_run(stock, ours)


@pytest.fixture(scope="module")
def tool_calling(tmp_path_factory):
    """A tiny Qwen3 that calls `add` at the start of about a fifth of its turns (saved), its tokenizer, prompts."""
    from datasets import Dataset

    from trl_longstraw.embedded import build_tool_calling_model, build_tool_calling_tokenizer

    tokenizer = build_tool_calling_tokenizer()
    path = tmp_path_factory.mktemp("model") / "tool-calling"
    build_tool_calling_model(tokenizer).save_pretrained(path)
    prompts = [[{"role": "user", "content": "add one and two"}], [{"role": "user", "content": "hi"}]] * 4
    return path, tokenizer, Dataset.from_dict({"prompt": prompts})


class Adder:
    """An `environment_factory` environment whose one tool is `add`, counting its calls."""

    def reset(self, **kwargs) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b


@pytest.mark.slow
@pytest.mark.parametrize(
    "source, replay_segment_size", [("tools", None), ("environment_factory", None), ("tools", 16)]
)
def test_tool_calling_trains_like_stock(source, replay_segment_size, tool_calling, tmp_path):
    """GRPOTrainer's tool loop: turns after a tool result decode from the prompt's state, and the tool results are
    scored and masked as stock scores and masks them; in segments of 16 tokens, boundaries fall inside tool results
    (masked tokens, run through the model as stock runs them) and at turn boundaries."""
    from trl_longstraw.embedded import add

    saved, tokenizer, dataset = tool_calling
    trainer_kwargs = {"tools": [add]} if source == "tools" else {"environment_factory": Adder}
    args = {"max_completion_length": 96, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 3}
    if replay_segment_size is not None:
        args["replay_segment_size"] = replay_segment_size
    stock = train_run(GRPOTrainer, saved, tokenizer, dataset, tmp_path, trainer_kwargs=trainer_kwargs, **args)
    ours = train_run(LongStrawGRPOTrainer, saved, tokenizer, dataset, tmp_path, trainer_kwargs=trainer_kwargs, **args)
    assert_same_run(stock, ours)
    assert all(log["tools/call_frequency"] > 0 for log in ours[0])
    turns = [len(completion) for step in ours[2] for completion in step]
    assert max(turns) >= 4  # a call, its result, another call, its result, ...


@pytest.mark.slow
@pytest.mark.parametrize("replay_segment_size", [None, 2])
def test_bf16_autocast_is_as_close_to_stock_as_stock_bf16(
    replay_segment_size, saved_model, tokenizer, prompt_dataset, tmp_path
):
    """Under autocast, whole members and members in segments of 2 (captured and replayed in bf16 alike)."""
    args = {"max_steps": 1, "per_device_train_batch_size": 3, "gradient_accumulation_steps": 2}
    stock_fp32 = train_run(GRPOTrainer, saved_model, tokenizer, prompt_dataset, tmp_path / "fp32", **args)
    stock_bf16 = train_run(GRPOTrainer, saved_model, tokenizer, prompt_dataset, tmp_path / "bf16", bf16=True, **args)
    ours_bf16 = train_run(
        LongStrawGRPOTrainer,
        saved_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        bf16=True,
        replay_segment_size=replay_segment_size,
        **args,
    )
    assert ours_bf16[2] == stock_bf16[2]  # bf16 generation is stock's: same samples
    stock_error = abs(stock_bf16[0][0]["grad_norm"] - stock_fp32[0][0]["grad_norm"])
    our_error = abs(ours_bf16[0][0]["grad_norm"] - stock_fp32[0][0]["grad_norm"])
    assert our_error <= 2 * stock_error + 1e-3 * stock_fp32[0][0]["grad_norm"], (our_error, stock_error)


@pytest.mark.slow
def test_resuming_from_a_checkpoint_trains_like_stock(saved_model, tokenizer, prompt_dataset, tmp_path):
    """`train(resume_from_checkpoint=...)` from a LongStraw checkpoint: the steps after it are stock's uninterrupted
    run (weights, optimizer, scheduler and random states come back; no prompt state is saved, none is needed)."""
    args = {
        "max_steps": 4,
        "save_strategy": "steps",
        "save_steps": 2,
        "per_device_train_batch_size": 3,
        "gradient_accumulation_steps": 2,
    }
    stock = train_run(GRPOTrainer, saved_model, tokenizer, prompt_dataset, tmp_path / "stock", **args)
    train_run(LongStrawGRPOTrainer, saved_model, tokenizer, prompt_dataset, tmp_path / "first", **args)
    checkpoint = tmp_path / "first" / LongStrawGRPOTrainer.__name__ / "checkpoint-2"
    logs, _, completions, weights, _ = train_run(
        LongStrawGRPOTrainer,
        saved_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        resume_from_checkpoint=checkpoint,
        **args,
    )
    stock_logs, _, stock_completions, stock_weights, _ = stock
    resumed_steps = len(stock_logs) - 2
    assert resumed_steps > 0 and completions == stock_completions[-len(completions) :]
    assert [log["step"] for log in logs] == [log["step"] for log in stock_logs]
    for got, want in zip(logs[2:], stock_logs[2:], strict=True):
        for key in ("loss", "grad_norm", "reward"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
    assert max_relative_error(weights, stock_weights) <= 1e-3


# ---------------------------------------------------------------------------------------------------------------------
# One behaviour per test
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_same_seed_samples_the_same_completions_as_stock(saved_model, tokenizer, prompt_dataset, tmp_path):
    # Stock's _prepare_inputs shuffles rows with torch's global generator before splitting the generation batch into
    # micro-steps; LongStraw must consume that stream identically or every later generation differs.
    args = {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 2, "max_steps": 4, "learning_rate": 1e-2}
    stock = train_run(GRPOTrainer, saved_model, tokenizer, prompt_dataset, tmp_path, **args)
    ours = train_run(LongStrawGRPOTrainer, saved_model, tokenizer, prompt_dataset, tmp_path, **args)
    assert len(ours[2]) == 4 and ours[2] == stock[2]
    assert [e["reward"] for e in ours[0]] == [e["reward"] for e in stock[0]]


def test_zero_gradient_batch_leaves_zero_gradients_not_none(fresh_model, tokenizer, prompt_dataset, tmp_path):
    # All-equal rewards and beta=0: stock's backward leaves zeros in every parameter's .grad, and AdamW counts the step
    # and applies weight decay; a None .grad would make AdamW skip the parameter entirely.
    trainer = make_trainer(LongStrawGRPOTrainer, fresh_model(), tokenizer, prompt_dataset, tmp_path, beta=0.0)
    inputs = synthetic_inputs(len(tokenizer))
    inputs["advantages"] = torch.zeros_like(inputs["advantages"])
    trainer.replay_and_backward(trainer.model, inputs)
    grads = [p.grad for p in trainer.model.parameters() if p.requires_grad]
    assert all(grad is not None for grad in grads)
    assert all(not grad.any() for grad in grads)


def test_a_parameter_first_reached_later_keeps_a_gradient_from_then_on(
    fresh_model, tokenizer, prompt_dataset, tmp_path
):
    # Routing can reach a parameter for the first time many steps in (an expert first chosen late); from then on it is
    # one of the parameters every rank averages, and it gets zeros in a backward that replays nothing, as the others.
    trainer = make_trainer(LongStrawGRPOTrainer, fresh_model(), tokenizer, prompt_dataset, tmp_path, beta=0.0)
    late = trainer.model.model.layers[1].mlp.down_proj.weight
    inputs = synthetic_inputs(len(tokenizer))
    late.requires_grad_(False)  # not reached by the first backward
    trainer.replay_and_backward(trainer.model, inputs)
    late.requires_grad_(True)
    trainer.model.zero_grad(set_to_none=True)
    trainer.replay_and_backward(trainer.model, inputs)  # reached now
    assert late.grad is not None and late.grad.any()
    trainer.model.zero_grad(set_to_none=True)
    inputs["advantages"] = torch.zeros_like(inputs["advantages"])
    trainer.replay_and_backward(trainer.model, inputs)  # replays nothing
    assert late.grad is not None and not late.grad.any()


def count_captures(trainer, monkeypatch) -> list:
    captures = []
    capture = trainer.engine.capture
    monkeypatch.setattr(trainer.engine, "capture", lambda *args: captures.append(args[1]) or capture(*args))
    return captures


def test_the_last_state_scored_is_replayed_first_and_the_last_replayed_is_scored_first(
    fresh_model, tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    """Two groups: scoring captures both and keeps the second, which the replay takes first (no capture), so one
    update captures three times; the state the replay kept is the next scoring's first: two captures then."""
    trainer = make_trainer(LongStrawGRPOTrainer, fresh_model(), tokenizer, prompt_dataset, tmp_path)
    captures = count_captures(trainer, monkeypatch)
    inputs = synthetic_inputs(len(tokenizer))
    trainer.replay_and_backward(trainer.model, inputs)
    assert [len(prompt) for prompt in captures] == [11, 7, 11]  # the groups by first row: 11 prompt tokens, then 7
    trainer.replay_and_backward(trainer.model, inputs)
    assert [len(prompt) for prompt in captures[3:]] == [7, 11]


def test_a_kept_state_is_captured_again_once_the_weights_moved(
    fresh_model, tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    """An optimizer step outside the trainer's loop (no callback clears the kept state): the next update sees the
    weights moved and captures again instead of reading a stale state."""
    trainer = make_trainer(LongStrawGRPOTrainer, fresh_model(), tokenizer, prompt_dataset, tmp_path)
    inputs = synthetic_inputs(len(tokenizer))
    trainer.replay_and_backward(trainer.model, inputs)
    torch.optim.SGD(trainer.model.parameters(), lr=0.1).step()
    captures = count_captures(trainer, monkeypatch)
    trainer.replay_and_backward(trainer.model, inputs)
    assert len(captures) == 3


def test_a_group_with_zero_advantages_still_trains_its_entropy_bonus(fresh_model, tokenizer, prompt_dataset, tmp_path):
    """Equal rewards and beta = 0 zero the log-probs' gradient, not the entropy bonus's: such a group is replayed."""
    model = fresh_model()
    settings = {"beta": 0.0, "entropy_coef": 0.05, "prompt_gradient": "exact"}
    stock = make_trainer(GRPOTrainer, model, tokenizer, prompt_dataset, tmp_path / "stock", **settings)
    ours = make_trainer(LongStrawGRPOTrainer, copy.deepcopy(model), tokenizer, prompt_dataset, tmp_path, **settings)
    inputs = add_old_and_ref_logps(stock, synthetic_inputs(len(tokenizer)))
    inputs["advantages"][:GROUP_SIZE] = 0
    stock.compute_loss(stock.model, inputs).backward()
    ours.replay_and_backward(ours.model, inputs)
    assert max_relative_error(grads_of(ours.model), grads_of(stock.model)) <= 1e-4


def test_all_truncated_group_under_mask_truncated_completions(fresh_model, tokenizer, prompt_dataset, tmp_path):
    model = fresh_model()
    settings = {"mask_truncated_completions": True, "prompt_gradient": "exact"}
    stock = make_trainer(GRPOTrainer, model, tokenizer, prompt_dataset, tmp_path / "stock", **settings)
    ours = make_trainer(LongStrawGRPOTrainer, copy.deepcopy(model), tokenizer, prompt_dataset, tmp_path, **settings)
    inputs = add_old_and_ref_logps(stock, synthetic_inputs(len(tokenizer)))
    inputs["completion_mask"][:GROUP_SIZE] = 0  # group 0: every completion truncated, hence masked
    stock_loss = stock.compute_loss(stock.model, inputs)
    stock_loss.backward()
    loss = ours.replay_and_backward(ours.model, inputs)
    assert loss.item() == pytest.approx(stock_loss.item(), rel=1e-5, abs=1e-7)
    assert max_relative_error(grads_of(ours.model), grads_of(stock.model)) <= 1e-4


def test_rows_are_grouped_by_prompt_wherever_they_sit(tokenizer):
    from trl_longstraw.groups import group_rows_by_prompt

    batch = synthetic_inputs(len(tokenizer), prompt_lengths=(11, 7, 9), completion_lengths=((6, 3), (2, 6), (4, 1)))
    order = torch.tensor([3, 0, 5, 2, 4, 1])  # rows of three prompts, interleaved as TRL's row shuffle leaves them
    groups = group_rows_by_prompt(
        batch["prompt_ids"][order], batch["prompt_mask"][order], batch["completion_mask"][order], None
    )
    assert [group.rows for group in groups] == [[0, 3], [1, 5], [2, 4]]
    assert [len(group.prompt_ids) for group in groups] == [7, 11, 9]
    assert [group.completion_lengths for group in groups] == [[6, 2], [6, 3], [1, 4]]


@pytest.mark.parametrize("max_positions, refused", [(17, False), (16, True)])
def test_rows_whose_prompt_and_completion_reach_past_the_positions_are_refused(tokenizer, max_positions, refused):
    from trl_longstraw.groups import group_rows_by_prompt

    batch = synthetic_inputs(len(tokenizer))  # prompts padded to 11 tokens, completions to 6: positions 0 .. 16
    group = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_mask"], max_positions)
    if refused:
        with pytest.raises(ValueError, match="spans 17 positions, more than the model's max_position_embeddings=16"):
            group_rows_by_prompt(*group)
    else:
        assert len(group_rows_by_prompt(*group)) == 2


def test_a_right_padded_prompt_is_refused(tokenizer):
    from trl_longstraw.groups import group_rows_by_prompt

    batch = synthetic_inputs(len(tokenizer))
    right_padded = batch["prompt_mask"].flip(1)
    with pytest.raises(ValueError, match="prompt_mask must be left-padded"):
        group_rows_by_prompt(batch["prompt_ids"], right_padded, batch["completion_mask"], None)


@pytest.mark.parametrize("per_device_train_batch_size", [2, 4], ids=["smaller-than-the-group", "not-a-multiple"])
def test_micro_batches_that_split_groups_are_accepted(per_device_train_batch_size, tmp_path):
    args = trainer_args(
        LongStrawGRPOConfig,
        tmp_path,
        per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=GROUP_SIZE,
    )
    assert args.generation_batch_size == GROUP_SIZE * per_device_train_batch_size


def test_position_check_runs_before_generation(fresh_model, tokenizer, prompt_dataset, tmp_path, monkeypatch):
    trainer = make_trainer(
        LongStrawGRPOTrainer, fresh_model(max_position_embeddings=40), tokenizer, prompt_dataset, tmp_path
    )

    def generate(*args, **kwargs):
        raise AssertionError("generation ran before the position check")

    monkeypatch.setattr(trainer, "_generate_single_turn", generate)
    rows = [{"prompt": prompt_dataset[0]["prompt"]}] * GROUP_SIZE  # 49 tokens + max_completion_length 6 > 40
    with pytest.raises(ValueError, match="max_position_embeddings=40"):
        trainer._generate_and_score_completions(rows)


@pytest.mark.parametrize(
    "settings, spans",
    [
        ({"max_completion_length": 39}, None),  # one prompt token + 39 = 40 positions: the model's last is 39
        ({"max_completion_length": 40}, "max_completion_length=40 spans 41 positions"),
        ({"max_completion_length": 64}, "max_completion_length=64 spans 65 positions"),
        ({"max_completion_length": 30, "pad_to_multiple_of": 16}, "max_completion_length=30 spans 48 positions"),
    ],
)
def test_completion_longer_than_the_positions_is_refused_at_construction(
    settings, spans, fresh_model, tokenizer, prompt_dataset, tmp_path
):
    def build():
        model = fresh_model(max_position_embeddings=40)
        return make_trainer(LongStrawGRPOTrainer, model, tokenizer, prompt_dataset, tmp_path, **settings)

    if spans is None:
        build()
    else:
        with pytest.raises(ValueError, match=f"{spans}, more than the model's max_position_embeddings=40"):
            build()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_prompt_state_device_without_cuda_fails_in_the_config(tmp_path):
    with pytest.raises(ValueError, match=r"prompt_state_device='cuda:0' but this machine has 0 CUDA device.*'cpu'"):
        trainer_args(LongStrawGRPOConfig, tmp_path, prompt_state_device="cuda:0")


def test_grad_enabled_compute_loss_backward_gives_stock_gradients(fresh_model, tokenizer, prompt_dataset, tmp_path):
    model = fresh_model()
    stock = make_trainer(GRPOTrainer, model, tokenizer, prompt_dataset, tmp_path / "stock", beta=0.04)
    ours = make_trainer(
        LongStrawGRPOTrainer,
        copy.deepcopy(model),
        tokenizer,
        prompt_dataset,
        tmp_path / "ours",
        beta=0.04,
        prompt_gradient="exact",
    )
    inputs = add_old_and_ref_logps(stock, synthetic_inputs(len(tokenizer)))
    stock_loss = stock.compute_loss(stock.model, inputs)
    stock_loss.backward()
    loss = ours.compute_loss(ours.model, inputs)
    assert loss.requires_grad
    loss.backward()
    assert loss.item() == pytest.approx(stock_loss.item(), rel=1e-5)
    assert max_relative_error(grads_of(ours.model), grads_of(stock.model)) <= 1e-4


def test_liger_kernel_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="use_liger_kernel=True is not supported: Liger's Triton kernels"):
        trainer_args(LongStrawGRPOConfig, tmp_path, use_liger_kernel=True)


class CountingCallback(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append("step_end")

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append("log")


@pytest.mark.slow
def test_callbacks_empty_cache_steps_and_profiling_keep_working(
    fresh_model, tokenizer, prompt_dataset, tmp_path, monkeypatch
):
    import transformers.trainer
    from trl.extras import profiling

    cleared, profiled = [], []
    monkeypatch.setattr(transformers.trainer, "clear_device_cache", lambda *a, **k: cleared.append(True))
    original_enter = profiling.ProfilingContext.__enter__
    monkeypatch.setattr(
        profiling.ProfilingContext, "__enter__", lambda self: profiled.append(self.name) or original_enter(self)
    )
    trainer = make_trainer(
        LongStrawGRPOTrainer,
        fresh_model(),
        tokenizer,
        prompt_dataset,
        tmp_path,
        max_steps=2,
        torch_empty_cache_steps=1,
    )
    callback = CountingCallback()
    trainer.add_callback(callback)
    trainer.train()
    assert callback.events.count("step_end") == 2 and callback.events.count("log") >= 2
    assert len(cleared) == 2  # once per micro-step, by Trainer.training_step
    for name in ("_get_per_token_logps_and_entropies", "compute_loss", "replay_backward"):
        assert f"LongStrawGRPOTrainer.{name}" in profiled, name


# ---------------------------------------------------------------------------------------------------------------------
# What LongStraw relies on in TRL's loop
# ---------------------------------------------------------------------------------------------------------------------
# LongStraw copies one TRL method, under context parallelism only: `get_high_entropy_mask` (its quantile then counts
# each row once). It relies on the others running as stock, in this shape. `training_step` must reach
# `compute_loss` under grad and back-propagate its result once; `_prepare_inputs` must generate through
# `_generate_and_score_completions` and shuffle with `shuffle_sequence_dict`; `_generate` must tokenize through
# `_tokenize_prompts` before generating; `_tool_call_loop` must generate each turn through `_generate_single_turn` with
# the row's prompt, completion and tool results; `_calculate_rewards` must return every rank's rewards gathered in
# rank order (checked for agreement within a CP group). (`_compute_loss` getting its log-probs from
# `_get_per_token_logps_and_entropies` is checked by the parity tests, loss type by loss type.) Recorded for trl 1.16.0
# and transformers 5.24.0.
TRL_SOURCES = {
    "GRPOTrainer.training_step": "9e18632f",
    "GRPOTrainer._prepare_inputs": "f824e7fb",
    "GRPOTrainer._generate": "2a27fdf8",
    "GRPOTrainer._tool_call_loop": "1c501f7f",
    "GRPOTrainer._calculate_rewards": "736ae29b",
    "GRPOTrainer.get_high_entropy_mask": "ce6e8628",
    "Trainer.training_step": "e9760c8e",
}


def source_hash(qualified_name: str) -> str:
    import transformers

    owner, name = qualified_name.split(".")
    cls = GRPOTrainer if owner == "GRPOTrainer" else transformers.Trainer
    return hashlib.sha256(inspect.getsource(getattr(cls, name)).encode()).hexdigest()[:8]


@pytest.mark.parametrize("qualified_name", list(TRL_SOURCES))
def test_the_trl_methods_longstraw_relies_on_are_unchanged(qualified_name):
    assert source_hash(qualified_name) == TRL_SOURCES[qualified_name], (
        f"The installed TRL/transformers changed {qualified_name}. LongStrawGRPOTrainer relies on its call pattern "
        "(see the comment above TRL_SOURCES and the trainer's module docstring): re-read it, re-run "
        "tests/test_drop_in.py, then record the new hash here."
    )


def test_longstraw_overrides_no_step_of_the_loop():
    for name in ("training_step", "_prepare_inputs", "compute_loss", "prediction_step"):
        assert name not in vars(LongStrawGRPOTrainer), name


# ---------------------------------------------------------------------------------------------------------------------
# The design lives in the repository
# ---------------------------------------------------------------------------------------------------------------------
def test_no_file_cites_a_design_document_outside_the_repository():
    assert os.path.exists(os.path.join(REPOSITORY, "docs", "design.md"))
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    citing = []
    for path in listed:
        full = os.path.join(REPOSITORY, path)
        if not os.path.isfile(full):
            continue
        with open(full, "rb") as file:
            text = file.read().decode("utf-8", "replace")
        for number, line in enumerate(text.splitlines(), 1):
            if "DESIGN" + ".md" in line:  # spelled so that this file does not match itself
                citing.append(f"{path}:{number}")
    assert not citing, f"cite docs/design.md instead: {citing}"


def test_the_high_entropy_mask_runs_on_a_bare_trainer_mock_as_grpo_trainers_tests_call_it():
    """GRPOTrainer's `TestGetHighEntropyMask` calls the method on `Mock(spec=...)`: no context parallelism there."""
    from unittest.mock import Mock

    trainer = Mock(spec=LongStrawGRPOTrainer)
    trainer.accelerator = Mock(num_processes=1)
    trainer.accelerator.gather = lambda x: x
    trainer.accelerator.pad_across_processes = lambda x, dim, pad_index: x
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    got = LongStrawGRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, threshold=0.8)
    assert got.tolist() == [[False] * 6, [False, False, True, True, False, False]]
