"""Data parallelism for the serial replay: one gradient all-reduce per optimizer step, as DDP would do.

The replay calls `backward()` once per member (and once per group's prompt in exact mode) on the unwrapped model,
which DDP's reducer cannot follow (it expects one backward per wrapped forward). So LongStraw skips the wrapper and
averages the accumulated gradients across ranks itself, once, on the micro-step that closes the accumulation window:
every rank ends the step with the gradient DDP would have given it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .faults import collective


def average_gradients(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None = None, shares: int = 1) -> None:
    """All-reduce the gradients of `params` across `group` into their mean over the data-parallel ranks, in one flat
    buffer per dtype. `shares`: how many ranks each data-parallel gradient is split over (a context-parallel group's
    ranks each hold the part of their members and chunks): the sum is divided by `world / shares`.

    `params` must be the same list, in the same order, on every rank; a parameter without a gradient gets zeros.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param in params:
        by_dtype.setdefault(param.grad.dtype, []).append(param)
    for same_dtype in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in same_dtype])
        with collective("gradient all-reduce", group):
            dist.all_reduce(flat, group=group)
        flat.div_(world_size // shares)
        offset = 0
        for param in same_dtype:
            count = param.grad.numel()
            param.grad.copy_(flat[offset : offset + count].view_as(param.grad))
            offset += count
