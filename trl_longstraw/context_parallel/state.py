"""One rank's chunks of a prompt state, and their serving across the CP group (`PromptSharding`, set on the
`PromptState`): the steps' attention (`ShardedAttention`), the DSA top-k (`ShardedSelection`), the recurrent hand-offs
(`ChunkStateHandOffs`).

Every rank of a CP group keeps the durable state of its chunks of the captured prompt tokens (`sharding.py`): each
layer state reads its entries' positions and indices through the geometry (`PromptGeometry.layout`), so a kind's
pages hold exactly this rank's chunks and a sliding window the entries of them a later query still reads. Nothing of
another rank's pages is ever copied: a query's attention over them is computed where they live, as a partial
`(o, lse)`, and the partials are merged by log-sum-exp, which is exact.

- Capture and exact-mode recompute run step by step, every rank's chunk of the step at once (the recompute in
  reverse). Attention: `step.StepAttention`. A DSA indexer call: the step's indexer inputs are all-gathered, each
  rank takes the top-k candidates of every query over the keys it holds before that query's chunk, the candidates go
  to the queries' ranks (all-to-all), which take their top-k, and the selections are all-gathered for the attention
  that applies them. Recurrent kinds hand their chunk states (`LayerState.chunk_states`) from the holder of a chunk to
  the holder of the next as each layer records them, in order (the conv state as soon as the mixer has its inputs):
  a GatedDeltaNet chunk runs its rule from the zero state and takes the starting recurrent state when it arrives
  (`ChunkStateHandOffs.defers_starting_state`, state passing), a Mamba2 chunk waits for its states (a wavefront: the next rank runs that
  layer while this one goes on); in the recompute their gradients go back the same way: a GatedDeltaNet rule's
  backward takes the next chunk's share of its final state's gradient late and sends its starting state's at once
  (`ChunkStateHandOffs.hands_off_state_gradients`, state passing backward), other states' gradients go as soon as they are accumulated
  and are received as the backward reaches their layer.
- Scoring and replay: every rank runs its own members, the group's ranks in step (`step.StepAttention` without chunks;
  DSA likewise). Rollouts: every rank decodes the same rows, each over its pages, merged (`merge.merge_across`).
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter

import torch

from ..block_attention import AttentionScalars, KeyBlock
from ..ops.gated_delta_rule import StateGradientHandOff, StatePassing
from ..state import LayerState, PromptState
from .communication import ContextParallelGroup
from .merge import merge_across, merge_topk, partial_attention
from .sharding import ContextParallelError, ShardLayout
from .step import StepAttention, StepCall, exchange, gather_step

# A continuation's chunks (a member's segments) run under autograd: at least two tokens each, so that linear-attention
# layers take their chunked (differentiable) kernel path, as a member's replay does.
CONTINUATION_CHUNK_TOKENS = 2


class PromptSharding:
    """One rank's share of a prompt state under context parallelism, set on its `PromptState` (`state.sharding`) by
    the engine's `ContextParallel` distribution: the state's layer states hold this rank's chunks of `layout`
    (`PromptGeometry.layout`, `rank`), and these three pieces serve the rest across the CP group, each called only
    under context parallelism: `attention` (a forward's attention over every rank's pages), `selection` (a DSA
    indexer's top-k over every rank's keys) and `hand_offs` (recurrent chunk states and their gradients handed
    between the holders of consecutive chunks).
    """

    def __init__(self, state: PromptState, cp: ContextParallelGroup, layout: ShardLayout):
        refuse_unsharded_layers(state.layers)
        # the state holds its sharding: a proxy back, not a cycle, so that a state is freed as soon as it is dropped
        # (a cycle waits for the garbage collector, which may keep a prompt's pages alive beside the next prompt's)
        self.state, self.cp, self.layout = weakref.proxy(state), cp, layout
        self._rows: tuple[weakref.ref, list[int]] | None = None  # the forward whose rows' lengths were gathered
        self.attention = ShardedAttention(self)
        self.selection = ShardedSelection(self)
        self.hand_offs = ChunkStateHandOffs(self)

    def continuation(self, state: PromptState, num_tokens: int, chunk_size: int) -> PromptState:
        """A continuation of `state` (the one this sharding serves, which the continuation holds on to:
        `PromptState.continuation`, `num_tokens` tokens after its captured ones, whose forwards read its entries
        first) that is itself spread over the CP group: its tokens cut into steps of `cp` chunks of at most about
        `chunk_size` as a prompt's are (`ShardLayout`), each rank holding one chunk per step. So the CP group captures
        and recomputes a long member's segments as it does the prompt's chunks, every rank its chunk of the step at
        once (`ContextParallel.replay_from`)."""
        if num_tokens < CONTINUATION_CHUNK_TOKENS * self.cp.size:
            raise ContextParallelError(
                f"A continuation of {num_tokens} tokens cannot give each of the {self.cp.size} ranks of its CP group "
                f"{CONTINUATION_CHUNK_TOKENS} tokens."
            )
        layout = ShardLayout.of(num_tokens, self.cp.size, chunk_size, CONTINUATION_CHUNK_TOKENS)
        continued = PromptState(
            state.plans,
            num_tokens=num_tokens,
            start_position=state.start_position + state.num_tokens,
            device=state.geometry.placement.device,
            weights_version=state.weights_version,
            exact=True,
            layout=layout,
            rank=self.cp.rank,
            continues=state,
        )
        continued.sharding = PromptSharding(continued, self.cp, layout)
        return continued

    def chunk_positions(self, chunk: int) -> torch.Tensor:
        start, end = self.layout.bounds[chunk]
        return torch.arange(self.state.start_position + start, self.state.start_position + end)

    def chunk_at(self, access) -> int:
        """The chunk of `layout` the capture (or recompute) forward `access` runs (its tokens start after
        `access.prefix_length` captured tokens: a continuation's after the prompt's)."""
        return self.layout.chunk_at(access.prefix_length - self.state.geometry.first_index)

    def step_chunks(self, access) -> list[int]:
        """Every rank's chunk of the capture (or recompute) step this forward runs, by rank."""
        return self.layout.step_chunks(self.chunk_at(access) // self.cp.size)

    def rows_lengths(self, access) -> list[int]:
        """Every rank's row width in this scoring or replay forward (each rank runs its own members), by rank: read
        once per forward, at its first collective."""
        if self._rows is None or self._rows[0]() is not access:
            mine = torch.tensor([access.query_positions.numel()], dtype=torch.int64)
            self._rows = (weakref.ref(access), [int(n) for n in self.cp.all_gather(mine, "lengths")])
        return self._rows[1]


def refuse_unsharded_layers(layers: list[LayerState]) -> None:
    """Kinds and layers context parallelism does not shard (`LayerState.sharded_layer_types`) are refused before
    any collective (every rank refuses alike), kinds first: they name the mixer (a DSA layer is also an
    'indexed_attention')."""
    for layer in layers:
        if not type(layer).sharded_layer_types:
            raise ContextParallelError(
                f"Layer {layer.layer_idx} keeps a {type(layer).name!r} state, which context parallelism does not "
                "shard yet: set context_parallel_size=1 for this model."
            )
    for layer in layers:
        if layer.layer_type not in type(layer).sharded_layer_types:
            raise ContextParallelError(
                f"Layer {layer.layer_idx} is a {layer.layer_type!r} layer: context parallelism shards full and "
                "sliding-window attention, MLA (with DSA) and recurrent layers so far. Set context_parallel_size=1 "
                "for this model."
            )


class ShardingPiece:
    """One piece of a `PromptSharding`, reading what the pieces share: the state, its CP group and its layout."""

    def __init__(self, sharding: PromptSharding):
        self.sharding, self.state, self.cp, self.layout = sharding, sharding.state, sharding.cp, sharding.layout


class ShardedAttention(ShardingPiece):
    """`PromptState.attention` over every rank's pages, as one softmax across the CP group."""

    def __call__(
        self,
        access,
        layer: LayerState,
        query: torch.Tensor,
        own_keys: list[torch.Tensor],
        own_values: list[torch.Tensor],
        scalars: AttentionScalars,
        sinks: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`PromptState.attention` over every rank's pages, as one softmax across the CP group: a capture or recompute
        step's, every rank's chunk at once (`step.StepAttention`); a scoring or replay forward's, every rank running
        its own rows (the same function, without chunks); a rollout step's, every rank decoding the same rows."""
        if access.mode in ("capture", "recompute", "read"):
            return self._step_attention(access, layer, query, own_keys, own_values, scalars, sinks, indices)
        return self._decode_attention(access, layer, query, own_keys, own_values, scalars, sinks, indices)

    @torch.no_grad()
    def _decode_attention(self, access, layer, query, own_keys, own_values, scalars, sinks, indices):
        """A rollout step: every rank decodes the same rows, each over its pages (rank 0 also over the rows' own
        entries, with the sinks), merged across the group (`merge.merge_across`)."""
        blocks, tensors = (list(part) for part in held_pages(layer, query.dtype, None, indices))
        counts_rows = self.cp.rank == 0
        if counts_rows:
            for keys, values, (positions, first) in zip(
                own_keys, own_values, access.own_blocks(own_keys), strict=True
            ):
                picked = None if indices is None else indices.long() - first
                blocks.append(KeyBlock(positions, shared=False, picked=picked))
                tensors += [keys, values]
        with torch.autocast(query.device.type, enabled=False):
            out, lse = partial_attention(
                query,
                access.query_positions,
                scalars,
                tuple(blocks),
                tuple(tensors),
                own_values[0].shape[-1],
                sinks if counts_rows else None,
            )
            out, _ = merge_across(out, lse, self.cp)
        return out.to(query.dtype)

    def _step_attention(self, access, layer, query, own_keys, own_values, scalars, sinks, indices):
        """A capture or recompute step's attention (every rank's chunk of the step), or a scoring or replay forward's
        (every rank's rows after the prompt, no chunks): `step.StepAttention` over this rank's pages before them."""
        if access.mode == "read":
            if query.shape[0] != 1:
                raise ContextParallelError(
                    "Under context parallelism each rank scores and replays its own members, one at a time: a batch "
                    f"of {query.shape[0]} rows reached the attention."
                )
            first = self.state.start_position + self.state.num_tokens
            starts, limit, kind, first_index = None, None, "rows", self.state.num_tokens
            positions = tuple(torch.arange(first, first + n) for n in self.sharding.rows_lengths(access))
        else:
            chunks = self.sharding.step_chunks(access)
            # key indices (a continuation's count on from the prompt's)
            starts = tuple(self.state.geometry.first_index + self.layout.bounds[chunk][0] for chunk in chunks)
            limit, kind, first_index = (
                self.state.local_prefix(min(starts)),
                access.mode,
                0,
            )  # the pages of earlier steps
            positions = tuple(self.sharding.chunk_positions(chunk) for chunk in chunks)
        selections = None if indices is None else tuple(self.sharding.selection.step_selections)
        page_blocks, page_tensors = held_pages(layer, query.dtype, limit)
        if selections is None:
            page_blocks = (page_blocks,) * self.cp.size
        else:  # each rank's queries pick their own pages
            page_blocks = tuple(held_pages(layer, query.dtype, limit, selection)[0] for selection in selections)
        call = StepCall(
            self.cp,
            starts,
            positions,
            page_blocks,
            selections,
            scalars,
            kind,
            first_index,
        )
        [own_keys], [own_values] = own_keys, own_values  # one block outside a rollout
        return StepAttention.apply(query, sinks, own_keys, own_values, call, *page_tensors)


def held_pages(layer: LayerState, dtype: torch.dtype, limit: int | None, indices: torch.Tensor | None = None):
    """`(KeyBlock, ...)` and their tensors of this rank's pages of `layer` (`LayerState.page_block`: its first
    `limit`, all by default), after every page this rank holds of the states `layer`'s continues (a continuation's
    forward reads the prompt's pages first)."""
    blocks, tensors = ((), []) if layer.parent is None else held_pages(layer.parent, dtype, None, indices)
    own_blocks, own_tensors = layer.page_block(dtype, limit, indices)
    return (*blocks, *own_blocks), [*tensors, *own_tensors]


class ShardedSelection(ShardingPiece):
    """A DSA indexer call's top-k over every rank's indexer keys (state/dsa.py selects within a rank)."""

    def __init__(self, sharding: PromptSharding):
        super().__init__(sharding)
        self.step_selections: list[torch.Tensor] | None = None  # each rank's last DSA top-k of the step
        self._step_calls: list[dict] | None = None  # each rank's inputs of the indexer call in flight

    def own_keys(self, access, own_index: torch.Tensor) -> torch.Tensor:
        if access.mode == "decode" and self.cp.rank != 0:  # every rank decodes the rows: rank 0 counts them
            return torch.full_like(own_index, -1)
        return own_index

    def _selection_calls(self, access) -> list[tuple[int, int, int]]:
        """Each rank's `(tokens, k, keys before them held here)` of the indexer call in flight (a step's chunks, or
        each rank's rows after the prompt)."""
        if access.mode == "read":
            return [
                (n, self.state.num_tokens + n, self.state.geometry.num_tokens)
                for n in self.sharding.rows_lengths(access)
            ]
        calls, first = [], self.state.geometry.first_index
        for chunk in self.sharding.step_chunks(access):
            start, end = self.layout.bounds[chunk]
            calls.append((end - start, first + end, self.state.local_prefix(first + start)))
        return calls

    def before_selection(self, access, call: dict) -> None:
        """A step's (or the rows') indexer call: every rank's inputs of it, each rank scoring its keys for all."""
        if access.mode == "decode":
            return
        lengths = [tokens for tokens, _, _ in self._selection_calls(access)]
        inputs = (call["hidden_states"], call["q_resid"], *call["position_embeddings"])
        gathered = [gather_step(self.cp, tensor.detach(), lengths, 1, "indexer") for tensor in inputs]
        self._step_calls = [
            {"hidden_states": hidden, "q_resid": q_resid, "position_embeddings": (cos, sin)}
            for hidden, q_resid, cos, sin in zip(*gathered, strict=True)
        ]

    @torch.no_grad()
    def finish_selection(self, access, layer: LayerState, candidates, k: int):
        """Decoding (every rank decodes the same rows): every rank's candidates merged on every rank. Otherwise this
        rank's candidates for every rank's queries over the keys it holds before them (its own queries':
        `candidates`), sent to the queries' ranks (all-to-all), whose top-k of them all is their selection; the
        selections are all-gathered for the attention that applies them."""
        if access.mode == "decode":
            return merge_topk(candidates, candidates[0], k, self.cp)
        calls = self._selection_calls(access)
        tops = [min(layer.mixer.index_topk, end) for _, end, _ in calls]  # the k of each rank's call
        width, tokens = max(tops), max(count for count, _, _ in calls)
        sent = []
        for rank, (_, _, limit) in enumerate(calls):
            best = candidates
            if rank != self.cp.rank:
                call = self._step_calls[rank]
                best = layer.held_candidates(call, None, tops[rank], limit, access.attention_chunk_size)
            slots = torch.full((1, tokens, width, 2), -1.0, dtype=torch.float64, device=candidates[0].device)
            slots[..., 0] = float("-inf")
            if best is not None:  # scores and key indices side by side (indices are exact in float64)
                values, indices = best
                slots[:, : values.shape[1], : values.shape[2], 0] = values
                slots[:, : values.shape[1], : values.shape[2], 1] = indices.to(torch.float64)
            sent.append(slots)
        self._step_calls = None
        lengths = [count for count, _, _ in calls]
        received = torch.cat(exchange(self.cp, sent, 1, lengths[self.cp.rank], "indexer"), dim=2)
        values, best = received[..., 0].topk(tops[self.cp.rank], dim=-1)
        indices = received[..., 1].gather(-1, best).long()
        padded = torch.cat([indices, indices.new_full((*indices.shape[:2], width - indices.shape[2]), -1)], dim=2)
        gathered = gather_step(self.cp, padded, lengths, 1, "indexer")
        self.step_selections = [selection[..., :top] for selection, top in zip(gathered, tops, strict=True)]
        return values.to(candidates[0].dtype), indices


class ChunkStateHandOffs(ShardingPiece):
    """Recurrent kinds' chunk states handed from the holder of a chunk to the holder of the next (capture), and their
    gradients back (exact-mode recompute).

    Exact mode: each of this rank's chunks keeps its starting states (the previous chunk's final ones, received or
    copied; none for the prompt's first chunk) and its final states, in prompt order (`entry_before`, `entry_after`),
    then the whole prompt's final states for the replays.
    """

    def __init__(self, sharding: PromptSharding):
        super().__init__(sharding)
        layers = self.state.layers
        # capture: id(layer state) -> (the chunk whose starting states it holds, how many of them are in place)
        self._started: dict[int, tuple[int, int]] = {}
        self._recorded: dict[tuple[int, int], set[int]] = {}  # capture: (id(layer state), chunk) -> slots recorded
        self._sent: Counter = Counter()  # capture: (id(layer state), chunk) -> slots sent (in order)
        self._sending: list = []  # the hand-offs in flight (capture: states; recompute: their gradients)
        self._sent_last_step: list = []  # the recompute's hand-offs of the step before, until this step's end
        self._hooks: list = []  # recompute: the starting states' gradient hand-offs
        # recompute: the recorded final states already wrapped, by id, kept alive until the step's end (a freed
        # tensor's id may be reused by a later one, which would then look wrapped and its gradient never received)
        self._wrapped: dict[int, torch.Tensor] = {}
        self._deferred: dict[int, StatePassing] = {}  # capture: id(layer state) -> its rule's deferred start
        self._hand_offs: dict[int, StatePassing] = {}  # recompute: chunk-state tag -> its rule's hand-off
        self._unread: list = []  # recompute: (like, source, tag) of the hand-offs no backward will receive
        self._chunk_state_tags: dict[int, int] = {}  # id(layer state) -> its first chunk state's message tag
        for layer in layers:
            self._chunk_state_tags[id(layer)] = sum(
                len(other.chunk_states()) for other in layers[: layers.index(layer)]
            )

    def entry_before(self, step: int) -> int:
        """Exact mode: the index in a kind's chunk states of this rank's chunk of `step`'s starting states (-1: the
        prompt's first chunk starts from none)."""
        return 2 * step - int(self.layout.owner(0) == self.cp.rank)

    def entry_after(self, step: int) -> int:
        return self.entry_before(step) + 1

    def starting_chunk_states(self, access, layer: LayerState, slot: int) -> None:
        """Capture: before `layer` first reads its state `slot` in a chunk, the previous chunk's final states up to
        that one (received from its holder, in order, or this rank's own) become the chunk's starting states."""
        chunk = self.sharding.chunk_at(access)
        chunk_states = layer.chunk_states()
        started, in_place = self._started.get(id(layer), (None, 0))
        if started != chunk:  # the prompt's first chunk starts from none
            in_place = 0 if chunk > 0 else len(chunk_states)
        while in_place <= slot:
            states, source = chunk_states[in_place], self.layout.owner(chunk - 1)
            if source != self.cp.rank:  # they arrive where the backend communicates (gloo: the host)
                layer.keep_chunk_state(
                    states, self.state.geometry.placement.store(self.cp.receive(source).to(layer.device))
                )
            elif self.state.exact:  # exact mode keeps every chunk's starting states, as its own leaves
                states.append(states[-1].clone())
            in_place += 1
        self._started[id(layer)] = (chunk, in_place)

    def defers_starting_state(self, access, layer: LayerState) -> bool:
        """State passing (state/linear_attention.py): a capture chunk whose previous chunk another rank holds starts
        its recurrent rule without the starting recurrent state, which it receives once its zero-state pass is done,
        where the layer kind can take it so (GatedDeltaNet with transformers' kernel hook); else the mixer waits for
        it (a wavefront)."""
        chunk = self.sharding.chunk_at(access)
        if chunk == 0 or self.layout.owner(chunk - 1) == self.cp.rank:
            return False
        slot = layer.chunk_state_slot("recurrent")

        def start() -> torch.Tensor:
            self.starting_chunk_states(access, layer, slot)
            return self.state.geometry.placement.stage(layer.chunk_states()[slot][-1], layer.device)

        passing = StatePassing(start=start)
        if not layer.pass_state(passing):
            return False
        self._deferred[id(layer)] = passing
        return True

    def hands_off_state_gradients(self, access, layer: LayerState) -> None:
        """State passing backward (exact mode's recompute): a GatedDeltaNet chunk whose next chunk another rank holds
        takes that rank's share of its final recurrent state's gradient inside its rule's backward, after
        back-propagating the gradients at hand, and one whose previous chunk another rank holds sends its starting
        state's gradient from there as soon as it is summed (`ops.gated_delta_rule.LateStateGradient`). So the ranks of a
        step run each GatedDeltaNet layer's backward at once, a chunk waiting for the next chunk's scan backward, not
        for its whole layer. Where the rule cannot take it (Mamba2; a one-token chunk), the gradient is received as
        the backward reaches the layer (`recorded_chunk_state`): a wavefront."""
        chunk = self.sharding.chunk_at(access)
        owners = [
            self.layout.owner(c) if 0 <= c < len(self.layout.bounds) else self.cp.rank for c in (chunk - 1, chunk + 1)
        ]
        previous, following = (None if owner == self.cp.rank else owner for owner in owners)
        if previous is None and following is None:
            return
        tag = self._chunk_state_tags[id(layer)] + layer.chunk_state_slot("recurrent")
        hand_off = StateGradientHandOff(
            receive=None if following is None else functools.partial(self._receive_state_gradient, following, tag),
            send=None if previous is None else functools.partial(self._send_state_gradient, previous, tag),
        )
        passing = StatePassing(hand_off=hand_off)
        if layer.pass_state(passing):
            self._hand_offs[tag] = passing

    def _receive_state_gradient(self, source: int, tag: int, final: torch.Tensor) -> torch.Tensor:
        return self.cp.receive_tagged(torch.empty_like(final), source, tag)

    def _send_state_gradient(self, target: int, tag: int, grad: torch.Tensor) -> None:
        self._sending += self.cp.send_tagged(grad.sum(0, keepdim=True), target, tag)  # the rows share one state

    def _taken_by_rule(self, tag: int) -> bool:
        passing = self._hand_offs.get(tag)
        return passing is not None and passing.taken

    def recorded_chunk_state(self, access, layer: LayerState, slot: int) -> None:
        """A capture: each final state of a chunk `layer` records goes to the next chunk's holder, in `chunk_states()`
        order (the conv state as soon as the mixer has its inputs, the recurrent state when its rule is done). A
        recompute: each recorded final state passes through `ReceivedGradient`, which adds, in the backward, the
        gradient the next chunk's holder computed for its starting state. Recorded here, inside the forward, the
        function sits in the graph between the layer and the next, so the backward receives it as it reaches the
        layer (a wavefront: that rank back-propagates through the layer first), not before."""
        chunk = self.sharding.chunk_at(access)
        after = chunk + 1 < len(self.layout.bounds) and self.layout.owner(chunk + 1) != self.cp.rank
        if access.mode == "recompute":
            tag = self._chunk_state_tags[id(layer)] + slot
            if (passing := self._hand_offs.get(tag)) is not None and not passing.taken:
                layer.withdraw_state_passing()  # not taken by this forward's rule (a one-token chunk's recurrent rule)
            if after:
                self._receive_gradients(access, layer, self.layout.owner(chunk + 1))
            return
        deferred = self._deferred.pop(id(layer), None) if slot == layer.chunk_state_slot("recurrent") else None
        if deferred is not None and not deferred.taken:  # the mixer started from zero and never got its start
            raise RuntimeError(
                f"Layer {layer.layer_idx}'s GatedDeltaNet ran no chunked rule in capture chunk {chunk}, so its "
                "deferred starting state was never added: its outputs would be those from the zero state."
            )
        key = (id(layer), chunk)
        recorded = self._recorded.setdefault(key, set())
        recorded.add(slot)
        chunk_states = layer.chunk_states()
        while self._sent[key] in recorded:  # each as soon as it and those before it are recorded, in order
            if after:
                self._sending += self.cp.send_async(chunk_states[self._sent[key]][-1], self.layout.owner(chunk + 1))
            self._sent[key] += 1
        if self._sent[key] == len(chunk_states):
            del self._recorded[key], self._sent[key]

    def _receive_gradients(self, access, layer: LayerState, source: int) -> None:
        """Wrap what `layer` recorded so far in this recompute (in `chunk_states()` order: a list, or the tensor of a
        kind with one) that is not wrapped yet."""
        recorded = access.recorded.get(layer)
        single = isinstance(recorded, torch.Tensor)
        values = [recorded] if single else list(recorded)
        first = self._chunk_state_tags[id(layer)]
        for slot, value in enumerate(values):
            if value is None or id(value) in self._wrapped:
                continue
            self._wrapped[id(value)] = value
            if not value.requires_grad:  # no trained weight reaches it (frozen layers below): received, unused
                self._unread.append((torch.empty_like(value), source, first + slot))
            elif not self._taken_by_rule(first + slot):  # (else its rule's backward receives it)
                values[slot] = ReceivedGradient.apply(value, self.cp, source, first + slot)
                self._wrapped[id(values[slot])] = values[slot]
        access.recorded[layer] = values[0] if single else values

    def finish_capture(self) -> None:
        """The hand-offs sent; every rank replays from the whole prompt's chunk states: those of the last chunk's
        holder, broadcast (fixed size). Detach mode replaces this rank's own final state with them; exact mode keeps
        this rank's entries (the recompute reads them) and appends them."""
        self.cp.wait(self._sending)
        self._sending = []
        last = self.layout.owner(len(self.layout.bounds) - 1)
        for states in self.chunk_states():
            final = self.cp.broadcast(states[-1].clone(), last, kind="recurrent")
            if self.cp.rank == last:
                continue
            if self.state.exact:
                states.append(final)
            else:
                states[-1] = final

    def chunk_states(self) -> list[list[torch.Tensor]]:
        """Every layer's chunk states (`LayerState.chunk_states`), in layer order."""
        return [states for layer in self.state.layers for states in layer.chunk_states()]

    def sum_final_state_gradients(self) -> None:
        """Exact mode, before the recompute: each rank's replays put their members' gradient on its copy of the whole
        prompt's final chunk states; the last chunk's holder recomputes them with all of it (summed)."""
        last = self.layout.owner(len(self.layout.bounds) - 1)
        for states in self.chunk_states():
            final = states[-1]
            grad = torch.zeros_like(final) if final.grad is None else final.grad
            total = self.cp.all_reduce(grad.clone(), kind="recurrent")
            if self.cp.rank == last:
                final.grad = total

    def before_recompute(self, step: int) -> None:
        """Exact mode, before this rank recomputes its chunk of `step`: its final chunk states get a gradient (the
        next chunk's starting states', where this rank holds that chunk too), so that every rank's recompute
        back-propagates through every recurrent layer (the next chunk's holder's share arrives during the backward:
        `recorded_chunk_state`); and its starting states hand their gradient on as soon as it is accumulated."""
        chunk = self.layout.chunk_of(self.cp.rank, step)
        local_next = chunk + 1 < len(self.layout.bounds) and self.layout.owner(chunk + 1) == self.cp.rank
        self._hooks = []
        for index, states in enumerate(self.chunk_states()):
            final = states[self.entry_after(step)]
            if final.grad is None:
                final.grad = torch.zeros_like(final)
            if local_next and (handed := states[self.entry_after(step) + 1].grad) is not None:
                final.grad += handed
            if chunk > 0 and (target := self.layout.owner(chunk - 1)) != self.cp.rank:
                start = states[self.entry_before(step)]
                send = functools.partial(self._send_gradient, target=target, tag=index)
                self._hooks.append(start.register_post_accumulate_grad_hook(send))

    def _send_gradient(self, leaf: torch.Tensor, target: int, tag: int) -> None:
        if not self._taken_by_rule(tag):  # else its rule's backward sent it (`hands_off_state_gradients`)
            self._sending += self.cp.send_tagged(leaf.grad.detach().clone(), target, tag)

    def after_recompute(self) -> None:
        """The chunk's hand-offs completed: the gradients sent to it for states no trained weight reaches (the next
        chunk's rank sends every one) received and dropped; the previous step's sends waited for. Not this step's: a
        send to the previous chunk's rank completes when that rank receives it, which may be in its recompute of the
        next step, whose collectives need this rank (waiting here could hang both); the previous step's receivers took
        them by the end of this step (`finish_recompute` waits for the last step's)."""
        for like, source, tag in self._unread:
            self.cp.receive_tagged(like, source, tag)
        self._unread = []
        self._wrapped.clear()
        self._hand_offs.clear()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.cp.wait(self._sent_last_step)
        self._sent_last_step, self._sending = self._sending, []

    def finish_recompute(self) -> None:
        """After the last step's recompute: its sends waited for."""
        self.cp.wait(self._sent_last_step)
        self._sent_last_step = []


class ReceivedGradient(torch.autograd.Function):
    """The identity, whose backward adds the gradient another rank sends (tagged `tag`): a final chunk state's share
    of the next chunk's starting-state gradient."""

    @staticmethod
    def forward(ctx, value, cp, source, tag):
        ctx.cp, ctx.source, ctx.tag = cp, source, tag
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        received = ctx.cp.receive_tagged(torch.empty_like(grad), ctx.source, ctx.tag)
        return grad + received, None, None, None
