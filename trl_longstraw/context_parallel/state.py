"""One rank's shard of a prompt state, and the serving side of the rank protocol.

Every rank of a CP group keeps the durable state of one contiguous shard of the captured prompt tokens (`sharding.py`):
each layer state sees its shard's geometry (the shard's tokens at their absolute positions, the whole prompt's first
position as `prompt_start`), so a kind's pages hold exactly its shard and its sliding window the last `window - 1`
entries of its shard. Nothing of another rank's pages is ever copied: `ShardedPromptState.attention` replaces the
single-process attention over a kind's pages (`LayerState.page_block`) with this rank's partial over its pages, merged
across the group (`merge.ContextParallelAttention`); in a capture or recompute the owner of the chunk announces the
call (`protocol.py`) and the other ranks `serve` it over their pages. Recurrent kinds hand their chunk states
(`LayerState.chunk_states`) from shard to shard; the last shard's final states are broadcast so that every rank's
replay starts from the whole prompt's. DSA: each rank's top-k candidates over its indexer keys (`state/dsa.py`) are
merged into the global top-k on every rank (`merge.merge_topk`). No kind is named here: each answers for itself.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import dataclass

import torch

from ..attention import KeyBlock, Visibility, blocks_backward
from ..state import LayerState, PromptState
from .communication import ContextParallelGroup, pack
from .merge import AttentionCall, ContextParallelAttention, merge_across, merge_topk, partial_attention
from .protocol import Announcement, Phase
from .sharding import ContextParallelError, shard_bounds

# Attention this process computed for other ranks' chunks (capture, recompute): wall seconds of the partials and
# (query token, key) pairs, the capture's imbalance as measured (benchmarks/context_parallel.py reports it).
SERVED: Counter = Counter()


@dataclass
class ServedCall:
    """What a serving rank keeps of one recompute attention call until its backward: one chunk's queries and merge."""

    announcement: Announcement
    query: torch.Tensor
    positions: torch.Tensor
    selection: torch.Tensor | None  # DSA: the merged top-k indices the owner's attention applies
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None


class ShardedPromptState(PromptState):
    """One rank's share of a prompt state under context parallelism.

    Its layer states see the geometry of this rank's shard (`geometry`: the shard's tokens at their absolute
    positions), so an attention kind's pages hold exactly its shard and know their positions; the state itself
    presents the whole prompt (`num_tokens`, `start_position`), which is what a replay continues after.

    Recurrent kinds: on a rank after the first, entry 0 of each of a layer's chunk states is the previous shard's
    final state (the start of this shard), so this rank's capture chunk k is chunk `k + chunk_offset` of its layer
    states; exact mode keeps, after this shard's own entries, the whole prompt's final state for the replays.
    """

    def __init__(self, plans, num_tokens, start_position, cp: ContextParallelGroup, **kwargs):
        self.cp = cp
        self.bounds = shard_bounds(num_tokens, cp.size)
        shard_start, shard_end = self.bounds[cp.rank]
        super().__init__(
            plans,
            num_tokens=shard_end - shard_start,
            start_position=start_position + shard_start,
            prompt_start=start_position,
            **kwargs,
        )
        self._whole = (num_tokens, start_position)
        self.chunk_offset = 0
        self.selection: torch.Tensor | None = None  # the last merged DSA top-k (`finish_selection`)
        self._refuse_unsharded_layers()

    def _refuse_unsharded_layers(self) -> None:
        """Kinds and layers context parallelism does not shard (`LayerState.sharded_layer_types`) are refused before
        any collective (every rank refuses alike), kinds first: they name the mixer (a DSA layer is also an
        'indexed_attention')."""
        for layer in self.layers:
            if not type(layer).sharded_layer_types:
                raise ContextParallelError(
                    f"Layer {layer.layer_idx} keeps a {type(layer).name!r} state, which context parallelism does not "
                    "shard yet: set context_parallel_size=1 for this model."
                )
        for layer in self.layers:
            if layer.layer_type not in type(layer).sharded_layer_types:
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

    # -- attention: this rank's partial over its pages, merged across the group ----------------------------------------
    def attention(
        self,
        access,
        layer: LayerState,
        query: torch.Tensor,
        own_keys: torch.Tensor,
        own_values: torch.Tensor,
        scaling: float,
        visibility: Visibility,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`PromptState.attention` over every rank's pages, as one softmax across the CP group; announced to the
        serving ranks when this rank owns the chunk (capture, recompute)."""
        positions = access.query_positions
        limit, on_backward = None, None
        if access.mode in ("read", "decode"):  # every rank runs the member (rows): rank 0 counts its own keys
            owns_suffix, reduce_suffix = self.cp.rank == 0, True
        else:  # this rank owns the chunk being captured or recomputed
            owns_suffix, reduce_suffix = True, False
            announcement = Announcement(
                Phase.CAPTURE if access.mode == "capture" else Phase.RECOMPUTE,
                layer.layer_idx,
                tuple(query.shape),
                own_values.shape[-1],
                int(positions[0]),
                scaling,
                visibility.sliding_window,
                softcap,
                query.dtype,
                sinks is not None,
                indices is not None,
            )
            announcement.send(self.cp)
            self.cp.broadcast(query.detach().contiguous(), self.cp.rank, kind="capture")
            if access.mode == "recompute":  # the pages before the chunk
                limit = self.local_prefix(access.prefix_length)
                on_backward = functools.partial(self.announce_backward, layer.layer_idx)
        page_blocks, page_tensors = layer.page_block(query.dtype, limit, indices)
        own_picked = None if indices is None else indices.long() - access.prefix_length
        call = AttentionCall(
            self.cp,
            owns_suffix,
            reduce_suffix,
            positions,
            scaling,
            visibility,
            access.attention_chunk_size,
            softcap,
            KeyBlock(access.own_positions(own_keys.shape[1]), shared=False, picked=own_picked),
            on_backward,
        )
        return ContextParallelAttention.apply(query, sinks, own_keys, own_values, call, page_blocks, *page_tensors)

    def announce_backward(self, layer_idx: int, d_out: torch.Tensor) -> None:
        Announcement(Phase.BACKWARD, layer_idx).send(self.cp)
        self.cp.broadcast(d_out, self.cp.rank, kind="recompute")

    def end_of_shard(self) -> None:
        Announcement(Phase.END_OF_SHARD).send(self.cp)

    # -- serving another rank's capture or recompute ------------------------------------------------------------------
    def serve(self, owner: int, chunk_size: int, device: torch.device) -> None:
        """Run the other side of `owner`'s capture (or recompute) until it announces the end of its shard. A serving
        rank holds at most one chunk of the owner's queries (and their merged output) per attention layer."""
        kept: dict[int, ServedCall] = {}
        while True:
            announcement = Announcement.receive(self.cp, owner)
            if announcement.phase == Phase.END_OF_SHARD:
                return
            if announcement.phase == Phase.INDEXER:
                self.serve_indexer(announcement.layer_idx, owner, announcement.top_k, chunk_size, device)
                continue
            layer = self.of_layer(announcement.layer_idx, "attention")
            if announcement.phase == Phase.BACKWARD:
                served = kept.pop(announcement.layer_idx)
                d_out = self.cp.broadcast(torch.empty_like(served.out), owner, kind="recompute")
                self.serve_backward(layer, served, d_out, owner, chunk_size)
                continue
            query = torch.empty(announcement.query_shape, dtype=announcement.dtype, device=device)
            query = self.cp.broadcast(query, owner, kind="capture")
            first, tokens = announcement.first_position, announcement.query_shape[2]
            positions = torch.arange(first, first + tokens)
            selection = self.selection if announcement.selects else None
            served = ServedCall(announcement, query, positions, selection)
            self.serve_forward(layer, served, owner, chunk_size)
            if announcement.phase == Phase.RECOMPUTE:
                kept[announcement.layer_idx] = served

    def _served_blocks(self, layer: LayerState, served: ServedCall, owner: int):
        if self.cp.rank > owner:  # this shard lies after the owner's queries: nothing it may see
            return (), ()
        return layer.page_block(served.query.dtype, indices=served.selection)

    @torch.no_grad()
    def serve_forward(self, layer: LayerState, served: ServedCall, owner: int, chunk_size: int) -> None:
        """Another rank's chunk: this rank's partial of its queries over `layer`'s pages, merged on every rank."""
        call = served.announcement
        blocks, tensors = self._served_blocks(layer, served, owner)
        start = time.perf_counter()
        out, lse = partial_attention(
            served.query,
            served.positions,
            call.scaling,
            layer.visibility(call.sliding_window),
            chunk_size,
            call.softcap,
            blocks,
            tensors,
            call.value_dim,
            None,
        )
        SERVED["seconds"] += time.perf_counter() - start
        SERVED["query_key_pairs"] += served.query.shape[2] * (tensors[0].shape[1] if tensors else 0)
        served.out, served.lse = merge_across(out, lse, self.cp)

    @torch.no_grad()
    def serve_backward(
        self, layer: LayerState, served: ServedCall, d_out: torch.Tensor, owner: int, chunk_size: int
    ) -> None:
        """Another rank's recompute backward: `layer`'s pages get their gradients (accumulated on the state leaves,
        before this rank recomputes them), and this rank's share of dq goes into the owner's sum."""
        call = served.announcement
        blocks, tensors = self._served_blocks(layer, served, owner)
        d_q = torch.zeros(served.query.shape, dtype=served.out.dtype, device=served.query.device)
        if blocks:
            d_q, (d_keys, d_values) = blocks_backward(
                d_out,
                served.query,
                served.positions,
                served.out,
                served.lse,
                call.scaling,
                layer.visibility(call.sliding_window),
                chunk_size,
                call.softcap,
                blocks,
                tensors,
                (True, True, True),
            )
            layer.accumulate_page_gradients(d_keys, d_values)
        pieces = [d_q]
        if call.has_sinks:
            pieces.append(torch.zeros(served.query.shape[1], dtype=d_q.dtype, device=d_q.device))
        self.cp.all_reduce(pack(pieces), kind="backward")

    # -- DSA: the top-k over every rank's indexer keys (state/dsa.py selects within a rank) ------------------------
    def own_keys(self, access, own_index: torch.Tensor) -> torch.Tensor:
        if access.mode in ("read", "decode") and self.cp.rank != 0:  # every rank runs the rows: rank 0 counts them
            return torch.full_like(own_index, -1)
        return own_index

    def before_selection(self, module, access, call: dict, k: int) -> None:
        if access.mode in ("capture", "recompute"):  # an owned chunk: the serving ranks score their keys too
            Announcement(Phase.INDEXER, module.layer_idx, top_k=k).send(self.cp)
            for tensor in (call["hidden_states"], call["q_resid"], *call["position_embeddings"]):
                self.cp.broadcast_tensor(tensor.contiguous(), self.cp.rank, kind="capture")

    def finish_selection(self, candidates, k: int):
        values, indices = merge_topk(candidates, candidates[0], k, self.cp)
        self.selection = indices
        return values, indices

    def serve_indexer(self, layer_idx: int, owner: int, k: int, chunk_size: int, device: torch.device) -> None:
        """Another rank's indexer call: the model's indexer over this rank's keys before the owner's chunk (all of an
        earlier shard's, none of a later one's), block by block, merged into the top-k on every rank."""
        hidden, q_resid, cos, sin = (
            self.cp.broadcast_tensor(None, owner, kind="capture").to(device) for _ in range(4)
        )
        layer = self.of_layer(layer_idx, "indexer")
        call = {"hidden_states": hidden, "q_resid": q_resid, "position_embeddings": (cos, sin)}
        limit = self.local_prefix(self.num_tokens) if self.cp.rank < owner else 0
        candidates = layer.prompt_candidates(call, None, k, limit, chunk_size, self.shard[0])
        self.selection = merge_topk(candidates, hidden, k, self.cp)[1]

    # -- recurrent kinds: the sequential hand-off of their chunk states -----------------------------------------------
    def chunk_states(self) -> list[list[torch.Tensor]]:
        """Every layer's chunk states (`LayerState.chunk_states`), in layer order: what the shards hand on."""
        return [states for layer in self.layers for states in layer.chunk_states()]

    def last_own_entry(self, chunks: int) -> int:
        return chunks - 1 + self.chunk_offset

    def send_recurrent(self, destination: int) -> None:
        for states in self.chunk_states():
            self.cp.send(states[-1], destination)

    def receive_recurrent(self, source: int) -> None:
        """Start this shard's chunk states from the previous shard's final states (as a capture chunk would)."""
        for layer in self.layers:  # they arrive where the backend communicates (gloo: the host)
            for states in layer.chunk_states():
                states.append(self.geometry.placement.store(self.cp.receive(source).to(layer.device)))
        self.chunk_offset = 1

    def share_final_recurrent(self) -> None:
        """Every rank replays from the whole prompt's chunk states: the last shard's, broadcast (fixed size). Detach
        mode replaces this rank's own final state with it; exact mode keeps this rank's entries (the recompute reads
        them) and appends it."""
        last = self.cp.size - 1
        for states in self.chunk_states():
            final = self.cp.broadcast(states[-1].clone(), last, kind="recurrent")
            if self.cp.rank == last:
                continue
            if self.exact:
                states.append(final)
            else:
                states[-1] = final

    def send_recurrent_gradients(self, destination: int) -> None:
        """Exact mode: the gradient on this shard's starting states belongs to the previous shard's final states."""
        for states in self.chunk_states():
            start = states[0]
            self.cp.send(torch.zeros_like(start) if start.grad is None else start.grad, destination)

    def receive_recurrent_gradients(self, source: int, chunks: int) -> None:
        entry = self.last_own_entry(chunks)
        for states in self.chunk_states():
            final = states[entry]
            grad = self.cp.receive(source).to(final.device, final.dtype)
            final.grad = grad if final.grad is None else final.grad + grad
