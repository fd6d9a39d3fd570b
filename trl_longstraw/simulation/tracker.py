"""What one update holds and does, phase by phase: live bytes, FLOPs, roofline time, communication, large allocations.

[`UpdateTracker`] is a `TorchDispatchMode`: every op the update runs passes through it, on fake tensors (a
simulation) or real ones (the validation runs on the CPU, which check the simulation against the same count of real
tensors). It counts

- **live bytes** per device type, as torch's own `MemTracker` does: each storage an op creates is counted until its
  last reference dies (a weak reference's callback), and a storage resized in place (FSDP2 frees and refills its
  gathered parameters so, `UntypedStorage.resize_`, which no dispatch mode sees) is followed through that method.
  This is the caching allocator's *allocated* bytes, not its reserved ones: fragmentation is not modelled;
- **FLOPs** by torch's flop formulas (`torch.utils.flop_counter.flop_registry`, the stand-ins' registered beside them);
- **roofline seconds**: per op, the larger of its FLOPs at the device's peak for its operands' dtype and the bytes
  it reads and writes (its tensor arguments and outputs; a view moves none) at HBM bandwidth (`DeviceSpec`);
- **communication**: the buffer bytes of every collective (torch's `CollectiveOp.get_comm_tensor_size`);
- the **largest allocation** (bytes, op, phase) and every **oversized** one: a tensor spanning the prompt and the
  model's width (`Oversize`), which the design never makes outside one chunk.

Stand-in kernels allocate workspace inside their fake implementations, where no dispatch mode sees it: each registers
its workspace's bytes as a function of its arguments (`register_workspace`), which count towards the peak while the
op runs and, written and read once, towards its roofline bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import wraps

import torch
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.weak import WeakIdKeyDictionary

from .devices import DeviceSpec

GIB = 1024**3
AT_PEAK = 12  # the largest live allocations a phase keeps from its peak
SNAPSHOT_STEP = 1.01  # a phase's peak is looked into again when it has risen by 1%
SETTLE_S = 0.002  # how long a real run waits after a collective for the process group's worker threads
aten = torch.ops.aten
_WORKSPACE: dict = {}  # op overload packet -> bytes of the transient workspace its kernel allocates, of its arguments


def register_workspace(op):
    """Register `fn(*args, **kwargs) -> bytes`: the workspace a stand-in kernel `op` allocates while it runs."""

    def register(fn):
        _WORKSPACE[op] = fn
        return fn

    return register


@dataclass(frozen=True)
class Allocation:
    bytes: int
    op: str
    phase: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict:
        return {"gib": self.bytes / GIB, "op": self.op, "phase": self.phase, "shape": list(self.shape),
                "dtype": self.dtype}  # fmt: skip


@dataclass
class PhaseRecord:
    """One phase of the update (summed over every time it ran)."""

    peak_bytes: int = 0  # the device's live bytes at their highest
    start_bytes: int | None = None  # live device bytes when the phase first began
    end_bytes: int = 0  # live device bytes when the phase last ended
    host_peak_bytes: int = 0
    flops: float = 0.0
    roofline_s: float = 0.0
    communication_bytes: int = 0
    runs: int = 0
    wall_s: float = 0.0  # the simulation's own time in the phase
    largest: Allocation | None = None  # the phase's largest single allocation
    at_peak: list[Allocation] = field(default_factory=list)  # the largest live allocations at the phase's peak

    def to_dict(self) -> dict:
        return {
            "at_peak": [allocation.to_dict() for allocation in self.at_peak],
            "peak_gib": self.peak_bytes / GIB,
            "added_gib": (self.peak_bytes - (self.start_bytes or 0)) / GIB,
            "held_gib": self.end_bytes / GIB,
            "host_peak_gib": self.host_peak_bytes / GIB,
            "flops": self.flops,
            "roofline_s": self.roofline_s,
            "communication_gib": self.communication_bytes / GIB,
            "runs": self.runs,
            "wall_s": self.wall_s,
        }


@dataclass
class Oversize:
    """What the design never allocates outside one chunk: a tensor with a dimension of more than `long` tokens (twice
    the largest chunk a forward runs: a capture chunk, an attention chunk, a replayed member) and another as wide as
    `wide` (the hidden size) or a second such long one. Prompt-state pages span the prompt with a head's width, and
    positions and token ids span it alone: neither is flagged; nor is a tensor shaped like a parameter (its gradient,
    its optimizer state, FSDP2's gathered copy), and a parameter's dimension (a vocabulary, an MLP's width) counts as
    no token dimension (`exempt`)."""

    long: int
    wide: int
    parameter_shapes: set = field(default_factory=set)
    widths: set = field(default_factory=set)

    def exempt(self, model: torch.nn.Module) -> None:
        """Parameter shapes of `model` (whole, and this rank's shards of them under FSDP2) are no activations, and their
        dimensions (the hidden size, an MLP's width, the vocabulary) no token counts."""
        for param in model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            for shape in {tuple(param.shape), tuple(local.shape)}:
                self.parameter_shapes.update({shape, shape[::-1]})
                self.widths.update(shape)

    def __call__(self, shape: tuple[int, ...]) -> bool:
        if shape in self.parameter_shapes:
            return False
        longs = [dim > self.long and dim not in self.widths for dim in shape]
        wides = [dim >= self.wide and not long for dim, long in zip(shape, longs, strict=True)]
        return sum(longs) >= 2 or (sum(longs) == 1 and any(wides))


@dataclass(frozen=True)
class Work:
    """What ran in a phase so far, apart from memory: FLOPs, roofline seconds, collective bytes, ops."""

    flops: float
    roofline_s: float
    communication_bytes: int
    ops: int

    def __sub__(self, other: Work) -> Work:
        return Work(
            self.flops - other.flops,
            self.roofline_s - other.roofline_s,
            self.communication_bytes - other.communication_bytes,
            self.ops - other.ops,
        )


@dataclass
class _Storage:
    bytes: int
    device: str
    made: Allocation | None = None  # what made it (None: made before the tracker saw it)


class UpdateTracker(TorchDispatchMode):
    """Counts what the update holds and does, per phase (module docstring). `device_type`: the accelerator's device
    type ("cuda"; "cpu" for a real run on the host); `spec`: the device the roofline is computed for (None: no
    times); `oversize`: the allocation rule flagged (None: nothing flagged); `settle_collectives`: a real run of
    several ranks, whose process group's worker threads must release each collective's tensors before the next op."""

    def __init__(
        self,
        device_type: str = "cuda",
        spec: DeviceSpec | None = None,
        oversize: Oversize | None = None,
        settle_collectives: bool = False,
    ):
        super().__init__()
        self.device_type = device_type
        self.settle_collectives = settle_collectives
        self.spec = spec
        self.oversize = oversize
        self.live: Counter = Counter()  # bytes by device type
        self._storages = WeakIdKeyDictionary()  # untyped storage -> _Storage
        self.phases: dict[str, PhaseRecord] = {}
        self.phase_name = "setup"
        self.oversized: list[Allocation] = []
        self.ops = 0
        self._original_resize = None
        self._collective_done = False  # a collective ran since the last op (`settle_collectives`)

    # -- phases ------------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PhaseRecord]:
        """Count what runs inside under phase `name` (phases nest: the inner one counts)."""
        outer, self.phase_name = self.phase_name, name
        record = self.phases.setdefault(name, PhaseRecord())
        record.runs += 1
        if record.start_bytes is None:
            record.start_bytes = self.live[self.device_type]
        self._peak(record)
        started = time.monotonic()
        try:
            yield record
        finally:
            record.wall_s += time.monotonic() - started
            record.end_bytes = self.live[self.device_type]
            self.phase_name = outer

    def _record(self) -> PhaseRecord:
        return self.phases.setdefault(self.phase_name, PhaseRecord())

    def _peak(self, record: PhaseRecord, extra: int = 0) -> None:
        current = self.live[self.device_type] + extra
        if current > record.peak_bytes * SNAPSHOT_STEP:  # what holds the memory, kept as the peak rises
            record.at_peak = self._largest_live(AT_PEAK)
        record.peak_bytes = max(record.peak_bytes, current)
        record.host_peak_bytes = max(record.host_peak_bytes, self.live["cpu"] if self.device_type != "cpu" else 0)

    def _largest_live(self, count: int) -> list[Allocation]:
        live = [entry.made for entry in self._storages.values() if entry.made is not None and entry.bytes]
        return sorted(live, key=lambda made: -made.bytes)[:count]

    def oversized_of(self, phases: Iterable[str]) -> list[Allocation]:
        """The allocations of the named phases that `oversize` flags."""
        named = set(phases)
        return [made for made in self.oversized if made.phase in named and self.oversize(made.shape)]

    def largest(self, phases: Iterable[str]) -> Allocation | None:
        """The largest single allocation of the named phases."""
        found = [self.phases[name].largest for name in phases if name in self.phases]
        return max((allocation for allocation in found if allocation), key=lambda a: a.bytes, default=None)

    def totals(self) -> Work:
        """The current phase's work so far."""
        record = self._record()
        return Work(record.flops, record.roofline_s, record.communication_bytes, self.ops)

    def repeat(self, work: Work) -> None:
        """Account `work` once more in the current phase without running it: an iteration interchangeable with one
        measured (`block_attention.visits`), whose memory is that one's too."""
        record = self._record()
        record.flops += work.flops
        record.roofline_s += work.roofline_s
        record.communication_bytes += work.communication_bytes
        self.ops += work.ops

    @property
    def peak_bytes(self) -> int:
        return max((record.peak_bytes for record in self.phases.values()), default=self.live[self.device_type])

    # -- storages ------------------------------------------------------------------------------------------------------
    def _add(self, tensor: torch.Tensor, op: str) -> None:
        storage = tensor.untyped_storage()
        if storage in self._storages:
            return
        device = tensor.device.type
        size = storage.nbytes()
        allocation = Allocation(
            size, op, self.phase_name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")
        )
        entry = _Storage(size, device, allocation if device == self.device_type else None)
        self._storages[storage] = entry
        weakref.finalize(storage, self._release, entry)
        self.live[device] += size
        if device != self.device_type:
            return
        record = self._record()
        if record.largest is None or size > record.largest.bytes:
            record.largest = allocation
        if self.oversize is not None and max(tensor.shape, default=0) > self.oversize.long:
            self.oversized.append(
                allocation
            )  # a candidate: judged once every parameter shape is known (`oversized_of`)

    def _release(self, entry: _Storage) -> None:
        self.live[entry.device] -= entry.bytes
        entry.bytes = 0

    def _resized(self, storage: torch.UntypedStorage) -> None:
        entry = self._storages.get(storage)
        if entry is not None:
            self.live[entry.device] += storage.nbytes() - entry.bytes
            entry.bytes = storage.nbytes()
            if entry.made is not None:
                entry.made = dataclasses.replace(entry.made, bytes=entry.bytes)
            self._peak(self._record())

    # -- the dispatch ---------------------------------------------------------------------------------------------------
    def __enter__(self):
        self._original_resize = torch.UntypedStorage.resize_
        original, tracker = self._original_resize, self

        @wraps(original)
        def resize_(storage, size):
            result = original(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._collective_done and self.settle_collectives:
            # A real process group's worker thread drops its references to a collective's tensors just after the
            # collective completes, which races the next ops: a buffer the update dropped would count as live.
            time.sleep(SETTLE_S)
        self._collective_done = func.namespace == "c10d"
        out = func(*args, **kwargs)
        if func in _METADATA:
            return out
        self.ops += 1
        record = self._record()
        made, outputs, inputs = out, list(tensors_of(out)), list(tensors_of(args, kwargs.values()))
        if any(isinstance(tensor, DTensor) for tensor in (*outputs, *inputs)):
            # A sharded tensor's op runs on its local tensors, beneath this mode: they are what is held and done.
            args, kwargs, made = tree_map(_local, (args, kwargs, out))
            outputs, inputs = list(tensors_of(made)), list(tensors_of(args, kwargs.values()))
        name = str(func.overloadpacket.__name__)
        workspace_of = _WORKSPACE.get(func.overloadpacket)
        workspace = 0 if workspace_of is None else int(workspace_of(*args, **kwargs))
        self._peak(record, extra=workspace)  # the inputs and the workspace, before the outputs replace it
        for tensor in outputs:
            self._add(tensor, name)
        self._peak(record)
        if func in collective_ops:
            record.communication_bytes += _communication_bytes(func, made, args, kwargs)
            return out
        if not any(tensor.device.type == self.device_type for tensor in (*inputs, *outputs)):
            return out  # host bookkeeping (positions, lengths): not the device's work
        flops = _flops(func, made, args, kwargs)
        record.flops += flops
        if self.spec is not None:
            moved = 0 if func.is_view else sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
            moved += 2 * workspace
            record.roofline_s += self.spec.roofline_s(flops, moved, _compute_dtype(inputs))
        return out


# Queries of a tensor's metadata that reach the dispatcher for fake tensors (`tensor.device`): nothing to count.
_METADATA = frozenset({torch.ops.prim.device.default, torch.ops.prim.layout.default})


def _local(value):
    return value.to_local() if isinstance(value, DTensor) else value


def tensors_of(*groups) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments or outputs (one level of lists and tuples: an aten op's `Tensor[]`)."""
    for group in groups:
        if isinstance(group, torch.Tensor):
            yield group
            continue
        if not isinstance(group, (list, tuple)) and not hasattr(group, "__iter__"):
            continue
        for value in group:
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (list, tuple)):
                yield from (item for item in value if isinstance(item, torch.Tensor))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _compute_dtype(inputs: list[torch.Tensor]) -> torch.dtype | None:
    return next((t.dtype for t in inputs if t.is_floating_point()), None)


def _flops(func, out, args, kwargs) -> float:
    formula: Callable | None = flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0.0
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except TypeError:  # an overload with more positional arguments than its formula names (addmm's `dtype_out`)
        return float(formula(*args[:3], out_val=out))


def _communication_bytes(func, out, args, kwargs) -> int:
    try:
        return int(CollectiveOp.get_comm_tensor_size(func, out, args, kwargs))
    except (TypeError, NotImplementedError, IndexError):  # barriers, waits: no payload
        return 0


# Formulas torch's counter lacks, for ops the update runs: MoE experts' grouped GEMM (transformers' `grouped_mm`), and
# the CPU flash attention the validation runs take.
if aten._grouped_mm not in flop_registry:

    @register_flop_formula(aten._grouped_mm, get_raw=True)
    def _grouped_mm_flop(input, weight, *args, out_val=None, **kwargs) -> int:
        """`[tokens, k] x [groups, k, n]`: every token through one group's `k x n` matrix."""
        return 2 * input.shape[0] * input.shape[-1] * weight.shape[-1]


if aten._scaled_dot_product_flash_attention_for_cpu not in flop_registry:

    @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
    def _cpu_flash_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _cpu_flash_backward_flop(grad_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape)
