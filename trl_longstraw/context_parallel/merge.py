"""The exact merge of partial attention across ranks: log-sum-exp across the CP group, and its autograd function.

A query's attention over a shard is computed where the shard lives, as that shard's partial `(o, lse)`; the partials
are merged by an all-reduce of the max log-sum-exp and then of the weighted outputs (`merge_across`), which is exact.
`ContextParallelAttention`'s backward gives each rank the gradient of its own partial (the ring-attention identity: a
key block's gradients need only the global output and log-sum-exp) and all-reduces (sums) the gradients of the
query-side inputs (q, the completion's own keys and values, sinks) inside the function, so every rank's upstream
graph receives the full gradient and every rank computes identical parameter gradients without any further
all-reduce. DSA's top-k is merged the same way: each rank's candidates, then the top-k of all of them (`merge_topk`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention import (
    KeyBlock,
    Visibility,
    _finite,
    blocks_backward,
    blocks_forward,
    merge_by_lse,
    sinks_gradient,
    sinks_partial,
)
from .communication import ContextParallelGroup, pack, unpack


def merge_across(out: torch.Tensor, lse: torch.Tensor, cp: ContextParallelGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact softmax over the union of every rank's keys, from each rank's partial `(out, lse)`: an all-reduce of
    the max log-sum-exp, then one of the weighted outputs with their weights. Same result on every rank."""
    top = cp.all_reduce(lse.clone(), op=dist.ReduceOp.MAX, kind="merge")
    safe = _finite(top)
    weight = torch.exp(lse - safe)
    packed = torch.cat([(weight[..., None] * out).reshape(-1), weight.reshape(-1)])
    cp.all_reduce(packed, kind="merge")
    total = packed[out.numel() :].view_as(weight)
    merged = packed[: out.numel()].view_as(out) / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return merged, safe + torch.log(total)


def merge_stacked(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact softmax over the union of several key sets, from their partials stacked on dim 0 (`out [n, ...,
    dv]`, `lse [n, ...]`): what `merge_across` computes, where one rank holds every partial."""
    safe = _finite(lse.max(0).values)
    weight = torch.exp(lse - safe)
    total = weight.sum(0)
    merged = (weight[..., None] * out).sum(0) / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return merged, safe + torch.log(total)


def merge_topk(
    candidates: tuple[torch.Tensor, torch.Tensor] | None, like: torch.Tensor, k: int, cp: ContextParallelGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-`k` of every rank's DSA index scores, from this rank's top-k `candidates` (scores and global key
    indices `[batch, tokens, <= k]`, or None: no key here; `like` gives the shape's batch and tokens): each rank's
    candidates in its slot of an all-reduce, then the top-k of all of them, the same on every rank (the global top-k
    is among the ranks' top-k). Where fewer than `k` keys exist, index `-1` pads."""
    shape = (cp.size, *like.shape[:2], k)
    slots = torch.zeros(shape, dtype=torch.float32, device=like.device)
    ids = torch.zeros(shape, dtype=torch.int64, device=like.device)
    slots[cp.rank], ids[cp.rank] = float("-inf"), -1
    if candidates is not None:
        values, indices = candidates
        slots[cp.rank, ..., : values.shape[-1]], ids[cp.rank, ..., : values.shape[-1]] = values, indices
    slots = cp.all_reduce(slots, kind="indexer")  # every slot has one contributor, the others add zeros
    ids = cp.all_reduce(ids, kind="indexer")
    merged = slots.permute(1, 2, 0, 3).reshape(*like.shape[:2], -1)
    values, best = merged.topk(k, dim=-1)
    return values, ids.permute(1, 2, 0, 3).reshape(merged.shape).gather(-1, best)


def empty_partial(q: torch.Tensor, value_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, tokens, _ = q.shape
    out = torch.zeros((batch, heads, tokens, value_dim), dtype=dtype, device=q.device)
    return out, torch.full((batch, heads, tokens), float("-inf"), dtype=dtype, device=q.device)


def partial_attention(q, q_positions, scaling, visibility, chunk_size, softcap, blocks, tensors, value_dim, sinks):
    """This rank's `(o, lse)` over its blocks (and its sinks, on the rank that counts them); `lse = -inf` if none."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out, lse = blocks_forward(q, q_positions, scaling, visibility, chunk_size, softcap, blocks, tensors)
    if out is None:
        out, lse = empty_partial(q, value_dim, acc)
    if sinks is not None:
        out, lse = merge_by_lse(out, lse, torch.zeros_like(out), sinks_partial(sinks, lse))
    return out, lse


@dataclass(frozen=True)
class AttentionCall:
    """The static side of one `ContextParallelAttention` call.

    `owns_suffix`: this rank counts the forward's own keys (and the sinks). `reduce_suffix`: every rank computed the
    own keys (replay in lockstep), so their gradients are summed across ranks like dq; otherwise (capture, recompute)
    only the owner has them. `on_backward`: the recompute's owner announces its backward to the serving ranks.
    """

    cp: ContextParallelGroup
    owns_suffix: bool
    reduce_suffix: bool
    q_positions: torch.Tensor
    scaling: float
    visibility: Visibility
    chunk_size: int
    softcap: float | None
    own_block: KeyBlock
    on_backward: Callable[[torch.Tensor], None] | None = None


class ContextParallelAttention(torch.autograd.Function):
    """Softmax attention of `q [batch, heads, tokens, d]` over the pages of every rank of the CP group plus this
    forward's own keys (counted on the rank that `owns_suffix` only), one softmax.

    Forward: this rank's partial over its pages (and the own keys and sinks where it owns them), merged across ranks.
    Backward: each rank's blocks get their gradients from the global output and log-sum-exp; the query-side gradients
    (q, sinks, and the own keys and values where every rank has them) are summed across ranks here, so every rank
    returns the full gradient.
    """

    @staticmethod
    def forward(ctx, q, sinks, own_k, own_v, call: AttentionCall, page_blocks, *page_tensors):
        with torch.autocast(q.device.type, enabled=False):
            blocks = page_blocks + ((call.own_block,) if call.owns_suffix else ())
            tensors = page_tensors + ((own_k, own_v) if call.owns_suffix else ())
            out, lse = partial_attention(
                q,
                call.q_positions,
                call.scaling,
                call.visibility,
                call.chunk_size,
                call.softcap,
                blocks,
                tensors,
                own_v.shape[-1],
                sinks if call.owns_suffix else None,
            )
            out, lse = merge_across(out, lse, call.cp)
        ctx.save_for_backward(q, sinks, own_k, own_v, out, lse, *page_tensors)
        ctx.call, ctx.blocks = call, blocks
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, sinks, own_k, own_v, out, lse, *page_tensors = ctx.saved_tensors
        call = ctx.call
        need = ctx.needs_input_grad
        with torch.autocast(q.device.type, enabled=False):
            d_out = d_out.to(out.dtype).contiguous()
            if call.on_backward is not None:
                call.on_backward(d_out)
            tensors = tuple(page_tensors) + ((own_k, own_v) if call.owns_suffix else ())
            flags = (True, *need[6:]) + ((need[2], need[3]) if call.owns_suffix else ())
            d_q, grads = blocks_backward(
                d_out,
                q,
                call.q_positions,
                out,
                lse,
                call.scaling,
                call.visibility,
                call.chunk_size,
                call.softcap,
                ctx.blocks,
                tensors,
                flags,
            )
            d_own_k, d_own_v = grads[len(page_tensors) :] if call.owns_suffix else (None, None)
            pieces = [d_q]
            if call.reduce_suffix:
                d_own_k = torch.zeros_like(own_k, dtype=out.dtype) if d_own_k is None else d_own_k.to(out.dtype)
                d_own_v = torch.zeros_like(own_v, dtype=out.dtype) if d_own_v is None else d_own_v.to(out.dtype)
                pieces += [d_own_k, d_own_v]
            if sinks is not None:
                own_sinks = None
                if call.owns_suffix:
                    own_sinks = sinks_gradient(sinks, lse, (d_out * out).sum(-1)).to(out.dtype)
                pieces.append(torch.zeros_like(sinks, dtype=out.dtype) if own_sinks is None else own_sinks)
            summed = unpack(call.cp.all_reduce(pack(pieces), kind="backward"), pieces)
        d_q = summed[0].to(q.dtype)
        if call.reduce_suffix:
            d_own_k, d_own_v = summed[1], summed[2]
        d_own_k = d_own_k.to(own_k.dtype) if need[2] and d_own_k is not None else None
        d_own_v = d_own_v.to(own_v.dtype) if need[3] and d_own_v is not None else None
        d_sinks = summed[-1].to(sinks.dtype) if sinks is not None and need[1] else None
        return (d_q, d_sinks, d_own_k, d_own_v, None, None, *grads[: len(page_tensors)])
