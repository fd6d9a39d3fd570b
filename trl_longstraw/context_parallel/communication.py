"""The collectives of context parallelism: one CP group, the device its tensors travel on, what went through it.

Every collective goes through [`ContextParallelGroup`], which picks, once per group, the device its communication
tensors live on (`communication_device`: CUDA's current device for NCCL, the CPU for gloo and any other backend) and
moves a tensor there and back only where it is not there already. The math stays on the compute device; with NCCL and
the model on CUDA nothing is copied, with gloo and the model on CPU nothing is either. Verified on gloo (CPU) only:
the NCCL path is written for, not tested.

`COMMUNICATION` counts the elements sent through each kind of collective (benchmarks/context_parallel.py checks the
count against the formulas of `step.py`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..faults import collective
from .sharding import ContextParallelError

# Elements sent through each kind of collective by this process (reset it to measure a phase).
COMMUNICATION: Counter = Counter()
# dtypes a tensor header can name (p2p hand-offs, broadcasts of tensors the receiver allocates)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CPU = torch.device("cpu")


def communication_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the tensors of `group`'s collectives must live: NCCL takes CUDA tensors on this process's current
    device; gloo (and any other backend) CPU tensors. A process group that carries both (`"cpu:gloo,cuda:nccl"`)
    gets CUDA, where the model's tensors already are."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


@dataclass(frozen=True)
class ContextParallelGroup:
    """The ranks that share one prompt: `group` (None: the default group), this rank's index in it, its size, the
    device its communication tensors live on (`communication_device`, picked once by `of`), and the group's timeout
    (the Trainer's `ddp_timeout`, named where a collective fails).

    Every collective of context parallelism goes through these methods, which take and return tensors on any device:
    a tensor not on `device` is copied there for the collective (and the result copied back in place); the math that
    produced it stays on the compute device. A collective that fails (a peer raised, exited or stopped answering)
    raises `faults.RankFailure` naming the phase and what each peer reported."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    device: torch.device = _CPU
    timeout: timedelta | None = None

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None, timeout: timedelta | None = None) -> ContextParallelGroup:
        return cls(group, dist.get_rank(group), dist.get_world_size(group), communication_device(group), timeout)

    def guarded(self, kind: str):
        """A context for one collective of this group (`faults.collective`, with the group's timeout)."""
        return collective(kind, self.group, self.timeout)

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` itself if the backend can send it (on `device`, contiguous), else a copy that it can."""
        return tensor.to(self.device).contiguous()

    def _in_place(self, collective, tensor: torch.Tensor) -> torch.Tensor:
        wire = self._wire(tensor)
        collective(wire)
        if wire is not tensor:
            tensor.copy_(wire)
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, kind: str = "all_reduce") -> torch.Tensor:
        COMMUNICATION[kind] += tensor.numel()
        with self.guarded(kind):
            return self._in_place(lambda wire: dist.all_reduce(wire, op=op, group=self.group), tensor)

    def broadcast(self, tensor: torch.Tensor, source: int, kind: str = "broadcast") -> torch.Tensor:
        """`tensor` as `source` has it, on every rank; the source's own tensor is never written (it may be a view of
        an activation autograd saved: an in-place write through a wire copy would bump its version)."""
        COMMUNICATION[kind] += tensor.numel()
        with self.guarded(kind):
            if self.rank == source:
                dist.broadcast(self._wire(tensor), group=self.group, group_src=source)
                return tensor
            return self._in_place(lambda wire: dist.broadcast(wire, group=self.group, group_src=source), tensor)

    def all_gather(self, tensor: torch.Tensor, kind: str) -> list[torch.Tensor]:
        """Every rank's `tensor` (the same shape and dtype on every rank), by rank, on `tensor`'s device."""
        wire = self._wire(tensor)
        gathered = [torch.empty_like(wire) for _ in range(self.size)]
        COMMUNICATION[kind] += tensor.numel() * (self.size - 1)
        with self.guarded(kind):
            dist.all_gather(gathered, wire, group=self.group)
        return [piece.to(tensor.device) for piece in gathered]

    def all_to_all(self, tensors: list[torch.Tensor], kind: str) -> list[torch.Tensor]:
        """`tensors[r]` to rank r, and back what every rank sent this one, by rank (equal shapes and dtypes)."""
        wires = [self._wire(tensor) for tensor in tensors]
        received = [torch.empty_like(wire) for wire in wires]
        COMMUNICATION[kind] += sum(tensor.numel() for rank, tensor in enumerate(tensors) if rank != self.rank)
        with self.guarded(kind):
            dist.all_to_all(received, wires, group=self.group)
        return [piece.to(tensors[0].device) for piece in received]

    def send_async(self, tensor: torch.Tensor, destination: int) -> list:
        """A tensor of any shape and dtype to `destination` (header first: `receive` allocates from it), without
        waiting for the receiver: the requests, to wait on (the wire tensors are kept with them)."""
        header, wire = _header(tensor, self.device), self._wire(tensor.detach())
        COMMUNICATION["send"] += tensor.numel()
        with self.guarded("send"):
            requests = [dist.isend(piece, group=self.group, group_dst=destination) for piece in (header, wire)]
        return [(request, header, wire) for request in requests]

    def send_tagged(self, tensor: torch.Tensor, destination: int, tag: int) -> list:
        """A tensor whose shape and dtype the receiver knows to `destination`, without waiting, matched by `tag`
        (`receive_tagged`): the request and the wire tensor, to wait on."""
        wire = self._wire(tensor.detach())
        COMMUNICATION["send"] += tensor.numel()
        with self.guarded("send"):
            return [(dist.isend(wire, group=self.group, group_dst=destination, tag=tag), wire)]

    def wait(self, sending: list) -> None:
        """Wait until the sends of `send_async` or `send_tagged` (their requests) have gone out."""
        with self.guarded("send"):
            for request, *_ in sending:
                request.wait()

    def receive_tagged(self, like: torch.Tensor, source: int, tag: int) -> torch.Tensor:
        """What `send_tagged` sent with `tag`, into a tensor like `like` (on `like`'s device)."""
        wire = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        with self.guarded(f"receive from group rank {source}"):
            dist.recv(wire, group=self.group, group_src=source, tag=tag)
        return wire.to(like.device)

    def receive(self, source: int) -> torch.Tensor:
        """The tensor `send_async` sent, on `device` (the caller moves it where it is kept)."""
        header = torch.empty(8, dtype=torch.int64, device=self.device)
        with self.guarded(f"receive from group rank {source}"):
            dist.recv(header, group=self.group, group_src=source)
            tensor = _allocated(header, self.device)
            dist.recv(tensor, group=self.group, group_src=source)
        return tensor


def _header(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What a receiver needs to allocate `tensor` (up to 6 dimensions): its rank, dtype and shape."""
    header = torch.zeros(8, dtype=torch.int64)
    header[0], header[1] = tensor.dim(), DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    return header.to(device)


def _allocated(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An empty tensor as `_header` described it."""
    dims, dtype, *shape = header.tolist()
    return torch.empty(tuple(shape[:dims]), dtype=DTYPES[dtype], device=device)


def build_context_parallel_group(context_parallel_size: int, timeout: timedelta | None = None) -> ContextParallelGroup:
    """This rank's CP group on `torch.distributed`, `world = dp x cp`: consecutive ranks `[k cp, (k + 1) cp)` form CP
    group k (neighbours share a prompt: on a multi-GPU node they share the fastest links), as Accelerate orders its
    mesh (`cp` inner). Every rank creates every group, in the same order, as `new_group` requires. Gradients are
    averaged over the whole world, not over a DP group: that is the DP mean (a CP group's ranks hold the same
    gradient), and it keeps a CP group's ranks bitwise equal even where a non-deterministic kernel (CUDA's scatter-add
    in MoE routing, say) made their replays differ in the last bits, so their weights can never drift apart.

    `timeout`: how long a collective of the group waits for a silent peer (the trainer passes `ddp_timeout`); None
    gives torch's default for new groups (30 minutes on gloo), not the default group's."""
    size = context_parallel_size
    if not dist.is_available() or not dist.is_initialized():
        raise ContextParallelError(
            f"context_parallel_size={size} needs a distributed launch: run `accelerate launch --num_processes N` with "
            f"N a multiple of {size}, or set context_parallel_size=1."
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ContextParallelError(
            f"context_parallel_size={size} does not divide the {world} processes (world = data parallel x context "
            f"parallel): launch a multiple of {size} processes, or set context_parallel_size to a divisor of {world}."
        )
    context = None
    for first in range(0, world, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks, timeout=timeout)
        context = group if rank in ranks else context
    return ContextParallelGroup.of(context, timeout)
