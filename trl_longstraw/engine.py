"""One group's update: capture the shared prompt once, decode or score members from it, replay each under autograd.

The engine knows models, not trainers. It drives a causal LM through two entry points: its backbone
(`model.base_model`) for the prompt, and its forward with TRL's fused LM head (`fused_lm_head=True`, see
`trl.trainer.utils.add_fused_lm_head`) for the completion tokens, so log-probs and entropies are computed exactly as
`GRPOTrainer` computes them (temperature, soft-capping, fp32 head). Every forward reaches the prompt state through
the `longstraw_state=` kwarg, which the registered `longstraw` attention reads.

Token layout of one member, for a prompt `p[0..P)` and completion `c[0..R)`:

    capture:  p[0 .. P-1)                         no grad, in chunks; state kept
    replay:   [p[P-1], c[0], ..., c[R-1]]        predicts c[0 .. R): the last prompt token is replayed, so the
                                                  first completion token gets its log-prob and its gradient path
                                                  (c[R-1] is fed but never scored: see `LongStrawEngine.member_forward`)

For a MoE policy trained with TRL's load-balancing loss (`routing`), each of these forwards also sums its tokens'
routing ([`~trl_longstraw.load_balancing.RouterLoad`]): the capture's on the state, each member's returned.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim.optimizer import register_optimizer_step_post_hook

from .attention import ATTENTION_IMPLEMENTATION, STATE_KWARG, register_attention
from .experts import EXPERTS_IMPLEMENTATION, lora_experts, register_experts
from .groups import PromptGroup
from .load_balancing import MoeRouting, RouterLoad, recorded_router_logits
from .loss import loss_pairs
from .segments import IGNORED, PrefixNode, prefix_tree, segments
from .state import PromptState, StateAccess, UnpreparedModelError, plan_layers
from .state.suffix import Suffix

if TYPE_CHECKING:
    from .context_parallel.sharding import ShardLayout

_optimizer_steps = 0
# A span two or more members of a group feed and predict alike is run once for them from this many tokens on: a shorter
# one saves less than the forward and backward of its own it costs (`LongStrawEngine.shared_span_tokens`).
SHARED_SPAN_TOKENS = 64


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


# Every `torch.optim` step anywhere in the process, fused and foreach ones included: those write the parameters
# without moving their autograd version counters (measured: fused AdamW leaves `_version` unchanged).
register_optimizer_step_post_hook(_count_optimizer_step)


def absolute_positions(first: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions `first .. first + count - 1` twice: on the host for the prompt state's attention, which reads them to
    choose each key chunk's kernel (on a GPU, reading a device tensor is a sync per chunk), and on `device` as the
    model's `position_ids` (copying one to the other would sync too)."""
    return torch.arange(first, first + count), torch.arange(first, first + count, device=device)


def weights_version(model: nn.Module) -> tuple[int, int]:
    """A stamp that moves whenever the weights may have changed: `(optimizer steps in this process, the sum of the
    parameters' autograd version counters)`.

    The version counters (what autograd uses to detect in-place modification of saved tensors) catch every in-place
    writer that goes through autograd's view of the tensor (SGD, foreach and single-tensor AdamW, `copy_` syncs); the
    global optimizer-step count catches the fused optimizers, which bypass them (TRL's default, `adamw_torch_fused`).
    Writes through `.data` bypass both: do not write weights that way between a capture and its replays. The counters
    of parameters PEFT re-parametrizes in every forward and of FSDP2's modules, whose gathered copies are not the
    parameters the optimizer writes, are no signal and not summed (`_unsignalled_parameters`): under FSDP2 the stamp
    is the optimizer steps.
    """
    skipped = _unsignalled_parameters(model)
    return _optimizer_steps, sum(p._version for p in model.parameters() if id(p) not in skipped)


def _unsignalled_parameters(model: nn.Module) -> set[int]:
    """Ids of the parameters whose version counters are no signal (one walk over the modules):

    - under FSDP2's modules (`fully_shard`): while a module is gathered its registered parameters are FSDP2's whole
      copies, not the sharded ones the optimizer writes;
    - the base parameters under PEFT's LoRA on parameters (`LoraConfig(target_parameters=...)`, e.g. fused MoE
      experts): its `ParamWrapper` registers a parametrization around the parameter in every forward and removes it
      after, which bumps the parameter's version counter without changing its values (the LoRA values themselves are
      parameters of their own and stay counted).
    """
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # PEFT absent: nothing wraps parameters
        ParamWrapper = None
    skipped = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            skipped.update(id(p) for p in module.parameters())
        elif ParamWrapper is not None and isinstance(module, ParamWrapper):
            parameter = getattr(module.get_base_layer(), module.parameter_name, None)
            if isinstance(parameter, nn.Parameter):
                skipped.add(id(parameter))
    return skipped


def prepare_model(model: nn.Module) -> nn.Module:
    """Route `model`'s attention through LongStraw (the registered `longstraw` implementation; SDPA or the model's
    own eager attention when a forward carries no prompt state) and, where PEFT's LoRA adapts fused MoE experts, its
    experts through LongStraw's (LoRA applied to the routed tokens, never merged into the expert stack: experts.py).
    Idempotent; the trainer does it for you."""
    register_attention()
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    if lora_experts(model):
        register_experts()
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return model


@contextlib.contextmanager
def stock_attention(model: nn.Module) -> Iterator[None]:
    """The model's own attention implementation (SDPA where the model supports it, else eager) instead of LongStraw's,
    for generation by TRL's backends: transformers' continuous batching accepts implementations by name. LongStraw's
    is restored after."""
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:  # a model SDPA cannot express (attention sinks, logit soft-capping)
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(ATTENTION_IMPLEMENTATION)


def check_prepared(model: nn.Module) -> None:
    implementation = model.config.get_text_config()._attn_implementation
    if implementation != ATTENTION_IMPLEMENTATION:
        raise UnpreparedModelError(
            f"The model's attention implementation is {implementation!r}, not LongStraw's {ATTENTION_IMPLEMENTATION!r}: "
            "its attention would never read the prompt state and every completion would be scored without its prompt. "
            "Call trl_longstraw.engine.prepare_model(model) (LongStrawGRPOTrainer does it for you)."
        )


@contextlib.contextmanager
def no_layer_checkpointing(model: nn.Module) -> Iterator[None]:
    """Run decoder layers without activation checkpointing (the exact-mode prompt recompute is already chunked)."""
    flagged = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for module in flagged:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in flagged:
            module.gradient_checkpointing = True


@contextlib.contextmanager
def checkpointed_layers_keep_the_state(model: nn.Module) -> Iterator[None]:
    """Let checkpointed decoder layers keep the `cache=` of a replay (transformers' `_can_checkpoint_with_cache`).

    Under activation checkpointing transformers drops a layer's cache, since a writer would be updated twice by the
    backward's recompute; a replay's `StateAccess` only reads (continuations are out of place), so the recompute
    reads the same prompt state. Without this, recurrent layers would replay from an empty state and MLA layers
    would find no latent (the attention kwarg carries the state past the checkpoint, the cache does not).
    """
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for layer in layers:
        layer._can_checkpoint_with_cache = True  # instance attribute: the class keeps transformers' default
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


def reentrant_checkpointing(model: nn.Module) -> bool:
    """Whether a decoder layer of `model` is activation-checkpointed reentrantly (`use_reentrant=True`): its forward
    then runs under no_grad, and only its inputs and outputs carry a graph."""
    return any(
        getattr(module, "gradient_checkpointing", False) is True
        and getattr(getattr(module, "_gradient_checkpointing_func", None), "keywords", {}).get("use_reentrant", False)
        for module in model.modules()
    )


def warn_routing_detached() -> None:
    warnings.warn(
        "The MoE load-balancing loss gets no gradient: reentrant activation checkpointing runs the router inside "
        "no_grad (GRPOTrainer's loss gets none either). Set gradient_checkpointing_kwargs={'use_reentrant': False} to "
        "train it.",
        stacklevel=3,
    )


def access_pairs(access: StateAccess, chunk_index: int, start: int, end: int) -> list[tuple[torch.Tensor, ...]]:
    """(recomputed entry, gradient its state leaf accumulated) pairs of the entries `start .. end - 1` a recompute
    forward of chunk `chunk_index` recorded (`LayerState.recompute_pairs`)."""
    return [
        pair
        for layer_state, recorded in access.recorded.items()
        for pair in layer_state.recompute_pairs(recorded, chunk_index, start, end)
    ]


def backward_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Back-propagate each (output, gradient) pair that has a graph, in one backward. An output computed from frozen
    parameters alone (the first layer's keys under LoRA on q_proj/v_proj) has a gradient but no graph: nothing it
    could push that gradient into trains."""
    pairs = [(tensor, grad) for tensor, grad in pairs if tensor.requires_grad]
    if pairs:
        torch.autograd.backward([tensor for tensor, _ in pairs], [grad for _, grad in pairs])


def on_the_heads_device(model: nn.Module):
    """The LM head's CUDA device as the current one, for a forward through TRL's fused head: its Triton kernel launches
    on the current device, not its tensors' (it sets no device guard), and `device_map` may put the head on another
    GPU than the current one. Kernels elsewhere in the model follow their tensors (PyTorch's ops, fla's guarded ones).
    """
    device = model.get_output_embeddings().weight.device
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class GroupScores:
    """What `LongStrawEngine.score_group` scored: `[members, T]` log-probs and entropies (`None` when every member is
    empty), and with `router_load` the rows' [`RouterLoad`], the captured prompt's counted once per row."""

    logps: torch.Tensor
    entropies: torch.Tensor | None
    router_load: RouterLoad | None = None


def no_phase(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@dataclass
class ReplayedMembers:
    """What `LongStrawEngine.replay_group` replayed here: the members (indices into the group), one flag each for
    whether its log-probs were finite (on the device: read once by the caller, not a sync per member), and whether the
    load-balancing loss found its router probabilities without a graph (reentrant activation checkpointing)."""

    members: list[int]
    finite: torch.Tensor
    routing_detached: bool = False


class Distribution(Protocol):
    """How the processes that share a prompt state divide its work: the engine's strategy, chosen at construction.

    `Local` (one process holds the whole state) or `context_parallel.ContextParallel` (the prompt's chunks across a
    CP group, `context_parallel/`). The strategy runs the phases whose work it divides (the capture, the scoring, the
    exact-mode prompt backward) with the engine's building blocks (`empty_state`, `backbone_forward`,
    `member_forward`, `recompute_chunk`); the engine runs the rest (a member's replay, a rollout step) the same way
    under every strategy, asking it which members are this process's and what a rollout step decided.
    """

    # Whether the processes sharing a prompt state run every score and replay together: a round where one has no
    # member then runs a `LongStrawEngine.stand_in`.
    lockstep: bool

    # The fewest tokens a continuation of a state takes (a span members share, a member's tokens after one): a
    # linear-attention layer replays at least two.
    continuation_tokens: int

    def members(self, members: list[int]) -> list[int | None]:
        """Which of a group's `members` (indices) this process scores or replays alone, one per round (None: a
        stand-in)."""

    def in_steps(self, engine: LongStrawEngine, length: int) -> bool:
        """Whether a member of `length` completion tokens is replayed (and scored) in segments (`replay_from`) rather
        than whole, alone (`members`)."""

    def capture_span(
        self, engine: LongStrawEngine, model, parent, tokens, start, end, autocast, scores: bool = True
    ) -> tuple[PromptState, list, torch.Tensor | None, torch.Tensor | None, RouterLoad | None]:
        """Tokens `start .. end - 1` of `tokens` (one row, `MemberTokens`) captured without autograd, in
        `replay_segment_size` pieces, into a continuation of `parent` (a shared span, or a member's segments):
        `(continuation, pieces, log-probs [1, end - start], entropies, router load)`, the scores and the load every
        piece's on every process; without `scores` (a replay's capture) the scores and load may be None."""

    def backward_span(
        self, engine: LongStrawEngine, model, span, pieces, tokens, start, scored_end, grad_logps, grad_entropies,
        router_weights, autocast,
    ) -> torch.Tensor:  # fmt: skip
        """`capture_span`'s pieces, last first, forward under autograd and backward with the loss's gradient of their
        tokens before `scored_end` (`grad_logps`, `grad_entropies`, indexed by token), the load-balancing loss's
        (`router_weights`) and the gradient the later pieces (and the members below a span) left on their entries.
        Returns whether every log-prob was finite (a device flag)."""

    def replay_from(
        self, engine: LongStrawEngine, model, state, offset, tokens, first, length, grad_logps, grad_entropies,
        router_weights, autocast,
    ) -> tuple[torch.Tensor, bool]:  # fmt: skip
        """One member's update from its token `first` on, after `state` (`LongStrawEngine.replay_member`'s arguments
        and returns): on one process, its segments one after the other; under context parallelism, spread over the CP
        group as the prompt's chunks are."""

    def score_from(self, engine: LongStrawEngine, model, state, offset, tokens, first, length):
        """One member's no-grad scores from its token `first` on (`LongStrawEngine.score_member`'s arguments and
        returns), in segments where it is longer than one; every process gets them (and the router load)."""

    def agree(self, decision: torch.Tensor) -> torch.Tensor:
        """A rollout step's decision (its sampled tokens, the rows still unfinished) as every process decoding these
        rows must take it."""

    def capture(
        self, engine: LongStrawEngine, model: nn.Module, prompt_ids: torch.Tensor, first_position: int
    ) -> PromptState:
        """The prompt's state, captured without autograd (`LongStrawEngine.capture`)."""

    def extend(self, engine: LongStrawEngine, model: nn.Module, state: PromptState, token_ids) -> PromptState:
        """`token_ids` captured without autograd into a continuation of `state` (`LongStrawEngine.extend`)."""

    def score(
        self, engine: LongStrawEngine, model, state, last_prompt_token, completions, lengths, batch_size, router_load
    ):
        """Every member's no-grad log-probs and entropies (`LongStrawEngine.score`)."""

    def backward_prompt(
        self, engine: LongStrawEngine, model, state, prompt_ids, router_weights: torch.Tensor | None
    ) -> None:
        """The exact-mode recompute of the prompt's chunks, in reverse (`LongStrawEngine.backward_prompt`)."""


class Local:
    """The whole prompt state on this process: every member its own, chunks captured and recomputed in order."""

    lockstep = False
    continuation_tokens = 2

    def members(self, members: list[int]) -> list[int | None]:
        return list(members)

    def in_steps(self, engine, length: int) -> bool:
        return len(engine.member_segments(length)) > 1

    def capture_span(self, engine, model, parent, tokens, start, end, autocast, scores=True):
        pieces = segments(start, end, engine.replay_segment_size)
        span = parent.continuation(end - start)
        logps, entropies, load = [], [], None
        with torch.no_grad(), autocast():
            for index, (first, stop) in enumerate(pieces):
                _, part_logps, part_entropies, part_load = engine.forward_tokens(
                    model, span, "capture", tokens, slice(first, stop), index, -start
                )
                logps.append(part_logps)
                entropies.append(part_entropies)
                load = part_load if load is None else load + part_load
        entropies = None if entropies[0] is None else torch.cat(entropies, dim=1)
        return span, pieces, torch.cat(logps, dim=1), entropies, load

    def backward_span(
        self, engine, model, span, pieces, tokens, start, scored_end, grad_logps, grad_entropies, router_weights,
        autocast,
    ):  # fmt: skip
        finite = []
        layers = (
            no_layer_checkpointing(model)
            if reentrant_checkpointing(model)
            else checkpointed_layers_keep_the_state(model)
        )
        with layers:
            for index in reversed(range(len(pieces))):
                first, stop = pieces[index]
                part_finite, _ = engine.backward_part(
                    model, span, "recompute", tokens, slice(first, stop), index, -start, scored_end, grad_logps,
                    grad_entropies, router_weights, autocast, held=(first - start, stop - start),
                )  # fmt: skip
                finite.append(part_finite)
        return torch.stack(finite).all()

    def replay_from(
        self, engine, model, state, offset, tokens, first, length, grad_logps, grad_entropies, router_weights, autocast
    ):
        return engine.replay_member(
            model, state, offset, tokens, first, length, grad_logps, grad_entropies, router_weights, autocast
        )

    def score_from(self, engine, model, state, offset, tokens, first, length):
        return engine.score_member(model, state, offset, tokens, first, length)

    def agree(self, decision: torch.Tensor) -> torch.Tensor:
        return decision

    def capture(self, engine, model, prompt_ids, first_position):
        num_tokens = prompt_ids.numel() - 1
        state = engine.empty_state(model, num_tokens, first_position)
        for chunk_index, start in enumerate(range(0, num_tokens, engine.prefill_chunk_size)):
            end = min(start + engine.prefill_chunk_size, num_tokens)
            _, load, _ = engine.backbone_forward(model, state, "capture", prompt_ids[start:end], start, chunk_index)
            state.add_router_load(load)
        state.check_captured()
        return state

    def extend(self, engine, model, state, token_ids):
        continued = state.continuation(token_ids.numel())
        for chunk_index, start in enumerate(range(0, token_ids.numel(), engine.prefill_chunk_size)):
            chunk = token_ids[start : start + engine.prefill_chunk_size]
            engine.backbone_forward(model, continued, "capture", chunk, start, chunk_index)
        return continued

    def score(self, engine, model, state, last_prompt_token, completions, lengths, batch_size, router_load):
        logps = entropies = load = None
        for start in range(0, len(completions), batch_size):
            rows = slice(start, start + batch_size)
            if int(lengths[rows].max()) == 0 and engine.routing is None:
                continue
            chunk_logps, chunk_entropies, chunk_load = engine.scored_rows(
                model, state, last_prompt_token, completions[rows], lengths[rows]
            )
            load = chunk_load if load is None else load + chunk_load
            width = chunk_logps.shape[1]
            if logps is None:
                logps = chunk_logps.new_zeros(completions.shape)
                entropies = None if chunk_entropies is None else chunk_entropies.new_zeros(completions.shape)
            logps[rows, :width] = chunk_logps
            if entropies is not None:
                entropies[rows, :width] = chunk_entropies
        if logps is None:  # every member is empty (e.g. all truncated and masked)
            logps = torch.zeros(completions.shape, device=engine.device(model))
        return (logps, entropies, load) if router_load else (logps, entropies)

    def backward_prompt(self, engine, model, state, prompt_ids, router_weights):
        """Chunk c reads the pages of chunks < c as leaves, so its backward adds to their gradients before they are
        themselves recomputed. Peak memory is one chunk's graph plus the state-sized gradient."""
        starts = list(range(0, state.num_tokens, engine.prefill_chunk_size))
        for chunk_index in reversed(range(len(starts))):
            start = starts[chunk_index]
            end = min(start + engine.prefill_chunk_size, state.num_tokens)
            engine.recompute_chunk(model, state, prompt_ids, start, end, chunk_index, router_weights)


@dataclass
class MemberTokens:
    """What a forward of members feeds (`LongStrawEngine.member_forward`): `inputs [n, width + 1]` (the last prompt
    token, then the right-padded completions), the `labels` each input token predicts (`-100`: none), and the
    `routed` tokens the load-balancing loss counts (the last prompt token and the real completion tokens)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    routed: torch.Tensor

    @classmethod
    def of(cls, last_prompt_token, completions, lengths, device) -> MemberTokens:
        width = max(int(lengths.max()), 1)
        completions = completions[:, :width].to(device)
        real = torch.arange(width, device=device)[None, :] < lengths.to(device)[:, None]
        rows = len(completions)
        inputs = torch.cat([last_prompt_token.to(device).expand(rows, 1), completions], dim=1)
        labels = torch.cat([completions.masked_fill(~real, -100), completions.new_full((rows, 1), -100)], 1)
        return cls(inputs, labels, torch.cat([real.new_ones(rows, 1), real], dim=1))

    @property
    def width(self) -> int:
        return self.inputs.shape[1] - 1


@dataclass
class LongStrawEngine:
    """Capture, score, replay and (exact mode) prompt backward for one causal LM with TRL's fused LM head.

    Args:
        prefill_chunk_size: prompt tokens per no-grad capture forward; bounds the capture's activations.
        attention_chunk_size: prompt keys per step of the prefix attention; bounds its score matrix.
        state_device: where prompt state lives (`None`: where each layer computes, the model's device or, with the
            model split over devices by `device_map`, each layer's own).
        prompt_gradient: "detach" (state is a constant) or "exact" (state gradients pushed into the parameters).
        prompt_state_dtype: "auto" (the model's dtype) or "float8_e4m3fn" (attention K/V and MLA latent pages in fp8
            with per-(page, head) scales, dequantised chunk by chunk as read; detach mode only).
        routing: a MoE model's routing when the update includes TRL's load-balancing loss: every forward then sums
            its tokens' router load (the capture's into `state.router_load`), and no layer's output goes unread.
        distribution: how the processes sharing a prompt state divide its work (`Distribution`: `Local`, or
            `context_parallel.ContextParallel` over a CP group).
        replay_segment_size: a member whose replay (its completion and the last prompt token) is longer is scored
            and replayed in segments of this many tokens (`member_segments`); None: every member whole.
        shared_span_tokens: spans of at least this many tokens that members of a group feed and predict alike are
            run once for all of them (`shared_spans`); None: every member from the prompt.
    """

    prefill_chunk_size: int
    attention_chunk_size: int
    state_device: torch.device | None = None
    prompt_gradient: Literal["detach", "exact"] = "detach"
    prompt_state_dtype: Literal["auto", "float8_e4m3fn"] = "auto"
    routing: MoeRouting | None = None
    distribution: Distribution = field(default_factory=Local)
    replay_segment_size: int | None = None
    shared_span_tokens: int | None = SHARED_SPAN_TOKENS

    @staticmethod
    def device(model: nn.Module) -> torch.device:
        return model.get_input_embeddings().weight.device

    def empty_state(
        self,
        model: nn.Module,
        num_tokens: int,
        first_position: int,
        layout: ShardLayout | None = None,
        rank: int = 0,
    ) -> PromptState:
        """The state a capture of `num_tokens` tokens from `first_position` fills (with a CP `layout`, this `rank`'s
        chunks of them): this engine's placement, gradient mode and page dtype, and zero routing sums where the
        load-balancing loss reads them."""
        state = PromptState(
            plan_layers(model),
            num_tokens=num_tokens,
            start_position=first_position,
            device=self.state_device,
            weights_version=weights_version(model),
            exact=self.prompt_gradient == "exact",
            fp8_pages=self.prompt_state_dtype == "float8_e4m3fn",
            layout=layout,
            rank=rank,
        )
        if self.routing is not None:
            state.router_load = RouterLoad.zeros(self.routing, self.device(model))
        return state

    @torch.no_grad()
    def capture(self, model: nn.Module, prompt_ids: torch.Tensor, first_position: int) -> PromptState:
        """Run all but the last of `prompt_ids` (1-D, real tokens only) without autograd and keep their state (the
        distribution's capture: on this process, or the prompt's chunks across a context-parallel group)."""
        check_prepared(model)
        return self.distribution.capture(self, model, prompt_ids, first_position)

    @torch.no_grad()
    def extend(self, model: nn.Module, state: PromptState, token_ids: torch.Tensor) -> PromptState:
        """A continuation of `state` (`PromptState.continuation`) holding `token_ids` (1-D: the tokens after its
        captured ones, at least `distribution.continuation_tokens`), captured without autograd in chunks of
        `prefill_chunk_size` (the distribution's: under context parallelism spread over the CP group as a prompt's
        chunks are): a tool turn's row (its last turn's tokens and the tool's output) on top of the state its earlier
        turns left, so that no turn captures a row's history again."""
        check_prepared(model)
        state.check_fresh(weights_version(model))
        continued = self.distribution.extend(self, model, state, token_ids)
        continued.check_captured()
        return continued

    def backbone_forward(
        self, model, state, mode, token_ids, start, chunk_index
    ) -> tuple[StateAccess, RouterLoad | None, object]:
        """One prompt chunk through the decoder stack (capture, or exact-mode recompute), pages read up to `start`:
        the access, with `routing` the chunk's router load (with its graph when recomputing), and the outputs."""
        device = self.device(model)
        first_position = state.start_position + start
        positions, position_ids = absolute_positions(first_position, token_ids.numel(), device)
        access = StateAccess(
            state,
            mode,
            positions,
            self.attention_chunk_size,
            state.geometry.first_index + start,  # a continuation's chunks follow the states it continues
            chunk_index=chunk_index,
            every_output_read=self.routing is not None,
        )
        routed = {} if self.routing is None else {"output_router_logits": True}
        # Under FSDP2 the causal LM's own forward runs its root hooks, which gather the embeddings (and the one
        # position of LM head computed here); otherwise the backbone alone.
        sharded = isinstance(model, FSDPModule)
        outputs = (model if sharded else model.base_model)(
            input_ids=token_ids.to(device)[None],
            position_ids=position_ids[None],
            cache=access,
            use_cache=False,
            **({"logits_to_keep": 1} if sharded else {}),
            **routed,
            **{STATE_KWARG: access},
        )
        if self.routing is None:
            return access, None, outputs
        return access, RouterLoad.of(outputs.router_logits, self.routing, torch.ones_like(position_ids)), outputs

    def member_forward(self, model, state, last_prompt_token, completions, lengths):
        """Log-probs and entropies of `completions [n, T]` (right-padded; `lengths [n]` real tokens) given the state,
        and with `routing` the router load of the members' tokens (the last prompt token and their real tokens, as
        stock's rows count them), else None: one forward of every row, whole.

        The input is `[last prompt token, completion...]`, one token longer than needed: the extra (last) token is
        never scored, but it keeps every replay at least two tokens long, so linear-attention layers take their
        chunked (differentiable) kernel path rather than the single-token decode kernel. A member without completion
        tokens is fed one masked token (its last prompt token's routing counts).
        """
        state.check_fresh(weights_version(model))
        tokens = MemberTokens.of(last_prompt_token, completions, lengths, self.device(model))
        with checkpointed_layers_keep_the_state(model):
            _, logps, entropies, load = self.forward_tokens(
                model, state, "read", tokens, slice(None), 0, state.num_tokens
            )
        width = tokens.width
        return logps[:, :width], None if entropies is None else entropies[:, :width], load

    def member_segments(self, length: int) -> list[tuple[int, int]]:
        """`[start, end)` of each segment of a member's `length + 1` replayed tokens (`member_forward`'s input), in
        `replay_segment_size` tokens (`segments.segments`). One segment when it fits."""
        return segments(0, max(length, 1) + 1, self.replay_segment_size)

    def scored_rows(self, model, state, last_prompt_token, completions, lengths):
        """`member_forward`'s scores of `completions [n, T]`, no grad; a single member longer than one segment
        (`member_segments`) is scored segment by segment: each one's state captured into a continuation of `state`
        that the later segments read, so the scoring holds one segment's activations, never the member's."""
        if len(completions) > 1 or len(self.member_segments(int(lengths.max()))) == 1:
            return self.member_forward(model, state, last_prompt_token, completions, lengths)
        state.check_fresh(weights_version(model))
        tokens = MemberTokens.of(last_prompt_token, completions, lengths, self.device(model))
        return self.score_member(model, state, state.num_tokens, tokens, 0, int(lengths.max()))

    def score_member(self, model, state, offset: int, tokens: MemberTokens, first: int, length: int):
        """No-grad scores of one member's tokens `first ..` (`tokens`, one row of `length` completion tokens; its
        token 0 is entry `offset` of `state`): `[1, width - first]` log-probs and entropies and its router load, in
        segments (`segments.segments`) captured into a continuation of `state` where it is longer than one."""
        pieces = segments(first, max(length, 1) + 1, self.replay_segment_size)
        continued = state.continuation(pieces[-1][0] - first) if len(pieces) > 1 else state
        offset = -first if len(pieces) > 1 else offset
        logps, entropies, load = [], [], None
        for index, (start, end) in enumerate(pieces):
            mode = "read" if index == len(pieces) - 1 else "capture"
            _, part_logps, part_entropies, part_load = self.forward_tokens(
                model, continued, mode, tokens, slice(start, end), index, offset
            )
            logps.append(part_logps)
            entropies.append(part_entropies)
            load = part_load if load is None else load + part_load
        width = tokens.width - first
        logps = torch.cat(logps, dim=1)[:, :width]
        return logps, None if entropies[0] is None else torch.cat(entropies, dim=1)[:, :width], load

    def forward_tokens(self, model, state, mode, tokens: MemberTokens, part: slice, chunk_index: int, offset: int):
        """One forward of the members' tokens `part` (a segment, or all of them) against `state` in `mode`: the
        access, the log-probs and entropies of each fed token's label (0 where it has none), and with `routing` the
        router load of the fed tokens the rows count. The members' token 0 is entry `offset` of `state`: the entry
        after the prompt's captured tokens (`offset=state.num_tokens`), or of a continuation of it that starts at
        token `first` (`PromptState.continuation`, `offset=-first`)."""
        inputs, labels = tokens.inputs[:, part], tokens.labels[:, part]
        entry = (part.start or 0) + offset  # of the part's first token
        # prefix: the captured tokens before the part, the prompt's (and the states a continuation continues) included
        first_position, prefix = state.start_position + entry, state.geometry.first_index + entry
        positions, position_ids = absolute_positions(first_position, inputs.shape[1], inputs.device)
        access = StateAccess(
            state,
            mode,
            positions,
            self.attention_chunk_size,
            prefix,
            batch_size=len(inputs),
            chunk_index=chunk_index,
            every_output_read=state.parent is not None,  # a segment's last layer feeds its log-probs
        )
        routed = {} if self.routing is None else {"output_router_logits": True}
        recording = contextlib.nullcontext() if self.routing is None else recorded_router_logits(model.base_model)
        with recording as router_logits, on_the_heads_device(model):
            outputs = model(
                input_ids=inputs,
                position_ids=position_ids[None],
                shift_labels=labels,
                fused_lm_head=True,
                cache=access,
                **routed,
                **{STATE_KWARG: access},
            )
        load = None
        if self.routing is not None:
            load = RouterLoad.of(router_logits[-1], self.routing, tokens.routed[:, part])
        return access, outputs.log_probs, outputs.entropy, load

    def backward_part(
        self, model, state, mode, tokens: MemberTokens, part: slice, chunk_index: int, offset: int, scored_end: int,
        grad_logps, grad_entropies, router_weights, autocast, held: tuple[int, int] | None = None,
        every_layer: bool = False,
    ) -> tuple[torch.Tensor, bool]:  # fmt: skip
        """One part of a member's or a shared span's tokens under autograd (`forward_tokens` in `mode`), then one
        backward of: its tokens' share of the loss (those before `scored_end` have a label; `grad_logps`,
        `grad_entropies` indexed by token), the load-balancing loss's (`router_weights`), and with `held` (the
        `[start, end)` of the part's entries in `state`'s numbering, as `access_pairs` takes them) the gradient the
        later parts left on its entries. With `every_layer`, the log-probs with a zero gradient too: a CP rank's
        backward then reaches every layer's collectives whatever its share of the loss. Returns whether the part's
        log-probs were finite (a device flag, not read here) and whether the load-balancing loss had no graph to
        reach (a layer run inside no_grad by reentrant checkpointing)."""
        with autocast():
            access, logps, entropies, load = self.forward_tokens(model, state, mode, tokens, part, chunk_index, offset)
        scored = max(min(part.stop, scored_end) - part.start, 0)  # the part's tokens with a label
        pairs = self.token_loss_pairs(logps, entropies, grad_logps, grad_entropies, part.start, scored)
        finite = torch.isfinite(logps[0, :scored].detach()).all()
        routing_detached = False
        if router_weights is not None:
            objective = load.objective(router_weights)
            routing_detached = not objective.requires_grad
            pairs.append((objective, torch.ones_like(objective)))
        if held is not None:
            pairs += access_pairs(access, chunk_index, *held)
        if every_layer:
            pairs.append((logps, torch.zeros_like(logps)))
        backward_pairs(pairs)
        return finite, routing_detached

    def score(
        self,
        model: nn.Module,
        state: PromptState,
        last_prompt_token: torch.Tensor,
        completions: torch.Tensor,
        lengths: torch.Tensor,
        batch_size: int,
        router_load: bool = False,
    ):
        """No-grad log-probs (and entropies, if the head computes them) of every member, `batch_size` at a time
        (under context parallelism each rank its own members, one at a time, every rank getting every member's).

        Returns `[n, completions.shape[1]]` tensors, zero past each member's length, like `GRPOTrainer`'s; with
        `router_load` (needs `routing`), also the members' [`RouterLoad`] (without the captured prompt's).
        """
        if router_load and self.routing is None:
            raise ValueError("router_load=True needs an engine built with the model's routing")
        with torch.no_grad():
            return self.distribution.score(
                self, model, state, last_prompt_token, completions, lengths, batch_size, router_load
            )

    def score_group(
        self, model: nn.Module, state: PromptState, group: PromptGroup, completions: torch.Tensor, router_load=False
    ) -> GroupScores:
        """No-grad scores of a group's members (`completions [members, T]`, the group's rows), one at a time like they
        are replayed: batching them would make the scoring peak grow with the group size (measured: 0.16 to 0.85 GiB
        from G = 2 to 16 at P = 8K). With `router_load`, the rows' load: each of stock's rows carries the prompt, so
        the captured prompt's load counts once per row, beside the members' own."""
        lengths = torch.tensor(group.completion_lengths)
        tree = self.shared_spans(completions, group.completion_lengths)
        shared = sorted(member for node in tree for member in node.members)
        alone = [member for member in range(len(completions)) if member not in shared]
        if router_load and self.routing is None:
            raise ValueError("router_load=True needs an engine built with the model's routing")
        logps, entropies, *members_load = self.score(
            model, state, group.prompt_ids[-1:], completions[alone], lengths[alone], batch_size=1, router_load=router_load
        ) if alone else (None, None, None)  # fmt: skip
        if shared:
            logps, entropies, members_load = self._score_tree(
                model, state, tree, group, completions, alone, logps, entropies, members_load
            )
        load = None
        if router_load:
            load = state.router_load.times(len(group.rows))
            load = load if members_load[0] is None else load + members_load[0]
        return GroupScores(logps, entropies, load)

    @torch.no_grad()
    def _score_tree(self, model, state, tree, group, completions, alone, alone_logps, alone_entropies, alone_load):
        """`score_group`'s scores where members share spans (`shared_spans`): each span scored once for the members
        below it (a continuation of the state above it, as `_replay_shared` runs it), each member's own tokens from
        its deepest span; the members `alone` were scored already (`alone_*`). A span's load counts once per member
        below it, as each member's row carries it."""
        state.check_fresh(weights_version(model))
        device = self.device(model)
        lengths = group.completion_lengths
        last_prompt_token = group.prompt_ids[-1:]
        pieces: dict[int, list] = {member: [] for member in range(len(completions))}  # (first, logps, entropies)
        loads = []

        def row(member: int) -> MemberTokens:
            return MemberTokens.of(
                last_prompt_token, completions[member][None], torch.tensor([lengths[member]]), device
            )

        def score(parent, node: PrefixNode) -> None:
            span, _, logps, entropies, load = self.distribution.capture_span(
                self, model, parent, row(node.members[0]), node.start, node.end, contextlib.nullcontext
            )
            for member in node.members:
                pieces[member].append((node.start, logps, entropies))
            if load is not None:
                loads.append(load.times(len(node.members)))
            for child in node.children:
                score(span, child)
            for member in node.leaves:
                logps, entropies, load = self.distribution.score_from(
                    self, model, span, -node.start, row(member), node.end, lengths[member]
                )
                pieces[member].append((node.end, logps, entropies))
                if load is not None:
                    loads.append(load)

        for node in tree:
            score(state, node)
        for index, member in enumerate(alone):
            pieces[member].append(
                (
                    0,
                    alone_logps[index : index + 1],
                    None if alone_entropies is None else alone_entropies[index : index + 1],
                )
            )
        if alone_load and alone_load[0] is not None:
            loads.append(alone_load[0])
        first = next(parts[0][1] for parts in pieces.values() if parts)
        logps = first.new_zeros(completions.shape)
        entropies = (
            None
            if all(parts[0][2] is None for parts in pieces.values() if parts)
            else first.new_zeros(completions.shape)
        )
        for member, parts in pieces.items():
            for start, part_logps, part_entropies in parts:
                width = (
                    min(part_logps.shape[1], lengths[member] - start) if member not in alone else part_logps.shape[1]
                )
                logps[member, start : start + width] = part_logps[0, :width]
                if entropies is not None and part_entropies is not None:
                    entropies[member, start : start + width] = part_entropies[0, :width]
        load = None
        for part in loads:
            load = part if load is None else load + part
        return logps, entropies, [load]

    def update_group(
        self,
        model: nn.Module,
        state: PromptState,
        group: PromptGroup,
        completions: torch.Tensor,
        grad_logps: torch.Tensor,
        grad_entropies: torch.Tensor | None = None,
        router_weights: torch.Tensor | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        phase: Callable[[str], contextlib.AbstractContextManager] = no_phase,
        check_replayed: Callable[[ReplayedMembers], None] | None = None,
    ) -> ReplayedMembers:
        """A group's share of the update: its members replayed against `state` (`replay_group`, in `phase("replay")`,
        where `check_replayed` reads what was replayed) and, in exact mode, the gradient they left on the state pushed
        into the parameters (`backward_prompt`, in `phase("prompt_backward")`), with the load-balancing loss's share
        through the prompt tokens' routing once per row of the group. In exact mode the state gets gradient buffers,
        which make it single-use."""
        exact = self.prompt_gradient == "exact"
        if exact:
            state.requires_grad_()
        with phase("replay"):
            replayed = self.replay_group(
                model,
                state,
                group.prompt_ids[-1:],
                completions,
                group.completion_lengths,
                grad_logps,
                grad_entropies,
                router_weights,
                autocast=autocast,
            )
            if check_replayed is not None:
                check_replayed(replayed)
        if exact:
            prompt_weights = None
            if router_weights is not None and not replayed.routing_detached:
                prompt_weights = router_weights * len(group.rows)
            with phase("prompt_backward"), autocast():
                self.backward_prompt(model, state, group.prompt_ids, prompt_weights)
        return replayed

    def replay(
        self,
        model: nn.Module,
        state: PromptState,
        last_prompt_token: torch.Tensor,
        completion: torch.Tensor,
        length: int,
        router_load: bool = False,
    ):
        """One member under autograd: `[length]` log-probs and entropies, connected to the parameters; with
        `router_load` (needs `routing`), also the member's [`RouterLoad`], its probabilities connected too."""
        if router_load and self.routing is None:
            raise ValueError("router_load=True needs an engine built with the model's routing")
        logps, entropies, load = self.member_forward(
            model, state, last_prompt_token, completion[None], torch.tensor([length])
        )
        logps, entropies = logps[0, :length], None if entropies is None else entropies[0, :length]
        return (logps, entropies, load) if router_load else (logps, entropies)

    def replay_group(
        self,
        model: nn.Module,
        state: PromptState,
        last_prompt_token: torch.Tensor,
        completions: torch.Tensor,
        lengths: list[int],
        grad_logps: torch.Tensor,
        grad_entropies: torch.Tensor | None = None,
        router_weights: torch.Tensor | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> ReplayedMembers:
        """The update of one group's members against its state: each member this process replays (`Distribution.members`), one at a
        time under autograd (in `autocast()`), back-propagating its share of the loss's gradient (`grad_logps`,
        `grad_entropies` `[members, T]`; with `router_weights`, the load-balancing loss's through its tokens' routing).

        `completions [members, T]` with `lengths` real tokens each. A member without tokens is skipped unless the
        load-balancing loss reads its last prompt token's routing; under a `lockstep` distribution a round without a member of this
        process runs a `stand_in`. Under reentrant activation checkpointing the router logits carry no graph (in stock
        too, whose loss then gets none of this gradient): the load-balancing loss adds nothing, with a warning.
        """
        flags, replayed, routing_detached = {}, [], False
        device = self.device(model)
        distribution = self.distribution
        tree = self.shared_spans(completions, lengths)
        shared = [member for node in tree for member in node.members]
        in_steps = [m for m, n in enumerate(lengths) if m not in shared and distribution.in_steps(self, n)]
        alone = [m for m in range(len(lengths)) if m not in shared and m not in in_steps]
        for member in [*distribution.members(alone), *in_steps]:
            length = 0 if member is None else lengths[member]
            if member is None or (length == 0 and router_weights is None):
                if distribution.lockstep:  # a round without a member of this process's: in step anyway
                    self.stand_in(model, state, last_prompt_token, completions[0])
                continue
            grads = (grad_logps[member, :length], None if grad_entropies is None else grad_entropies[member, :length])
            replayed.append(member)
            tokens = MemberTokens.of(last_prompt_token, completions[member][None], torch.tensor([length]), device)
            if member in in_steps:
                state.check_fresh(weights_version(model))
                flags[member], detached = distribution.replay_from(
                    self, model, state, state.num_tokens, tokens, 0, length, *grads, router_weights, autocast
                )
            else:
                flags[member], detached = self.replay_member(
                    model, state, state.num_tokens, tokens, 0, length, *grads, router_weights, autocast
                )
            routing_detached = routing_detached or detached
        replayed += shared  # with the tree of spans they share
        below, detached = self._replay_spans(
            model, state, tree, last_prompt_token, completions, lengths, grad_logps, grad_entropies, router_weights,
            autocast,
        )  # fmt: skip
        flags.update(below)
        routing_detached = routing_detached or detached
        replayed.sort()
        finite = torch.stack([flags[member] for member in replayed]) if replayed else torch.ones(0, dtype=torch.bool)
        return ReplayedMembers(replayed, finite, routing_detached)

    def replay_member(
        self,
        model: nn.Module,
        state: PromptState,
        offset: int,
        tokens: MemberTokens,
        first: int,
        length: int,
        grad_logps: torch.Tensor,
        grad_entropies: torch.Tensor | None = None,
        router_weights: torch.Tensor | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> tuple[torch.Tensor, bool]:
        """One member's update from its token `first` on (`tokens`, one row of `length` completion tokens; its token
        0 is entry `offset` of `state`: `forward_tokens`), back-propagating its share of the loss (`grad_logps`,
        `grad_entropies` `[length]`, of which tokens `first ..` are its own here; `router_weights`): whole, or, longer
        than `replay_segment_size`, in segments (`segments.segments`) as exact mode updates from the prompt.

        In segments, every segment but the last is captured without autograd into a continuation of `state`
        (`PromptState.continuation`, its entries then autograd leaves); then from the last segment back to the first,
        each one runs forward under autograd over the entries before it and backward with its share of the loss and
        the gradient the later segments left on its own entries. The member's own tokens get their whole gradient in
        both prompt-gradient modes; `state`'s entries get theirs as a whole replay would give them (in exact mode, or
        `state` a continuation). Peak: `state`, the member's entries and their gradient, one segment's graph,
        checkpointed as the model's layers are. Reentrant checkpointing runs a layer inside no_grad, which would leave
        the entries a segment records without the graph their gradient needs: segments then run without it, and the
        load-balancing loss gets no gradient, as in stock under reentrant checkpointing (and as in a whole replay).

        Returns whether every log-prob was finite (a device flag, not read here) and whether the load-balancing loss
        got no gradient.
        """
        state.check_fresh(weights_version(model))
        pieces = segments(first, max(length, 1) + 1, self.replay_segment_size)
        reentrant = reentrant_checkpointing(model)
        segmented = len(pieces) > 1
        continued = state.continuation(pieces[-1][0] - first) if segmented else state
        offset = -first if segmented else offset
        routing_detached = segmented and reentrant and router_weights is not None
        if routing_detached:
            warn_routing_detached()
        finite = []
        layers = (
            no_layer_checkpointing(model) if segmented and reentrant else checkpointed_layers_keep_the_state(model)
        )
        with layers:
            if segmented:
                with torch.no_grad(), autocast():
                    for index, (start, end) in enumerate(pieces[:-1]):
                        self.forward_tokens(model, continued, "capture", tokens, slice(start, end), index, offset)
                continued.requires_grad_()
            for index in reversed(range(len(pieces))):
                start, end = pieces[index]
                last = index == len(pieces) - 1
                # the last piece's entries are nobody's state; an earlier one's got the later pieces' gradient
                part_finite, detached = self.backward_part(
                    model, continued, "read" if last else "recompute", tokens, slice(start, end), index, offset,
                    length, grad_logps, grad_entropies, None if routing_detached else router_weights, autocast,
                    held=None if last else (start - first, end - first),
                )  # fmt: skip
                finite.append(part_finite)
                if detached:  # the whole member under reentrant checkpointing
                    routing_detached = True
                    warn_routing_detached()
        return torch.stack(finite).all(), routing_detached

    @staticmethod
    def token_loss_pairs(logps, entropies, grad_logps, grad_entropies, start: int, scored: int) -> list:
        """`loss.loss_pairs` of a forward's first `scored` log-probs (and entropies) with the loss's gradient of
        tokens `start .. start + scored - 1` (`grad_logps`, `grad_entropies` indexed by token)."""
        return loss_pairs(
            logps[0, :scored],
            None if entropies is None else entropies[0, :scored],
            grad_logps[start : start + scored],
            None if grad_entropies is None else grad_entropies[start : start + scored],
        )

    def shared_spans(self, completions: torch.Tensor, lengths: list[int]) -> list[PrefixNode]:
        """The spans of `shared_span_tokens` tokens or more that two or more of a group's members predict alike
        (`segments.prefix_tree` over their labels: each member's completion, then `IGNORED`)."""
        if self.shared_span_tokens is None:
            return []
        labels = [
            completions[member, :length].tolist() + [IGNORED] if length > 0 else []
            for member, length in enumerate(lengths)
        ]
        continuation = self.distribution.continuation_tokens
        return prefix_tree(labels, max(self.shared_span_tokens, continuation), continuation)

    def _replay_spans(self, model, parent, nodes: list[PrefixNode], *group) -> tuple[dict[int, torch.Tensor], bool]:
        """`_replay_shared` of each of `nodes` from `parent`: every member's finiteness flag, and whether the
        load-balancing loss got no gradient."""
        flags, routing_detached = {}, False
        for node in nodes:
            below, detached = self._replay_shared(model, parent, node, *group)
            flags.update(below)
            routing_detached = routing_detached or detached
        return flags, routing_detached

    def _replay_shared(
        self, model, parent, node: PrefixNode, last_prompt_token, completions, lengths, grad_logps, grad_entropies,
        router_weights, autocast,
    ) -> tuple[dict[int, torch.Tensor], bool]:  # fmt: skip
        """The update of the members below `node`, whose tokens `node.start .. node.end - 1` they feed and predict
        alike: the span captured once without autograd into a continuation of `parent` (the prompt state, or the
        node above's; `Distribution.capture_span`), its entries made autograd leaves; the nodes below and the members
        that go on alone (`Distribution.replay_from`) updated from it; then the span's segments, last first, forward
        under autograd and backward with the sum of its members' shares of the loss (the load-balancing loss's once
        per member: each member's row carries the span) and the gradient the members left on its entries
        (`Distribution.backward_span`). Under context parallelism the CP group runs each of these together, the span
        spread over it as the prompt's chunks are. Returns each member's finiteness flag (its own tokens' and every
        span's above it) and whether the load-balancing loss got no gradient."""
        device = self.device(model)
        row = lambda member: MemberTokens.of(
            last_prompt_token, completions[member][None], torch.tensor([lengths[member]]), device
        )
        tokens = row(node.members[0])
        span, pieces, *_ = self.distribution.capture_span(
            self, model, parent, tokens, node.start, node.end, autocast, scores=False
        )
        span.requires_grad_()
        flags, routing_detached = self._replay_spans(
            model, span, node.children, last_prompt_token, completions, lengths, grad_logps, grad_entropies,
            router_weights, autocast,
        )  # fmt: skip
        for member in node.leaves:
            length = lengths[member]
            flags[member], detached = self.distribution.replay_from(
                self, model, span, -node.start, row(member), node.end, length, grad_logps[member, :length],
                None if grad_entropies is None else grad_entropies[member, :length], router_weights, autocast,
            )  # fmt: skip
            routing_detached = routing_detached or detached
        summed_logps = grad_logps[node.members].sum(dim=0)
        summed_entropies = None if grad_entropies is None else grad_entropies[node.members].sum(dim=0)
        routing_detached = routing_detached or (reentrant_checkpointing(model) and router_weights is not None)
        # the load-balancing loss's once per member: each member's row carries the span
        span_weights = None if routing_detached or router_weights is None else router_weights * len(node.members)
        span_finite = self.distribution.backward_span(
            self, model, span, pieces, tokens, node.start, node.end, summed_logps, summed_entropies, span_weights,
            autocast,
        )  # fmt: skip
        return {member: flag & span_finite for member, flag in flags.items()}, routing_detached

    def stand_in(self, model: nn.Module, state: PromptState, last_prompt_token, completion) -> None:
        """A replay that adds nothing (one token, zero gradient), for a round where this process has no member while
        the others of its group replay (`lockstep`): its forward and backward meet theirs."""
        logps, _ = self.replay(model, state, last_prompt_token, completion, 1)
        logps.backward(torch.zeros_like(logps))

    @torch.no_grad()
    def decode(self, model: nn.Module, state: PromptState, suffix: Suffix, token_ids: torch.Tensor) -> torch.Tensor:
        """One rollout step of a group's rows: feed `token_ids [rows, T]` after what they decoded so far (`suffix`,
        extended here) and return the fp32 logits `[rows, vocab]` of each row's next token, as `generate` takes them.
        """
        state.check_fresh(weights_version(model))
        device = self.device(model)
        first_position = suffix.first_position + suffix.length
        positions, position_ids = absolute_positions(first_position, token_ids.shape[1], device)
        access = StateAccess(
            state,
            "decode",
            positions,
            self.attention_chunk_size,
            state.geometry.first_index + state.num_tokens,
            batch_size=token_ids.shape[0],
            suffix=suffix,
        )
        outputs = model(
            input_ids=token_ids.to(device),
            position_ids=position_ids[None],
            cache=access,
            logits_to_keep=1,
            **{STATE_KWARG: access},
        )
        suffix.advance(token_ids.shape[1])
        return outputs.logits[:, -1].to(dtype=torch.float32, copy=True)

    def backward_prompt(
        self,
        model: nn.Module,
        state: PromptState,
        prompt_ids: torch.Tensor,
        router_weights: torch.Tensor | None = None,
    ) -> None:
        """Exact mode: push the gradient accumulated on the state leaves into the parameters, and with
        `router_weights` (`[experts]`, see `RouterLoad.weights`) the load-balancing loss's gradient through the
        prompt tokens' routing: the prompt's chunks recomputed under autograd in reverse (the distribution's order)."""
        state.check_fresh(weights_version(model))
        with no_layer_checkpointing(model), torch.enable_grad():
            self.distribution.backward_prompt(self, model, state, prompt_ids, router_weights)

    def recompute_chunk(self, model, state, prompt_ids, start, end, chunk_index, router_weights) -> None:
        """One chunk of the prompt backward: recompute prompt tokens `start .. end - 1` (capture chunk `chunk_index`
        of this process's state) under autograd and push the gradient its state entries accumulated (and with
        `router_weights` the load-balancing loss's share through its routing) into the parameters."""
        access, load, outputs = self.backbone_forward(
            model, state, "recompute", prompt_ids[start:end], start, chunk_index
        )
        # the chunk's entries held here
        pairs = access_pairs(access, chunk_index, state.local_prefix(start), state.local_prefix(end))
        if router_weights is not None:
            pairs.append((load.objective(router_weights), torch.ones((), device=load.probs.device)))
        if isinstance(model, FSDPModule):
            # FSDP2 gathers a layer's weights for its backward when the gradient reaches the layer's outputs, while
            # these entries sit inside the layers: a zero gradient through the outputs reaches each layer first
            # (autograd runs the later-created node first), and keeps every rank's passes alike (fsdp.py)
            pairs.append((outputs.logits, torch.zeros_like(outputs.logits)))
        elif state.sharding is not None:
            # every rank's backward must reach every layer's attention, whose backward is a collective, whatever
            # gradients its own entries hold: a zero gradient through the outputs (the residual stream) does
            pairs.append((outputs.last_hidden_state, torch.zeros_like(outputs.last_hidden_state)))
        backward_pairs(pairs)
