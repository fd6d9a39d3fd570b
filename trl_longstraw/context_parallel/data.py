"""The trainer's data side of context parallelism: the ranks of a CP group train on the same rows, in lockstep.

Every rank of a group generates and trains on its first rank's rows (`share_leader_inputs`, `SharedRowsSampler`),
refuses rows or rewards that differ across the group before they could desynchronise its collectives
(`check_same_rows`, `check_same_rewards`), and counts the group's rows once in gathered statistics (`leader_rows`).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from .communication import ContextParallelGroup
from .sharding import ContextParallelError


def check_same_rows(prompt_ids: list[list[int]], cp: ContextParallelGroup) -> None:
    """The ranks of a CP group decode the same rows in lockstep, so the rows they generate from must be the same. A
    tool-calling turn's rows carry tool results each rank computed itself: a tool or environment whose results are
    not deterministic makes them differ, which is refused here (on every rank alike) instead of hanging in mismatched
    collectives."""
    digest = hashlib.sha256(repr(prompt_ids).encode()).digest()
    value = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64)
    low = cp.all_reduce(value.clone(), op=dist.ReduceOp.MIN, kind="rollout")
    high = cp.all_reduce(value.clone(), op=dist.ReduceOp.MAX, kind="rollout")
    if int(low) != int(high):
        raise ContextParallelError(
            f"The ranks of a context-parallel group (size {cp.size}) reached a tool-calling turn with different "
            "histories: a tool or environment returned different results on different ranks (each rank runs the "
            "tools). Make the tools deterministic given their arguments (seed any randomness from them), or set "
            "context_parallel_size=1."
        )


def check_same_rewards(rewards: torch.Tensor, cp: ContextParallelGroup, rows: int) -> None:
    """GRPOTrainer gathers the rewards of every rank, `[world * rows, reward functions]`: a CP group's ranks scored the
    same rows, so their copies must agree. A reward that is not deterministic (a sampled judge, the clock) would give
    each rank other advantages, and a rank skipping a flat-reward group would leave the others in its collectives.
    Checked on the gathered tensor every rank holds, so every rank refuses alike."""
    copies = rewards.view(-1, cp.size, rows, rewards.shape[-1])
    first = copies[:, :1]
    same = (copies == first) | (torch.isnan(copies) & torch.isnan(first))
    if not bool(same.all()):
        raise ContextParallelError(
            f"The ranks of a context-parallel group (size {cp.size}) scored the same completions with different "
            "rewards: a reward function returned different values on different ranks (each rank computes them). "
            "Make the reward functions deterministic given their inputs (seed any randomness from them), or set "
            "context_parallel_size=1."
        )


def leader_rows(tensor: torch.Tensor, cp: ContextParallelGroup) -> torch.Tensor:
    """This rank's `tensor` where it is its CP group's first rank, else none of it: what a statistic gathered over
    every rank should count once per CP group (the group's ranks hold the same rows)."""
    return tensor if cp.rank == 0 else tensor[:0]


def share_leader_inputs(inputs, cp: ContextParallelGroup):
    """Every rank of a CP group generates and trains on its first rank's rows, from its random state: the group then
    samples the same completions and computes the same loss, so its ranks replay the same members in lockstep. With
    `SharedRowsSampler` the rows are already the same (this then only aligns the random state); without it (iterable
    datasets) the other ranks' own rows of the step are drawn and not used."""
    payload = [inputs, torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None]
    with cp.guarded("broadcast of the leader's rows"):
        dist.broadcast_object_list(payload, group=cp.group, group_src=0)
    torch.set_rng_state(payload[1])
    if payload[2] is not None:
        torch.cuda.set_rng_state(payload[2])
    return payload[0]


class SharedRowsSampler(torch.utils.data.Sampler):
    """TRL's `RepeatSampler` for `world / cp` data-parallel ranks, each block of `rows_per_rank` rows repeated `cp`
    times in a row: the dataloader deals consecutive blocks to consecutive ranks, so the ranks of a CP group (which
    are consecutive) all draw the same rows, and a step consumes the rows a data-parallel run of `world / cp` ranks
    would (no rank's rows are drawn and dropped)."""

    def __init__(self, sampler, rows_per_rank: int, copies: int):
        # The same sampler with `1 / copies` of its prompts per generation batch (its arguments are public fields).
        self.base = type(sampler)(
            sampler.data_source,
            sampler.mini_repeat_count,
            max(1, sampler.batch_size // copies),  # evaluation's sampler draws one prompt at a time
            sampler.repeat_count,
            sampler.shuffle,
            sampler.seed,
        )
        self.rows_per_rank, self.copies = rows_per_rank, copies

    def __iter__(self):
        block = []
        for index in self.base:
            block.append(index)
            if len(block) == self.rows_per_rank:
                for _ in range(self.copies):
                    yield from block
                block = []

    def __len__(self) -> int:
        return len(self.base) // self.rows_per_rank * self.rows_per_rank * self.copies
