"""The references LongStraw's update is compared with: stock `GRPOTrainer`, and the detached reference.

The detached reference is the straightforward way to hold the prompt constant: the prompt is cached by transformers'
own cache under `no_grad`, and each completion is replayed under autograd on a deep copy of that cache.
"""

import copy

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionLayer
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from trl import GRPOTrainer

from trl_longstraw import LongStrawGRPOTrainer
from trl_longstraw.preflight import positions_follow_mask

from .conftest import add_old_and_ref_logps, grads_of, make_trainer, max_relative_error, synthetic_inputs

LOSS_TYPES = ["grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]


class OutOfPlaceLinearAttentionLayer(LinearAttentionLayer):
    """HF's recurrent cache layer, except that the recurrent state is replaced instead of `copy_`-ed into: HF's
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
    """Prompt cached by HF under no_grad, each completion replayed on a deep copy of the cache. With the MoE
    load-balancing loss, transformers' `load_balancing_loss_func` over every row's tokens: the prompt's router logits
    from the no-grad prefill, the rest from a backbone forward of the whole completion under autograd."""

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, compute_aux_loss=False, **kwargs
    ):
        rows_logps, rows_entropies, router_logits, routed = [], [], [], []
        counts_real_tokens = positions_follow_mask(model)  # as stock's padded forward numbers positions
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            prompt_mask = mask[:-logits_to_keep].bool()
            first = 0 if counts_real_tokens else int((~prompt_mask).sum())
            prompt = ids[:-logits_to_keep][prompt_mask]
            completion = ids[-logits_to_keep:]
            length = int(mask[-logits_to_keep:].sum())
            positions = torch.arange(first, first + prompt.numel() + logits_to_keep)
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                prefill = model.base_model(
                    input_ids=prompt[None, :-1],
                    position_ids=positions[None, : prompt.numel() - 1],
                    cache=cache,
                    use_cache=True,
                    **({"output_router_logits": True} if compute_aux_loss else {}),
                )
            if compute_aux_loss:  # the row's prompt, then its last prompt token and whole completion
                whole = model.base_model(
                    input_ids=torch.cat([prompt[-1:], completion])[None],
                    position_ids=positions[None, prompt.numel() - 1 :],
                    cache=replayable_copy(cache),
                    output_router_logits=True,
                )
                router_logits.append([torch.cat(pair) for pair in zip(prefill.router_logits, whole.router_logits)])
                routed.append(torch.cat([torch.ones(prompt.numel()), mask[-logits_to_keep:].float()]))
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
        aux_loss = None
        if compute_aux_loss:
            config = model.config.get_text_config()
            aux_loss = load_balancing_loss_func(
                tuple(torch.cat(layer) for layer in zip(*router_logits)),
                config.num_experts,
                config.num_experts_per_tok,
                torch.cat(routed),
            )
        return torch.stack(rows_logps), torch.stack(rows_entropies), aux_loss


# Exact mode against stock GRPOTrainer, detach mode against the detached reference.
AGAINST_THE_REFERENCE = pytest.mark.parametrize(
    "prompt_gradient, reference_class",
    [("exact", GRPOTrainer), ("detach", DetachedReferenceTrainer)],
    ids=["exact-vs-stock", "detach-vs-detached-reference"],
)


def assert_matches_the_reference(ref_loss, loss, ref_grads, grads, floor_fraction=0.0):
    """Loss to 1e-5 and every gradient tensor to 1e-4 relative (`floor_fraction`: see `max_relative_error`)."""
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (loss, ref_loss)
    assert max_relative_error(grads, ref_grads, floor_fraction=floor_fraction) <= 1e-4


def run_pair(
    reference_class,
    fresh_model,
    tokenizer,
    prompt_dataset,
    tmp_path,
    dtype=torch.float32,
    model_type="qwen3",
    batch_shape=None,
    **args,
):
    """The reference's loss and gradients and LongStraw's `replay_and_backward`'s, on one synthetic batch
    (`synthetic_inputs`, of `batch_shape`: its prompt and completion lengths)."""
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
    inputs = add_old_and_ref_logps(reference, synthetic_inputs(len(tokenizer), **(batch_shape or {})))
    if dtype == torch.float64:
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    ref_loss = reference.compute_loss(reference.model, inputs)
    ref_loss.backward()
    loss = ours.replay_and_backward(ours.model, inputs)
    return ref_loss.detach(), loss, grads_of(reference.model), grads_of(ours.model)
