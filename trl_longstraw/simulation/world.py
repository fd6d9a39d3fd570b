"""The world a simulated rank lives in: the simulated accelerator's runtime API, and the other ranks.

**The device.** On fake tensors nothing reaches a CUDA driver, but code asks `torch.cuda` about the device it runs on
(transformers' grouped GEMM checks the compute capability, FSDP2 sets the device and makes streams and events, the
engine makes the LM head's device current). In the simulation's own process `simulated_cuda` answers as the
simulated device (`DeviceSpec`): its capability and memory, device 0 current, streams and events that order nothing
(fake tensors have no work to order).

**The other ranks.** With context parallelism or FSDP2 the process plays rank `rank` of a world of `world_size` on
torch's fake process group (`torch.testing._internal.distributed.fake_pg`: every collective completes at once and
moves nothing), so every collective of the update still runs and its buffers are counted. Fake tensors need nothing
more; host values that cross ranks (a CP group's chunk lengths, a hand-off's header, FSDP2's pass agreement) take the
values *symmetric peers* would send, every rank running the same work as this one (`MirroredCollectives`): an
all-gather hands back this rank's contribution from every rank, a sum is this rank's value times the group size, a
minimum or maximum is this rank's value, and the k-th receive of integers with a tag gets what this rank sent k-th with
that tag (a rank receives from its predecessor the sequence it sends its successor; floating-point values that no host
decision reads, a received recurrent state, need nothing). The busiest
rank is the one to simulate (`busiest_rank`); a receive before any matching send (a later rank's first recurrent
hand-off under context parallelism) cannot be mirrored and raises, naming the rank to simulate instead.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

from .devices import DeviceSpec
from .runtime import SimulationError

c10d = torch.ops.c10d


class _Quiet:
    """A stream or event of the simulated device: fake tensors have no work to order."""

    def __init__(self, *args, **kwargs):
        self.device = torch.device("cuda", 0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def simulated_cuda(spec: DeviceSpec) -> Iterator[None]:
    """`torch.cuda`'s device queries answered as `spec`'s device, for the simulation's own process (module
    docstring). Restored on exit."""
    properties = SimpleNamespace(
        name=f"NVIDIA {spec.name} (simulated)",
        major=spec.capability[0],
        minor=spec.capability[1],
        total_memory=spec.memory_bytes,
        multi_processor_count=132,
        is_integrated=False,
    )
    answers = {
        "is_bf16_supported": lambda including_emulation=True: spec.capability >= (8, 0),
        "get_device_capability": lambda device=None: spec.capability,
        "get_device_properties": lambda device=None: properties,
        "get_device_name": lambda device=None: properties.name,
        "current_device": lambda: 0,
        "device_count": lambda: 8,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "device": _Quiet,
        "Stream": _Quiet,
        "Event": _Quiet,
        "current_stream": lambda device=None: _Quiet(),
        "default_stream": lambda device=None: _Quiet(),
        "stream": lambda stream=None: contextlib.nullcontext(),
        "memory_allocated": lambda device=None: 0,
    }
    saved = {name: getattr(torch.cuda, name) for name in answers}
    for name, answer in answers.items():
        setattr(torch.cuda, name, answer)
    # `torch.autocast("cuda")` turns itself off where CUDA is "definitely not available"; `torch.cuda.is_available()`
    # itself stays False (FakeTensorMode runs small constants for real on an available device)
    amp = torch.cuda.amp.common
    definitely_not_available, amp.amp_definitely_not_available = amp.amp_definitely_not_available, lambda: False
    try:
        yield
    finally:
        amp.amp_definitely_not_available = definitely_not_available
        for name, original in saved.items():
            setattr(torch.cuda, name, original)


@dataclass
class World:
    """The simulated rank's world (module docstring)."""

    rank: int
    size: int
    collectives: MirroredCollectives | None = None

    def describe(self) -> dict:
        mirrored = {} if self.collectives is None else dict(self.collectives.counts)
        return {"rank": self.rank, "size": self.size, "mirrored_collectives": mirrored}


class MirroredCollectives:
    """Host values through the fake process group's collectives, as symmetric peers would send them (module
    docstring). `after(func, args)` runs after the (empty) collective `func` on host tensors."""

    def __init__(self):
        self.sent: dict[int, collections.deque] = {}  # tag -> the host values this rank sent with it, oldest first
        self.counts: dict[str, int] = {}

    def after(self, func, args) -> None:
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        if func is c10d.allgather_.default:
            for output in args[0][0]:
                output.copy_(args[1][0])
        elif func is c10d._allgather_base_.default:
            args[0].view(-1, args[1].numel()).copy_(args[1].reshape(1, -1))
        elif func is c10d.allreduce_.default:
            if _reduce_op(args[2]) == dist.ReduceOp.SUM:
                group = _group(args[1])
                for tensor in args[0]:
                    tensor.mul_(group.size())
        elif func is c10d.alltoall_.default:
            for output, given in zip(args[0], args[1], strict=True):
                output.copy_(given)
        elif func is c10d.send.default:
            if not args[0][0].is_floating_point():  # what a receive of integers will be answered with
                self.sent.setdefault(int(args[3]), collections.deque()).append(args[0][0].clone())
        elif func is c10d.recv_.default:
            into = args[0][0]
            if into.is_floating_point():  # values no host decision reads (a received state): nothing to answer
                return
            queue = self.sent.get(int(args[3]))
            sent = queue.popleft() if queue else None
            if sent is None or sent.numel() != into.numel() or sent.dtype != into.dtype:
                raise SimulationError(
                    "This rank receives a host value before it has sent one like it, which a simulated world of "
                    "symmetric peers cannot answer (a later rank's first recurrent hand-off under context "
                    "parallelism): simulate rank 0 of the group (--simulate-rank 0), which does as much work."
                )
            into.copy_(sent.view(into.shape))


def _group(boxed):
    return dist.ProcessGroup.unbox(boxed)


def _reduce_op(boxed) -> dist.ReduceOp:
    return dist.ReduceOp.RedOpType(boxed.op())  # c10d's ops take the ReduceOp boxed as a script object


@contextlib.contextmanager
def simulated_world(spec, device: DeviceSpec) -> Iterator[World]:
    """The simulated device (for a CUDA simulation) and, with `spec.world_size > 1`, the fake process group in which
    this process is rank `spec.rank`."""
    cuda = simulated_cuda(device) if spec.device == "cuda" else contextlib.nullcontext()
    with cuda:
        if spec.world_size == 1:
            yield World(spec.rank, 1)
            return
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        dist.init_process_group("fake", store=FakeStore(), rank=spec.rank, world_size=spec.world_size)
        try:
            yield World(spec.rank, spec.world_size, MirroredCollectives())
        finally:
            dist.destroy_process_group()
