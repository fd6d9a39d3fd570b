"""Rollouts from the captured prompt: a generation batch's completions decoded against one prompt state per prompt.

TRL's transformers path repeats each prompt G times, prefills every copy and keeps G prompt caches. Here each distinct
prompt is captured once ([`LongStrawEngine.capture`], the same capture the update reads) and its rows decode together:
every row attends to the prompt's read-only pages, shared by all rows (never copied), and to its own decoded tokens,
kept in a [`Suffix`] (one row's worth of K/V, latents, indexer keys and recurrent states). Decode memory per prompt is
one prompt state plus its rows' suffixes. A tool-calling turn's row decodes from the state its last turn left, what it
added since captured on top of it ([`ToolTurnStates`]).

Sampling is `generate`'s own: the generation config is prepared, and the logits processors and stopping criteria are
built, by the model's `GenerationMixin` helpers from the same `GenerationConfig` `GRPOTrainer` passes to `generate`
(temperature, top-p/k, min-p, repetition penalty, EOS / pad, `generation_kwargs`); the token choice is `generate`'s
(`argmax`, or `multinomial` over the whole batch's probabilities). All prompts of the batch advance in lockstep, one
`[batch, vocab]` draw per step, so that a seeded run draws the same random numbers in the same order as `generate`:
the same completions as stock `GRPOTrainer` with float32 weights (in bf16 the two paths' attention kernels round
differently, which can flip a draw; fp8 pages and context parallelism change the numbers by design). The price is
that a process keeps one prompt state per distinct prompt of its generation batch alive while decoding (one, with
one group per process).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode

from .engine import LongStrawEngine
from .segments import PrefixNode, prefix_tree
from .state import PromptState
from .state.suffix import Suffix


class UnsupportedRolloutError(ValueError):
    """A generation setting a rollout from the prompt state cannot serve."""


@dataclass
class Sampling:
    """`generate`'s decoding rules for one batch, prepared by the model's own `GenerationMixin` helpers."""

    config: GenerationConfig
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    do_sample: bool
    pad_token_id: int | None
    stops_at_eos: bool


# transformers' own `generate`, as imported: what a rollout from the prompt state reproduces.
TRANSFORMERS_GENERATE = GenerationMixin.generate


def generates_with_transformers(model: nn.Module, causal_lm: nn.Module) -> bool:
    """Whether `model.generate` (`model`: the trained model, the causal LM `causal_lm` or a PEFT model around it) is
    transformers' own: not replaced on either instance, and neither a method of the causal LM's class nor a patched
    `GenerationMixin.generate`. Only then does a rollout from the prompt state sample what it would sample."""
    replaced = any("generate" in vars(module) for module in (model, causal_lm))
    return not replaced and type(causal_lm).generate is TRANSFORMERS_GENERATE


def check_generation_config(model: nn.Module, generation_config: GenerationConfig) -> None:
    """Refuse what a rollout from the prompt state cannot serve, naming the setting and the way out."""
    config, _ = model._prepare_generation_config(generation_config)
    _refuse_what_a_rollout_cannot_serve(config)


def _refuse_what_a_rollout_cannot_serve(config: GenerationConfig) -> None:
    """`check_generation_config` on a generation config `_prepare_generation_config` already prepared."""
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH):
        raise UnsupportedRolloutError(
            f"The generation settings ask for {mode.value.replace('_', ' ')} (num_beams={config.num_beams}, "
            f"assistant/prompt lookup settings), which a rollout from the prompt state does not implement: it samples "
            "or decodes greedily, like GRPOTrainer's default. Set rollout_from_prompt_state=False to generate with "
            "transformers' generate, or drop the setting from generation_kwargs."
        )
    if config.guidance_scale is not None and config.guidance_scale != 1:
        raise UnsupportedRolloutError(
            f"generation_kwargs guidance_scale={config.guidance_scale}: classifier-free guidance runs a second, "
            "unconditional forward per step, which a rollout from the prompt state does not. Set "
            "rollout_from_prompt_state=False, or drop guidance_scale."
        )
    if getattr(config, "token_healing", False):
        raise UnsupportedRolloutError(
            "generation_kwargs token_healing=True: token healing re-tokenizes the prompt's end, which needs the "
            "tokenizer (generate fails without one, and GRPOTrainer passes none). Drop token_healing."
        )
    if config.cache_implementation == "quantized":
        raise UnsupportedRolloutError(
            "generation_kwargs cache_implementation='quantized': generate would decode from a quantized K/V cache, a "
            "rollout from the prompt state reads the prompt's own pages (see prompt_state_dtype for fp8 pages). Set "
            "rollout_from_prompt_state=False to decode with the quantized cache, or drop cache_implementation."
        )
    if (config.num_return_sequences or 1) != 1:
        raise UnsupportedRolloutError(
            f"generation_kwargs num_return_sequences={config.num_return_sequences}: GRPOTrainer repeats prompts "
            "itself (num_generations). Drop num_return_sequences."
        )


def prepare_sampling(
    model: nn.Module, generation_config: GenerationConfig, padded_prompts: torch.Tensor, prompt_mask: torch.Tensor
) -> Sampling:
    """`generate`'s preparation of `generation_config` for the left-padded `padded_prompts [batch, width]`.

    `prompt_mask` (1 on real tokens) reaches the logits processors as `generate`'s attention mask does: the
    repetition penalty skips each row's left padding (the pad token is often the EOS token)."""
    has_default_max_length = generation_config.max_length is None and model.generation_config.max_length is None
    has_default_min_length = generation_config.min_length is None and model.generation_config.min_length is None
    config, model_kwargs = model._prepare_generation_config(generation_config)
    _refuse_what_a_rollout_cannot_serve(config)
    device = padded_prompts.device
    model._prepare_special_tokens(config, True, device=device, batch_size=padded_prompts.shape[0])
    config = model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name="input_ids",
        input_ids_length=padded_prompts.shape[1],
        inputs_tensor=padded_prompts,
    )
    model._validate_generated_length(config, padded_prompts.shape[1], has_default_max_length)  # as generate does
    logits_processor = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=padded_prompts.shape[1],
        encoder_input_ids=padded_prompts,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device=device,
        model_kwargs={**model_kwargs, "attention_mask": None if bool(prompt_mask.all()) else prompt_mask},
    )
    stopping_criteria = model._get_stopping_criteria(config, stopping_criteria=StoppingCriteriaList(), tokenizer=None)
    pad = config._pad_token_tensor
    return Sampling(
        config=config,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        do_sample=bool(config.do_sample),
        pad_token_id=None if pad is None else int(pad),
        stops_at_eos=any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria),
    )


@dataclass
class PromptRows:
    """The rows of a generation batch that share one prompt, and that prompt's captured state.

    `continuation` (tokens every one of these rows has after the tokens the state holds, but the last) is fed on top
    of the state in the rollout's first forward: what a tool-calling turn's row added since its last turn, where it
    is too few tokens to continue the state with (`LongStrawEngine.extend`: under context parallelism, two per rank).
    """

    rows: list[int]
    prompt_ids: torch.Tensor  # [P] real tokens
    state: PromptState
    continuation: torch.Tensor | None = None  # [C] real tokens after prompt_ids


class ToolTurnStates:
    """A generation's states, kept through GRPOTrainer's tool loop. A tool turn's row (its prompt, then its
    completion and tool results so far) continues the longest kept row it extends: what it added since (its last
    turn's tokens and the tool's output) is captured into a continuation of that row's state
    (`LongStrawEngine.extend`), so a row's history is captured once whatever its number of turns. Rows extending one
    kept row share its state, and the spans of what they added that they have alike (64 tokens or more,
    `segments.prefix_tree`) are captured once, each row going on from its deepest. A row that added fewer tokens than
    a continuation takes (`Distribution.continuation_tokens`: under context parallelism two per rank, the
    continuation spread over the CP group) feeds them on top of the state in the turn's first forward
    (`PromptRows.continuation`). Released when the generation ends, before scoring."""

    def __init__(self):
        self._states: dict[tuple[int, ...], PromptRows] | None = None

    @property
    def in_tool_loop(self) -> bool:
        """Whether the first turn kept its states: the turn now decoding is a tool turn."""
        return self._states is not None

    def prompt_rows(
        self,
        rows_of: dict[tuple[int, ...], list[int]],
        capture: Callable[[int, list[int], torch.Tensor], PromptState],
        extend: Callable[[PromptState, torch.Tensor], PromptState],
        device: torch.device,
        shared_span_tokens: int | None = None,
        continuation_tokens: int = 1,
    ) -> list[PromptRows]:
        """This turn's rows by prompt (`rows_of`: token ids -> rows): in a tool turn, a row extending a kept row
        continues its state (`extend(state, tokens)`: a continuation of `state` holding `tokens`, at least
        `continuation_tokens` of them; fewer are fed on top of it); any other row is captured
        (`capture(index, rows, prompt_ids)`). Spans of `shared_span_tokens` or more that rows extending one kept row
        added alike are captured once (None: not looked for). In a tool turn, this turn's rows are kept for the next
        (the states they continue stay alive through them); the others are released."""
        extending: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for ids in rows_of if self.in_tool_loop else ():
            if (earlier := self._extended_row(ids)) is not None:
                extending.setdefault(earlier, []).append(ids)
        continued: dict[tuple[int, ...], PromptRows] = {}
        for earlier, extended in extending.items():
            kept = self._states[earlier]
            continued.update(
                self._continue(kept, extended, rows_of, extend, device, shared_span_tokens, continuation_tokens)
            )
        prompt_rows = []
        for ids, rows in rows_of.items():
            if ids in continued:
                prompt_rows.append(continued[ids])
                continue
            prompt_ids = torch.tensor(ids, device=device)
            prompt_rows.append(PromptRows(rows, prompt_ids, capture(len(prompt_rows), rows, prompt_ids)))
        if self.in_tool_loop:
            self.keep(dict(zip(rows_of, prompt_rows, strict=True)))
        return prompt_rows

    def _continue(self, kept: PromptRows, rows, rows_of, extend, device, shared_span_tokens, fewest) -> dict:
        """The `PromptRows` of `rows` (token ids, each extending `kept`; `rows_of` gives their batch rows), each
        continuing `kept`'s state with `extend` where it added `fewest` tokens or more."""
        held = len(kept.prompt_ids) - 1  # the kept row's state holds its tokens but the last
        added = [list(ids[held:-1]) for ids in rows]  # the kept row's last token on, but the row's last
        continued = {}

        def walk(parent: PromptState, start: int, members, nodes: list[PrefixNode]) -> None:
            below = set()
            for node in nodes:
                span = extend(parent, torch.tensor(added[node.members[0]][node.start : node.end], device=device))
                walk(span, node.end, node.members, node.children)
                below.update(node.members)
            for member in members:
                if member not in below:
                    ids, own = rows[member], added[member][start:]
                    if len(own) >= fewest:
                        state = extend(parent, torch.tensor(own, device=device))
                        continued[ids] = PromptRows(rows_of[ids], torch.tensor(ids, device=device), state)
                        continue
                    # too few to continue `parent` with (which holds the row's tokens before `own`): fed on top of it
                    held_here = len(ids) - len(own)
                    fed = torch.tensor(ids[held_here:], device=device) if own else None
                    prompt_ids = torch.tensor(ids[:held_here], device=device)
                    continued[ids] = PromptRows(rows_of[ids], prompt_ids, parent, fed)

        tree = []
        if shared_span_tokens is not None:
            tree = prefix_tree(added, max(shared_span_tokens, fewest), own_tokens=fewest)
        walk(kept.state, 0, range(len(rows)), tree)
        return continued

    def keep(self, states: dict[tuple[int, ...], PromptRows]) -> None:
        """Keep a turn's rows (by their token ids) for the tool loop's next turn."""
        self._states = states

    def release(self) -> None:
        self._states = None

    def _extended_row(self, ids: tuple[int, ...]) -> tuple[int, ...] | None:
        """The kept row that a tool turn's row `ids` extends (the longest, if one kept row starts another), or
        None."""
        extended = [kept for kept in self._states if len(ids) > len(kept) and ids[: len(kept)] == kept]
        return max(extended, key=len) if extended else None


def decode(
    engine: LongStrawEngine,
    model: nn.Module,
    prompts: list[PromptRows],
    padded_prompts: torch.Tensor,
    sampling: Sampling,
    step_logits: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode every row of `prompts` in lockstep; returns the generated tokens `[batch, steps]` (pad after a row
    stopped), as `generate` returns them after the prompt.

    `padded_prompts [batch, width]` is the batch as `generate` would get it (left-padded): the logits processors read
    it (e.g. the repetition penalty, which `prepare_sampling` told where each row's padding ends). `step_logits`, if
    given, receives each step's raw `[batch, vocab]` logits.
    """
    batch = padded_prompts.shape[0]
    device = padded_prompts.device
    capacity = sampling.config.max_length - padded_prompts.shape[1]
    inputs = [_first_input(p).to(device).expand(len(p.rows), -1) for p in prompts]
    suffixes = [
        Suffix(len(p.rows), capacity + first.shape[1] - 1, p.state.start_position + p.state.num_tokens)
        for p, first in zip(prompts, inputs, strict=True)
    ]
    row_index = [torch.tensor(p.rows, device=device) for p in prompts]
    input_ids = padded_prompts
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    while True:
        logits = None
        for prompt, suffix, rows, tokens in zip(prompts, suffixes, row_index, inputs, strict=True):
            group_logits = engine.decode(model, prompt.state, suffix, tokens).to(device)
            if logits is None:
                logits = group_logits.new_empty(batch, group_logits.shape[-1])
            logits[rows] = group_logits
        if step_logits is not None:
            step_logits.append(logits.clone())
        scores = sampling.logits_processor(input_ids, logits)
        if sampling.do_sample:
            next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        next_tokens = engine.distribution.agree(next_tokens)
        if sampling.stops_at_eos:
            next_tokens = next_tokens * unfinished + sampling.pad_token_id * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished = engine.distribution.agree(
            unfinished & ~sampling.stopping_criteria(input_ids, ())
        )  # (max_time: per rank)
        if int(unfinished.max()) == 0:
            break
        inputs = [next_tokens[rows, None] for rows in row_index]
    return input_ids[:, padded_prompts.shape[1] :]


def _first_input(prompt: PromptRows) -> torch.Tensor:
    """The tokens of a row's first rollout forward: the prompt's last token (the state holds the others), then the
    continuation, if any."""
    last = prompt.prompt_ids[-1:]
    return last[None] if prompt.continuation is None else torch.cat([last, prompt.continuation.to(last.device)])[None]
