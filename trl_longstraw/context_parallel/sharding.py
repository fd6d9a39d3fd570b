"""Sharding arithmetic: which captured tokens each rank of a CP group holds, and what that costs each rank.

The captured tokens are cut into `steps x cp` chunks of about `prefill_chunk_size` tokens (sizes differing by at most
one, so that every rank gets one chunk per step), and step s's chunks are dealt to the ranks in order on even steps and
in reverse order on odd ones (zigzag): rank r holds chunk `s cp + r` (s even) or `s cp + cp - 1 - r` (s odd). Why:

- The capture runs step by step with every rank capturing its chunk of the step at once (`ContextParallel`):
  a chunk reads only earlier chunks, which are either earlier steps' (pages, on every rank alike) or the step's own
  earlier chunks, so all ranks of a group work at the same time, layer by layer.
- Every rank holds one chunk per step, so the pages every step's queries read are spread evenly: each rank computes
  `1/cp` of the capture's (query, key) pairs over pages. Within a step the work of a later chunk's queries over an
  earlier chunk is split in two halves, one on each of the two chunks' ranks (`step.py`), so every rank does the same
  work in every step (`capture_attention_pairs`).
- Recurrent states pass from chunk to chunk: within a step from rank to rank (GatedDeltaNet by state passing: every
  rank runs the layer at once and adds its starting state's share when it arrives; Mamba2 as a wavefront: rank r runs
  the layer once the rank before it has), and across a step boundary on the same rank (zigzag: the last chunk of a
  step and the first of the next have the same owner).
- After the capture, every replayed and scored query reads every rank's pages, so replays stay balanced.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property

import torch


class ContextParallelError(ValueError):
    """A context-parallel setup that cannot work (the message names the fix)."""


@dataclass(frozen=True)
class ShardLayout:
    """The chunks of `num_tokens` captured tokens (`bounds`, in prompt order) and the rank of `size` that holds each."""

    num_tokens: int
    size: int
    bounds: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, num_tokens: int, size: int, chunk_size: int, min_tokens: int = 1) -> ShardLayout:
        """`steps x size` chunks of at most about `chunk_size` tokens (at least `min_tokens` each: `num_tokens >=
        size * min_tokens`)."""
        steps = max(1, min(-(-num_tokens // (size * chunk_size)), num_tokens // (size * min_tokens)))
        count = steps * size
        return cls(
            num_tokens, size, tuple((c * num_tokens // count, (c + 1) * num_tokens // count) for c in range(count))
        )

    @property
    def steps(self) -> int:
        return len(self.bounds) // self.size

    def owner(self, chunk: int) -> int:
        """The rank that holds (and captures) `chunk`."""
        step, place = divmod(chunk, self.size)
        return place if step % 2 == 0 else self.size - 1 - place

    def chunk_of(self, rank: int, step: int) -> int:
        """The chunk `rank` holds in `step`."""
        return step * self.size + (rank if step % 2 == 0 else self.size - 1 - rank)

    def chunks(self, rank: int) -> list[int]:
        """`rank`'s chunks, in prompt order (one per step)."""
        return [self.chunk_of(rank, step) for step in range(self.steps)]

    def step_chunks(self, step: int) -> list[int]:
        """The chunk each rank captures in `step`, by rank."""
        return [self.chunk_of(rank, step) for rank in range(self.size)]

    def chunk_at(self, start: int) -> int:
        """The chunk that starts at captured-token index `start`."""
        chunk = bisect.bisect_left(self._starts, start)
        if chunk == len(self.bounds) or self._starts[chunk] != start:
            raise ValueError(f"No chunk of this layout starts at token {start}.")
        return chunk

    @cached_property
    def _starts(self) -> list[int]:
        return [start for start, _ in self.bounds]

    def held(self, rank: int) -> list[tuple[int, int]]:
        """The captured-token ranges `rank` holds, in prompt order."""
        return [self.bounds[chunk] for chunk in self.chunks(rank)]

    def held_tokens(self, rank: int) -> int:
        return sum(end - start for start, end in self.held(rank))

    def held_before(self, rank: int, index: int) -> int:
        """How many of the captured tokens before index `index` `rank` holds (its local entry count there)."""
        return sum(max(0, min(end, index) - start) for start, end in self.held(rank))

    def global_indices(self, rank: int, first: int, end: int) -> torch.Tensor:
        """Captured-token indices of `rank`'s local entries `first .. end - 1` (host)."""
        if rank not in self._held_indices:
            self._held_indices[rank] = torch.cat([torch.arange(start, stop) for start, stop in self.held(rank)])
        return self._held_indices[rank][first:end]

    @cached_property
    def _held_indices(self) -> dict[int, torch.Tensor]:
        return {}

    def local_indices(self, rank: int, indices: torch.Tensor) -> torch.Tensor:
        """`indices` (captured-token indices, any shape) as `rank`'s local entry indices; -1 where another rank holds
        the token (or the index is none of the prompt's)."""
        held = self.held(rank)
        bounds = torch.tensor([[start, end] for start, end in held]).to(indices.device)  # built on the host, one copy
        starts, ends = bounds[:, 0].contiguous(), bounds[:, 1].contiguous()
        before = torch.cat([torch.zeros_like(starts[:1]), (ends - starts)[:-1]]).cumsum(0)
        which = (torch.searchsorted(starts, indices, right=True) - 1).clamp(min=0)
        inside = (indices >= starts[which]) & (indices < ends[which])
        return torch.where(inside, before[which] + indices - starts[which], torch.full_like(indices, -1))

    def next_query(self, end: int) -> int:
        """The first captured-token index any query may have once the chunk ending at `end` is captured: the start of
        the next step (the chunks of a step attend to each other before any of them is kept)."""
        chunk = bisect.bisect_left([stop for _, stop in self.bounds], end)
        step_end = (chunk // self.size + 1) * self.size
        return self.num_tokens if step_end >= len(self.bounds) else self.bounds[step_end][0]


def check_prompt_length(prompt_tokens: int, size: int) -> None:
    """Every rank of a CP group needs at least one captured token (all but the last prompt token are captured)."""
    if prompt_tokens - 1 < size:
        raise ContextParallelError(
            f"A prompt of {prompt_tokens} tokens captures {prompt_tokens - 1} (all but the last), fewer than the "
            f"{size} ranks of context_parallel_size={size}: every rank needs at least one token of the prompt. "
            "Lower context_parallel_size or filter out shorter prompts."
        )


def capture_attention_pairs(layout: ShardLayout) -> list[int]:
    """Causal (query, key) pairs of the capture each rank computes (`step.py`): every query over its pages, its own
    chunk's queries over its own chunk, and of a later chunk of the step the first half of the queries over its chunk
    (the later chunk's rank takes the second half): the capture's attention work per rank."""
    pairs = [0] * layout.size
    for step in range(layout.steps):
        chunks = sorted(layout.step_chunks(step))  # in prompt order
        step_start, step_end = layout.bounds[chunks[0]][0], layout.bounds[chunks[-1]][1]
        for place, chunk in enumerate(chunks):
            rank = layout.owner(chunk)
            start, end = layout.bounds[chunk]
            length = end - start
            pairs[rank] += length * (length + 1) // 2  # its own queries over its own chunk, causal
            pairs[rank] += layout.held_before(rank, step_start) * (step_end - step_start)  # the step's over its pages
            for later in chunks[place + 1 :]:
                queries = layout.bounds[later][1] - layout.bounds[later][0]
                pairs[rank] += queries // 2 * length  # the first half of the later chunk's queries, here
                pairs[layout.owner(later)] += (queries - queries // 2) * length  # the second half, there
    return pairs
