"""What the trainer learns by running the prepared model on a few tokens at construction, before any training.

Two questions that neither the config nor the modules answer:

- **How does the model's own forward number a left-padded row's positions?** Stock GRPO scores a left-padded batch
  without `position_ids`, so the model's own rule decides where a prompt's first real token sits. Nearly every
  decoder numbers positions by index in the padded row (transformers' `cache_position`); a few count the real tokens
  of the attention mask (OPT, BioGPT). LongStraw captures a prompt without its padding and must give its tokens the
  positions stock's forward gives them (`positions_follow_mask`).
- **Does every layer reach the prompt state, once per forward?** A decoder layer that does not hand the forward's
  attention kwargs to its attention (StableLM's) never reaches it; an attention that calls the attention function
  twice (DiffLlama's differential attention) reaches it twice. Both are found by a capture of a few tokens
  (`check_reaches_prompt_state`) and refused at construction, naming the layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .engine import LongStrawEngine
from .state import UnpreparedModelError, UnsupportedModelError
from .state.registry import text_config

PROBE_TOKENS = 3  # real tokens of the probes' row
PROBE_PADDING = 2  # left padding of the positions probe's row


@contextlib.contextmanager
def _training_mode(model: nn.Module) -> Iterator[None]:
    """The probes run as the update does, in training mode (the trainer has checked that no dropout is active), then
    the model's mode is restored. Not in eval mode: bitsandbytes repacks NF4 weights for inference at the first
    eval-mode forward on a CPU with AVX512-BF16, and its repacked matmul has no backward."""
    training = model.training
    model.train()
    try:
        yield
    finally:
        model.train(training)


def _probe_tokens(model: nn.Module) -> torch.Tensor:
    vocab_size = text_config(model.config).vocab_size
    device = next(model.parameters()).device
    return (torch.arange(PROBE_TOKENS, device=device) * 7 + 3) % vocab_size


@torch.no_grad()
def positions_follow_mask(model: nn.Module) -> bool:
    """Whether `model`'s own forward numbers a left-padded row's positions by counting its real tokens (from the
    attention mask) rather than by index in the padded row.

    The model's own forward (no prompt state) runs once on a left-padded row without `position_ids`, as stock GRPO
    runs it, and twice on the row's real tokens, numbered either way. The count is chosen only when it matches and the
    index clearly does not: with relative positions (RoPE) both match and the padded index, what stock's
    `cache_position` gives, is kept."""
    tokens = _probe_tokens(model)[None]
    padding = torch.zeros((1, PROBE_PADDING), dtype=tokens.dtype, device=tokens.device)
    mask = torch.cat([torch.zeros_like(padding), torch.ones_like(tokens)], dim=1)
    positions = torch.arange(PROBE_TOKENS, device=tokens.device)[None]
    with _training_mode(model):
        stock = model(input_ids=torch.cat([padding, tokens], dim=1), attention_mask=mask, use_cache=False)
        by_index = model(input_ids=tokens, position_ids=positions + PROBE_PADDING, use_cache=False)
        by_count = model(input_ids=tokens, position_ids=positions, use_cache=False)
    want = stock.logits[0, PROBE_PADDING:].float()
    index_error = (by_index.logits[0].float() - want).abs().max().item()
    count_error = (by_count.logits[0].float() - want).abs().max().item()
    return index_error > 1e-3 * (1.0 + want.abs().max().item()) and count_error < index_error / 10


def check_reaches_prompt_state(model: nn.Module) -> None:
    """Capture a few tokens with the prepared `model` (no collectives, no autograd): every layer must write its prompt
    state once. Raises `UnsupportedModelError` naming the layer otherwise."""
    engine = LongStrawEngine(prefill_chunk_size=PROBE_TOKENS, attention_chunk_size=PROBE_TOKENS)
    try:
        with _training_mode(model):
            engine.capture(model, _probe_tokens(model), first_position=0)
    except UnpreparedModelError as error:
        raise UnsupportedModelError(
            f"{', '.join(error.layers)}: a capture of {PROBE_TOKENS} tokens at construction left no prompt state "
            "there, so scoring would ignore the prompt. The decoder layer must hand the forward's attention kwargs to "
            "its attention (StableLM's decoder layer drops them), and the attention must call transformers' "
            "AttentionInterface and Cache API. Train this model with GRPOTrainer."
        ) from error
