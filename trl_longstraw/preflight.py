"""What the trainer learns by running the prepared model on a few tokens at construction, before any training.

Two questions that neither the config nor the modules answer:

- **How does the model's own forward number a left-padded row's positions?** Stock GRPO scores a left-padded batch
  without `position_ids`, so the model's own rule decides where a prompt's first real token sits. Nearly every
  decoder numbers positions by index in the padded row (transformers' `cache_position`); a few count the real tokens
  of the attention mask (OPT, BioGPT). LongStraw captures a prompt without its padding and must give its tokens the
  positions stock's forward gives them (`positions_follow_mask`).
- **Does every layer reach the prompt state, once per forward?** A decoder layer that does not hand the forward's
  attention kwargs to its attention (StableLM's) never reaches it; an attention that calls the attention function
  twice (DiffLlama's differential attention) reaches it twice. Both are found by a capture of a few tokens and
  refused at construction, naming the layer.
- **Do the log-probs scored from that capture equal the model's own forward?** Ladder level 2 on a few tokens: a
  model whose layers compute something LongStraw does not reproduce (positions counted from the cache's length
  instead of `position_ids`, as BART-family decoders count them) is refused at construction instead of training on
  wrong log-probs. One capture answers both (`check_capture_matches_own_forward`).
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
PROBE_COMPLETION = 3  # completion tokens the scores probe scores
# Largest |log-prob difference| the scores probe accepts: rounding of the model's dtype (fp32 agrees to ~1e-6).
SCORE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3, torch.bfloat16: 1e-1, torch.float16: 5e-2}


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


def _probe_tokens(model: nn.Module, count: int = PROBE_TOKENS) -> torch.Tensor:
    vocab_size = text_config(model.config).vocab_size
    device = next(model.parameters()).device
    return (torch.arange(count, device=device) * 7 + 3) % vocab_size


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


@torch.no_grad()
def check_capture_matches_own_forward(model: nn.Module) -> None:
    """Ladder level 2 on a few tokens, with the prepared `model` (no collectives): a capture (in one-token chunks, so
    that later chunks and the completion continue after earlier ones) must write every layer's prompt state once, and
    the completion log-probs scored from it must equal those of the model's own forward of the whole sequence (TRL's
    fused LM head on both sides). Raises `UnsupportedModelError` naming the layer or the difference otherwise. The
    model must carry TRL's fused LM head (`add_fused_lm_head`, as GRPOTrainer adds it)."""
    ids = _probe_tokens(model, PROBE_TOKENS + PROBE_COMPLETION)
    prompt, completion = ids[:PROBE_TOKENS], ids[PROBE_TOKENS:]
    engine = LongStrawEngine(prefill_chunk_size=1, attention_chunk_size=PROBE_TOKENS)
    with _training_mode(model):
        labels = ids[None].clone()
        labels[:, :PROBE_TOKENS] = -100
        try:
            own = model(input_ids=ids[None], labels=labels, fused_lm_head=True, use_cache=False).log_probs[
                0, -len(completion) :
            ]
        except Exception as error:  # any failure of the model's own forward: re-raised, named
            raise UnsupportedModelError(
                f"{type(model).__name__}: its own forward, as GRPOTrainer runs it (TRL's fused LM head), fails on "
                f"{len(ids)} tokens ({type(error).__name__}: {error}), so GRPOTrainer cannot train it either. Train "
                "its full model class, or one whose forward TRL's fused LM head supports."
            ) from error
        try:
            state = engine.capture(model, prompt, first_position=0)
        except UnpreparedModelError as error:
            raise UnsupportedModelError(
                f"{', '.join(error.layers)}: a capture of {PROBE_TOKENS} tokens at construction did not reach the "
                "prompt state there as its state kind expects, so scoring would ignore the prompt. The decoder layer "
                "must hand the forward's attention kwargs to its attention (StableLM's decoder layer drops them), and "
                "the mixer must call transformers' AttentionInterface and Cache API as its kind expects. Train this "
                "model with GRPOTrainer."
            ) from error
        lengths = torch.tensor([len(completion)])
        scored, _ = engine.score(model, state, prompt[-1:], completion[None], lengths, batch_size=1)
    difference = (scored[0].float() - own.float()).abs().max().item()
    dtype = next(model.parameters()).dtype
    tolerance = SCORE_TOLERANCE.get(dtype, SCORE_TOLERANCE[torch.bfloat16])
    if not difference <= tolerance:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the log-probs LongStraw scores from a captured prompt differ from the model's "
            f"own forward by {difference:.3g} (tolerance {tolerance:g} in {dtype}) on {PROBE_TOKENS} prompt and "
            f"{PROBE_COMPLETION} completion tokens: its layers compute something LongStraw does not reproduce (e.g. "
            "positions counted from the cache's length instead of position_ids, as BART-family decoders count them). "
            "Train this model with GRPOTrainer."
        )
