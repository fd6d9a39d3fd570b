"""Attention of replayed tokens over the captured prompt and over themselves: key blocks as one softmax.

A replayed completion attends to the captured prompt (the *prefix*, read-only, possibly far larger than the
completion) and to itself (the *suffix*). Concatenating the two would copy the whole prefix per layer per replay and
autograd would keep that copy alive for backward. Instead the keys are visited as blocks (the prompt's pages in
chunks of `attention_chunk_size`, then the forward's own tokens), each block's output and log-sum-exp computed on its
own and merged exactly:

    lse = logaddexp(lse_a, lse_b);  o = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

[`BlockAttention`] is that whole softmax as one autograd function. Its backward never materialises a `[queries,
prefix]` score matrix: it revisits the blocks and gets each block's dK, dV and share of dQ from the *global* output
and log-sum-exp (the ring-attention identity: `dS = P * (dO V^T - rowsum(dO * O))` with `P = exp(S - lse)` needs
nothing but the block, `O` and `lse`), so the fused backward kernels apply to prefix blocks exactly as to a whole
attention. One algorithm, two kernels per block: PyTorch's fused CPU flash kernels where no per-row mask is needed
(keys all visible, or a square causal block; MLA's values, narrower than its keys, zero-padded to their width),
plain torch tiles where one is (a window or chunk edge, logit soft-capping). A block read through a DSA top-k
(`KeyBlock.picked`) is
neither chunked nor masked: each query gathers the keys its top-k picked, so its cost is `k` keys per query however
long the prompt (a mask over the whole prompt would cost the prompt's length). On CUDA the same two calls go to
PyTorch's memory-efficient kernels (`_scaled_dot_product_efficient_attention` and its backward, which likewise take
the global output and log-sum-exp), for fp32, fp16 and bf16.
The merge across blocks, the plain-torch tiles and the gathered top-k accumulate in fp32 (or wider) whatever the
autocast state (the function disables autocast inside); a fused kernel accumulates in fp32 inside and returns its
chunk's output and gradients in the inputs' dtype, as SDPA does, before they join the fp32 merge.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

# Query rows per step of the plain-torch backward: with the key chunk, bounds its score-sized temporaries (scores,
# their gradient) to [groups, BACKWARD_ROW_BLOCK, chunk_size] however many rows a prompt chunk has. Measured on the
# exact-mode prompt backward (tiny dense model, P = 8K): 1024 -> 128 rows cut its peak 0.60 -> 0.36 GiB and its time
# 19.7 -> 12.7 s (the tiles stay in cache).
BACKWARD_ROW_BLOCK = 128


def _fused_forward_kernel(query, key, value, causal: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(o, lse)` of one key chunk through PyTorch's fused kernels, `[batch, heads, rows, d]` operands: the CPU flash
    kernel, or on CUDA the memory-efficient kernel (fp32, fp16 and bf16 alike; its log-sum-exp comes padded to a
    multiple of 32 rows)."""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, scale=scaling
        )[:2]
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, causal, scale=scaling
    )[:2]
    return out, lse[..., : query.shape[2]]


def _fused_backward_kernel(d_out, query, key, value, out, lse, causal: bool, scaling: float):
    """`(dq, dk, dv)` of one key chunk from the *given* `out` and `lse [batch, heads, rows]` (fp32): the merged ones
    of the whole softmax, not this chunk's. The matching backward of `_fused_forward_kernel`'s kernel."""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, query, key, value, out, lse, 0.0, causal, scale=scaling
        )
    no_dropout = torch.zeros((), dtype=torch.int64, device=query.device)  # philox seed and offset, unread
    out, lse = efficient_backward_operands(out, lse)
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        d_out,
        query,
        key,
        value,
        None,
        out,
        lse,
        no_dropout,
        no_dropout,
        0.0,
        [True, True, True, False],
        causal,
        scale=scaling,
    )[:3]


def efficient_backward_operands(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`out [batch, heads, rows, dv]` and `lse [batch, heads, rows]` laid out as the CUDA memory-efficient backward
    reads them, which is how its forward returns them: `out` contiguous as `[batch, rows, heads, dv]` (its
    half-precision kernels read rows at a fixed stride of `heads * dv`), `lse` padded to a multiple of 32 rows (the
    kernel refuses a log-sum-exp whose batch and head strides are not multiples of 8)."""
    rows = lse.shape[-1]
    padded = lse.new_zeros((*lse.shape[:-1], -(-rows // 32) * 32))
    padded[..., :rows] = lse
    return out.transpose(1, 2).contiguous().transpose(1, 2), padded


Item = TypeVar("Item")


def every_item(items: Iterable[Item], key: Callable[[Item], Hashable], together: dict | None = None) -> Iterable[Item]:
    """Every item of the loop: how the loops of `visits` run, outside a simulation."""
    return items


_VISITS: list[Callable] = [every_item]


def visits(items: Iterable[Item], key: Callable[[Item], Hashable], together: dict | None = None) -> Iterable[Item]:
    """The items of a loop whose iterations with equal `key(item)` are the same computation on other data and leave the
    same tensors behind (a block's key chunks merged into one running output, a DSA indexer's key blocks into one
    running top-k, a context-parallel step's partials): every one, unless a simulation samples them
    (`sampled_visits`). Loops given one `together` dict (empty at first) are sampled as one loop: their iterations
    of equal key are interchangeable across them too (the pieces of a context-parallel step)."""
    return _VISITS[-1](items, key, together)


@contextlib.contextmanager
def sampled_visits(visit: Callable[[Iterable[Item], Callable[[Item], Hashable]], Iterable[Item]]) -> Iterator[None]:
    """Run the loops of `visits` through `visit(items, key)` instead: a simulation (`trl_longstraw.simulation`) runs
    the first iterations of each key and accounts the rest by their cost, which 256 key chunks per layer and member at
    2M prompt tokens need for it to finish in minutes."""
    _VISITS.append(visit)
    try:
        yield
    finally:
        _VISITS.remove(visit)


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


@dataclass(frozen=True)
class AttentionScalars:
    """The scalars of one softmax attention besides its tensors and positions.

    `scaling`: the scores' scale. `chunk_size`: keys per step of a block (`attention_chunk_size`): bounds the score
    tiles. `visibility`: which earlier keys a query sees. `softcap`: Gemma 2's logit soft-capping, or None.
    """

    scaling: float
    chunk_size: int
    visibility: Visibility = CAUSAL
    softcap: float | None = None


def sees_every_key(q_positions: torch.Tensor, k_positions: torch.Tensor, visibility: Visibility) -> bool:
    """Whether every key precedes every query and, with a window or chunks, lies inside every query's (ascending key
    positions). The positions are host tensors: this reads their values, which on a GPU would be a device sync per
    key chunk."""
    return int(k_positions[-1]) <= int(q_positions.min()) and window_keeps_all(
        visibility, int(k_positions[0]), int(q_positions.max())
    )


def visible_keys(
    q_positions: torch.Tensor, k_positions: torch.Tensor, visibility: Visibility, device: torch.device
) -> torch.Tensor | None:
    """Boolean `[rows, keys]` visibility on `device` (causal by absolute position, windowed or chunked) of host
    positions, or None if all visible (`sees_every_key`): only a mask that is needed is built, on the device."""
    if sees_every_key(q_positions, k_positions, visibility):
        return None
    return visible_pairs(to_device(q_positions, device)[:, None], to_device(k_positions, device)[None, :], visibility)


def to_device(positions: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host `positions` on `device`, without a device sync (a blocking host-to-device copy synchronises the stream)."""
    return positions.to(device, non_blocking=True)


def window_keeps_all(visibility: Visibility, first_key: int, last_query: int) -> bool:
    """Whether a sliding window or chunking (if any) drops none of the causal pairs between keys from position
    `first_key` on and queries up to position `last_query`."""
    if not visibility.windowed():
        return True
    if visibility.sliding_window is not None and last_query - first_key >= visibility.sliding_window:
        return False
    if visibility.chunk_size is not None:
        origin, size = visibility.chunk_origin, visibility.chunk_size
        return (first_key - origin) // size == (last_query - origin) // size
    return True


def visible_pairs(q_positions: torch.Tensor, k_positions: torch.Tensor, visibility: Visibility) -> torch.Tensor:
    """Whether each query position sees each key position (broadcast against each other), as `visible_keys`."""
    visible = k_positions <= q_positions
    if visibility.sliding_window is not None:
        visible &= (q_positions - k_positions) < visibility.sliding_window
    if visibility.chunk_size is not None:
        origin, size = visibility.chunk_origin, visibility.chunk_size
        visible &= (k_positions - origin) // size == (q_positions - origin) // size
    return visible


@dataclass(frozen=True)
class KeyBlock:
    """One set of keys the queries attend to, besides its tensors: their absolute `positions [keys]` (on the host, where
    the chunk decisions read them), whether they are
    `shared` by every batch row (the prompt's pages, `[kv_heads, keys, d]`) or one set per row (the forward's own
    tokens, `[batch * kv_heads, keys, d]`), an optional DSA top-k `picked [batch, tokens, k]` (the keys each token
    picked, distinct per token as `topk` returns them, as indices into this block; an index outside `0 .. keys - 1`
    picks a key of another block), and for fp8 pages `dequantize(keys, values, index) -> (keys, values)` in the
    compute dtype, given the entries' indices in the block (a chunk, or the picked entries), applied as they are read."""

    positions: torch.Tensor
    shared: bool
    picked: torch.Tensor | None = None
    dequantize: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None


def without_picks(blocks: Iterable[KeyBlock]) -> tuple[tuple[KeyBlock, ...], list[torch.Tensor | None]]:
    """`blocks` without their DSA picks, and the picks (None where a block has none), in order. An autograd function
    keeps the first on `ctx` and saves the second with `ctx.save_for_backward`, which activation checkpointing frees
    after the layer's forward and recomputes for its backward; a pick held on `ctx` itself would outlive the layer
    (one `[tokens, k]` int64 index tensor per layer, and per rank under context parallelism: 2 GiB per layer for a
    2,049-token replay of GLM-5 on 32 ranks)."""
    blocks = tuple(blocks)
    return tuple(replace(block, picked=None) for block in blocks), [block.picked for block in blocks]


def with_picks(blocks: tuple[KeyBlock, ...], picks) -> tuple[KeyBlock, ...]:
    """`without_picks` undone: each block with its pick back."""
    return tuple(replace(block, picked=picked) for block, picked in zip(blocks, picks, strict=True))


class _Fold:
    """How queries `[batch, heads, tokens, ...]` fold into one block's `[groups, rows, ...]` layout: the query heads
    of a kv head become rows, so GQA keys are read once per chunk, never repeated per query head."""

    def __init__(self, batch: int, heads: int, tokens: int, key_groups: int, shared: bool):
        self.batch, self.tokens, self.shared = batch, tokens, shared
        self.kv_heads = key_groups if shared else key_groups // batch
        self.groups = heads // self.kv_heads

    def fold(self, x: torch.Tensor) -> torch.Tensor:
        rest = x.shape[3:]
        x = x.reshape(self.batch, self.kv_heads, self.groups, self.tokens, *rest)
        if self.shared:
            return x.transpose(0, 1).reshape(self.kv_heads, -1, *rest)
        return x.reshape(self.batch * self.kv_heads, -1, *rest)

    def unfold(self, y: torch.Tensor) -> torch.Tensor:
        rest = y.shape[2:]
        if self.shared:
            y = y.reshape(self.kv_heads, self.batch, self.groups, self.tokens, *rest).transpose(0, 1)
        return y.reshape(self.batch, self.kv_heads * self.groups, self.tokens, *rest)

    def positions(self, q_positions: torch.Tensor) -> torch.Tensor:
        return q_positions.repeat(self.batch * self.groups if self.shared else self.groups)


@dataclass
class _Chunk:
    """One key chunk of one block, in the block's folded layout."""

    keys: torch.Tensor  # [groups, n, d] on the compute device
    values: torch.Tensor  # [groups, n, dv]
    row_positions: torch.Tensor  # [rows], on the host
    key_positions: torch.Tensor  # [n], on the host
    visibility: Visibility

    def mask(self, rows=slice(None)) -> torch.Tensor | None:
        return visible_keys(self.row_positions[rows], self.key_positions, self.visibility, self.keys.device)


def _fusable(chunk: _Chunk, q: torch.Tensor, softcap: float | None) -> str | None:
    """Whether PyTorch's fused kernels can do this chunk: "all" (every key visible to every row), "causal" (the rows
    are groups of the key tokens themselves: a square causal mask per group), or None. CPU: the flash kernel, fp32
    and bf16; CUDA: the memory-efficient kernel, fp32, fp16 and bf16, head widths a multiple of 8 (its alignment).
    Values narrower than the keys (MLA's latents beside its latents + rope keys) go in zero-padded."""
    if q.device.type == "cpu":
        if q.dtype not in (torch.float32, torch.bfloat16):
            return None
    elif q.device.type != "cuda" or q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or q.shape[-1] % 8:
        return None
    if softcap is not None or chunk.values.shape[-1] > q.shape[-1]:
        return None  # soft-capping; a value head wider than the key head (no supported model has one)
    if sees_every_key(chunk.row_positions, chunk.key_positions, chunk.visibility):
        return "all"
    tokens, rows = chunk.key_positions.numel(), chunk.row_positions.numel()
    if (
        rows % tokens == 0
        and torch.equal(chunk.row_positions.view(-1, tokens), chunk.key_positions.expand(rows // tokens, tokens))
        and window_keeps_all(chunk.visibility, int(chunk.key_positions[0]), int(chunk.key_positions[-1]))
    ):
        return "causal"
    return None


def _to_key_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """`x` zero-padded on its last dimension to the key head `width`. The fused kernels take one head width for
    keys and values; zero value columns give zero output columns (and zero gradients), dropped after the call."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _fused_operands(kind: str, q, chunk: _Chunk):
    groups, rows, dim = q.shape
    values = _to_key_width(chunk.values.to(q.dtype), dim)
    if kind == "all":
        return q[:, None], chunk.keys[:, None].to(q.dtype), values[:, None], False
    tokens = chunk.key_positions.numel()
    per = rows // tokens
    keys = chunk.keys[:, None].to(q.dtype).expand(groups, per, tokens, dim)
    return q.view(groups, per, tokens, dim), keys, values[:, None].expand(groups, per, tokens, dim), True


def _chunk_forward(q, chunk: _Chunk, scalars: AttentionScalars) -> tuple[torch.Tensor, torch.Tensor]:
    """`(o [groups, rows, dv], lse [groups, rows])` of one chunk, in the accumulation dtype; 0 / -inf where unseen.

    The profile of the CPU path showed the plain-torch chunk (matmul + exp) at ~80% of an update; the fused kernel
    computes the same in ~1/9 of the time.
    """
    acc = _accumulation_dtype(q.dtype)
    scaling, softcap = scalars.scaling, scalars.softcap
    kind = _fusable(chunk, q, softcap)
    if kind is not None:
        query, key, value, causal = _fused_operands(kind, q, chunk)
        out, lse = _fused_forward_kernel(query, key, value, causal, scaling)
        out = out.reshape(q.shape[0], q.shape[1], -1)[..., : chunk.values.shape[-1]]
        return out.to(acc), lse.reshape(q.shape[0], q.shape[1]).to(acc)
    scores = torch.matmul(q.to(acc), chunk.keys.to(acc).transpose(1, 2)).mul_(scaling)
    if softcap is not None:  # Gemma 2: softcap * tanh(scores / softcap)
        scores.div_(softcap).tanh_().mul_(softcap)
    mask = chunk.mask()
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores.sub_(_finite(lse)[..., None]))
    return torch.matmul(probs, chunk.values.to(acc)), lse


def _chunk_backward(d_out, q, o, lse, d_row, chunk: _Chunk, scalars: AttentionScalars, need):
    """One chunk's `(dq, dk, dv)` from the *global* output `o`, `lse` and `d_row = rowsum(dO * o)` (folded layout).

    `need = (q, k, v)` flags; entries not needed are None.
    """
    acc = _accumulation_dtype(q.dtype)
    scaling, softcap = scalars.scaling, scalars.softcap
    kind = _fusable(chunk, q, softcap)
    if kind is not None:
        query, key, value, causal = _fused_operands(kind, q, chunk)
        shape, width = query.shape[:-1], q.shape[-1]
        dq, dk, dv = _fused_backward_kernel(
            _to_key_width(d_out.to(q.dtype), width).reshape(*shape, -1),
            query,
            key,
            value,
            _to_key_width(o.to(q.dtype), width).reshape(*shape, -1),
            lse.to(torch.float32).reshape(shape),
            causal,
            scaling,
        )
        if kind == "causal":  # the keys were expanded over the row groups: sum their gradients back
            dk, dv = dk.sum(1), dv.sum(1)
        else:
            dk, dv = dk[:, 0], dv[:, 0]
        return dq.reshape(q.shape).to(acc), dk.to(acc), dv[..., : chunk.values.shape[-1]].to(acc)
    keys, values = chunk.keys.to(acc), chunk.values.to(acc)
    qf, d_out = q.to(acc), d_out.to(acc)
    safe_lse = _finite(lse)
    dq = torch.zeros_like(qf) if need[0] else None
    dk = torch.zeros_like(keys) if need[1] else None
    dv = torch.zeros_like(values) if need[2] else None
    for row_start in range(0, q.shape[1], BACKWARD_ROW_BLOCK):
        rows = slice(row_start, row_start + BACKWARD_ROW_BLOCK)
        scores = torch.matmul(qf[:, rows], keys.transpose(1, 2)).mul_(scaling)
        capped = None
        if softcap is not None:  # d(c tanh(s / c)) / ds = 1 - tanh(s / c)^2
            capped = scores.div_(softcap).tanh_()
            scores = capped * softcap
        mask = chunk.mask(rows)
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        probs = torch.exp(scores.sub_(safe_lse[:, rows, None]))
        if dv is not None:
            dv += torch.matmul(probs.transpose(1, 2), d_out[:, rows])
        d_scores = probs.mul_(torch.matmul(d_out[:, rows], values.transpose(1, 2)).sub_(d_row[:, rows, None]))
        if capped is not None:
            d_scores.mul_(1 - capped.square_())
        d_scores.mul_(scaling)
        if dq is not None:
            dq[:, rows] += torch.matmul(d_scores, keys)
        if dk is not None:
            dk += torch.matmul(d_scores.transpose(1, 2), qf[:, rows])
    return dq, dk, dv


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over the union of two disjoint key sets, from each set's output and log-sum-exp.

    `lse = logaddexp(lse_a, lse_b)`, `o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b`, computed in the dtype of the
    log-sum-exps (fp32 or wider). Rows that saw no key in either set keep `o = 0`, `lse = -inf`. Returns `(o, lse)`,
    `o` in `out_a`'s dtype.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = _finite(lse)
    weight_a = torch.exp(lse_a - safe)[..., None]
    weight_b = torch.exp(lse_b - safe)[..., None]
    out = weight_a * out_a.to(weight_a.dtype) + weight_b * out_b.to(weight_b.dtype)
    return out.to(out_a.dtype), lse


def pages_elsewhere(keys: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether a block's keys live on another device than the queries (host-resident prompt state)."""
    return keys.device != q.device


def stage(entries: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`entries [heads, ...]` on the compute `device`: asynchronous from pinned host memory. A chunk of host-resident
    pages (`pages[:, start:end]`) is not contiguous, and PyTorch copies a non-contiguous host tensor into pageable
    host memory before it crosses, synchronously on the host; each head's entries are contiguous, so each head crosses
    on its own, from the pinned pages."""
    if entries.device == device or entries.is_contiguous() or not all(head.is_contiguous() for head in entries):
        return entries.to(device, non_blocking=True)
    staged = torch.empty(entries.shape, dtype=entries.dtype, device=device)
    for target, head in zip(staged, entries, strict=True):
        target.copy_(head, non_blocking=True)
    return staged


def values_in_keys(keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `values` are the first columns of `keys`, a view of the same pages (MLA's latents beside its latents +
    rope keys): staged or gathered once, as the keys."""
    return (
        values.untyped_storage() is keys.untyped_storage()  # not data_ptr(): a simulation's tensors have no data
        and values.storage_offset() == keys.storage_offset()
        and values.stride() == keys.stride()
        and values.dtype == keys.dtype
        and values.shape[:-1] == keys.shape[:-1]
        and values.shape[-1] <= keys.shape[-1]
    )


def select_entries(pages: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`pages [heads, entries, d]` at entry indices `index`; fp8 pages by their bytes (a gather moves bytes, and not
    every device's `index_select` takes fp8)."""
    if pages.dtype == torch.float8_e4m3fn:
        return pages.view(torch.uint8).index_select(1, index).view(pages.dtype)
    return pages.index_select(1, index)


class _KeyChunks:
    """A block's key chunks: their spans, what decides each one's computation besides its data (`kind`, from the
    positions at the chunks' ends, read once per block: no tensor op per chunk), and a visited one's keys and values
    staged onto the compute device (`chunk`: host-resident prompt state moves chunk by chunk).

    The forward's own keys stay whole when they form one square causal block the fused kernel takes (it never
    materialises the block's scores): cut at `chunk_size`, a capture chunk longer than the attention chunk would
    leave non-square causal pieces to plain-torch tiles (measured: 3.6x slower, 8x the peak).
    """

    def __init__(self, q, keys, values, block: KeyBlock, fold: _Fold, q_positions, scalars: AttentionScalars):
        visibility, chunk_size = scalars.visibility, scalars.chunk_size
        self.q, self.keys, self.values, self.block, self.visibility = q, keys, values, block, visibility
        self.row_positions = fold.positions(q_positions)
        count = keys.shape[1]
        if not block.shared and count > chunk_size:
            whole = _Chunk(keys, values, self.row_positions, block.positions, visibility)
            if _fusable(whole, q, scalars.softcap) == "causal":
                chunk_size = count
        self.spans = [slice(start, min(start + chunk_size, count)) for start in range(0, count, chunk_size)]
        self.shares_pages = values_in_keys(keys, values)
        self._firsts = block.positions[::chunk_size].tolist()
        self._lasts = block.positions[chunk_size - 1 :: chunk_size].tolist()
        if count % chunk_size:
            self._lasts.append(int(block.positions[-1]))
        self._queries = (int(q_positions.min()), int(q_positions.max())) if q_positions.numel() else (0, 0)
        self._size = chunk_size

    def kind(self, span: slice) -> Hashable:
        """The chunk's length, and whether every query sees every key of it (`sees_every_key`, on the positions at
        its ends): chunks alike in both run the same computation on other data (`visits`)."""
        index = span.start // self._size
        first, last = self._firsts[index], self._lasts[index]
        sees_all = last <= self._queries[0] and window_keeps_all(self.visibility, first, self._queries[1])
        return span.stop - span.start, sees_all

    def chunk(self, span: slice) -> _Chunk:
        keys = stage(self.keys[:, span], self.q.device)
        values = (
            keys[..., : self.values.shape[-1]] if self.shares_pages else stage(self.values[:, span], self.q.device)
        )
        if self.block.dequantize is not None:
            index = torch.arange(span.start, span.stop, device=self.keys.device)  # where the pages (and scales) live
            keys, values = self.block.dequantize(keys, values, index)
        return _Chunk(keys, values, self.row_positions, self.block.positions[span], self.visibility)


class _Picked:
    """A block read through a DSA top-k (`KeyBlock.picked`): each query gathers the keys it picked, in blocks of query
    tokens, and attends to those alone, so a query costs `k` keys whatever the block's length. Rows that picked
    nothing here (or nothing they can see) get `o = 0`, `lse = -inf`, as a chunk they see nothing of. A step's
    gathered keys, values and scores hold no more elements than the scores of the block's queries against
    `chunk_size` keys, what a dense chunk of the same call would hold."""

    def __init__(self, q, keys, values, block: KeyBlock, q_positions, scalars: AttentionScalars):
        self.scalars = scalars
        self.batch, heads, self.tokens, self.dim = q.shape
        self.value_dim = values.shape[-1]
        self.keys, self.values, self.block = keys, values, block
        self.pages = (keys, values)  # the block's own tensors (`keys`/`values` become the staged entries, if staged)
        self.values_in_keys = values_in_keys(keys, values)
        self.kv_heads = keys.shape[0] if block.shared else keys.shape[0] // self.batch
        self.groups = heads // self.kv_heads
        picked = block.picked.to(device=q.device, dtype=torch.long)
        count = keys.shape[1]
        inside = (picked >= 0) & (picked < count)
        # The picks of this block first, and only as many per token as the token with the most of them has here (a
        # top-k splits between the prompt's pages and the forward's own keys): the other picks cost nothing. A top-k's
        # picks are distinct, so no more than the block's keys.
        order = torch.argsort(inside.to(torch.int8), dim=-1, descending=True, stable=True)
        width = max(1, min(count, int(inside.sum(-1).max())))
        inside, picked = inside.gather(-1, order[..., :width]), picked.gather(-1, order[..., :width])
        self.index = picked.clamp(0, count - 1)  # [batch, tokens, width]; `visible` drops the picks not inside
        key_positions = to_device(block.positions, q.device)[self.index]
        self.visible = inside & visible_pairs(
            to_device(q_positions, q.device)[None, :, None], key_positions, scalars.visibility
        )
        self.entries = None  # the block's indices of the staged entries, when the pages live elsewhere
        if block.shared and pages_elsewhere(keys, q):
            self._stage_picked_entries(q.device)
        per_row = width * (heads + self.kv_heads * (self.dim + self.value_dim))
        step = max(1, self.tokens * heads * scalars.chunk_size // per_row)
        self.spans = [slice(start, min(start + step, self.tokens)) for start in range(0, self.tokens, step)]

    def _stage_picked_entries(self, device: torch.device) -> None:
        """Move the entries some query picked onto `device`, each once, and index them there from then on.

        Host-resident pages would otherwise cross once per query that picked them: a capture chunk's tokens x k picks
        are many times the prompt's length (GLM-5: 8,192 x 2,048 per chunk over at most 2M keys), where the distinct
        entries are at most the block (what staging it chunk by chunk, as dense blocks are, would move). fp8 entries
        stay fp8 until gathered."""
        self.entries, self.index = torch.unique(self.index, return_inverse=True)
        where = self.entries.to(self.keys.device)
        self.keys = select_entries(self.keys, where).to(device, non_blocking=True)
        self.values = (
            self.keys[..., : self.value_dim]
            if self.values_in_keys
            else select_entries(self.values, where).to(device, non_blocking=True)
        )

    def _unstage(self, grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
        """A staged entries' gradient in the block's layout, on its tensors' device (zeros where nothing picked)."""
        if grad is None or self.entries is None:
            return grad
        full = torch.zeros((*like.shape[:-1], grad.shape[-1]), dtype=grad.dtype, device=like.device)
        return full.index_add_(1, self.entries.to(like.device), grad.to(like.device))

    def gather(self, span: slice, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the tokens of `span` picked, `[batch, kv_heads, tokens, k, d]` in `dtype`."""
        index = self.index[:, span]
        if self.block.shared:  # [kv_heads, keys, d]: the pages (or the entries staged from them), possibly fp8
            where = index.reshape(-1).to(self.keys.device)
            keys = select_entries(self.keys, where).to(device, non_blocking=True)
            if self.values_in_keys:  # MLA: the values are the latents, the keys' first columns (one gather)
                values = keys[..., : self.value_dim]
            else:
                values = select_entries(self.values, where).to(device, non_blocking=True)
            if self.block.dequantize is not None:
                entries = where if self.entries is None else self.entries[where]
                keys, values = self.block.dequantize(keys, values, entries)
            shape = (self.kv_heads, *index.shape, -1)
            keys, values = keys.view(shape).transpose(0, 1), values.reshape(shape).transpose(0, 1)
        else:  # [batch * kv_heads, keys, d]: each row's own, gathered as rows of `[batch * kv_heads * keys, d]`
            groups = torch.arange(self.batch * self.kv_heads, device=index.device).view(self.batch, -1, 1, 1)
            where = (groups * self.keys.shape[1] + index[:, None]).reshape(-1)
            keys = self.keys.reshape(-1, self.dim).index_select(0, where)
            if self.values_in_keys:
                values = keys[..., : self.value_dim]
            else:
                values = self.values.reshape(-1, self.value_dim).index_select(0, where)
            shape = (self.batch, self.kv_heads, *index.shape[1:], -1)
            keys, values = keys.view(shape), values.reshape(shape)
        return keys.to(dtype), values.to(dtype)

    def queries(self, x: torch.Tensor, span: slice) -> torch.Tensor:
        """`x [batch, heads, tokens, ...]` of the tokens of `span` as `[batch, kv_heads, groups, tokens, ...]`."""
        x = x[:, :, span]
        return x.reshape(self.batch, self.kv_heads, self.groups, *x.shape[2:])

    def scores(self, q, keys, span):
        """`(scores, tanh of the capped scores or None)`, `[batch, kv_heads, groups, tokens, k]`, -inf where unseen."""
        scores = torch.einsum("bvgtd,bvtkd->bvgtk", q, keys).mul_(self.scalars.scaling)
        softcap = self.scalars.softcap
        capped = None
        if softcap is not None:
            capped = scores.div_(softcap).tanh_()
            scores = capped * softcap
        return scores.masked_fill_(~self.visible[:, None, None, span], float("-inf")), capped

    def forward(self, q) -> tuple[torch.Tensor, torch.Tensor]:
        """`(o, lse)`, each span's written in place (no list of parts concatenated: one output's memory)."""
        acc = _accumulation_dtype(q.dtype)
        out = torch.empty((*q.shape[:3], self.value_dim), dtype=acc, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
        for span in visits(self.spans, key=_span_length):
            keys, values = self.gather(span, q.device, acc)
            scores, _ = self.scores(self.queries(q, span).to(acc), keys, span)
            span_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores.sub_(_finite(span_lse)[..., None]))
            out[:, :, span] = torch.einsum("bvgtk,bvtke->bvgte", probs, values).flatten(1, 2)
            lse[:, :, span] = span_lse.flatten(1, 2)
        return out, lse

    def backward(self, d_out, q, out, lse, d_row, need):
        """`(dq [batch, heads, tokens, d], d_keys, d_values)` from the global `out`, `lse` and `d_row`; the key and
        value gradients are scattered back to the entries picked (summed, in the accumulation dtype, where several
        queries picked one). Values that are the keys' first columns get theirs in `d_keys` (`d_values` None): the
        same leaf, one buffer."""
        acc = _accumulation_dtype(q.dtype)
        need_q, need_k, need_v = need
        merged = need_k and need_v and self.values_in_keys
        dq = torch.zeros(q.shape, dtype=acc, device=q.device) if need_q else None
        d_keys = torch.zeros(self.keys.shape, dtype=acc, device=self.keys.device) if need_k else None
        d_values = None
        if need_v:
            d_values = (
                d_keys[..., : self.value_dim]
                if merged
                else torch.zeros(self.values.shape, dtype=acc, device=self.values.device)
            )
        for span in visits(self.spans, key=_span_length):
            keys, values = self.gather(span, q.device, acc)
            q_span, d_out_span = self.queries(q, span).to(acc), self.queries(d_out, span).to(acc)
            scores, capped = self.scores(q_span, keys, span)
            probs = torch.exp(scores.sub_(_finite(self.queries(lse[..., None], span))))
            d_scores = torch.einsum("bvgte,bvtke->bvgtk", d_out_span, values)
            d_scores = probs * d_scores.sub_(self.queries(d_row[..., None], span))
            if capped is not None:
                d_scores.mul_(1 - capped.square_())
            d_scores.mul_(self.scalars.scaling)
            if need_q:
                dq[:, :, span] = torch.einsum("bvgtk,bvtkd->bvgtd", d_scores, keys).flatten(1, 2)
            if need_k:
                self.scatter(d_keys, torch.einsum("bvgtk,bvgtd->bvtkd", d_scores, q_span), span)
            if need_v:
                self.scatter(d_values, torch.einsum("bvgtk,bvgte->bvtke", probs, d_out_span), span)
        if self.entries is not None:
            d_keys = self._unstage(d_keys, self.pages[0])
            d_values = None if merged else self._unstage(d_values, self.pages[1])
        return dq, d_keys, None if merged else d_values

    def scatter(self, grad: torch.Tensor, picked_grad: torch.Tensor, span: slice) -> None:
        """Add `picked_grad [batch, kv_heads, tokens, k, d]` into `grad` (the block's layout) at the picked entries."""
        index = self.index[:, span][:, None]  # [batch, 1, tokens, k]
        count = grad.shape[1]
        heads = torch.arange(self.kv_heads, device=index.device).view(1, -1, 1, 1)
        if not self.block.shared:
            heads = heads + self.kv_heads * torch.arange(self.batch, device=index.device).view(-1, 1, 1, 1)
        rows = (heads * count + index).reshape(-1).to(grad.device)
        picked_grad = picked_grad.reshape(-1, picked_grad.shape[-1]).to(grad.device)
        grad.flatten(0, 1).index_add_(0, rows, picked_grad)  # a view: fresh zeros, or the value columns of them


def _span_length(span: slice) -> int:
    return span.stop - span.start


def blocks_forward(q, q_positions, scalars: AttentionScalars, blocks, tensors):
    """`(o, lse)` of `q [batch, heads, tokens, d]` over the key blocks, in the accumulation dtype; `(None, None)` when
    every block is empty. One softmax's partial over some of its keys: merge partials with `merge_by_lse` (context
    parallelism merges each rank's partial over its shard this way)."""
    batch, heads, tokens, _ = q.shape
    out = lse = None
    for index, block in enumerate(blocks):
        keys, values = tensors[2 * index], tensors[2 * index + 1]
        if keys.shape[1] == 0:
            continue
        if block.picked is not None:
            picked = _Picked(q, keys, values, block, q_positions, scalars)
            part = picked.forward(q)
            out, lse = part if out is None else merge_by_lse(out, lse, *part)
            continue
        fold = _Fold(batch, heads, tokens, keys.shape[0], block.shared)
        q_folded = fold.fold(q)
        chunks = _KeyChunks(q, keys, values, block, fold, q_positions, scalars)
        for span in visits(chunks.spans, key=chunks.kind):
            o, part_lse = _chunk_forward(q_folded, chunks.chunk(span), scalars)
            part = (fold.unfold(o), fold.unfold(part_lse[..., None])[..., 0])
            out, lse = part if out is None else merge_by_lse(out, lse, *part)
    return out, lse


def blocks_backward(d_out, q, q_positions, out, lse, scalars: AttentionScalars, blocks, tensors, need):
    """`(d_q, [d_keys, d_values per block])` of the blocks' share of one softmax, from its *global* output `out` and
    log-sum-exp `lse` (the ring-attention identity): a partial over some of the keys gets exactly its keys' gradients
    and its share of `d_q`. `need = (q, *each tensor)` flags; entries not needed are None, and so is the value
    gradient of a DSA block whose values are its keys' first columns (MLA's latents): it is inside the keys'."""
    need_q, need_tensors = need[0], need[1:]
    batch, heads, tokens, _ = q.shape
    d_row = (d_out * out).sum(-1)  # rowsum(dO * O): the same for every block
    d_q = torch.zeros(q.shape, dtype=out.dtype, device=q.device) if need_q else None
    grads = [None] * len(tensors)
    for index, block in enumerate(blocks):
        keys, values = tensors[2 * index], tensors[2 * index + 1]
        need_k, need_v = need_tensors[2 * index], need_tensors[2 * index + 1]
        if keys.shape[1] == 0 or not (need_q or need_k or need_v):
            continue
        if block.picked is not None:
            picked = _Picked(q, keys, values, block, q_positions, scalars)
            dq, d_keys, d_values = picked.backward(d_out, q, out, lse, d_row, (need_q, need_k, need_v))
            if need_q:
                d_q += dq
            grads[2 * index] = None if d_keys is None else d_keys.to(keys.dtype)
            grads[2 * index + 1] = None if d_values is None else d_values.to(values.dtype)
            continue
        fold = _Fold(batch, heads, tokens, keys.shape[0], block.shared)
        folded = [fold.fold(x) for x in (q, d_out, out)]
        folded_lse, folded_d_row = (fold.fold(x[..., None])[..., 0] for x in (lse, d_row))
        d_keys = torch.zeros(keys.shape, dtype=keys.dtype, device=keys.device) if need_k else None
        d_values = torch.zeros(values.shape, dtype=values.dtype, device=values.device) if need_v else None
        d_q_folded = torch.zeros_like(folded[0], dtype=out.dtype) if need_q else None
        chunks = _KeyChunks(q, keys, values, block, fold, q_positions, scalars)
        for span in visits(chunks.spans, key=chunks.kind):
            dq, dk, dv = _chunk_backward(
                folded[1], folded[0], folded[2], folded_lse, folded_d_row, chunks.chunk(span), scalars,
                (need_q, need_k, need_v),
            )  # fmt: skip
            if need_q:
                d_q_folded += dq
            if need_k:
                d_keys[:, span] = dk.to(keys.device, keys.dtype)
            if need_v:
                d_values[:, span] = dv.to(values.device, values.dtype)
        if need_q:
            d_q += fold.unfold(d_q_folded)
        grads[2 * index], grads[2 * index + 1] = d_keys, d_values
    return d_q, grads


def sinks_partial(sinks: torch.Tensor, like_lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp of attention sinks `[heads]` (one logit per head, value 0) for every row of `like_lse`."""
    return sinks.to(like_lse.dtype)[None, :, None].expand_as(like_lse)


def sinks_gradient(sinks: torch.Tensor, lse: torch.Tensor, d_row: torch.Tensor) -> torch.Tensor:
    """d lse / d sink = p_sink, and the sink's value is 0: d sink = -sum(p_sink * rowsum(dO * O))."""
    p_sink = torch.exp(sinks.to(lse.dtype)[None, :, None] - _finite(lse))
    return -(p_sink * d_row).sum(dim=(0, 2)).to(sinks.dtype)


class BlockAttention(torch.autograd.Function):
    """Softmax attention of `q [batch, heads, tokens, d]` over key blocks as one softmax (see the module docstring).

    `blocks`: the static `KeyBlock`s; `tensors`: each block's keys and values, in order. `sinks [heads]` (gpt-oss)
    join every softmax denominator with a zero value. Rows that see no key and no sink get `o = 0`. Returns `o [batch,
    heads, tokens, dv]` in `q`'s dtype.
    """

    @staticmethod
    def forward(ctx, q, sinks, q_positions, scalars, blocks, *tensors):
        with torch.autocast(q.device.type, enabled=False):
            out, lse = blocks_forward(q, q_positions, scalars, blocks, tensors)
            if sinks is not None:
                out, lse = merge_by_lse(out, lse, torch.zeros_like(out), sinks_partial(sinks, lse))
        ctx.blocks, picks = without_picks(blocks)
        ctx.save_for_backward(q, sinks, q_positions, out, lse, *picks, *tensors)
        ctx.scalars = scalars
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, sinks, q_positions, out, lse, *saved = ctx.saved_tensors
        picks, tensors = saved[: len(ctx.blocks)], saved[len(ctx.blocks) :]
        blocks = with_picks(ctx.blocks, picks)
        need_q, need_sinks = ctx.needs_input_grad[:2]
        need = (need_q, *ctx.needs_input_grad[5:])
        with torch.autocast(q.device.type, enabled=False):
            d_out = d_out.to(out.dtype)
            d_q, grads = blocks_backward(d_out, q, q_positions, out, lse, ctx.scalars, blocks, tensors, need)
            d_sinks = sinks_gradient(sinks, lse, (d_out * out).sum(-1)) if need_sinks else None
        d_q = d_q.to(q.dtype) if need_q else None
        return (d_q, d_sinks, None, None, None, *grads)


def attention_over_blocks(
    q: torch.Tensor,
    blocks: list[tuple[torch.Tensor, torch.Tensor, KeyBlock]],
    q_positions: torch.Tensor,
    scalars: AttentionScalars,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `q [batch, heads, tokens, d]` at absolute `q_positions [tokens]` over `(keys, values, KeyBlock)`
    blocks, as one softmax; returns `o [batch, heads, tokens, dv]`. See `BlockAttention`."""
    tensors = [t for keys, values, _ in blocks for t in (keys, values)]
    # The positions are read on the host, chunk by chunk (`_fusable`): LongStraw builds them there, so `.cpu()` is a
    # no-op; positions given on a device cost one sync here, not one per chunk.
    specs = tuple(replace(block, positions=block.positions.cpu()) for _, _, block in blocks)
    q_positions = q_positions.cpu()
    return BlockAttention.apply(q, sinks, q_positions, scalars, specs, *tensors)
