"""How a run's processes divide the work: built once at trainer construction, asked everywhere.

torchtitan's `ParallelDims` is the model: one object holds the sizes and the process groups, and nothing else keeps
its own copy. Here: context parallelism (the ranks of a CP group share one prompt's state: `context_parallel/`), data
parallelism (the CP groups, each with rows of its own), and FSDP2's weight sharding (`fsdp.py`), whose mesh spans
every rank (1D, or 2D replicas x shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch import nn

from .context_parallel import ContextParallelGroup, build_context_parallel_group
from .fsdp import is_sharded, shard_count, sharded_mesh_group


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the run.

    Args:
        context_parallel: ranks per CP group, sharing one prompt's state (1: none).
        weight_shards: ranks each parameter is sharded over by FSDP2 (1: every rank holds the whole weights).
        cp_group: this rank's CP group (None without context parallelism).
        shard_group: the process group whose passes FSDP2 keeps in step (None without sharded weights).
    """

    context_parallel: int = 1
    weight_shards: int = 1
    cp_group: ContextParallelGroup | None = None
    shard_group: dist.ProcessGroup | None = None

    @classmethod
    def build(
        cls, context_parallel_size: int, causal_lm: nn.Module, timeout: timedelta | None = None
    ) -> ParallelLayout:
        """The layout of a launch with `context_parallel_size` ranks per CP group (their groups built, every rank
        creating every group, with `timeout`) for `causal_lm` as sharded (or not) by `fsdp.parallelize`."""
        return cls(
            context_parallel=context_parallel_size,
            weight_shards=shard_count(causal_lm),
            cp_group=build_context_parallel_group(context_parallel_size, timeout)
            if context_parallel_size > 1
            else None,
            shard_group=sharded_mesh_group(causal_lm) if is_sharded(causal_lm) else None,
        )
