"""The context-parallel distribution: the capture's and the exact recompute's steps, each rank's members, rollout
decisions.

Capture (`ContextParallel.capture`): step by step, every rank capturing its chunk of the step at once
(`PromptSharding`, `step.StepAttention`). The exact-mode recompute runs the steps in reverse, every rank at once.
Scoring and replay: each rank its own members (`members`), a stand-in (`LongStrawEngine.stand_in`) keeping it in step
with the group where it has none; scores are all-gathered. Rollouts decode every row on every rank in lockstep, with
rank 0's decisions (`agree`).
"""

from __future__ import annotations

import torch

from ..engine import Distribution, Local
from ..load_balancing import RouterLoad
from .communication import ContextParallelGroup
from .protocol import check_protocol
from .sharding import ShardLayout, check_prompt_length
from .state import PromptSharding


def distribution_over(group: ContextParallelGroup | None) -> Distribution:
    """The engine's distribution for this rank's CP group: `ContextParallel` over a group of two or more, else
    `Local`."""
    return ContextParallel(group) if group is not None and group.size > 1 else Local()


class ContextParallel:
    """The prompt sharded across a CP group of two or more ranks (module docstring; a `Distribution`). Every rank of
    the group must call the engine's `capture`, `score`, `replay_group` and `backward_prompt` with the same arguments,
    in the same order."""

    lockstep = True

    def __init__(self, group: ContextParallelGroup):
        if group.size < 2:
            raise ValueError(f"ContextParallel needs a group of two or more ranks (got {group.size}): use Local.")
        self.group = group
        self._protocol_checked = False

    def agree(self, decision: torch.Tensor) -> torch.Tensor:
        """A rollout step's decision, rank 0's on every rank of the CP group (they decode the same rows in
        lockstep)."""
        return self.group.broadcast(decision.to(torch.int64).contiguous(), 0, kind="rollout").to(decision.dtype)

    def members(self, count: int) -> list[int | None]:
        """The members this rank scores or replays, one per round: member `round * cp + rank` of the group's `count`,
        or None where the last round has fewer (a stand-in then keeps the rank in step with the group)."""
        size, rank = self.group.size, self.group.rank
        return [round_ * size + rank if round_ * size + rank < count else None for round_ in range(-(-count // size))]

    def _summed_over_group(self, engine, load: RouterLoad, kind: str) -> RouterLoad:
        """Routing sums of each rank's tokens, summed over the CP group (one all-reduce)."""
        total = self.group.all_reduce(torch.cat([load.counts, load.probs, load.rows.reshape(1)]), kind=kind)
        experts = engine.routing.num_experts
        return RouterLoad(total[:experts], total[experts : 2 * experts], total[-1])

    def score(self, engine, model, state, last_prompt_token, completions, lengths, batch_size, router_load):
        """Each rank scores its members (`members`, one at a time whatever `batch_size`), and every rank gets every
        member's log-probs and entropies (one all-gather)."""
        cp = self.group
        width = completions.shape[1]
        rounds = []
        load = has_entropies = None
        for member in self.members(len(completions)):
            rows = [0 if member is None else member]
            length = torch.zeros(1, dtype=lengths.dtype) if member is None else lengths[rows]
            logps, entropies, member_load = engine.member_forward(
                model, state, last_prompt_token, completions[rows], length
            )
            has_entropies = entropies is not None
            scored = torch.zeros(2, width, dtype=torch.float32, device=logps.device)
            if member is not None:
                scored[0, : logps.shape[1]] = logps[0]
                if entropies is not None:
                    scored[1, : entropies.shape[1]] = entropies[0]
                if member_load is not None:
                    load = member_load if load is None else load + member_load
            rounds.append(scored)
        gathered = cp.all_gather(torch.stack(rounds), kind="scores") if rounds else []
        logps = torch.zeros(completions.shape, device=engine.device(model))
        entropies = torch.zeros_like(logps) if has_entropies else None
        for rank, scored in enumerate(gathered):
            for round_, values in enumerate(scored):
                member = round_ * cp.size + rank
                if member < len(completions):
                    logps[member] = values[0].to(logps.device)
                    if entropies is not None:
                        entropies[member] = values[1].to(logps.device)
        if not router_load:
            return logps, entropies
        load = RouterLoad.zeros(engine.routing, engine.device(model)) if load is None else load
        return logps, entropies, self._summed_over_group(engine, load, kind="scores")

    def layout(self, prompt_tokens: int, prefill_chunk_size: int) -> ShardLayout:
        """The chunks of a prompt of `prompt_tokens` tokens (all but the last captured) over the CP group."""
        check_prompt_length(prompt_tokens, self.group.size)
        return ShardLayout.of(prompt_tokens - 1, self.group.size, prefill_chunk_size)

    def capture(self, engine, model, prompt_ids, first_position):
        """Step by step, every rank capturing its chunk of the step at once (`PromptSharding`)."""
        cp = self.group
        layout = self.layout(prompt_ids.numel(), engine.prefill_chunk_size)
        if not self._protocol_checked:  # before the first collective: every rank raises alike on a mismatch
            check_protocol(cp)
            self._protocol_checked = True
        state = engine.empty_state(model, layout.num_tokens, first_position, layout, cp.rank)
        state.sharding = PromptSharding(state, cp, layout)
        for local, chunk in enumerate(layout.chunks(cp.rank)):
            start, end = layout.bounds[chunk]
            _, load, _ = engine.backbone_forward(model, state, "capture", prompt_ids[start:end], start, local)
            state.add_router_load(load)
        state.sharding.hand_offs.finish_capture()
        if engine.routing is not None:  # every rank holds the whole prompt's routing sums
            state.router_load = self._summed_over_group(engine, state.router_load, kind="router")
        state.check_captured()
        return state

    def backward_prompt(self, engine, model, state, prompt_ids, router_weights):
        """The steps are recomputed in reverse, every rank its chunk of the step at once (the step's attention
        backward gives the pages of earlier steps their gradients where they live, before those are recomputed, and
        the step's chunks their gradients from each other); a chunk's starting recurrent states hand their gradient to
        the previous chunk's final ones (GatedDeltaNet's inside its rule's backward: state passing backward). Then the
        parameter gradients this added are summed across the CP group (with `router_weights`, each rank's chunks add
        their tokens' share of the load-balancing loss's gradient)."""
        layout, hand_offs = state.sharding.layout, state.sharding.hand_offs
        hand_offs.sum_final_state_gradients()
        for step in reversed(range(layout.steps)):
            start, end = layout.bounds[layout.chunk_of(self.group.rank, step)]
            hand_offs.before_recompute(step)
            engine.recompute_chunk(model, state, prompt_ids, start, end, hand_offs.entry_after(step), router_weights)
            hand_offs.after_recompute()
        hand_offs.finish_recompute()
