"""The rank protocol: what the owner of a shard announces to the ranks that serve it, as one fixed-size tensor.

In a capture or an exact-mode recompute, the owner of the current shard announces every call whose work the other
ranks share (an attention call, the backward of a recompute attention call, a DSA indexer call) and the end of its
shard; the serving ranks decode each announcement and enter the matching collectives (`ShardedPromptState.serve`).
An [`Announcement`] has one `encode` and one `decode`, and both ends check the protocol: `check_protocol` compares
every rank's `Announcement.signature()` (its fields' names and types, and `PROTOCOL_VERSION`) before a group's first
capture, so ranks running different code raise `ContextParallelError` together instead of hanging in mismatched
collectives, and `decode` refuses a tensor that another signature encoded.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .communication import DTYPES, ContextParallelGroup
from .sharding import ContextParallelError

# Bump when the meaning of a field changes without its name or type changing.
PROTOCOL_VERSION = 1


class Phase(enum.IntEnum):
    """What an announcement announces."""

    END_OF_SHARD = 0  # the owner's shard is done: the serving ranks return
    CAPTURE = 1  # a capture's attention call: its queries follow; nothing is kept after the merge
    RECOMPUTE = 2  # a recompute's attention call: its queries follow; kept (with the merge) until its backward
    BACKWARD = 3  # the backward of the layer's last recompute attention call: the output's gradient follows
    INDEXER = 4  # a DSA indexer call: its inputs follow (hidden states, query residual, cos, sin)


@dataclass(frozen=True)
class Announcement:
    """One announcement of the owner of a shard. The fields after `layer_idx` describe an attention call."""

    phase: Phase
    layer_idx: int = -1
    query_shape: tuple[int, int, int, int] = (0, 0, 0, 0)  # [batch, heads, tokens, d] of the queries that follow
    value_dim: int = 0
    first_position: int = 0  # absolute position of the first query
    scaling: float = 0.0
    sliding_window: int | None = None
    softcap: float | None = None
    dtype: torch.dtype = torch.float32  # of the queries
    has_sinks: bool = False  # the owner counts attention sinks (the serving ranks' share of their gradient is zero)
    selects: bool = False  # a DSA selection restricts the keys: the serving ranks apply their last merged one
    top_k: int = 0  # INDEXER: the k of the selection

    WIRE_SIZE = 16  # signature + the encoded fields (query_shape takes 4)

    @classmethod
    def signature(cls) -> int:
        """A 48-bit digest (exact in float64) of `PROTOCOL_VERSION` and the fields' names and types, in order."""
        fields = ",".join(f"{field.name}:{field.type}" for field in dataclasses.fields(cls))
        digest = hashlib.sha256(f"{PROTOCOL_VERSION};{cls.WIRE_SIZE};{fields}".encode()).digest()
        return int.from_bytes(digest[:6], "little")

    def encode(self, device: torch.device) -> torch.Tensor:
        """`[WIRE_SIZE]` float64: the signature, then the fields (None as NaN, the dtype as its index in `DTYPES`)."""
        values = [
            self.signature(),
            int(self.phase),
            self.layer_idx,
            *self.query_shape,
            self.value_dim,
            self.first_position,
            self.scaling,
            math.nan if self.sliding_window is None else self.sliding_window,
            math.nan if self.softcap is None else self.softcap,
            DTYPES.index(self.dtype),
            self.has_sinks,
            self.selects,
            self.top_k,
        ]
        return torch.tensor(values, dtype=torch.float64, device=device)

    @classmethod
    def decode(cls, wire: torch.Tensor) -> Announcement:
        """The announcement `encode` wrote; `ContextParallelError` if another protocol wrote it."""
        values = wire.tolist()
        if len(values) != cls.WIRE_SIZE or int(values[0]) != cls.signature():
            raise ContextParallelError(
                "A context-parallel announcement was encoded by another version of trl_longstraw's rank protocol "
                f"(signature {int(values[0]) if values else None}, expected {cls.signature()}): every rank must run "
                "the same trl_longstraw."
            )
        _, phase, layer_idx, batch, heads, tokens, dim, value_dim, first, scaling, window, softcap, *rest = values
        dtype, has_sinks, selects, top_k = rest
        return cls(
            Phase(int(phase)),
            int(layer_idx),
            (int(batch), int(heads), int(tokens), int(dim)),
            int(value_dim),
            int(first),
            scaling,
            None if math.isnan(window) else int(window),
            None if math.isnan(softcap) else softcap,
            DTYPES[int(dtype)],
            bool(has_sinks),
            bool(selects),
            int(top_k),
        )

    @classmethod
    def receive(cls, cp: ContextParallelGroup, owner: int) -> Announcement:
        """The next announcement of `owner` (a serving rank's side of `send`)."""
        wire = torch.zeros(cls.WIRE_SIZE, dtype=torch.float64, device=cp.device)
        return cls.decode(cp.broadcast(wire, owner, kind="capture"))

    def send(self, cp: ContextParallelGroup) -> None:
        """Announce this to every rank of the group (this rank owns the shard)."""
        cp.broadcast(self.encode(cp.device), cp.rank, kind="capture")


def check_protocol(cp: ContextParallelGroup, announcement: type[Announcement] = Announcement) -> None:
    """Every rank of `cp` must encode announcements alike: their signatures are compared (one all-reduce of the
    minimum and one of the maximum), and every rank raises together where they differ."""
    signature = torch.tensor([announcement.signature()], dtype=torch.int64)
    low = cp.all_reduce(signature.clone(), op=dist.ReduceOp.MIN, kind="protocol")
    high = cp.all_reduce(signature.clone(), op=dist.ReduceOp.MAX, kind="protocol")
    if int(low) != int(high):
        raise ContextParallelError(
            f"The ranks of a context-parallel group (size {cp.size}) run different versions of trl_longstraw's rank "
            f"protocol (this rank's signature {int(signature)}, the group's range {int(low)}..{int(high)}): install "
            "the same trl_longstraw on every node."
        )
