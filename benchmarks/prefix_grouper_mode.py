"""The peer baseline: Prefix Grouper (PyPI `prefix-grouper`, arXiv 2506.05433) inside stock `GRPOTrainer`.

Prefix Grouper packs one prompt and its G completions into one row `[prompt, c_1, ..., c_G]`, runs the prompt's
self-attention once, and gives every completion an attention over `[prompt keys, own keys]` (the prompt's K/V are
repeated G times, `batch_repeat_cat`). The prompt is computed once per group, under autograd, so the gradient is
stock GRPO's (exact), and the prompt's activations are kept for backward once (not G times).

Integration (version 0.0.1.post1): its `AttentionForward` takes any `attn_func(q, k, v, key_padding_mask, ...)`;
its own transformers adapter only forwards to `flash_attention_2` (no CPU), and its README lists SDPA as future work,
so this module supplies the SDPA adapter (bottom-right-aligned causal mask + key padding, torch SDPA with GQA),
position ids (every completion restarts at the prompt's end), and the log-probs through TRL's own chunked log-prob
kernel (the one `fused_lm_head=True` runs), scored on the completion positions only. Everything else is
`GRPOTrainer._compute_loss`: same loss, normalisers and metrics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface
from trl import GRPOTrainer

ATTENTION_NAME = "prefix_grouper_sdpa"


def _sdpa_adapter(q, k, v, key_padding_mask, module=None, scaling=None, **_):
    """`q [b, H, Lq, d]` over `k, v [b, KV, Lk, d]`; queries are the last Lq positions (bottom-right causal)."""
    lq, lk = q.shape[2], k.shape[2]
    key_padding_mask = key_padding_mask.to(q.device).bool()
    if lq == lk and bool(key_padding_mask.all()):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        q_idx = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        k_idx = torch.arange(lk, device=q.device)[None, :]
        # padded query rows see their own (padded) key, so no row is fully masked (their outputs are dropped anyway)
        mask = (key_padding_mask[:, None, None, :] & (k_idx <= q_idx)) | (k_idx == q_idx)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()  # [b, Lq, H, d], as PrefixGrouper.group expects


def _attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    prefix_grouper=None,
    **kwargs,
):
    if prefix_grouper is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            sliding_window=sliding_window,
            **kwargs,
        )
    if sliding_window is not None:
        raise NotImplementedError("the Prefix Grouper SDPA adapter here does not implement sliding windows")
    return prefix_grouper.forward(_sdpa_adapter, query, key, value, module=module, scaling=scaling), None


def _no_mask(*args, **kwargs):
    return None  # the adapter builds its own masks from the PrefixGrouper's padding masks


def register() -> None:
    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


class PrefixGrouperGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose policy forward is one Prefix Grouper row per group (shared prompt computed once)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        register()
        self.accelerator.unwrap_model(self.model).set_attn_implementation(ATTENTION_NAME)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        from prefix_grouper import PrefixGrouper
        from trl.kernels import ChunkedLogProbFunction

        if compute_aux_loss or any(value is not None for value in multimodal.values()):
            raise ValueError("the Prefix Grouper baseline here is text-only, without MoE aux loss")
        group = self.num_generations if self.model.training else self.num_generations_eval
        prompt_ids, prompt_mask = input_ids[:, :-logits_to_keep], attention_mask[:, :-logits_to_keep]
        completion_ids, completion_mask = input_ids[:, -logits_to_keep:], attention_mask[:, -logits_to_keep:]
        rows = prompt_ids.shape[0]
        firsts = torch.arange(0, rows, group, device=input_ids.device)
        for offset in range(group):  # every row of a group must carry the group's prompt
            if not torch.equal(prompt_ids[firsts + offset], prompt_ids[firsts]):
                raise ValueError("Prefix Grouper needs the rows of a group to share one prompt")
        if not bool(
            (completion_mask.cumsum(1) == completion_mask.sum(1, keepdim=True))
            .logical_or(completion_mask.bool())
            .all()
        ):
            raise ValueError("completions must be right-padded")
        g_prompt_ids, g_prompt_mask = prompt_ids[firsts], prompt_mask[firsts]
        grouper = PrefixGrouper.from_ungrouped_masks(
            prefix_mask=g_prompt_mask,
            suffix_mask=completion_mask,
            group_sizes=group,
            padding_mode="right",
            device=input_ids.device,
        )
        packed = grouper.concat_input(g_prompt_ids, g_prompt_mask, completion_ids, completion_mask)
        # Positions as the stock padded forward numbers them: left padding counts, every completion restarts at
        # the prompt's end.
        width = prompt_ids.shape[1]
        positions = torch.zeros_like(packed)
        for index, info in enumerate(grouper.group_info):
            first = width - info.prefix_len
            pieces = [torch.arange(first, width)]
            pieces += [torch.arange(width, width + length) for length in info.suffix_lens]
            line = torch.cat(pieces)
            positions[index, : line.numel()] = line
        unwrapped = self.accelerator.unwrap_model(model)
        with self.accelerator.autocast():
            hidden = unwrapped.base_model(
                input_ids=packed, position_ids=positions, use_cache=False, prefix_grouper=grouper
            ).last_hidden_state
            _, _, suffix_hidden, suffix_mask = grouper.split_output(hidden, include_prefix_last=1)
            suffix_hidden = suffix_hidden[:, :-1]  # [last prompt token, c_0 .. c_{T-2}] predicts c_0 .. c_{T-1}
            real = suffix_mask[:, 1:].bool()
            width_c = real.shape[1]
            labels = completion_ids[:, :width_c]
            head = unwrapped.get_output_embeddings()
            text_config = unwrapped.config.get_text_config()
            logp, entropy, *_ = ChunkedLogProbFunction.apply(
                suffix_hidden[real],
                head.weight,
                head.bias,
                labels[real],
                self.temperature,
                32768,
                getattr(text_config, "final_logit_softcapping", None),
                getattr(text_config, "logit_scale", None) or 1.0,
                ("log_probs", "entropy"),
            )
        logps = logp.new_zeros(completion_ids.shape)
        logps[:, :width_c] = logps[:, :width_c].masked_scatter(real, logp)
        entropies = None
        if compute_entropy:
            entropies = entropy.new_zeros(completion_ids.shape)
            entropies[:, :width_c] = entropies[:, :width_c].masked_scatter(real, entropy)
        return logps, entropies, None
