"""Loss and gradient fidelity of `replay_and_backward` against stock `GRPOTrainer` (docs/design.md ladder 3, 4)."""

import copy

import pytest
import torch
from transformers.cache_utils import LinearAttentionLayer
from trl import GRPOTrainer

from trl_longstraw import LongStrawGRPOTrainer

from .conftest import add_old_and_ref_logps, grads_of, make_trainer, max_relative_error, synthetic_inputs

LOSS_TYPES = ["grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]


class OutOfPlaceLinearAttentionLayer(LinearAttentionLayer):
    """HF's GatedDeltaNet cache layer, except that the recurrent state is replaced instead of `copy_`-ed into: HF's
    in-place update would overwrite the tensor the replay's graph reads (autograd refuses that)."""

    def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states


def replayable_copy(cache):
    replay_cache = copy.deepcopy(cache)
    for layer in replay_cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            layer.__class__ = OutOfPlaceLinearAttentionLayer
    return replay_cache


class DetachedReferenceTrainer(GRPOTrainer):
    """docs/design.md's detached reference: prompt cached by HF under no_grad, each completion replayed on a deep copy."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        rows_logps, rows_entropies = [], []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            prompt_mask = mask[:-logits_to_keep].bool()
            first = int((~prompt_mask).sum())
            prompt = ids[:-logits_to_keep][prompt_mask]
            completion = ids[-logits_to_keep:]
            length = int(mask[-logits_to_keep:].sum())
            positions = torch.arange(first, first + prompt.numel() + logits_to_keep)
            from transformers import DynamicCache

            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                model.model(
                    input_ids=prompt[None, :-1],
                    position_ids=positions[None, : prompt.numel() - 1],
                    cache=cache,
                    use_cache=True,
                )
            replay = torch.cat([prompt[-1:], completion[:-1]])
            labels = completion.masked_fill(torch.arange(logits_to_keep) >= length, -100)
            out = model(
                input_ids=replay[None],
                position_ids=positions[None, prompt.numel() - 1 : -1],
                cache=replayable_copy(cache),
                shift_labels=labels[None],
                fused_lm_head=True,
            )
            rows_logps.append(out.log_probs[0])
            rows_entropies.append(out.entropy[0])
        return torch.stack(rows_logps), torch.stack(rows_entropies), None


def run_pair(
    reference_class, fresh_model, tokenizer, prompt_dataset, tmp_path, dtype=torch.float32, model_type="qwen3", **args
):
    model = fresh_model(model_type=model_type, dtype=dtype)
    reference = make_trainer(
        reference_class, copy.deepcopy(model), tokenizer, prompt_dataset, tmp_path / "ref", **args
    )
    ours = make_trainer(
        LongStrawGRPOTrainer,
        copy.deepcopy(model),
        tokenizer,
        prompt_dataset,
        tmp_path / "ours",
        prefill_chunk_size=4,
        attention_chunk_size=3,
        **args,
    )
    inputs = add_old_and_ref_logps(reference, synthetic_inputs(len(tokenizer)))
    if dtype == torch.float64:
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    ref_loss = reference.compute_loss(reference.model, inputs)
    ref_loss.backward()
    loss = ours.replay_and_backward(ours.model, inputs)
    return ref_loss.detach(), loss, grads_of(reference.model), grads_of(ours.model)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(
    "prompt_gradient, reference_class",
    [("exact", GRPOTrainer), ("detach", DetachedReferenceTrainer)],
    ids=["exact-vs-stock", "detach-vs-detached-reference"],
)
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
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (loss, ref_loss)
    assert max_relative_error(grads, ref_grads) <= 1e-4


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
        dict(importance_sampling_level="sequence"),
        dict(top_entropy_quantile=0.5),
        dict(entropy_coef=0.05),
        dict(off_policy_mask_threshold=0.1),
        dict(delta=1.1),
    ],
)
def test_exact_mode_matches_stock_with_loss_options(setting, fresh_model, tokenizer, prompt_dataset, tmp_path):
    ref_loss, loss, ref_grads, grads = run_pair(
        GRPOTrainer, fresh_model, tokenizer, prompt_dataset, tmp_path, beta=0.04, prompt_gradient="exact", **setting
    )
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert max_relative_error(grads, ref_grads) <= 1e-4


# Tiny GLM-5 (MLA + DSA with IndexShare + MoE): index_topk covers these short sequences (test_engine covers a sparse
# selection). Qwen3.5's A_log/dt_bias gradients are measured against a floor of 1e-3 of the global norm (docs/design.md).
@pytest.mark.parametrize(
    "model_type, floor_fraction", [("qwen3_5", 1e-3), ("glm_moe_dsa", 0.0)], ids=["gated-deltanet", "mla-dsa-moe"]
)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize(
    "prompt_gradient, reference_class",
    [("exact", GRPOTrainer), ("detach", DetachedReferenceTrainer)],
    ids=["exact-vs-stock", "detach-vs-detached-reference"],
)
def test_paper_families_match_the_reference(
    prompt_gradient,
    reference_class,
    loss_type,
    model_type,
    floor_fraction,
    fresh_model,
    tokenizer,
    prompt_dataset,
    tmp_path,
):
    ref_loss, loss, ref_grads, grads = run_pair(
        reference_class,
        fresh_model,
        tokenizer,
        prompt_dataset,
        tmp_path,
        model_type=model_type,
        loss_type=loss_type,
        beta=0.04,
        prompt_gradient=prompt_gradient,
    )
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (loss, ref_loss)
    assert max_relative_error(grads, ref_grads, floor_fraction=floor_fraction) <= 1e-4
