"""The exact merge of partial attention: a query's attention over the keys one rank holds is that rank's partial
`(o, lse)`, and partials merge by log-sum-exp, which is exact: on one rank that holds them all (`merge_partials`, the
steps' and rows' attention, `step.py`) or across the CP group (`merge_across`: an all-reduce of the max log-sum-exp and
then of the weighted outputs, the rollouts' decoding, where every rank decodes the same rows). DSA's top-k merges the
same way across the group: each rank's candidates, then the top-k of all of them (`merge_topk`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..block_attention import (
    _finite,
    blocks_forward,
    merge_by_lse,
    sinks_partial,
)
from .communication import ContextParallelGroup


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


def merge_partials(partials: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact softmax over the union of several key sets, from their partials (each `[..., dv + 1]`: the output
    then the log-sum-exp): what `merge_across` computes, where one rank holds every partial. One partial's weights
    at a time, so no stacked copy of them all."""
    lses = [partial[..., -1] for partial in partials]
    top = lses[0]
    for lse in lses[1:]:
        top = torch.maximum(top, lse)
    safe = _finite(top)
    merged, total = None, None
    for partial, lse in zip(partials, lses, strict=True):
        weight = torch.exp(lse - safe)
        weighted = weight[..., None] * partial[..., :-1]
        merged = weighted if merged is None else merged.add_(weighted)
        total = weight if total is None else total.add_(weight)
    merged /= torch.where(total > 0, total, torch.ones_like(total))[..., None]
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


def partial_attention(q, q_positions, scalars, blocks, tensors, value_dim, sinks):
    """This rank's `(o, lse)` over its blocks (and its sinks, on the rank that counts them); `lse = -inf` if none."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out, lse = blocks_forward(q, q_positions, scalars, blocks, tensors)
    if out is None:
        out, lse = empty_partial(q, value_dim, acc)
    if sinks is not None:
        out, lse = merge_by_lse(out, lse, torch.zeros_like(out), sinks_partial(sinks, lse))
    return out, lse
