"""LongStraw's attention as transformers calls it: the `longstraw` implementation registered in its
`AttentionInterface`, reading the prompt state a forward carries (`longstraw_state=`), stock attention otherwise.

The kernels (key blocks as one softmax, the fused CPU / CUDA calls, the DSA gather) are `block_attention.py`'s; the
state each kind keeps and how it attends are `state/`'s.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .block_attention import Visibility, visible_keys

ATTENTION_IMPLEMENTATION = "longstraw"
STATE_KWARG = "longstraw_state"


def longstraw_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: LongStraw's prompt state when a forward carries one, stock otherwise.

    A forward that does not pass `longstraw_state=` (generation, evaluation of other metrics) runs as transformers
    would: SDPA, or the model's own eager attention where SDPA cannot express it (attention sinks, logit
    soft-capping). With a state, attention sinks (`s_aux`, gpt-oss) and soft-capping (`softcap`, Gemma 2) are
    applied by the prompt state's attention.
    """
    state_access = kwargs.pop(STATE_KWARG, None)
    sinks = kwargs.pop("s_aux", None)
    softcap = kwargs.pop("softcap", None)
    if state_access is None:
        return _stock_attention(
            module, query, key, value, attention_mask, scaling, dropout, sliding_window, sinks, softcap, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = state_access.attend(
        module,
        query,
        key,
        value,
        scaling=scaling,
        sliding_window=sliding_window,
        indices=kwargs.get("indices"),
        sinks=sinks,
        softcap=softcap,
    )
    return out.transpose(1, 2).contiguous(), None


def _stock_attention(
    module, query, key, value, attention_mask, scaling, dropout, sliding_window, sinks, softcap, **kw
):
    indices = kw.pop("indices", None)
    if indices is not None:  # DSA top-k: transformers turns it into a mask only for its own eager/sdpa names
        attention_mask = _restrict_to_selection(attention_mask, indices, key.shape[2])
    common = {"scaling": scaling, "dropout": dropout, "sliding_window": sliding_window, **kw}
    if sinks is None and softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **common)
    # The modeling file's own eager attention implements its sinks / soft-capping; it adds the mask to the scores.
    eager = sys.modules[type(module).__module__].eager_attention_forward
    if attention_mask is None:  # SDPA's mask may be skipped in favour of `is_causal`; eager needs it spelled out
        queries, keys = query.shape[2], key.shape[2]
        q_positions = torch.arange(keys - queries, keys)
        attention_mask = visible_keys(q_positions, torch.arange(keys), Visibility(sliding_window), query.device)
        attention_mask = None if attention_mask is None else attention_mask[None, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill_(
            ~attention_mask, torch.finfo(query.dtype).min
        )
    extra = {"s_aux": sinks} if sinks is not None else {"softcap": softcap}
    return eager(module, query, key, value, attention_mask, **extra, **common)


def _restrict_to_selection(attention_mask: torch.Tensor, indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The causal mask further restricted to each query's top-k keys, as transformers does for DSA under SDPA."""
    batch, tokens = indices.shape[:2]
    selected = indices.new_zeros((batch, tokens, num_keys), dtype=torch.bool).scatter(-1, indices.long(), True)
    if attention_mask.dtype == torch.bool:
        return attention_mask & selected[:, None]
    return attention_mask.masked_fill(~selected[:, None], torch.finfo(attention_mask.dtype).min)


def register_attention() -> None:
    """Register the `longstraw` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, longstraw_attention_forward)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)
