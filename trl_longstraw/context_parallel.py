"""Context parallelism: one group's prompt sharded by sequence across the ranks of a CP group.

Every rank of a CP group keeps the durable state of one contiguous shard of the captured prompt tokens (attention K/V
pages, MLA latent pages and DSA indexer keys of its shard only; a sliding-window layer the last `window - 1` entries
of its shard, as one process keeps them of the prompt; the fixed-size recurrent state is replicated after capture).
Nothing of another rank's pages
is ever copied: a query's attention over a shard is computed where the shard lives, as that shard's partial `(o,
lse)`, and the partials are merged by log-sum-exp across the group (`merge_across`), which is exact.

Sharding rule: contiguous shards, `shard r = [r N / cp, (r + 1) N / cp)` of the `N` captured tokens (sizes differ by
at most one). Why contiguous rather than zigzag: after capture, every replayed and scored query sits after the whole
prompt and reads every shard, so the replay's attention work (the phase repeated G times per capture) is balanced
whatever the layout, and contiguous shards hand the recurrent state on between neighbours only.
The capture is causal, hence imbalanced: rank r's keys are read by the queries of shards r..cp-1, so the capture's
attention pairs on rank r are proportional to `(cp - r - 1/2) / cp^2` of `N^2` (cp = 2: 3/8 vs 1/8 of `N^2`, a 3:1
ratio; `capture_attention_pairs` computes it). The capture runs shard by shard in rank order anyway (see below), so
this imbalance costs time only on the ranks that serve, never memory.

Capture (`ContextParallelEngine.capture`): shard by shard, in rank order. The owner of the current shard runs its chunks
through the model; at each attention layer but the last (whose attention a capture skips: `StateAccess.output_unread`,
unless the MoE load-balancing loss reads every layer's output) it broadcasts the chunk's queries (one chunk:
`prefill_chunk_size` tokens) and every rank computes the partial attention of those queries over its own pages (the
owner over its pages so far plus the chunk's own keys, causal; a rank whose shard is not captured yet contributes
`lse = -inf`); the partials are merged on every rank. Meanwhile the other ranks run `ShardedPromptState.serve`, the
matching loop, until the owner announces the end of its shard (the exact-mode recompute runs the same way, shards in
reverse order, the owner also announcing each attention backward). Recurrent layers (GatedDeltaNet, Mamba2) are
sequential: the owner of shard r + 1 starts from shard r's final conv/recurrent states, sent point to point; after the
last shard its final states are broadcast, so that every rank's replay starts from the whole prompt's recurrent state.
So no rank ever holds another rank's pages, only one chunk of another rank's queries and one chunk-sized partial at a
time.

Replay and scoring: every rank of the group runs the same member in lockstep; each attends over its own shard's pages,
the completion's own keys are counted on rank 0 of the group only, and `ContextParallelAttention` merges the partials
by an all-reduce of the max log-sum-exp and then of the weighted outputs. Its backward gives each rank the gradient of
its own partial (the ring-attention identity: a key block's gradients need only the global output and log-sum-exp) and
all-reduces (sums) the gradients of the query-side inputs (q, the completion's own keys and values, sinks) inside the
function, so every rank's upstream graph receives the full gradient and every rank computes identical parameter
gradients without any further all-reduce.

DSA (DeepSeek-V3.2, GLM-5): the top-k is selected over the whole prefix, never per shard. The model's own indexer
runs on every rank over that rank's indexer keys, block by block (`state/dsa.py`), and its candidates are finished by
`ShardedPromptState.finish_selection`: each rank's top-k candidates, in global key indices, are gathered by an
all-reduce (`merge_topk`) and the top-k of those taken, the same on every rank; the global top-k is always among
them, so this is exact. In a capture or recompute the owner announces each indexer call (its hidden
states, query residual and rotary embeddings of one chunk) and the ranks holding earlier shards run the indexer over
theirs. A serving rank's partial attention applies the last merged selection, as the model's IndexShare layers
reuse the last computing layer's. Exactly tied index scores (e.g. every key at 0 after a zero query) may be broken
differently than in one process, as between two chunkings of one process.

Rollouts (`rollout_from_prompt_state`): decoding is one more mode of the same views. Every rank decodes the group's
rows in lockstep against its shard, each rank keeping the rows' own decoded entries (`Suffix`, counted on rank 0),
and each step's sampled tokens and stopping decisions are rank 0's (`agree`), so the ranks never drift apart (a
time-based stopping criterion could otherwise stop them on different steps).

Communication (elements all-reduced, per replayed token, per attention layer, `heads` query heads of width `d`,
`kv_heads` key heads, value width `dv`): forward `heads * (dv + 2)` (the max and the weighted sum with its weight),
backward `heads * d + kv_heads * (d + dv)` (dq and the own keys' and values' gradients), plus `heads` with sinks;
and per DSA indexer layer `2 * cp * k` (each rank's top-k candidate scores and key indices).
`COMMUNICATION` counts what actually went through the collectives (benchmarks/context_parallel.py checks one against
the other).

Backends: every collective goes through `ContextParallelGroup`, which picks, once per group, the device its
communication tensors live on (`communication_device`: CUDA's current device for NCCL, the CPU for gloo and any other
backend) and moves a tensor there and back only where it is not there already. The math stays on the compute device;
with NCCL and the model on CUDA nothing is copied, with gloo and the model on CPU nothing is either. Verified on gloo
(CPU) only: the NCCL path is written for, not tested (no GPU in this project's CI).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .attention import (
    CAUSAL,
    KeyBlock,
    Visibility,
    _finite,
    blocks_backward,
    blocks_forward,
    merge_by_lse,
    sinks_gradient,
    sinks_partial,
)
from .engine import LongStrawEngine, check_prepared, no_layer_checkpointing, non_finite_error, weights_version
from .load_balancing import RouterLoad
from .state import (
    AttentionPages,
    ConvRecurrentState,
    FeedForwardOnly,
    IndexerKeys,
    LatentPages,
    PromptState,
    plan_layers,
)
from .state.mla import absorb

# Elements sent through each kind of collective by this process (reset it to measure a phase).
COMMUNICATION: Counter = Counter()
# Attention this process computed for other ranks' chunks (capture, recompute): wall seconds of the partials and
# (query token, key) pairs, the capture's imbalance as measured (benchmarks/context_parallel.py reports it).
SERVED: Counter = Counter()

# dtypes a tensor header can name (p2p hand-offs, the capture's query broadcast)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# What the owner of a shard announces to the other ranks (the first entry of an announcement), in capture and in the
# exact-mode recompute: the end of its shard, a forward attention call (capture: nothing kept; recompute: its queries
# and merged output kept until the call's backward), the backward of a recompute attention call, a DSA indexer call.
_END_OF_SHARD, _CAPTURE, _RECOMPUTE, _BACKWARD, _INDEXER = range(5)
_ANNOUNCEMENT = 14
_CPU = torch.device("cpu")


def communication_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the tensors of `group`'s collectives must live: NCCL takes CUDA tensors on this process's current
    device; gloo (and any other backend) CPU tensors. A process group that carries both (`"cpu:gloo,cuda:nccl"`)
    gets CUDA, where the model's tensors already are."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


@dataclass(frozen=True)
class ContextParallelGroup:
    """The ranks that share one prompt: `group` (None: the default group), this rank's index in it, its size, and the
    device its communication tensors live on (`communication_device`, picked once by `of`).

    Every collective of context parallelism goes through these methods, which take and return tensors on any device:
    a tensor not on `device` is copied there for the collective (and the result copied back in place); the math that
    produced it stays on the compute device."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    device: torch.device = _CPU

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> ContextParallelGroup:
        return cls(group, dist.get_rank(group), dist.get_world_size(group), communication_device(group))

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` itself if the backend can send it (on `device`, contiguous), else a copy that it can."""
        return tensor.to(self.device).contiguous()

    def _in_place(self, collective, tensor: torch.Tensor) -> torch.Tensor:
        wire = self._wire(tensor)
        collective(wire)
        if wire is not tensor:
            tensor.copy_(wire)
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce") -> torch.Tensor:
        COMMUNICATION[kind] += tensor.numel()
        return self._in_place(lambda wire: dist.all_reduce(wire, op=op, group=self.group), tensor)

    def broadcast(self, tensor: torch.Tensor, source: int, kind: str = "broadcast") -> torch.Tensor:
        """`tensor` as `source` has it, on every rank; the source's own tensor is never written (it may be a view of
        an activation autograd saved: an in-place write through a wire copy would bump its version)."""
        COMMUNICATION[kind] += tensor.numel()
        if self.rank == source:
            dist.broadcast(self._wire(tensor), group=self.group, group_src=source)
            return tensor
        return self._in_place(lambda wire: dist.broadcast(wire, group=self.group, group_src=source), tensor)

    def broadcast_tensor(self, tensor: torch.Tensor | None, source: int, kind: str) -> torch.Tensor:
        """A tensor of any shape and dtype from `source` (`None` elsewhere; header first: the others allocate from
        it), on `device` except at the source."""
        header = _header(tensor, self.device) if self.rank == source else torch.zeros(8, dtype=torch.int64)
        header = self.broadcast(header, source, kind="header")
        if self.rank != source:
            tensor = _allocated(header, self.device)
        return self.broadcast(tensor.detach(), source, kind=kind)

    def send(self, tensor: torch.Tensor, destination: int) -> None:
        """A tensor of any shape and dtype to `destination` (header first: the receiver allocates from it)."""
        dist.send(_header(tensor, self.device), group=self.group, group_dst=destination)
        COMMUNICATION["send"] += tensor.numel()
        dist.send(self._wire(tensor.detach()), group=self.group, group_dst=destination)

    def receive(self, source: int) -> torch.Tensor:
        """The tensor `send` sent, on `device` (the caller moves it where it is kept)."""
        header = torch.empty(8, dtype=torch.int64, device=self.device)
        dist.recv(header, group=self.group, group_src=source)
        tensor = _allocated(header, self.device)
        dist.recv(tensor, group=self.group, group_src=source)
        return tensor


def _header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What a receiver needs to allocate `tensor` (up to 6 dimensions): its rank, dtype and shape."""
    header = torch.zeros(8, dtype=torch.int64)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    return header.to(device)


def _allocated(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An empty tensor as `_header` described it."""
    dims, dtype, *shape = header.tolist()
    return torch.empty(tuple(shape[:dims]), dtype=_DTYPES[dtype], device=device)


def shard_bounds(num_tokens: int, size: int) -> list[tuple[int, int]]:
    """Contiguous shards of `num_tokens` captured tokens over `size` ranks, sizes differing by at most one."""
    return [(rank * num_tokens // size, (rank + 1) * num_tokens // size) for rank in range(size)]


def check_prompt_length(prompt_tokens: int, size: int) -> None:
    """Every rank of a CP group needs at least one captured token (all but the last prompt token are captured)."""
    if prompt_tokens - 1 < size:
        raise ContextParallelError(
            f"A prompt of {prompt_tokens} tokens captures {prompt_tokens - 1} (all but the last), fewer than the "
            f"{size} ranks of context_parallel_size={size}: every rank needs at least one token of the prompt. "
            "Lower context_parallel_size or filter out shorter prompts."
        )


def capture_attention_pairs(num_tokens: int, size: int) -> list[int]:
    """Causal (query, key) pairs of the capture whose key lives on each rank: the capture's attention work per rank."""
    pairs = []
    for start, end in shard_bounds(num_tokens, size):
        length = end - start
        pairs.append(length * (length + 1) // 2 + length * (num_tokens - end))
    return pairs


class ContextParallelError(ValueError):
    """A context-parallel setup that cannot work (the message names the fix)."""


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


def _empty_partial(q: torch.Tensor, value_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, tokens, _ = q.shape
    out = torch.zeros((batch, heads, tokens, value_dim), dtype=dtype, device=q.device)
    return out, torch.full((batch, heads, tokens), float("-inf"), dtype=dtype, device=q.device)


def partial_attention(q, q_positions, scaling, visibility, chunk_size, softcap, blocks, tensors, value_dim, sinks):
    """This rank's `(o, lse)` over its blocks (and its sinks, on the rank that counts them); `lse = -inf` if none."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out, lse = blocks_forward(q, q_positions, scaling, visibility, chunk_size, softcap, blocks, tensors)
    if out is None:
        out, lse = _empty_partial(q, value_dim, acc)
    if sinks is not None:
        out, lse = merge_by_lse(out, lse, torch.zeros_like(out), sinks_partial(sinks, lse))
    return out, lse


@dataclass(frozen=True)
class _Call:
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
    visibility: object
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
    def forward(ctx, q, sinks, own_k, own_v, call: _Call, page_blocks, *page_tensors):
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
            summed = _unpack(call.cp.all_reduce(_pack(pieces), kind="backward"), pieces)
        d_q = summed[0].to(q.dtype)
        if call.reduce_suffix:
            d_own_k, d_own_v = summed[1], summed[2]
        d_own_k = d_own_k.to(own_k.dtype) if need[2] and d_own_k is not None else None
        d_own_v = d_own_v.to(own_v.dtype) if need[3] and d_own_v is not None else None
        d_sinks = summed[-1].to(sinks.dtype) if sinks is not None and need[1] else None
        return (d_q, d_sinks, d_own_k, d_own_v, None, None, *grads[: len(page_tensors)])


def _pack(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([piece.reshape(-1) for piece in pieces])


def _unpack(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    pieces, offset = [], 0
    for piece in like:
        pieces.append(packed[offset : offset + piece.numel()].view_as(piece))
        offset += piece.numel()
    return pieces


def _accumulate_grad(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad` (for the first entries of `leaf`) to `leaf.grad`, as autograd would for a leaf."""
    if leaf.grad is None:
        leaf.grad = torch.zeros_like(leaf)
    leaf.grad[:, : grad.shape[1]] += grad.to(leaf.grad.dtype)


@dataclass
class _Served:
    """What a serving rank keeps of one recompute attention call until its backward: one chunk's queries and merge."""

    query: torch.Tensor
    positions: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    scaling: float
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool
    value_dim: int
    selection: torch.Tensor | None = None  # DSA: the merged top-k indices the owner's attention applies


class ShardedView:
    """What the registered attention reaches for a paged layer of a sharded state: the layer's own pages (its shard,
    at its absolute positions) as this rank's partial, merged across the CP group. A subclass per paged kind says
    how its pages form a key block and how this forward's queries and own keys are formed."""

    def __init__(self, layer, state: ShardedPromptState):
        self.layer = layer
        self.state = state

    # -- per kind ----------------------------------------------------------------------------------------------------
    def page_block(self, dtype, limit=None, indices=None) -> tuple[tuple[KeyBlock, ...], tuple[torch.Tensor, ...]]:
        """This rank's pages (their first `limit` entries; all by default) as one shared key block, or nothing; with
        DSA top-k `indices` (global key indices), only the keys they select."""
        raise NotImplementedError

    def visibility(self, sliding_window: int | None):
        return CAUSAL

    def accumulate(self, d_keys: torch.Tensor, d_values: torch.Tensor) -> None:
        """Add a served backward's gradients of the page block's keys and values to the page leaves."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------------------------------
    def sharded_attention(self, access, query, own_k, own_v, scaling, sliding_window, softcap, sinks, indices=None):
        """`query` over every rank's pages and over `own_k/own_v` (this forward's own keys, `[batch * groups, tokens,
        d]`), as one softmax across the CP group; announced to the serving ranks when this rank owns the chunk. DSA
        `indices` (the merged top-k, global key indices: the prompt's tokens, then this forward's) restrict both."""
        state = self.state
        positions = access.query_positions
        limit, on_backward = None, None
        if access.mode in ("read", "decode"):  # every rank runs the member (rows): rank 0 counts its own keys
            owns_suffix, reduce_suffix = state.cp.rank == 0, True
        else:  # this rank owns the chunk being captured or recomputed
            owns_suffix, reduce_suffix = True, False
            phase = _CAPTURE if access.mode == "capture" else _RECOMPUTE
            state.announce(
                phase,
                self.layer.layer_idx,
                query,
                own_v.shape[-1],
                positions,
                scaling,
                sliding_window,
                softcap,
                sinks,
                indices is not None,
            )
            if access.mode == "recompute":  # the pages before the chunk
                limit = access.prefix_length - state.shard[0]

                def on_backward(d_out, layer_idx=self.layer.layer_idx):
                    state.announce_backward(layer_idx, d_out)

        page_blocks, page_tensors = self.page_block(query.dtype, limit, indices)
        own_picked = None if indices is None else indices.long() - access.prefix_length
        call = _Call(
            state.cp,
            owns_suffix,
            reduce_suffix,
            positions,
            scaling,
            self.visibility(sliding_window),
            access.attention_chunk_size,
            softcap,
            KeyBlock(access.own_positions(own_k.shape[1]), shared=False, picked=own_picked),
            on_backward,
        )
        return ContextParallelAttention.apply(query, sinks, own_k, own_v, call, page_blocks, *page_tensors)

    def _served_blocks(self, served: _Served, owner: int):
        if self.state.cp.rank > owner:  # this shard lies after the owner's queries: nothing it may see
            return (), ()
        return self.page_block(served.query.dtype, indices=served.selection)

    @torch.no_grad()
    def serve_forward(self, served: _Served, owner: int, chunk_size: int) -> None:
        """Another rank's chunk: this rank's partial of its queries over this rank's pages, merged on every rank."""
        blocks, tensors = self._served_blocks(served, owner)
        start = time.perf_counter()
        out, lse = partial_attention(
            served.query,
            served.positions,
            served.scaling,
            self.visibility(served.sliding_window),
            chunk_size,
            served.softcap,
            blocks,
            tensors,
            served.value_dim,
            None,
        )
        SERVED["seconds"] += time.perf_counter() - start
        SERVED["query_key_pairs"] += served.query.shape[2] * (tensors[0].shape[1] if tensors else 0)
        served.out, served.lse = merge_across(out, lse, self.state.cp)

    @torch.no_grad()
    def serve_backward(self, served: _Served, d_out: torch.Tensor, owner: int, chunk_size: int) -> None:
        """Another rank's recompute backward: this rank's pages get their gradients (accumulated on the state leaves,
        before this rank recomputes them), and this rank's share of dq goes into the owner's sum."""
        blocks, tensors = self._served_blocks(served, owner)
        d_q = torch.zeros(served.query.shape, dtype=served.out.dtype, device=served.query.device)
        if blocks:
            d_q, (d_keys, d_values) = blocks_backward(
                d_out,
                served.query,
                served.positions,
                served.out,
                served.lse,
                served.scaling,
                self.visibility(served.sliding_window),
                chunk_size,
                served.softcap,
                blocks,
                tensors,
                (True, True, True),
            )
            self.accumulate(d_keys, d_values)
        pieces = [d_q]
        if served.has_sinks:
            pieces.append(torch.zeros(served.query.shape[1], dtype=d_q.dtype, device=d_q.device))
        self.state.cp.all_reduce(_pack(pieces), kind="backward")


class ShardedAttention(ShardedView):
    """Softmax attention (GQA/MQA): this rank's K/V pages."""

    def page_block(self, dtype, limit=None, indices=None):
        layer = self.layer
        limit = layer.length if limit is None else limit
        if limit == 0:
            return (), ()
        positions = torch.arange(layer.start_position, layer.start_position + limit)
        dequantize = layer._dequantizer(dtype) if layer.key.fp8 else None
        block = KeyBlock(positions, shared=True, dequantize=dequantize)
        return (block,), (layer.key.read(limit), layer.value.read(limit))

    def visibility(self, sliding_window):
        """The layer's visibility, with a chunked layer's chunks counted from the whole prompt's first position (the
        layer's own geometry starts at its shard)."""
        return Visibility(sliding_window, self.layer.chunk_size, self.state.start_position)

    def accumulate(self, d_keys, d_values):
        _accumulate_grad(self.layer.key.data, d_keys)
        _accumulate_grad(self.layer.value.data, d_values)

    def attend(self, access, query, key, value, scaling, sliding_window=None, sinks=None, softcap=None, **_):
        layer = self.layer
        batch, kv_heads, tokens, _ = key.shape
        window = self.visibility(sliding_window).sliding_window  # decoding: the rows' earlier entries first
        own_k = access.own_entries(layer, "key", key.reshape(batch * kv_heads, tokens, -1), dim=1, window=window)
        own_v = access.own_entries(layer, "value", value.reshape(batch * kv_heads, tokens, -1), 1, window)
        out = self.sharded_attention(access, query, own_k, own_v, scaling, sliding_window, softcap, sinks)
        self.keep(access, key, value, sliding_window)
        return out

    def keep(self, access, key, value, sliding_window=None, **_) -> None:
        # the view's visibility: a chunked layer's chunks count from the whole prompt's start, not the shard's
        self.layer.keep(access, key, value, visibility=self.visibility(sliding_window))


class ShardedLatentAttention(ShardedView):
    """MLA: this rank's latent pages, read as multi-query attention by the absorbed queries (as `LatentPages`)."""

    def page_block(self, dtype, limit=None, indices=None):
        pages = self.layer.pages
        limit = pages.length if limit is None else limit
        if limit == 0:
            return (), ()
        start = self.layer.prompt.start_position  # the shard's first absolute position
        positions = torch.arange(start, start + limit)
        picked = None if indices is None else indices.long() - self.state.shard[0]
        block = KeyBlock(positions, shared=True, picked=picked, dequantize=self.layer.dequantizer(dtype))
        data = pages.read(limit)
        return (block,), (data, data[..., : self.layer.mixer.kv_lora_rank])

    def accumulate(self, d_keys, d_values):
        leaf = self.layer.pages.data
        if leaf.grad is None:
            leaf.grad = torch.zeros_like(leaf)
        leaf.grad[:, : d_keys.shape[1]] += d_keys.to(leaf.grad.dtype)
        if d_values is not None:  # None: a DSA block gave the values' gradient inside the keys' (`blocks_backward`)
            leaf.grad[:, : d_values.shape[1], : d_values.shape[-1]] += d_values.to(leaf.grad.dtype)

    def attend(self, access, query, key, value, scaling, indices=None, **_):
        layer = self.layer
        module = layer.mixer
        own_keys = access.own_entries(layer, "latent", layer.own_latents(access), dim=1)  # decoding: earlier first
        rank = module.kv_lora_rank
        absorbed, values = absorb(module, query)
        out = self.sharded_attention(
            access, absorbed, own_keys, own_keys[..., :rank], scaling, None, None, None, indices
        )
        layer.keep(access, key, value, latents=own_keys)
        return values(out)

    def keep(self, access, key, value, **_) -> None:
        self.layer.keep(access, key, value)


class ShardedPromptState(PromptState):
    """One rank's share of a prompt state under context parallelism.

    Its layer states see the geometry of this rank's shard (`geometry`: the shard's tokens at their absolute
    positions), so an attention kind's pages hold exactly its shard and know their positions; the state itself
    presents the whole prompt (`num_tokens`, `start_position`), which is what a replay continues after. Attention
    and MLA layers are reached through a `ShardedView`, which merges every rank's partial.

    Recurrent layers: on a rank after the first, entry 0 of each recurrent layer's per-chunk states is the previous
    shard's final state (the start of this shard), so this rank's capture chunk k is chunk `k + chunk_offset` of its
    layer states; exact mode keeps, after this shard's own entries, the whole prompt's final state for the replays.
    """

    SUPPORTED_LAYER_TYPES = (
        None,
        "full_attention",
        "sliding_attention",
        "indexed_attention",
        "linear_attention",
        "hybrid",
        "mlp",
        "moe",
    )

    def __init__(self, plans, num_tokens, start_position, cp: ContextParallelGroup, **kwargs):
        self.cp = cp
        self.bounds = shard_bounds(num_tokens, cp.size)
        shard_start, shard_end = self.bounds[cp.rank]
        super().__init__(
            plans, num_tokens=shard_end - shard_start, start_position=start_position + shard_start, **kwargs
        )
        self._whole = (num_tokens, start_position)
        self.chunk_offset = 0
        self.selection: torch.Tensor | None = None  # the last merged DSA top-k (`finish_selection`)
        self._refuse_unsharded_layers()
        views = {AttentionPages: ShardedAttention, LatentPages: ShardedLatentAttention}
        self._views = {
            id(layer.mixer): views[type(layer)](layer, self) for layer in self.layers if type(layer) in views
        }

    def _refuse_unsharded_layers(self) -> None:
        """Kinds and layers context parallelism does not shard yet are refused before any collective (every rank
        refuses alike), unsupported kinds first: they name the mixer (a DSA layer is also an 'indexed_attention')."""
        for layer in self.layers:
            if not isinstance(
                layer, AttentionPages | LatentPages | IndexerKeys | ConvRecurrentState | FeedForwardOnly
            ):
                raise ContextParallelError(
                    f"Layer {layer.layer_idx} keeps a {type(layer).name!r} state, which context parallelism does not "
                    "shard yet: set context_parallel_size=1 for this model."
                )
        for layer in self.layers:
            if layer.layer_type not in self.SUPPORTED_LAYER_TYPES:
                raise ContextParallelError(
                    f"Layer {layer.layer_idx} is a {layer.layer_type!r} layer: context parallelism shards full and "
                    "sliding-window attention, MLA (with DSA) and recurrent layers so far. Set context_parallel_size=1 "
                    "for this model."
                )

    @property
    def num_tokens(self) -> int:
        return self._whole[0]

    @property
    def start_position(self) -> int:
        return self._whole[1]

    @property
    def shard(self) -> tuple[int, int]:
        return self.bounds[self.cp.rank]

    def local_prefix(self, prefix_length: int) -> int:
        shard_start, shard_end = self.shard
        return max(0, min(prefix_length, shard_end) - shard_start)

    def for_mixer(self, module):
        view = self._views.get(id(module))
        return view if view is not None else super().for_mixer(module)

    # -- capture and recompute: the owner announces each attention call, the other ranks serve it --------------------
    def announce(
        self, phase, layer_idx, query, value_dim, positions, scaling, sliding_window, softcap, sinks, selects
    ) -> None:
        announcement = torch.tensor(
            [
                phase,
                layer_idx,
                *query.shape,
                value_dim,
                int(positions[0]),
                scaling,
                -1 if sliding_window is None else sliding_window,
                0.0 if softcap is None else softcap,
                _DTYPES.index(query.dtype),
                sinks is not None,
                selects,
            ],
            dtype=torch.float64,
            device=self.cp.device,
        )
        self.cp.broadcast(announcement, self.cp.rank, kind="capture")
        self.cp.broadcast(query.detach().contiguous(), self.cp.rank, kind="capture")

    def announce_backward(self, layer_idx: int, d_out: torch.Tensor) -> None:
        announcement = torch.zeros(_ANNOUNCEMENT, dtype=torch.float64, device=self.cp.device)
        announcement[0], announcement[1] = _BACKWARD, layer_idx
        self.cp.broadcast(announcement, self.cp.rank, kind="recompute")
        self.cp.broadcast(d_out, self.cp.rank, kind="recompute")

    def end_of_shard(self) -> None:
        end = torch.zeros(_ANNOUNCEMENT, dtype=torch.float64, device=self.cp.device)
        self.cp.broadcast(end, self.cp.rank, kind="capture")

    def serve(self, owner: int, chunk_size: int, device: torch.device) -> None:
        """Run the other side of `owner`'s capture (or recompute) until it announces the end of its shard. A serving
        rank holds at most one chunk of the owner's queries (and their merged output) per attention layer."""
        by_layer = {view.layer.layer_idx: view for view in self._views.values()}
        kept: dict[int, _Served] = {}
        while True:
            announcement = torch.zeros(_ANNOUNCEMENT, dtype=torch.float64, device=self.cp.device)
            phase, layer_idx, *rest = self.cp.broadcast(announcement, owner, kind="capture").tolist()
            phase, layer_idx = int(phase), int(layer_idx)
            if phase == _END_OF_SHARD:
                return
            if phase == _INDEXER:
                self.serve_indexer(layer_idx, owner, int(rest[0]), chunk_size, device)
                continue
            view = by_layer[layer_idx]
            if phase == _BACKWARD:
                served = kept.pop(layer_idx)
                d_out = self.cp.broadcast(torch.empty_like(served.out), owner, kind="recompute")
                view.serve_backward(served, d_out, owner, chunk_size)
                continue
            batch, heads, tokens, dim, value_dim, first, scaling, window, softcap, dtype, has_sinks, selects = rest
            query = torch.empty(
                (int(batch), int(heads), int(tokens), int(dim)), dtype=_DTYPES[int(dtype)], device=device
            )
            query = self.cp.broadcast(query, owner, kind="capture")
            positions = torch.arange(int(first), int(first) + int(tokens))
            window = None if window < 0 else int(window)
            served = _Served(query, positions, None, None, scaling, window, softcap or None, has_sinks, int(value_dim))
            served.selection = self.selection if selects else None
            view.serve_forward(served, owner, chunk_size)
            if phase == _RECOMPUTE:
                kept[layer_idx] = served

    # -- DSA: the top-k over every rank's indexer keys (state/dsa.py selects within a rank) ------------------------
    def own_keys(self, access, own_index: torch.Tensor) -> torch.Tensor:
        if access.mode in ("read", "decode") and self.cp.rank != 0:  # every rank runs the rows: rank 0 counts them
            return torch.full_like(own_index, -1)
        return own_index

    def before_selection(self, module, access, call: dict, k: int) -> None:
        if access.mode in ("capture", "recompute"):  # an owned chunk: the serving ranks score their keys too
            inputs = (call["hidden_states"], call["q_resid"], *call["position_embeddings"])
            self.announce_indexer(module.layer_idx, k, *inputs)

    def finish_selection(self, candidates, k: int):
        values, indices = merge_topk(candidates, candidates[0], k, self.cp)
        self.selection = indices
        return values, indices

    def announce_indexer(self, layer_idx: int, k: int, *inputs: torch.Tensor) -> None:
        announcement = torch.zeros(_ANNOUNCEMENT, dtype=torch.float64, device=self.cp.device)
        announcement[0], announcement[1], announcement[2] = _INDEXER, layer_idx, k
        self.cp.broadcast(announcement, self.cp.rank, kind="capture")
        for tensor in inputs:
            self.cp.broadcast_tensor(tensor.contiguous(), self.cp.rank, kind="capture")

    def serve_indexer(self, layer_idx: int, owner: int, k: int, chunk_size: int, device: torch.device) -> None:
        """Another rank's indexer call: the model's indexer over this rank's keys before the owner's chunk (all of an
        earlier shard's, none of a later one's), block by block, merged into the top-k on every rank."""
        hidden, q_resid, cos, sin = (
            self.cp.broadcast_tensor(None, owner, kind="capture").to(device) for _ in range(4)
        )
        layer = self.of_layer(layer_idx, IndexerKeys)
        call = {"hidden_states": hidden, "q_resid": q_resid, "position_embeddings": (cos, sin)}
        limit = layer.keys.length if self.cp.rank < owner else 0
        candidates = layer.prompt_candidates(call, None, k, limit, chunk_size, self.shard[0])
        self.selection = merge_topk(candidates, hidden, k, self.cp)[1]

    # -- recurrent layers: the sequential hand-off ---------------------------------------------------------------------
    def recurrent_layers(self) -> list[ConvRecurrentState]:
        return [layer for layer in self.layers if isinstance(layer, ConvRecurrentState)]

    def last_own_entry(self, chunks: int) -> int:
        return chunks - 1 + self.chunk_offset

    def send_recurrent(self, destination: int) -> None:
        for layer in self.recurrent_layers():
            self.cp.send(layer.conv[-1], destination)
            self.cp.send(layer.recurrent[-1], destination)

    def receive_recurrent(self, source: int) -> None:
        """Start this shard's recurrent layers from the previous shard's final states (as a capture chunk would)."""
        for layer in self.recurrent_layers():  # they arrive where the backend communicates (gloo: the host)
            layer.conv.append(self.geometry.placement.store(self.cp.receive(source).to(layer.device)))
            layer.recurrent.append(self.geometry.placement.store(self.cp.receive(source).to(layer.device)))
        self.chunk_offset = 1

    def share_final_recurrent(self) -> None:
        """Every rank replays from the whole prompt's recurrent state: the last shard's, broadcast (fixed size).
        Detach mode replaces this rank's own final state with it; exact mode keeps this rank's entries (the
        recompute reads them) and appends it."""
        last = self.cp.size - 1
        for layer in self.recurrent_layers():
            for states in (layer.conv, layer.recurrent):
                final = self.cp.broadcast(states[-1].clone(), last, kind="recurrent")
                if self.cp.rank == last:
                    continue
                if self.exact:
                    states.append(final)
                else:
                    states[-1] = final

    def send_recurrent_gradients(self, destination: int) -> None:
        """Exact mode: the gradient on this shard's starting states belongs to the previous shard's final states."""
        for layer in self.recurrent_layers():
            for start in (layer.conv[0], layer.recurrent[0]):
                self.cp.send(torch.zeros_like(start) if start.grad is None else start.grad, destination)

    def receive_recurrent_gradients(self, source: int, chunks: int) -> None:
        entry = self.last_own_entry(chunks)
        for layer in self.recurrent_layers():
            for final in (layer.conv[entry], layer.recurrent[entry]):
                grad = self.cp.receive(source).to(final.device, final.dtype)
                final.grad = grad if final.grad is None else final.grad + grad


@dataclass
class ContextParallelEngine(LongStrawEngine):
    """`LongStrawEngine` with the prompt sharded across `context_parallel` (module docstring). With a group of one
    (or none) it is the plain engine. Every rank of the group must call `capture`, `score`, `replay` and
    `backward_prompt` with the same arguments, in the same order."""

    context_parallel: ContextParallelGroup | None = field(default=None)

    @property
    def sharded(self) -> bool:
        return self.context_parallel is not None and self.context_parallel.size > 1

    def agree(self, decision: torch.Tensor) -> torch.Tensor:
        """A rollout step's decision, rank 0's on every rank of the CP group (they decode the same rows in
        lockstep)."""
        if not self.sharded:
            return decision
        return self.context_parallel.broadcast(decision.to(torch.int64).contiguous(), 0, kind="rollout").to(
            decision.dtype
        )

    def _own_chunks(self, state: ShardedPromptState) -> list[tuple[int, int]]:
        shard_start, shard_end = state.shard
        return [
            (start, min(start + self.prefill_chunk_size, shard_end))
            for start in range(shard_start, shard_end, self.prefill_chunk_size)
        ]

    @torch.no_grad()
    def capture(self, model, prompt_ids, first_position):
        if not self.sharded:
            return super().capture(model, prompt_ids, first_position)
        cp = self.context_parallel
        check_prepared(model)
        check_prompt_length(prompt_ids.numel(), cp.size)
        num_tokens = prompt_ids.numel() - 1
        state = ShardedPromptState(
            plan_layers(model),
            num_tokens,
            first_position,
            cp,
            device=self.state_device,
            weights_version=weights_version(model),
            exact=self.prompt_gradient == "exact",
            fp8_pages=self.prompt_state_dtype == "float8_e4m3fn",
        )
        if self.routing is not None:
            state.router_load = RouterLoad.zeros(self.routing, self._device(model))
        for owner in range(cp.size):
            if owner != cp.rank:
                state.serve(owner, self.attention_chunk_size, self._device(model))
                continue
            if owner > 0:
                state.receive_recurrent(owner - 1)
            for chunk_index, (start, end) in enumerate(self._own_chunks(state)):
                chunk = chunk_index + state.chunk_offset
                _, load = self._backbone_forward(model, state, "capture", prompt_ids[start:end], start, chunk)
                state.add_router_load(load)
            state.end_of_shard()
            if owner < cp.size - 1:
                state.send_recurrent(owner + 1)
        state.share_final_recurrent()
        if self.routing is not None:  # every rank holds the whole prompt's routing sums
            experts = self.routing.num_experts
            load = state.router_load
            total = cp.all_reduce(torch.cat([load.counts, load.probs, load.rows.reshape(1)]), kind="capture")
            state.router_load = RouterLoad(total[:experts], total[experts : 2 * experts], total[-1])
        state.check_captured()
        finite = torch.tensor([float(state.all_finite())])
        if not cp.all_reduce(finite, op=dist.ReduceOp.MIN, kind="capture").item():  # every rank raises together
            raise non_finite_error("the captured prompt state")
        return state

    def backward_prompt(self, model, state, prompt_ids, router_weights=None) -> None:
        """Exact mode: each rank pushes its shard's state gradient into the parameters by recomputing its own chunks,
        shards in reverse order (the last shard's recompute sends gradients into earlier shards' pages, served where
        they live, and into its starting recurrent state, sent back to the previous shard's owner, before those are
        recomputed); then the parameter gradients this added are summed across the CP group (with `router_weights`,
        each rank's chunks add their tokens' share of the load-balancing loss's gradient)."""
        if not self.sharded:
            return super().backward_prompt(model, state, prompt_ids, router_weights)
        cp = self.context_parallel
        state.check_fresh(weights_version(model))
        params = [p for p in model.parameters() if p.requires_grad]
        before = [None if p.grad is None else p.grad.clone() for p in params]
        chunks = self._own_chunks(state)
        shard_start = state.shard[0]
        with no_layer_checkpointing(model), torch.enable_grad():
            for owner in reversed(range(cp.size)):
                if owner != cp.rank:
                    state.serve(owner, self.attention_chunk_size, self._device(model))
                    continue
                if owner < cp.size - 1:
                    state.receive_recurrent_gradients(owner + 1, len(chunks))
                for chunk_index in reversed(range(len(chunks))):
                    start, end = chunks[chunk_index]
                    chunk = chunk_index + state.chunk_offset
                    self._recompute_chunk(model, state, prompt_ids, start, end, chunk, router_weights, shard_start)
                state.end_of_shard()
                if owner > 0:
                    state.send_recurrent_gradients(owner - 1)
        sum_added_gradients(params, before, cp)


def sum_added_gradients(params, before, cp: ContextParallelGroup) -> None:
    """Sum across the CP group what each rank's prompt recompute added to the parameter gradients (the replays'
    part, identical on every rank, is kept once). A parameter reached on any rank gets a gradient on every rank."""
    reached = torch.tensor([float(p.grad is not None) for p in params])
    cp.all_reduce(reached, op=dist.ReduceOp.MAX, kind="gradients")
    params = [(p, b) for p, b, r in zip(params, before, reached.tolist(), strict=True) if r]
    added = [
        p.grad - b if b is not None else (p.grad if p.grad is not None else torch.zeros_like(p)) for p, b in params
    ]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, delta in enumerate(added):
        by_dtype.setdefault(delta.dtype, []).append(index)
    for indices in by_dtype.values():
        summed = _unpack(
            cp.all_reduce(_pack([added[i] for i in indices]), kind="gradients"), [added[i] for i in indices]
        )
        for i, total in zip(indices, summed, strict=True):
            param, base = params[i]
            param.grad = total.clone() if base is None else base + total


def build_context_parallel_group(context_parallel_size: int) -> ContextParallelGroup:
    """This rank's CP group on `torch.distributed`, `world = dp x cp`: consecutive ranks `[k cp, (k + 1) cp)` form CP
    group k (neighbours share a prompt: on a multi-GPU node they share the fastest links), as Accelerate orders its
    mesh (`cp` inner). Every rank creates every group, in the same order, as `new_group` requires. Gradients are
    averaged over the whole world, not over a DP group: that is the DP mean (a CP group's ranks hold the same
    gradient), and it keeps a CP group's ranks bitwise equal even where a non-deterministic kernel (CUDA's scatter-add
    in MoE routing, say) made their replays differ in the last bits, so their weights can never drift apart."""
    size = context_parallel_size
    if not dist.is_available() or not dist.is_initialized():
        raise ContextParallelError(
            f"context_parallel_size={size} needs a distributed launch: run `accelerate launch --num_processes N` with "
            f"N a multiple of {size}, or set context_parallel_size=1."
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ContextParallelError(
            f"context_parallel_size={size} does not divide the {world} processes (world = data parallel x context "
            f"parallel): launch a multiple of {size} processes, or set context_parallel_size to a divisor of {world}."
        )
    context = None
    for first in range(0, world, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks)
        context = group if rank in ranks else context
    return ContextParallelGroup.of(context)


def check_same_rows(prompt_ids: list[list[int]], cp: ContextParallelGroup) -> None:
    """The ranks of a CP group decode the same rows in lockstep, so the rows they generate from must be the same. A
    tool-calling turn's rows carry tool results each rank computed itself: a tool or environment whose results are
    not deterministic makes them differ, which is refused here (on every rank alike) instead of hanging in mismatched
    collectives."""
    digest = hashlib.sha256(repr(prompt_ids).encode()).digest()
    value = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64)
    low = cp.all_reduce(value.clone(), op=dist.ReduceOp.MIN, kind="rollout")
    high = cp.all_reduce(value.clone(), op=dist.ReduceOp.MAX, kind="rollout")
    if int(low) != int(high):
        raise ContextParallelError(
            f"The ranks of a context-parallel group (size {cp.size}) reached a tool-calling turn with different "
            "histories: a tool or environment returned different results on different ranks (each rank runs the "
            "tools). Make the tools deterministic given their arguments (seed any randomness from them), or set "
            "context_parallel_size=1."
        )


def check_same_rewards(rewards: torch.Tensor, cp: ContextParallelGroup, rows: int) -> None:
    """GRPOTrainer gathers the rewards of every rank, `[world * rows, reward functions]`: a CP group's ranks scored the
    same rows, so their copies must agree. A reward that is not deterministic (a sampled judge, the clock) would give
    each rank other advantages, and a rank skipping a flat-reward group would leave the others in its collectives.
    Checked on the gathered tensor every rank holds, so every rank refuses alike."""
    copies = rewards.view(-1, cp.size, rows, rewards.shape[-1])
    first = copies[:, :1]
    same = (copies == first) | (torch.isnan(copies) & torch.isnan(first))
    if not bool(same.all()):
        raise ContextParallelError(
            f"The ranks of a context-parallel group (size {cp.size}) scored the same completions with different "
            "rewards: a reward function returned different values on different ranks (each rank computes them). "
            "Make the reward functions deterministic given their inputs (seed any randomness from them), or set "
            "context_parallel_size=1."
        )


def leader_rows(tensor: torch.Tensor, cp: ContextParallelGroup) -> torch.Tensor:
    """This rank's `tensor` where it is its CP group's first rank, else none of it: what a statistic gathered over
    every rank should count once per CP group (the group's ranks hold the same rows)."""
    return tensor if cp.rank == 0 else tensor[:0]


def share_leader_inputs(inputs, cp: ContextParallelGroup):
    """Every rank of a CP group generates and trains on its first rank's rows, from its random state: the group then
    samples the same completions and computes the same loss, so its ranks replay the same members in lockstep. With
    `SharedRowsSampler` the rows are already the same (this then only aligns the random state); without it (iterable
    datasets) the other ranks' own rows of the step are drawn and not used."""
    payload = [inputs, torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None]
    dist.broadcast_object_list(payload, group=cp.group, group_src=0)
    torch.set_rng_state(payload[1])
    if payload[2] is not None:
        torch.cuda.set_rng_state(payload[2])
    return payload[0]


class SharedRowsSampler(torch.utils.data.Sampler):
    """TRL's `RepeatSampler` for `world / cp` data-parallel ranks, each block of `rows_per_rank` rows repeated `cp`
    times in a row: the dataloader deals consecutive blocks to consecutive ranks, so the ranks of a CP group (which
    are consecutive) all draw the same rows, and a step consumes the rows a data-parallel run of `world / cp` ranks
    would (no rank's rows are drawn and dropped)."""

    def __init__(self, sampler, rows_per_rank: int, copies: int):
        # The same sampler with `1 / copies` of its prompts per generation batch (its arguments are public fields).
        self.base = type(sampler)(
            sampler.data_source,
            sampler.mini_repeat_count,
            max(1, sampler.batch_size // copies),  # evaluation's sampler draws one prompt at a time
            sampler.repeat_count,
            sampler.shuffle,
            sampler.seed,
        )
        self.rows_per_rank, self.copies = rows_per_rank, copies

    def __iter__(self):
        block = []
        for index in self.base:
            block.append(index)
            if len(block) == self.rows_per_rank:
                for _ in range(self.copies):
                    yield from block
                block = []

    def __len__(self) -> int:
        return len(self.base) // self.rows_per_rank * self.rows_per_rank * self.copies
