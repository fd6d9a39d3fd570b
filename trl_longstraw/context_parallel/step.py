"""A capture step's attention at one layer, every rank's chunk at once, as one autograd function.

In a capture (and in the exact-mode recompute, which runs the same steps in reverse) every rank of the CP group runs its
chunk of the step through the same layer at the same time (`sharding.py`). A query of the step reads the pages of
earlier steps, which every rank holds a share of, the step's earlier chunks, and its own chunk causally. Each rank
computes, after one all-gather of the step's queries, keys and values (one chunk per rank, never a rank's pages):

- every query of the step over its pages (before the step),
- its own queries over its own chunk, causally (with the attention sinks, counted once),
- for each later chunk of the step, the first half of that chunk's queries over its own chunk; the later chunk's rank
  computes the second half over the gathered copy. So every rank does the same attention work in every step,
  whatever its place in the step (the rank that holds the first chunk would otherwise do the most).

Rows after the prompt (scoring and replay, every rank running its own members: `starts` None) are the same without
chunks between ranks: every rank computes every rank's rows over its pages, and its own rows over their own keys.

The partials go to their queries' ranks (one all-to-all) and are merged by log-sum-exp there, which is exact. The
backward is the same work in reverse (the ring-attention identity: a key block's gradients need only the merged output
and log-sum-exp): the step's output gradients, outputs and log-sum-exps are all-gathered, each rank back-propagates the
partials it computed, the query gradients go back to the queries' ranks and the gathered keys' and values' gradients
to the chunks' ranks (all-to-all each); the pages get theirs where they live.

Communication (elements each rank sends to each other rank, `COMMUNICATION`), per layer, for `n` tokens (a chunk of
the step, padded to the step's longest, or a rank's rows), `heads` query heads of width `d`, `kv` key heads, value width
`dv`: forward `n (heads d + kv (d + dv) + heads (dv + 1))` (the queries, keys and values gathered, the partials sent
back; rows gather no keys or values: `n heads (d + dv + 1)`); backward `n (heads d + kv (d + dv))` again (gathered
anew rather than kept), `n heads (2 dv + 1)` (the output gradients, outputs and log-sum-exps), `n heads d` (the query
gradients) and, for chunks, `n kv (d + dv)` (the gathered keys' and values' gradients; rows: none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import KeyBlock, Visibility, blocks_backward, merge_by_lse, sinks_gradient, visits
from .communication import ContextParallelGroup
from .merge import empty_partial, merge_stacked, partial_attention


@dataclass(frozen=True)
class StepCall:
    """The static side of one step attention call (every field by rank where it is a tuple)."""

    cp: ContextParallelGroup
    starts: tuple[int, ...] | None  # each rank's chunk's first captured-token index; None: rows after the prompt
    positions: tuple[torch.Tensor, ...]  # each rank's queries' absolute positions (host)
    page_blocks: tuple[tuple[KeyBlock, ...], ...]  # this rank's pages as each rank's queries read them
    selections: tuple[torch.Tensor, ...] | None  # DSA: each rank's top-k (captured-token indices), or None
    scaling: float
    visibility: Visibility
    chunk_size: int
    softcap: float | None
    kind: str  # the communication counter
    rows_first_index: int = 0  # rows after the prompt: the key index of their first own entry (the prompt's length)

    def terms(self) -> list[tuple[int, slice, object, KeyBlock | tuple[KeyBlock, ...]]]:
        """The partials this rank computes: `(queries' rank, their slice, key source, blocks)`, where the source is
        "pages", "own" (this rank's chunk) or the rank of a gathered earlier chunk."""
        me = self.cp.rank
        terms = []
        for rank in range(self.cp.size):
            tokens = len(self.positions[rank])
            terms.append((rank, slice(0, tokens), "pages", self.page_blocks[rank]))
            if rank == me:
                terms.append((rank, slice(0, tokens), "own", (self._chunk_block(me, rank, slice(0, tokens)),)))
            elif self.starts is not None and self.starts[rank] > self.starts[me]:
                head = slice(0, tokens // 2)
                terms.append((rank, head, "own", (self._chunk_block(me, rank, head),)))
        tokens = len(self.positions[me])
        for rank in range(self.cp.size if self.starts is not None else 0):
            if self.starts[rank] < self.starts[me]:
                tail = slice(tokens // 2, tokens)
                terms.append((me, tail, rank, (self._chunk_block(rank, me, tail),)))
        return terms

    def _chunk_block(self, holder: int, reader: int, rows: slice) -> KeyBlock:
        """`holder`'s chunk as rows `rows` of `reader`'s queries read it (picked by their DSA selection)."""
        selection = None if self.selections is None else self.selections[reader][:, rows]
        first = self.starts[holder] if self.starts is not None else self.rows_first_index
        picked = None if selection is None else selection.long() - first
        return KeyBlock(self.positions[holder], shared=False, picked=picked)


def _term_kind(term) -> tuple:
    """What decides a partial's computation besides its data (`attention.visits`): its key source's kind (the pages,
    the own chunk, another rank's), its rows, and its blocks' lengths and top-k widths."""
    _, rows, source, blocks = term
    blocks = blocks if isinstance(blocks, tuple) else (blocks,)
    shapes = tuple(
        (len(block.positions), None if block.picked is None else tuple(block.picked.shape)) for block in blocks
    )
    return source if isinstance(source, str) else "chunk", rows.stop - rows.start, shapes


def _padded(tensor: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor.contiguous()
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def gather_step(cp: ContextParallelGroup, tensor: torch.Tensor, lengths: list[int], dim: int, kind: str):
    """Every rank's `tensor` (its chunk's `lengths[rank]` tokens along `dim`), by rank."""
    return gather_together(cp, [tensor], [dim], lengths, kind)[0]


def gather_together(cp, tensors: list[torch.Tensor], dims: list[int], lengths: list[int], kind: str):
    """Every rank's `tensors` (of one dtype; each its chunk's `lengths[rank]` tokens along its dim), in one
    all-gather: by tensor, then by rank."""
    padded = [_padded(tensor, dim, max(lengths)) for tensor, dim in zip(tensors, dims, strict=True)]
    gathered = cp.all_gather(torch.cat([piece.reshape(-1) for piece in padded]), kind)
    result, offset = [], 0
    for piece, dim in zip(padded, dims, strict=True):
        ranks = [flat[offset : offset + piece.numel()].view(piece.shape) for flat in gathered]
        result.append([part.narrow(dim, 0, length) for part, length in zip(ranks, lengths, strict=True)])
        offset += piece.numel()
    return result


def exchange(cp: ContextParallelGroup, pieces: list[torch.Tensor], dim: int, length: int, kind: str):
    """`pieces[rank]` to each rank (padded along `dim`), and what every rank sent here, cut to `length`, by rank."""
    width = max(piece.shape[dim] for piece in pieces)
    received = cp.all_to_all([_padded(piece, dim, width) for piece in pieces], kind)
    return [piece.narrow(dim, 0, length) for piece in received]


class StepAttention(torch.autograd.Function):
    """`q [batch, heads, tokens, d]` of this rank's chunk over the pages of every rank before the step, the step's
    earlier chunks and its own keys (causal), as one softmax (module docstring)."""

    @staticmethod
    def forward(ctx, q, sinks, own_k, own_v, call: StepCall, *page_tensors):
        cp, me = call.cp, call.cp.rank
        lengths = [len(positions) for positions in call.positions]
        with torch.autocast(q.device.type, enabled=False):
            queries, keys, values = _gathered(call, q, own_k, own_v, lengths)
            value_dim = own_v.shape[-1]
            acc = torch.promote_types(q.dtype, torch.float32)
            partials = [empty_partial(query, value_dim, acc) for query in queries]
            for rank, rows, source, blocks in visits(call.terms(), key=_term_kind):
                tensors = _source(source, page_tensors, own_k, own_v, keys, values)
                part = partial_attention(
                    queries[rank][:, :, rows],
                    call.positions[rank][rows],
                    call.scaling,
                    call.visibility,
                    call.chunk_size,
                    call.softcap,
                    blocks,
                    tensors,
                    value_dim,
                    sinks if (rank, source) == (me, "own") else None,
                )
                out, lse = partials[rank]
                merged = merge_by_lse(out[:, :, rows], lse[..., rows], *part)
                out, lse = out.clone(), lse.clone()
                out[:, :, rows], lse[..., rows] = merged
                partials[rank] = (out, lse)
            sent = [torch.cat([out, lse[..., None]], dim=-1) for out, lse in partials]
            received = torch.stack(exchange(cp, sent, 2, lengths[me], call.kind))
            out, lse = merge_stacked(received[..., :-1], received[..., -1])
        ctx.save_for_backward(q, sinks, own_k, own_v, out, lse, *page_tensors)
        ctx.call, ctx.lengths = call, lengths
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, sinks, own_k, own_v, out, lse, *page_tensors = ctx.saved_tensors
        call, lengths = ctx.call, ctx.lengths
        cp, me = call.cp, call.cp.rank
        need = ctx.needs_input_grad
        with torch.autocast(q.device.type, enabled=False):
            d_out = d_out.to(out.dtype)
            queries, keys, values = _gathered(call, q, own_k, own_v, lengths)
            merged = gather_step(cp, torch.cat([d_out, out, lse[..., None]], dim=-1), lengths, 2, call.kind)
            value_dim = out.shape[-1]
            d_queries = [torch.zeros(query.shape, dtype=out.dtype, device=q.device) for query in queries]
            d_own = [torch.zeros_like(own_k), torch.zeros_like(own_v)]
            d_keys = [
                [torch.zeros_like(k), torch.zeros_like(v)] for k, v in zip(keys or (), values or (), strict=True)
            ]
            d_pages = [None] * len(page_tensors)
            for rank, rows, source, blocks in visits(call.terms(), key=_term_kind):
                tensors = _source(source, page_tensors, own_k, own_v, keys, values)
                grad_out, out_rank, lse_rank = merged[rank][:, :, rows].split([value_dim, value_dim, 1], dim=-1)
                flags = (True, *(need[5:] if source == "pages" else (True, True)))
                d_q, grads = blocks_backward(
                    grad_out,
                    queries[rank][:, :, rows],
                    call.positions[rank][rows],
                    out_rank,
                    lse_rank[..., 0],
                    call.scaling,
                    call.visibility,
                    call.chunk_size,
                    call.softcap,
                    blocks,
                    tensors,
                    flags,
                )
                d_queries[rank][:, :, rows] += d_q
                targets = d_pages if source == "pages" else d_own if source == "own" else d_keys[source]
                for index, grad in enumerate(grads):
                    if grad is not None:
                        targets[index] = grad if targets[index] is None else targets[index] + grad
            d_q = torch.stack(exchange(cp, d_queries, 2, lengths[me], call.kind)).sum(0)
            returned = []
            if call.starts is not None:  # the step's earlier chunks' keys and values, back to their ranks
                returned = exchange(cp, [torch.cat([k, v], dim=-1) for k, v in d_keys], 1, lengths[me], call.kind)
            for piece in returned:
                d_k, d_v = piece.split([own_k.shape[-1], own_v.shape[-1]], dim=-1)
                d_own[0], d_own[1] = d_own[0] + d_k, d_own[1] + d_v
            d_sinks = None
            if sinks is not None and need[1]:
                d_sinks = sinks_gradient(sinks, lse, (d_out * out).sum(-1))
        return (
            d_q.to(q.dtype),
            d_sinks,
            d_own[0].to(own_k.dtype) if need[2] else None,
            d_own[1].to(own_v.dtype) if need[3] else None,
            None,
            *(
                None if grad is None else grad.to(tensor.dtype)
                for grad, tensor in zip(d_pages, page_tensors, strict=True)
            ),
        )


def _gathered(call: StepCall, q, own_k, own_v, lengths):
    """The step's queries, and its keys and values where chunks of the step read each other (None for rows)."""
    if call.starts is None:
        return gather_step(call.cp, q, lengths, 2, call.kind), None, None
    return gather_together(call.cp, [q, own_k, own_v], [2, 1, 1], lengths, call.kind)


def _source(source, page_tensors, own_k, own_v, keys, values) -> tuple[torch.Tensor, ...]:
    if source == "pages":
        return tuple(page_tensors)
    if source == "own":
        return own_k, own_v
    return keys[source], values[source]
