"""The rank protocol's version: ranks running different code raise together instead of hanging.

The ranks of a CP group meet in the same collectives in the same order (each capture or recompute step's all-gathers
and all-to-alls, `step.py`; the recurrent hand-offs; the replays' merges). Ranks running different versions of
trl_longstraw would meet in mismatched collectives and hang or read garbage, so before a group's first capture
`check_protocol` compares every rank's `protocol_signature()` (a digest of `PROTOCOL_VERSION` and of the fields of a
step call, `step.StepCall`) and every rank raises `ContextParallelError` together where they differ.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.distributed as dist

from .communication import ContextParallelGroup
from .sharding import ContextParallelError
from .step import StepCall

# Bump when the collectives of a step, a hand-off or a merge change without StepCall's fields changing.
PROTOCOL_VERSION = 3


def protocol_signature(call: type = StepCall) -> int:
    """A 48-bit digest (exact in int64) of `PROTOCOL_VERSION` and `call`'s fields' names and types, in order."""
    fields = ",".join(f"{field.name}:{field.type}" for field in dataclasses.fields(call))
    digest = hashlib.sha256(f"{PROTOCOL_VERSION};{fields}".encode()).digest()
    return int.from_bytes(digest[:6], "little")


def check_protocol(cp: ContextParallelGroup, signature: int | None = None) -> None:
    """Every rank of `cp` must run the same protocol: their signatures (this rank's `signature`, by default
    `protocol_signature()`) are compared (one all-reduce of the minimum and one of the maximum), and every rank raises
    together where they differ."""
    mine = torch.tensor([protocol_signature() if signature is None else signature], dtype=torch.int64)
    low = cp.all_reduce(mine.clone(), op=dist.ReduceOp.MIN, kind="protocol")
    high = cp.all_reduce(mine.clone(), op=dist.ReduceOp.MAX, kind="protocol")
    if int(low) != int(high):
        raise ContextParallelError(
            f"The ranks of a context-parallel group (size {cp.size}) run different versions of trl_longstraw's rank "
            f"protocol (this rank's signature {int(mine)}, the group's range {int(low)}..{int(high)}): install "
            "the same trl_longstraw on every node."
        )
