"""Prefix-suffix attention merged by log-sum-exp, and its registration with transformers.

A replayed completion attends to the captured prompt (the *prefix*, read-only, possibly far larger than the
completion) and to itself (the *suffix*). Concatenating the two would copy the whole prefix per layer per replay and
autograd would keep that copy alive for backward. Instead each part is computed on its own, returning its output and
its log-sum-exp, and the two are merged exactly:

    lse = logaddexp(lse_p, lse_s);  o = exp(lse_p - lse) * o_p + exp(lse_s - lse) * o_s

The part over the prefix runs in chunks of keys with an online softmax; its backward recomputes chunk by chunk, so
no `[queries, prefix]` score matrix ever exists in full, forward or backward.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_IMPLEMENTATION = "longstraw"
STATE_KWARG = "longstraw_state"


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 inputs accumulate in fp32 like SDPA's math path; fp32/fp64 stay as they are.
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class Visibility:
    """Which earlier keys a query may see, by absolute position, on top of causality.

    `sliding_window`: keys less than `sliding_window` positions back (transformers' `sliding_window_overlay`).
    `chunk_size`: keys in the query's own chunk of `chunk_size` positions counted from `chunk_origin`, the first real
    token (Llama 4's chunked attention, transformers' `chunked_overlay`).
    """

    sliding_window: int | None = None
    chunk_size: int | None = None
    chunk_origin: int = 0

    def windowed(self) -> bool:
        return self.sliding_window is not None or self.chunk_size is not None


CAUSAL = Visibility()


def _chunk_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, visibility: Visibility) -> torch.Tensor | None:
    """Boolean `[rows, keys]` visibility (causal by absolute position, windowed or chunked), or None if all visible."""
    if not visibility.windowed() and int(k_positions[-1]) <= int(q_positions.min()):
        return None
    visible = k_positions[None, :] <= q_positions[:, None]
    if visibility.sliding_window is not None:
        visible &= (q_positions[:, None] - k_positions[None, :]) < visibility.sliding_window
    if visibility.chunk_size is not None:
        origin, size = visibility.chunk_origin, visibility.chunk_size
        visible &= (k_positions[None, :] - origin) // size == (q_positions[:, None] - origin) // size
    return visible


def _mask_scores(scores, q_positions, k_positions, start, end, visibility, selection, rows=slice(None)) -> None:
    """Set to -inf the scores of keys `start:end` that query rows `rows` may not see."""
    mask = _chunk_mask(q_positions[rows], k_positions[start:end], visibility)
    if selection is not None:
        selected = selection(start, end)[:, rows]
        mask = selected if mask is None else mask & selected
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))


# Query rows per step of the recomputing backward: with the key chunk, bounds its score-sized temporaries (scores,
# their gradient) to [kv_heads, BACKWARD_ROW_BLOCK, chunk_size] however many rows a prompt chunk has. Measured on the
# exact-mode prompt backward (tiny dense model, P = 8K): 1024 -> 128 rows cut its peak 0.60 -> 0.36 GiB and its time
# 19.7 -> 12.7 s (the tiles stay in cache).
BACKWARD_ROW_BLOCK = 128


def _soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-2's attention logit soft-capping, `softcap * tanh(scores / softcap)`, in place."""
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    return scores


def _masked_chunk(q, kc, vc, q_positions, k_positions, start, end, scaling, visibility, softcap, selection, acc):
    """One key chunk in plain torch: `(o [kv_heads, rows, dv], lse [kv_heads, rows])`, zero / -inf where unseen."""
    scores = _soft_cap(torch.matmul(q.to(acc), kc.to(acc).transpose(1, 2)).mul_(scaling), softcap)
    _mask_scores(scores, q_positions, k_positions, start, end, visibility, selection)
    lse = torch.logsumexp(scores, dim=-1)
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores.sub_(safe_lse[..., None]))
    return torch.matmul(probs, vc.to(acc)), lse


def _fused_chunk(q, kc, vc, q_positions, k_positions, start, end, scaling, visibility, softcap, selection):
    """The same chunk through PyTorch's fused CPU flash-attention kernel (which also returns the log-sum-exp), when
    no per-row mask is needed: keys all visible, or the queries' own tokens under a plain causal mask. None otherwise.

    The profile of the CPU path showed the plain-torch chunk (matmul + exp) at ~80% of an update; the fused kernel
    computes the same in ~1/9 of the time. Its backward is not needed: `ChunkedAttention.backward` recomputes.
    """
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16) or selection is not None:
        return None
    if softcap is not None or vc.shape[-1] != q.shape[-1]:  # the kernel has no soft-cap and one head size (not MLA's)
        return None
    kv_heads, rows, dim = q.shape
    tokens = end - start
    if _chunk_mask(q_positions, k_positions[start:end], visibility) is None:  # every key visible to every row
        query, key, value, causal = q[:, None], kc[:, None], vc[:, None], False
    elif (
        not visibility.windowed()
        and start == 0
        and end == k_positions.numel()
        and rows % tokens == 0
        and torch.equal(q_positions[:tokens], k_positions)
        and torch.equal(q_positions.view(-1, tokens), k_positions.expand(rows // tokens, tokens))
    ):  # the rows are groups of the key tokens themselves: a square causal mask per group
        groups = rows // tokens
        query = q.view(kv_heads, groups, tokens, dim)
        key = kc[:, None].expand(kv_heads, groups, tokens, dim)
        value = vc[:, None].expand(kv_heads, groups, tokens, vc.shape[-1])
        causal = True
    else:
        return None
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key.to(q.dtype), value.to(q.dtype), 0.0, causal, scale=scaling
    )[:2]
    acc = _accumulation_dtype(q.dtype)
    return out.reshape(kv_heads, rows, -1).to(acc), lse.reshape(kv_heads, rows).to(acc)


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over the union of two disjoint key sets, from each set's output and log-sum-exp.

    `lse = logaddexp(lse_a, lse_b)`, `o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b`, computed in the dtype of the
    log-sum-exps (fp32 or wider). Rows that saw no key in either set keep `o = 0`, `lse = -inf`. Returns `(o, lse)`,
    `o` in `out_a`'s dtype.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - safe)[..., None]
    weight_b = torch.exp(lse_b - safe)[..., None]
    out = weight_a * out_a.to(weight_a.dtype) + weight_b * out_b.to(weight_b.dtype)
    return out.to(out_a.dtype), lse


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention sinks (gpt-oss): one learned logit per head joins every softmax denominator, with a zero value.

    `out [batch, heads, tokens, dv]`, `lse [batch, heads, tokens]` over all real keys, `sinks [heads]`. The sink is a
    key set of its own (output 0, log-sum-exp `sinks[h]`) merged by LSE, so its gradient reaches the parameter.
    """
    sink_lse = sinks.to(lse.dtype)[None, :, None].expand_as(lse)
    merged, _ = merge_by_lse(out, lse, torch.zeros_like(out), sink_lse)
    return merged


class ChunkedAttention(torch.autograd.Function):
    """Attention of grouped queries over one key/value block, in key chunks, returning output and log-sum-exp.

    Shapes: `q [kv_heads, rows, d]` (a kv head's query heads, batch and tokens folded into rows), `k [kv_heads, keys,
    d]`, `v [kv_heads, keys, dv]`, `q_positions [rows]`, `k_positions [keys]` (absolute token positions). Keys may
    live on another device than the queries (host-resident prompt state): each chunk is staged on use. `selection`,
    if given, maps a key range `(start, end)` to a boolean `[kv_heads or 1, rows, end - start]` of the keys each row
    may see (DSA's top-k), on top of causality and `visibility`; `softcap` caps the scores (Gemma 2).
    Returns `o [kv_heads, rows, dv]` (zero for rows that see no key) and `lse [kv_heads, rows]` (-inf there).
    """

    @staticmethod
    def forward(ctx, q, k, v, q_positions, k_positions, scaling, visibility, chunk_size, softcap=None, selection=None):
        acc = _accumulation_dtype(q.dtype)
        out = lse = None
        for start in range(0, k.shape[1], chunk_size):
            end = min(start + chunk_size, k.shape[1])
            kc = k[:, start:end].to(q.device, non_blocking=True)
            vc = v[:, start:end].to(q.device, non_blocking=True)
            chunk_args = (q, kc, vc, q_positions, k_positions, start, end, scaling, visibility, softcap, selection)
            part = _fused_chunk(*chunk_args)
            if part is None:
                part = _masked_chunk(*chunk_args, acc)
            out, lse = part if out is None else merge_by_lse(out, lse, *part)
        ctx.save_for_backward(q, k, v, q_positions, k_positions, out, lse)
        ctx.scaling, ctx.visibility, ctx.chunk_size = scaling, visibility, chunk_size
        ctx.softcap, ctx.selection = softcap, selection
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, q_positions, k_positions, out, lse = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        acc = out.dtype
        qf = q.to(acc)
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(acc)
        grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse.to(acc)
        # d lse / d score = p; d o / d score = p * (v - o): both folded into one per-row correction term.
        row_term = grad_lse - (grad_out * out).sum(dim=-1)
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        grad_q = torch.zeros_like(qf) if need_q else None
        grad_k = torch.zeros(k.shape, dtype=k.dtype, device=k.device) if need_k else None
        grad_v = torch.zeros(v.shape, dtype=v.dtype, device=v.device) if need_v else None
        for start in range(0, k.shape[1], ctx.chunk_size):
            end = min(start + ctx.chunk_size, k.shape[1])
            kc = k[:, start:end].to(q.device, acc)
            vc = v[:, start:end].to(q.device, acc)
            chunk_grad_k = torch.zeros_like(kc) if need_k else None
            chunk_grad_v = torch.zeros_like(vc) if need_v else None
            for row_start in range(0, q.shape[1], BACKWARD_ROW_BLOCK):
                rows = slice(row_start, row_start + BACKWARD_ROW_BLOCK)
                scores = torch.matmul(qf[:, rows], kc.transpose(1, 2)).mul_(ctx.scaling)
                capped = None
                if ctx.softcap is not None:  # d(c tanh(s / c)) / ds = 1 - tanh(s / c)^2
                    capped = scores.div_(ctx.softcap).tanh_()
                    scores = capped * ctx.softcap
                _mask_scores(scores, q_positions, k_positions, start, end, ctx.visibility, ctx.selection, rows)
                probs = torch.exp(scores.sub_(safe_lse[:, rows, None]))
                if need_v:
                    chunk_grad_v += torch.matmul(probs.transpose(1, 2), grad_out[:, rows])
                grad_scores = probs.mul_(
                    torch.matmul(grad_out[:, rows], vc.transpose(1, 2)).add_(row_term[:, rows, None])
                )
                if capped is not None:
                    grad_scores.mul_(1 - capped.square_())
                grad_scores.mul_(ctx.scaling)
                if need_q:
                    grad_q[:, rows] += torch.matmul(grad_scores, kc)
                if need_k:
                    chunk_grad_k += torch.matmul(grad_scores.transpose(1, 2), qf[:, rows])
            if need_k:
                grad_k[:, start:end] = chunk_grad_k.to(k.device, k.dtype)
            if need_v:
                grad_v[:, start:end] = chunk_grad_v.to(v.device, v.dtype)
        grad_q = grad_q.to(q.dtype) if need_q else None
        return grad_q, grad_k, grad_v, None, None, None, None, None, None, None


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    scaling: float,
    visibility: Visibility,
    chunk_size: int,
    selected: Callable[[int, int], torch.Tensor] | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention of `q [batch, heads, tokens, d]` over `k, v [kv_heads, keys, d]` shared by the batch.

    Returns `o [batch, heads, tokens, dv]` and `lse [batch, heads, tokens]`. The kv heads are never repeated: the
    query heads of one kv head are folded into rows, so a GQA prefix is read once per chunk, not once per query head.
    `selected(start, end)`, if given, returns the boolean `[batch, tokens, end - start]` of keys each token may see.
    """
    batch, heads, tokens, dim = q.shape
    kv_heads = k.shape[0]
    groups = heads // kv_heads
    rows = q.view(batch, kv_heads, groups, tokens, dim).permute(1, 0, 2, 3, 4).reshape(kv_heads, -1, dim)
    row_positions = q_positions.repeat(batch * groups)
    selection = None
    if selected is not None:

        def selection(start: int, end: int) -> torch.Tensor:  # rows are (batch, group, token) within a kv head
            chunk = selected(start, end)[:, None].expand(batch, groups, tokens, end - start)
            return chunk.reshape(1, batch * groups * tokens, end - start)

    out, lse = ChunkedAttention.apply(
        rows, k, v, row_positions, k_positions, scaling, visibility, chunk_size, softcap, selection
    )
    out = out.view(kv_heads, batch, groups, tokens, -1).permute(1, 0, 2, 3, 4).reshape(batch, heads, tokens, -1)
    lse = lse.view(kv_heads, batch, groups, tokens).permute(1, 0, 2, 3).reshape(batch, heads, tokens)
    return out, lse


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
    if sinks is None and softcap is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            sliding_window=sliding_window,
            **kw,
        )
    # The modeling file's own eager attention implements its sinks / soft-capping; it adds the mask to the scores.
    eager = sys.modules[type(module).__module__].eager_attention_forward
    if attention_mask is None:  # SDPA's mask may be skipped in favour of `is_causal`; eager needs it spelled out
        queries, keys = query.shape[2], key.shape[2]
        q_positions = torch.arange(keys - queries, keys, device=query.device)
        attention_mask = _chunk_mask(q_positions, torch.arange(keys, device=query.device), Visibility(sliding_window))
        attention_mask = None if attention_mask is None else attention_mask[None, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill_(
            ~attention_mask, torch.finfo(query.dtype).min
        )
    extra = {"s_aux": sinks} if sinks is not None else {"softcap": softcap}
    return eager(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=scaling,
        dropout=dropout,
        sliding_window=sliding_window,
        **extra,
        **kw,
    )


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
