"""A capture step's attention at one layer, every rank's chunk at once, as one autograd function.

In a capture (and in the exact-mode recompute, which runs the same steps in reverse) every rank of the CP group runs its
chunk of the step through the same layer at the same time (`sharding.py`). A query of the step reads the pages of
earlier steps, which every rank holds a share of, the step's earlier chunks, and its own chunk causally. Each rank
computes, from the step's queries, keys and values all-gathered (one chunk per rank, never a rank's pages):

- every query of the step over its pages (before the step),
- its own queries over its own chunk, causally (with the attention sinks, counted once),
- for each later chunk of the step, the first half of that chunk's queries over its own chunk; the later chunk's rank
  computes the second half over the gathered copy. So every rank does the same attention work in every step,
  whatever its place in the step (the rank that holds the first chunk would otherwise do the most).

Rows after the prompt (scoring and replay, every rank running its own members: `starts` None) are the same without
chunks between ranks: every rank computes every rank's rows over its pages, and its own rows over their own keys.

The partials go to their queries' ranks (all-to-all) and are merged by log-sum-exp there, which is exact. The rows
go through in `cp` pieces (`StepCall.pieces`): each piece's queries are gathered, and its partials computed and
exchanged, on their own (the keys and values once per step), so a rank never holds every rank's queries and partials
at once: at 2M tokens that is tens of GiB per layer for MLA's 64 heads. A rank's own queries over its own chunk stay
where they are, whole (the fused kernels take a square causal block, not a piece of one). The backward is the same
work in reverse (the ring-attention identity: a key block's gradients need only the merged output and log-sum-exp):
piece by piece, the output gradients, outputs and log-sum-exps are all-gathered, each rank back-propagates the partials
it computed and the query gradients go back to the queries' ranks; then the gathered keys' and values' gradients go to
the chunks' ranks (all-to-all each); the pages get theirs where they live.

Communication (elements each rank sends to each other rank, `COMMUNICATION`), per layer, for `n` tokens (a chunk of
the step, padded to the step's longest, or a rank's rows), `heads` query heads of width `d`, `kv` key heads, value width
`dv`: forward `n (heads d + kv (d + dv) + heads (dv + 1))` (the queries, keys and values gathered, the partials sent
back; rows gather no keys or values: `n heads (d + dv + 1)`); backward `n (heads d + kv (d + dv))` again (gathered
anew rather than kept), `n heads (2 dv + 1)` (the output gradients, outputs and log-sum-exps), `n heads d` (the query
gradients) and, for chunks, `n kv (d + dv)` (the gathered keys' and values' gradients; rows: none).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..block_attention import (
    AttentionScalars,
    KeyBlock,
    blocks_backward,
    merge_by_lse,
    sinks_gradient,
    visits,
    with_picks,
    without_picks,
)
from .communication import ContextParallelGroup
from .merge import merge_partials, partial_attention


@dataclass(frozen=True)
class StepCall:
    """The static side of one step attention call (every field by rank where it is a tuple)."""

    cp: ContextParallelGroup
    starts: tuple[int, ...] | None  # each rank's chunk's first captured-token index; None: rows after the prompt
    positions: tuple[torch.Tensor, ...]  # each rank's queries' absolute positions (host)
    page_blocks: tuple[tuple[KeyBlock, ...], ...]  # this rank's pages as each rank's queries read them
    selections: tuple[torch.Tensor, ...] | None  # DSA: each rank's top-k (captured-token indices), or None
    scalars: AttentionScalars
    kind: str  # the communication counter
    rows_first_index: int = 0  # rows after the prompt: the key index of their first own entry (the prompt's length)

    def without_tensors(self) -> tuple[StepCall, list[torch.Tensor | None]]:
        """This call without its device tensors (each rank's DSA selection and page picks), and those tensors: what
        `StepAttention` keeps on `ctx` and what it saves for backward (`block_attention.without_picks`)."""
        pages = [without_picks(blocks) for blocks in self.page_blocks]
        selections = None if self.selections is None else (None,) * len(self.selections)
        tensors = [*(self.selections or ()), *(pick for _, picks in pages for pick in picks)]
        return dataclasses.replace(self, page_blocks=tuple(b for b, _ in pages), selections=selections), tensors

    def with_tensors(self, tensors) -> StepCall:
        """`without_tensors` undone."""
        tensors = list(tensors)
        selections = None
        if self.selections is not None:
            selections, tensors = tuple(tensors[: len(self.selections)]), tensors[len(self.selections) :]
        page_blocks = []
        for blocks in self.page_blocks:
            page_blocks.append(with_picks(blocks, tensors[: len(blocks)]))
            tensors = tensors[len(blocks) :]
        return dataclasses.replace(self, page_blocks=tuple(page_blocks), selections=selections)

    def pieces(self) -> list[slice]:
        """The step's rows in `cp.size` pieces (the same rows of every rank's chunk, cut to its length): each piece's
        queries are gathered, and its partials exchanged, on their own, so what every rank holds for every rank's
        queries at once is one chunk's worth, whatever the CP size."""
        longest = max(len(positions) for positions in self.positions)
        size = max(1, -(-longest // self.cp.size))
        return [slice(start, min(start + size, longest)) for start in range(0, longest, size)]

    def rows(self, rank: int, piece: slice) -> slice:
        """`piece` of `rank`'s rows (empty past its chunk's end)."""
        tokens = len(self.positions[rank])
        return slice(min(piece.start, tokens), min(piece.stop, tokens))

    def own_blocks(self) -> tuple[KeyBlock, ...]:
        """This rank's queries over its own chunk, causally: merged where they are, without pieces (so the fused
        kernels take its square causal blocks whole)."""
        me = self.cp.rank
        return (self._chunk_block(me, me, slice(0, len(self.positions[me]))),)

    def terms(self, piece: slice) -> list[tuple[int, slice, object, tuple[KeyBlock, ...]]]:
        """The partials this rank computes for the rows of `piece` besides `own_blocks`: `(queries' rank, their rows,
        key source, blocks)`, where the source is "pages", "own" (this rank's chunk, read by a later chunk's first
        half) or the rank of a gathered earlier chunk."""
        me = self.cp.rank

        def within(rank: int, start: int, stop: int) -> slice | None:
            rows = self.rows(rank, piece)
            rows = slice(max(rows.start, start), min(rows.stop, stop))
            return rows if rows.start < rows.stop else None

        terms = []
        for rank in range(self.cp.size):
            tokens = len(self.positions[rank])
            if (rows := within(rank, 0, tokens)) is not None:
                terms.append((rank, rows, "pages", self._page_blocks(rank, rows)))
            if (
                rank != me
                and self.starts is not None
                and self.starts[rank] > self.starts[me]
                and (head := within(rank, 0, tokens // 2)) is not None
            ):
                terms.append((rank, head, "own", (self._chunk_block(me, rank, head),)))
        tokens = len(self.positions[me])
        for rank in range(self.cp.size if self.starts is not None else 0):
            if self.starts[rank] < self.starts[me] and (tail := within(me, tokens // 2, tokens)) is not None:
                terms.append((me, tail, rank, (self._chunk_block(rank, me, tail),)))
        return terms

    def _page_blocks(self, reader: int, rows: slice) -> tuple[KeyBlock, ...]:
        """The pages as rows `rows` of `reader`'s queries read them (their DSA picks)."""
        return tuple(
            block if block.picked is None else dataclasses.replace(block, picked=block.picked[:, rows])
            for block in self.page_blocks[reader]
        )

    def _chunk_block(self, holder: int, reader: int, rows: slice) -> KeyBlock:
        """`holder`'s chunk as rows `rows` of `reader`'s queries read it (picked by their DSA selection)."""
        selection = None if self.selections is None else self.selections[reader][:, rows]
        first = self.starts[holder] if self.starts is not None else self.rows_first_index
        picked = None if selection is None else selection.long() - first
        return KeyBlock(self.positions[holder], shared=False, picked=picked)


def _term_kind(term) -> tuple:
    """What decides a partial's computation besides its data (`block_attention.visits`): its key source's kind (the pages,
    the own chunk, another rank's), its rows, and its blocks' lengths and top-k widths (every query of a term sees
    every key of its blocks but the pages' excluded ones)."""
    _, rows, source, blocks = term
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
        me = call.cp.rank
        lengths = [len(positions) for positions in call.positions]
        value_dim = own_v.shape[-1]
        with torch.autocast(q.device.type, enabled=False):
            keys, values = _gathered_chunks(call, own_k, own_v, lengths)
            out, lse = partial_attention(
                q, call.positions[me], call.scalars, call.own_blocks(), (own_k, own_v), value_dim, sinks,
            )  # fmt: skip
            together = {}  # the pieces' partials are sampled as one loop
            for piece in call.pieces():
                _piece_forward(call, piece, together, q, own_k, own_v, keys, values, page_tensors, out, lse)
        ctx.call, call_tensors = call.without_tensors()
        ctx.save_for_backward(q, sinks, own_k, own_v, out, lse, *call_tensors, *page_tensors)
        ctx.call_tensors, ctx.lengths = len(call_tensors), lengths
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, sinks, own_k, own_v, out, lse, *saved = ctx.saved_tensors
        call, page_tensors = ctx.call.with_tensors(saved[: ctx.call_tensors]), saved[ctx.call_tensors :]
        lengths = ctx.lengths
        cp, me = call.cp, call.cp.rank
        need = ctx.needs_input_grad
        with torch.autocast(q.device.type, enabled=False):
            d_out = d_out.to(out.dtype)
            keys, values = _gathered_chunks(call, own_k, own_v, lengths)
            d_q, grads = blocks_backward(
                d_out, q, call.positions[me], out, lse, call.scalars, call.own_blocks(), (own_k, own_v),
                (True, True, True),
            )  # fmt: skip
            d_own = [torch.zeros_like(own_k), torch.zeros_like(own_v)]
            _accumulate(d_own, grads)
            d_keys = [
                [torch.zeros_like(k), torch.zeros_like(v)] for k, v in zip(keys or (), values or (), strict=True)
            ]
            d_pages = [None] * len(page_tensors)
            together = {}
            for piece in call.pieces():
                _piece_backward(
                    call, piece, together, need, q, d_out, out, lse, own_k, own_v, keys, values, page_tensors, d_q,
                    d_own, d_keys, d_pages,
                )  # fmt: skip
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


def _gathered_chunks(call: StepCall, own_k, own_v, lengths):
    """Every rank's chunk's keys and values, by rank, where chunks of the step read each other; (None, None) for
    rows after the prompt."""
    if call.starts is None:
        return None, None
    return gather_together(call.cp, [own_k, own_v], [1, 1], lengths, call.kind)


def _piece_gather(call: StepCall, piece: slice, rows: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `rows [batch, heads, rows, ...]` of `piece` (this rank's given), by rank."""
    counts = [rows.stop - rows.start for rows in (call.rows(rank, piece) for rank in range(call.cp.size))]
    return gather_step(call.cp, rows, counts, 2, call.kind)


def _piece_forward(
    call: StepCall, piece: slice, together: dict, q, own_k, own_v, keys, values, page_tensors, out, lse
):
    """The rows of `piece`: every rank's partials from this rank's keys, exchanged, and this rank's merged into `out`
    and `lse` in place. Nothing of the piece outlives the call (its sampled iterations leave the same tensors behind)."""
    mine = call.rows(call.cp.rank, piece)
    sent = _partials(call, piece, together, q, own_k, own_v, keys, values, page_tensors)
    received = exchange(call.cp, sent, 2, mine.stop - mine.start, call.kind)
    del sent
    out[:, :, mine], lse[..., mine] = merge_by_lse(out[:, :, mine], lse[..., mine], *merge_partials(received))


def _partials(
    call: StepCall, piece: slice, together: dict, q, own_k, own_v, keys, values, page_tensors
) -> list[torch.Tensor]:
    """Every rank's partial of the rows of `piece` from this rank's keys, by rank, each as one tensor to send:
    `[batch, heads, rows, dv + 1]`, the output then the log-sum-exp. Each term merges into its rank's tensor in place;
    the piece's gathered queries are dropped on return, before the exchange."""
    me = call.cp.rank
    queries = _piece_gather(call, piece, q[:, :, call.rows(me, piece)])
    value_dim = own_v.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    partials = []
    for query in queries:
        partial = torch.zeros((*query.shape[:-1], value_dim + 1), dtype=acc, device=q.device)
        partial[..., value_dim] = float("-inf")
        partials.append(partial)
    for rank, rows, source, blocks in visits(call.terms(piece), _term_kind, together):
        tensors = _source(source, page_tensors, own_k, own_v, keys, values)
        local = slice(rows.start - piece.start, rows.stop - piece.start)
        part = partial_attention(
            queries[rank][:, :, local],
            call.positions[rank][rows],
            call.scalars,
            blocks,
            tensors,
            value_dim,
            None,
        )
        target = partials[rank][:, :, local]
        merged_out, merged_lse = merge_by_lse(target[..., :value_dim], target[..., value_dim], *part)
        target[..., :value_dim], target[..., value_dim] = merged_out, merged_lse
    return partials


def _piece_backward(
    call, piece, together, need, q, d_out, out, lse, own_k, own_v, keys, values, page_tensors, d_q, d_own, d_keys,
    d_pages,
) -> None:  # fmt: skip
    """The rows of `piece`: every rank's query gradients from this rank's keys, exchanged, and this rank's added to
    `d_q`; this rank's keys' gradients added to `d_own`, `d_keys` and `d_pages`."""
    me = call.cp.rank
    mine = call.rows(me, piece)
    queries = _piece_gather(call, piece, q[:, :, mine])
    merged = _piece_gather(call, piece, torch.cat([d_out[:, :, mine], out[:, :, mine], lse[..., mine, None]], -1))
    value_dim = out.shape[-1]
    d_queries = [torch.zeros(query.shape, dtype=out.dtype, device=q.device) for query in queries]
    for rank, rows, source, blocks in visits(call.terms(piece), _term_kind, together):
        tensors = _source(source, page_tensors, own_k, own_v, keys, values)
        local = slice(rows.start - piece.start, rows.stop - piece.start)
        grad_out, out_rank, lse_rank = merged[rank][:, :, local].split([value_dim, value_dim, 1], dim=-1)
        flags = (True, *(need[5:] if source == "pages" else (True, True)))
        d_rows, grads = blocks_backward(
            grad_out,
            queries[rank][:, :, local],
            call.positions[rank][rows],
            out_rank,
            lse_rank[..., 0],
            call.scalars,
            blocks,
            tensors,
            flags,
        )
        d_queries[rank][:, :, local] += d_rows
        _accumulate(d_pages if source == "pages" else d_own if source == "own" else d_keys[source], grads)
    del queries, merged
    received = exchange(call.cp, d_queries, 2, mine.stop - mine.start, call.kind)
    del d_queries
    while received:
        d_q[:, :, mine] += received.pop(0)


def _accumulate(targets: list, grads) -> None:
    """Add each of `grads` (None: none) to its entry of `targets` (None: none yet)."""
    for index, grad in enumerate(grads):
        if grad is not None:
            targets[index] = grad if targets[index] is None else targets[index] + grad


def _source(source, page_tensors, own_k, own_v, keys, values) -> tuple[torch.Tensor, ...]:
    if source == "pages":
        return tuple(page_tensors)
    if source == "own":
        return own_k, own_v
    return keys[source], values[source]
