"""The context-parallel engine: capture, exact-mode prompt backward and rollout decisions with the prompt sharded.

Capture (`ContextParallelEngine.capture`): shard by shard, in rank order. The owner of the current shard runs its
chunks through the model, announcing each attention and indexer call; the other ranks serve them
(`ShardedPromptState.serve`) until the owner announces the end of its shard. Recurrent states are handed from shard
to shard and the last shard's broadcast (`state.py`). The exact-mode recompute runs the same way, shards in reverse
order, and the parameter gradients each rank's recompute added are summed across the group
(`sum_added_gradients`). Rollouts decode every row on every rank in lockstep, with rank 0's decisions (`agree`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..engine import LongStrawEngine, check_prepared, no_layer_checkpointing, non_finite_error, weights_version
from ..load_balancing import RouterLoad
from .communication import ContextParallelGroup, pack, unpack
from .protocol import check_protocol
from .sharding import check_prompt_length
from .state import ShardedPromptState


@dataclass
class ContextParallelEngine(LongStrawEngine):
    """`LongStrawEngine` with the prompt sharded across `context_parallel` (module docstring). With a group of one
    (or none) it is the plain engine. Every rank of the group must call `capture`, `score`, `replay` and
    `backward_prompt` with the same arguments, in the same order."""

    context_parallel: ContextParallelGroup | None = field(default=None)
    _protocol_checked: bool = field(default=False, init=False, repr=False)

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
        if not self._protocol_checked:  # before the first announcement: every rank raises alike on a mismatch
            check_protocol(cp)
            self._protocol_checked = True
        state = self.empty_state(model, prompt_ids.numel() - 1, first_position, ShardedPromptState, cp=cp)
        for owner in range(cp.size):
            if owner != cp.rank:
                state.serve(owner, self.attention_chunk_size, self._device(model))
                continue
            if owner > 0:
                state.receive_recurrent(owner - 1)
            for chunk_index, (start, end) in enumerate(self._own_chunks(state)):
                chunk = chunk_index + state.chunk_offset
                _, load, _ = self._backbone_forward(model, state, "capture", prompt_ids[start:end], start, chunk)
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
        summed = unpack(
            cp.all_reduce(pack([added[i] for i in indices]), kind="gradients"), [added[i] for i in indices]
        )
        for i, total in zip(indices, summed, strict=True):
            param, base = params[i]
            param.grad = total.clone() if base is None else base + total
