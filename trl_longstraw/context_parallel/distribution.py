"""The context-parallel distribution: the capture's and the exact recompute's steps, each rank's members, rollout
decisions.

Capture (`ContextParallel.capture`): step by step, every rank capturing its chunk of the step at once
(`PromptSharding`, `step.StepAttention`). The exact-mode recompute runs the steps in reverse, every rank at once.
Scoring and replay: each rank its own members (`members`), a stand-in (`LongStrawEngine.stand_in`) keeping it in step
with the group where it has none; scores are all-gathered. Rollouts decode every row on every rank in lockstep, with
rank 0's decisions (`agree`).
"""

from __future__ import annotations

import contextlib

import torch

from ..engine import (
    Distribution,
    Local,
    MemberTokens,
    no_layer_checkpointing,
    weights_version,
)
from ..load_balancing import RouterLoad
from .communication import ContextParallelGroup
from .protocol import check_protocol
from .sharding import ShardLayout, check_prompt_length
from .state import CONTINUATION_CHUNK_TOKENS, PromptSharding


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
        self.continuation_tokens = CONTINUATION_CHUNK_TOKENS * group.size  # two per rank (`in_steps`)
        self._protocol_checked = False

    def agree(self, decision: torch.Tensor) -> torch.Tensor:
        """A rollout step's decision, rank 0's on every rank of the CP group (they decode the same rows in
        lockstep)."""
        return self.group.broadcast(decision.to(torch.int64).contiguous(), 0, kind="rollout").to(decision.dtype)

    def members(self, members: list[int]) -> list[int | None]:
        """The members this rank scores or replays alone, one per round: `members[round * cp + rank]`, or None where
        the last round has fewer (a stand-in then keeps the rank in step with the group)."""
        size, rank = self.group.size, self.group.rank
        count = len(members)
        return [
            members[round_ * size + rank] if round_ * size + rank < count else None
            for round_ in range(-(-count // size))
        ]

    def in_steps(self, engine, length: int) -> bool:
        """A member of `length` completion tokens whose replay is longer than one segment
        (`LongStrawEngine.member_segments`), and long enough to give every rank two tokens of it, is scored and
        replayed by the whole CP group: its tokens in steps of `cp` chunks of at most `replay_segment_size` tokens, as
        the prompt's (`replay_from`)."""
        return len(engine.member_segments(length)) > 1 and length + 1 >= self.continuation_tokens

    def capture_span(self, engine, model, parent, tokens, start, end, autocast, scores=True):
        """Every rank captures its chunk of each step of the tokens (`PromptSharding.continuation`: in chunks of at
        most `replay_segment_size`, a step of one chunk per rank where that is None), as the prompt's capture does.
        The pieces are this rank's chunks, `(step, start, end)` in token indices, in step order. Scores and router
        load: every rank's chunks', summed over the group (one all-reduce each; without `scores`, none: None)."""
        chunk_size = engine.replay_segment_size or -(-(end - start) // self.group.size)
        span = parent.continuation(end - start, chunk_size)
        layout = span.sharding.layout
        pieces = [
            (step, start + layout.bounds[chunk][0], start + layout.bounds[chunk][1])
            for step, chunk in enumerate(layout.chunks(self.group.rank))
        ]
        device = engine.device(model)
        scored = torch.zeros(2, end - start, dtype=torch.float32, device=device)
        load = has_entropies = None
        with torch.no_grad(), autocast():
            for local, (_, first, stop) in enumerate(pieces):
                _, logps, entropies, part_load = engine.forward_tokens(
                    model, span, "capture", tokens, slice(first, stop), local, -start
                )
                scored[0, first - start : stop - start] = logps[0]
                has_entropies = entropies is not None
                if entropies is not None:
                    scored[1, first - start : stop - start] = entropies[0]
                load = part_load if load is None else load + part_load
        span.sharding.hand_offs.finish_capture()
        if not scores:  # a replay's capture: nothing reads them
            return span, pieces, None, None, None
        scored = self.group.all_reduce(scored, kind="scores").to(device)
        if load is not None:
            load = self._summed_over_group(engine, load, kind="scores")
        return span, pieces, scored[:1], scored[1:] if has_entropies else None, load

    def backward_span(
        self, engine, model, span, pieces, tokens, start, scored_end, grad_logps, grad_entropies, router_weights,
        autocast,
    ):  # fmt: skip
        """The steps, last first, every rank its chunk at once, as exact mode's recompute of the prompt: forward
        under autograd over the pages before the step (the prompt's, the spans' above, the earlier steps') and the
        step's chunks, backward with the chunk's share of the loss and the gradient the later steps left on its
        entries. Each rank's graph is one chunk, run without activation checkpointing as the prompt's recompute is.
        The members below the span left their gradient on each rank's copy of its final recurrent states: summed onto
        the last chunk's rank first, as for the prompt."""
        span.sharding.hand_offs.sum_final_state_gradients()
        return self._backward_steps(
            engine, model, span, pieces, tokens, start, scored_end, grad_logps, grad_entropies, router_weights,
            autocast,
        )  # fmt: skip

    def _backward_steps(
        self, engine, model, span, pieces, tokens, start, scored_end, grad_logps, grad_entropies, router_weights,
        autocast,
    ):  # fmt: skip
        hand_offs = span.sharding.hand_offs
        first_index = span.geometry.first_index
        finite = []
        with no_layer_checkpointing(model):
            for step, first, stop in reversed(pieces):
                hand_offs.before_recompute(step)
                held = (span.local_prefix(first_index + first - start), span.local_prefix(first_index + stop - start))
                chunk_finite, _ = engine.backward_part(
                    model, span, "recompute", tokens, slice(first, stop), hand_offs.entry_after(step), -start,
                    scored_end, grad_logps, grad_entropies, router_weights, autocast, held=held, every_layer=True,
                )  # fmt: skip
                finite.append(chunk_finite)
                hand_offs.after_recompute()
            hand_offs.finish_recompute()
        return torch.stack(finite).all()

    def replay_from(
        self, engine, model, state, offset, tokens, first, length, grad_logps, grad_entropies, router_weights, autocast
    ):
        """One member's tokens from `first` on captured by the group into a continuation of `state`
        (`capture_span`), then updated step by step in reverse (`backward_span`), as exact mode updates from the
        prompt. Its log-probs' finiteness on this rank (a device flag), and False: the load-balancing loss got its
        gradient (the chunks run without activation checkpointing)."""
        span, pieces, *_ = self.capture_span(engine, model, state, tokens, first, length + 1, autocast, scores=False)
        span.requires_grad_()
        finite = self._backward_steps(
            engine, model, span, pieces, tokens, first, length, grad_logps, grad_entropies, router_weights, autocast
        )
        return finite, False

    def score_from(self, engine, model, state, offset, tokens, first, length):
        """One member's scores from its token `first` on, captured by the group (`capture_span`), on every rank."""
        _, _, logps, entropies, load = self.capture_span(
            engine, model, state, tokens, first, length + 1, contextlib.nullcontext
        )
        width = tokens.width - first
        return logps[:, :width], None if entropies is None else entropies[:, :width], load

    def _summed_over_group(self, engine, load: RouterLoad, kind: str) -> RouterLoad:
        """Routing sums of each rank's tokens, summed over the CP group (one all-reduce)."""
        total = self.group.all_reduce(torch.cat([load.counts, load.probs, load.rows.reshape(1)]), kind=kind)
        experts = engine.routing.num_experts
        return RouterLoad(total[:experts], total[experts : 2 * experts], total[-1])

    def score(self, engine, model, state, last_prompt_token, completions, lengths, batch_size, router_load):
        """Each rank scores its members (`members`, one at a time whatever `batch_size`), and every rank gets every
        member's log-probs and entropies (one all-gather)."""
        cp = self.group
        width, device = completions.shape[1], engine.device(model)
        rounds = []
        load = has_entropies = None
        steps = [member for member in range(len(completions)) if self.in_steps(engine, int(lengths[member]))]
        alone = [member for member in range(len(completions)) if member not in steps]
        for member in self.members(alone):
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
        logps = torch.zeros(completions.shape, device=device)
        entropies = torch.zeros_like(logps) if has_entropies else None
        for rank, scored in enumerate(gathered):
            for round_, values in enumerate(scored):
                if (index := round_ * cp.size + rank) < len(alone):
                    logps[alone[index]] = values[0].to(logps.device)
                    if entropies is not None:
                        entropies[alone[index]] = values[1].to(logps.device)
        if router_load:
            load = RouterLoad.zeros(engine.routing, device) if load is None else load
            load = self._summed_over_group(engine, load, kind="scores")
        for member in steps:  # by the whole group, every rank getting the scores and the load
            length = int(lengths[member])
            tokens = MemberTokens.of(
                last_prompt_token, completions[member][None], lengths[member : member + 1], device
            )
            state.check_fresh(weights_version(model))
            member_logps, member_entropies, member_load = self.score_from(
                engine, model, state, state.num_tokens, tokens, 0, length
            )
            logps[member, : member_logps.shape[1]] = member_logps[0]
            if member_entropies is not None:
                if entropies is None:
                    entropies = torch.zeros_like(logps)
                entropies[member, : member_entropies.shape[1]] = member_entropies[0]
            if router_load:
                load = load + member_load
        return (logps, entropies, load) if router_load else (logps, entropies)

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

    def extend(self, engine, model, state, token_ids):
        """Every rank captures its chunk of each step of `token_ids` (in chunks of at most `prefill_chunk_size`) into
        a continuation of `state` spread over the group (`PromptSharding.continuation`), as the prompt's capture
        does; every rank then holds its final recurrent states, which a rollout decodes from."""
        continued = state.continuation(token_ids.numel(), engine.prefill_chunk_size)
        layout = continued.sharding.layout
        for local, chunk in enumerate(layout.chunks(self.group.rank)):
            start, end = layout.bounds[chunk]
            engine.backbone_forward(model, continued, "capture", token_ids[start:end], start, local)
        continued.sharding.hand_offs.finish_capture()
        return continued

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
