"""Sharding arithmetic: which captured tokens each rank of a CP group holds, and what that costs each rank.

Contiguous shards, `shard r = [r N / cp, (r + 1) N / cp)` of the `N` captured tokens (sizes differ by at most one).
Why contiguous rather than zigzag: after capture, every replayed and scored query sits after the whole prompt and
reads every shard, so the replay's attention work (the phase repeated G times per capture) is balanced whatever the
layout, and contiguous shards hand the recurrent state on between neighbours only. The capture is causal, hence
imbalanced: rank r's keys are read by the queries of shards r..cp-1, so the capture's attention pairs on rank r are
proportional to `(cp - r - 1/2) / cp^2` of `N^2` (cp = 2: 3/8 vs 1/8 of `N^2`, a 3:1 ratio;
`capture_attention_pairs` computes it).
"""

from __future__ import annotations


class ContextParallelError(ValueError):
    """A context-parallel setup that cannot work (the message names the fix)."""


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
