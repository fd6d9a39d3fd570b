"""Property-based parity (hypothesis): on random generation batches, exact mode's loss and gradients equal stock
`GRPOTrainer`'s and detach mode's equal the detached reference's (`tests/reference.py`).

The fixed shapes of `test_trainer.py` and `test_families.py` pin the ladder at one point; these draw the batch instead,
to reach the layouts no hand-written case lists: 1 to 3 groups of 2 to 4 rows, each group's prompt 1 to 300 tokens
(left-padded to the longest, plus up to 8 columns of padding that no row uses), completions 0 tokens up to the batch's
width (1 to 8), with batches where every row is truncated (full width, no EOS) and where TRL's
`mask_truncated_completions` has masked those rows out (every mask zero included: stock's normalisers clamp at 1, so
its loss is 0, not 0/0, and ours must be the same 0), groups with zero advantages (nothing to replay unless `beta`
is on), old log-probs given or on policy, the rows shuffled and split into micro-steps as TRL's `_prepare_inputs`
splits a generation batch (a group then spans micro-steps, and a prompt state kept by one serves the next), with or
without the no-grad scoring of the whole batch first (TRL's old log-probs: the last state scored stays kept), `beta`
0, 0.04 and 0.5, capture and key-block chunkings from 1 token to whole prompts, and three families (GQA with RoPE, a
6-token sliding window, OPT's positions counted from the mask). Each loss type gets its own 13 batches per mode: 208
in all. In float64 (see `DTYPE`), at `assert_matches_the_reference`'s tolerances.

The trainers are built once per module and reused: each example sets what it varies on them. `loss_type`, `beta`
and the accumulation steps are read by TRL's `_compute_loss` at each call (`test_the_varied_settings_reach_the_loss`:
setting them gives the loss of a trainer built with them); the chunk sizes are fields of LongStraw's engine, read at
each capture. The examples are derandomized (the same on every run); a failure prints the drawn case, its shapes and
losses (`note`) and the blob that reproduces it.

Detach mode's prompts have 2 tokens or more: the detached reference prefills all but the last prompt token through
transformers' cache, which cannot run an empty forward (a 1-token prompt has no state to detach; exact mode's batches,
against stock, include it).
"""

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from trl import GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from trl_longstraw import LongStrawGRPOTrainer
from trl_longstraw.embedded import build_model

from .conftest import add_old_and_ref_logps, grads_of, make_trainer, synthetic_inputs
from .reference import AGAINST_THE_REFERENCE, LOSS_TYPES, assert_matches_the_reference

EXAMPLES = 13  # per gradient mode and loss type: 2 x 8 x 13 = 208 batches in all
FAMILIES = ("qwen3", "mistral", "opt")  # RoPE + GQA; a sliding window of 6; positions counted from the mask
BETAS = (0.0, 0.04, 0.5)
# float64, and tensors whose gradient norm is under 1e-6 of the whole gradient's compared against that floor: some
# drawn batches leave tensors with no gradient in exact arithmetic (every scored query reads one key, whose softmax
# weight is 1 whatever the score: no gradient to the query and key projections; OPT's key bias always), where both
# sides hold rounding noise, ~1e-7 of the global norm in float32 (no relative tolerance fits it), ~1e-16 in float64.
DTYPE = torch.float64
FLOOR_FRACTION = 1e-6
MAX_PROMPT = 300
MAX_COMPLETION = 8
MAX_UNUSED_PADDING = 8
# Chunk sizes are drawn, then raised so that the longest prompt takes at most this many capture chunks and key blocks:
# exact mode's prompt backward is quadratic in their number, and 300 tokens in chunks of 4 x 3 take seconds.
MAX_CHUNKS = 8
PREFILL_CHUNKS = (1, 2, 3, 4, 7, 16, 64, 1024)
ATTENTION_CHUNKS = (1, 2, 3, 5, 16, 64, 1024)

PROPERTY_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # seeded: the same examples on every run, in CI and here
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@st.composite
def generation_batches(draw, shortest_prompt=1):
    """One generation batch and how it is trained on (see the module docstring)."""
    num_groups = draw(st.integers(1, 3))
    group_size = draw(st.integers(2, 4))
    rows = num_groups * group_size
    short_or_long = st.one_of(  # mostly short, often the longest
        st.integers(shortest_prompt, 16), st.integers(shortest_prompt, MAX_PROMPT), st.just(MAX_PROMPT)
    )
    prompt_lengths = draw(st.lists(short_or_long, min_size=num_groups, max_size=num_groups))
    width = draw(st.integers(1, MAX_COMPLETION))
    all_truncated = draw(st.sampled_from(["ragged", "ragged", "ragged", "all truncated"])) == "all truncated"
    if all_truncated:
        completion_lengths = [width] * rows
    else:
        completion_lengths = draw(st.lists(st.integers(0, width), min_size=rows, max_size=rows))
    longest = max(prompt_lengths)
    return {
        "family": draw(st.sampled_from(FAMILIES)),
        "prompt_lengths": prompt_lengths,
        "group_size": group_size,
        "unused_padding": draw(st.integers(0, MAX_UNUSED_PADDING)),
        "completion_width": width,
        "completion_lengths": completion_lengths,
        "all_truncated": all_truncated,
        "mask_truncated": draw(st.booleans()),  # a full-width row has no EOS: TRL's mask_truncated_completions
        "zero_advantage_groups": draw(st.lists(st.booleans(), min_size=num_groups, max_size=num_groups)),
        "on_policy": draw(st.booleans()),  # no old log-probs: TRL uses the current ones, detached
        "scored_first": draw(st.booleans()),
        "micro_steps": draw(st.sampled_from([k for k in range(1, rows + 1) if rows % k == 0])),
        "row_order": draw(st.permutations(range(rows))),
        "beta": draw(st.sampled_from(BETAS)),
        "prefill_chunk_size": max(draw(st.sampled_from(PREFILL_CHUNKS)), math.ceil(longest / MAX_CHUNKS)),
        "attention_chunk_size": max(draw(st.sampled_from(ATTENTION_CHUNKS)), math.ceil(longest / MAX_CHUNKS)),
        "seed": draw(st.integers(0, 2**16)),
    }


def generation_batch(reference, case, vocab_size):
    """`synthetic_inputs` of the case's shape, widened by its unused padding and completion width, with the truncated
    rows masked if the case says so, its zero advantages, and old/ref log-probs from stock's forward."""
    size = case["group_size"]
    lengths = case["completion_lengths"]
    inputs = synthetic_inputs(
        vocab_size,
        prompt_lengths=tuple(case["prompt_lengths"]),
        completion_lengths=tuple(tuple(lengths[i : i + size]) for i in range(0, len(lengths), size)),
        seed=case["seed"],
    )
    rows, pad, width = len(lengths), case["unused_padding"], case["completion_width"]
    extra = width - inputs["completion_ids"].shape[1]  # every row shorter than the width (all empty, say)
    for key, columns, left in (("prompt", pad, True), ("completion", extra, False)):
        for name in (f"{key}_ids", f"{key}_mask"):
            zeros = torch.zeros(rows, columns, dtype=inputs[name].dtype)
            inputs[name] = torch.cat([zeros, inputs[name]] if left else [inputs[name], zeros], dim=1)
    if case["mask_truncated"]:  # the tokens stay; only the mask drops them, as in TRL
        inputs["completion_mask"] = inputs["completion_mask"] * (
            inputs["completion_mask"].sum(1, keepdim=True) < width
        )
    zero_advantage = torch.tensor(case["zero_advantage_groups"]).repeat_interleave(size)
    inputs["advantages"] = inputs["advantages"].masked_fill(zero_advantage, 0.0)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()  # over the generation batch, after masking
    inputs = add_old_and_ref_logps(reference, inputs, seed=case["seed"] + 1)
    inputs = {key: value.to(DTYPE) if value.is_floating_point() else value for key, value in inputs.items()}
    if case["on_policy"]:
        del inputs["old_per_token_logps"]
    return inputs


@pytest.fixture(scope="module")
def trainer_pairs(tokenizer, prompt_dataset, tmp_path_factory):
    """`pair(family, reference_class, prompt_gradient)`: the reference trainer and LongStraw's on copies of one tiny
    model, built on first use (with `beta` 0: `compute_loss` reads the reference log-probs from its inputs, so no
    reference model is needed) and reused by every example."""
    pairs = {}

    def pair(family, reference_class, prompt_gradient):
        key = (family, reference_class, prompt_gradient)
        if key not in pairs:
            model = build_model(family, dtype=DTYPE)
            root = tmp_path_factory.mktemp(f"{family}-{prompt_gradient}")
            common = {"beta": 0.0, "max_completion_length": MAX_COMPLETION}
            reference = make_trainer(
                reference_class, copy.deepcopy(model), tokenizer, prompt_dataset, root / "ref", **common
            )
            ours = make_trainer(
                LongStrawGRPOTrainer,
                model,
                tokenizer,
                prompt_dataset,
                root / "ours",
                prompt_gradient=prompt_gradient,
                **common,
            )
            pairs[key] = reference, ours
        return pairs[key]

    return pair


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@AGAINST_THE_REFERENCE
@PROPERTY_SETTINGS
@given(data=st.data())
def test_update_matches_the_reference_on_random_batches(
    prompt_gradient, reference_class, loss_type, data, trainer_pairs
):
    case = data.draw(generation_batches(shortest_prompt=1 if prompt_gradient == "exact" else 2), label="case")
    reference, ours = trainer_pairs(case["family"], reference_class, prompt_gradient)
    inputs = generation_batch(reference, case, len(reference.processing_class))
    note(
        f"prompt_ids {tuple(inputs['prompt_ids'].shape)}, completion lengths "
        f"{inputs['completion_mask'].sum(1).tolist()} of {inputs['completion_ids'].shape[1]}, "
        f"advantages {inputs['advantages'].tolist()}"
    )
    for trainer in (reference, ours):
        trainer.loss_type, trainer.beta = loss_type, case["beta"]
        trainer.current_gradient_accumulation_steps = trainer.args.steps_per_generation = case["micro_steps"]
        trainer.model.zero_grad(set_to_none=True)
    ours.engine.prefill_chunk_size = case["prefill_chunk_size"]
    ours.engine.attention_chunk_size = case["attention_chunk_size"]
    ours._kept.invalidate()  # a new generation batch (`_generate_and_score_completions` drops the kept state too)
    if case["scored_first"]:  # TRL's old log-probs: the whole batch scored under no grad, its last state kept
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        width = case["completion_width"]
        with torch.no_grad():
            want, want_entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                reference, reference.model, ids, mask, width, compute_entropy=True
            )
            got, entropies, _ = ours._get_per_token_logps_and_entropies(
                ours.model, ids, mask, width, compute_entropy=True
            )
        real = inputs["completion_mask"].bool()
        assert torch.where(real, got - want, 0.0).abs().max() <= 1e-5
        assert torch.where(real, entropies - want_entropies, 0.0).abs().max() <= 1e-5
    order = torch.tensor(case["row_order"])
    shuffled = {key: value[order] if value.ndim else value for key, value in inputs.items()}
    ref_losses, losses = [], []
    for micro_batch in split_tensor_dict(shuffled, case["micro_steps"]):  # as TRL's _prepare_inputs splits
        ref_loss = reference.compute_loss(reference.model, micro_batch)
        ref_loss.backward()
        ref_losses.append(ref_loss.detach())
        losses.append(ours.replay_and_backward(ours.model, micro_batch))
    note(f"losses: reference {[x.item() for x in ref_losses]}, LongStraw {[x.item() for x in losses]}")
    assert_matches_the_reference(
        torch.stack(ref_losses),
        torch.stack(losses),
        grads_of(reference.model),
        grads_of(ours.model),
        floor_fraction=FLOOR_FRACTION,
    )


@pytest.mark.parametrize("trainer_class", [GRPOTrainer, LongStrawGRPOTrainer])
def test_the_varied_settings_reach_the_loss(trainer_class, fresh_model, tokenizer, prompt_dataset, tmp_path):
    """Setting `loss_type`, `beta` and the accumulation steps on a built trainer gives the loss of a trainer built
    with them: what lets the property test reuse its trainers."""
    model = fresh_model()
    reused = make_trainer(trainer_class, copy.deepcopy(model), tokenizer, prompt_dataset, tmp_path / "reused")
    inputs = add_old_and_ref_logps(reused, synthetic_inputs(len(tokenizer)))
    losses = set()
    for loss_type in LOSS_TYPES:
        for beta, steps in ((0.0, 1), (0.5, 2)):
            built = make_trainer(
                trainer_class,
                copy.deepcopy(model),
                tokenizer,
                prompt_dataset,
                tmp_path / f"{loss_type}-{beta}",
                loss_type=loss_type,
                beta=beta,
                steps_per_generation=steps,
                gradient_accumulation_steps=steps,
            )
            built.current_gradient_accumulation_steps = steps
            reused.loss_type, reused.beta = loss_type, beta
            reused.current_gradient_accumulation_steps = reused.args.steps_per_generation = steps
            with torch.no_grad():
                want = built.compute_loss(built.model, inputs)
                got = reused.compute_loss(reused.model, inputs)
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (loss_type, beta, got, want)
            losses.add(round(want.item(), 6))
    assert len(losses) > len(LOSS_TYPES)  # the settings do change the loss: the comparison is not vacuous
