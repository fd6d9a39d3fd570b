"""The simulated device: fake CUDA tensors (shapes, dtypes, no storage) beside real host values.

A simulation runs the real update code on `torch._subclasses.FakeTensorMode` tensors: every tensor on the simulated
accelerator is fake, and its ops run their shape functions only (PyTorch's meta kernels, and the fake
implementations of custom ops: bitsandbytes' 4-bit ops, the stand-ins of `stand_ins.py`). Two things a fake tensor
cannot give, the update needs:

- **Host values.** LongStraw keeps positions, lengths and chunk bounds on the host and reads them to choose kernels
  (`block_attention.py`); those must stay real. [`SimulatedDevice`] runs an op for real when it touches no fake tensor,
  unless it makes room for data: a floating-point, pinned or large (`HOST_REAL_BYTES`) host tensor is fake like the
  device's (prompt-state pages in host memory, the buffers a collective fills), while integers, which decide what
  runs, stay real.
- **Small integer values on the device.** Token ids, completion lengths and masks decide shapes (TRL's fused LM head
  scores the label mask's positions only) and control flow. Every integer or boolean tensor of at most
  `SHADOW_ELEMENTS` elements computed from known values carries a *shadow*: the same op run on the host on real
  values. A read of a device value (`.item()`, `bool(...)`) or an op whose output shape depends on values (a boolean
  mask's index, `nonzero`) uses the shadow.
- **Bounds.** Without a shadow, a small integer tensor may still carry bounds its ops imply (a comparison is 0 or 1, a
  sum of `n` of them at most `n`, its max no more): a read of it is answered by its upper bound, what memory must be
  provisioned for (DSA's count of a block's top-k picks: at most k), and counted (`answered_reads`). A boolean read
  without either (a finiteness check, `tensor.any()`) is answered as the healthy run's, True, and counted; any other
  read raises `SimulationError`.

On a torch build without CUDA, torch itself asks a CUDA device for a device guard and, in autograd, a current stream:
`fake_cuda_library` compiles (once, cached) `fake_cuda.cpp`, which registers c10's fake guard and CUDA hooks, and the
simulation's own process loads it before importing torch (`simulation/__init__.py`). A CUDA build needs none of it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections import Counter
from importlib.resources import files
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from .tracker import _METADATA, tensors_of

aten = torch.ops.aten

HOST_REAL_BYTES = 64 * 2**20  # a host allocation larger than this is fake (pinned prompt-state pages, staging)
SHADOW_ELEMENTS = 2**23  # integer/bool device tensors up to this size carry their host values (8M: a 2M prompt's ids)
# Ops whose (last) integer output indexes a dimension of their input, and ops that pass their input's values on.
_INDEXING = frozenset({aten.topk, aten.sort, aten.argsort, aten.argmax, aten.argmin})
_PASSING = frozenset({aten._to_copy, aten.clone, aten.view, aten.reshape, aten._unsafe_view, aten.expand, aten.slice,
                      aten.select, aten.gather, aten.index, aten.squeeze, aten.unsqueeze, aten.permute, aten.transpose,
                      aten.t, aten.contiguous, aten.flatten, aten.max, aten.amax, aten.min, aten.amin,
                      aten.alias, aten.index_select, aten.repeat, aten.narrow})  # fmt: skip
_ARITHMETIC = frozenset({aten.add, aten.sub, aten.rsub, aten.mul})
_INTEGRAL = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_FACTORIES = {aten.empty.memory_format, aten.empty_strided.default, aten.zeros.default, aten.ones.default,
              aten.full.default, aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
              aten.full_like.default, aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
              aten.new_full.default}  # fmt: skip


class SimulationError(RuntimeError):
    """The update read something a simulation cannot know (a device value without a shadow)."""


def fake_cuda_library(cache: Path | None = None) -> Path | None:
    """The compiled `fake_cuda.cpp` for this torch build (built once into `cache`, by default
    `$XDG_CACHE_HOME/trl_longstraw` or `~/.cache/trl_longstraw`), or None where torch has CUDA built in and needs
    none. Needs a C++17 compiler (`$CXX`, else `c++`) and torch's headers, which its wheels carry."""
    if torch.backends.cuda.is_built():
        return None
    source = files("trl_longstraw.simulation").joinpath("fake_cuda.cpp").read_bytes()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # The library finds torch's by the path it was linked against: another install of the same torch (another virtual
    # environment, a checkout that has since been deleted) gets a library of its own.
    torch_dir = Path(torch.__file__).resolve().parent
    key = hashlib.sha256(source + f"{torch.__version__};{abi};{torch_dir}".encode()).hexdigest()[:16]
    root = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trl_longstraw"
    library = root / f"fake_cuda-{key}.so"
    if library.is_file():
        return library
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise SimulationError(
            "The simulation needs a C++ compiler on a torch build without CUDA (it compiles a 30-line stand-in "
            "CUDA device guard once): install one (e.g. `apt install g++`) or set CXX."
        )
    root.mkdir(parents=True, exist_ok=True)
    source_file = root / f"fake_cuda-{key}.cpp"
    source_file.write_bytes(source)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    command = [
        compiler, "-O1", "-std=c++20", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{torch_dir / 'include'}", str(source_file), f"-L{torch_dir / 'lib'}", f"-Wl,-rpath,{torch_dir / 'lib'}",
        "-lc10", "-ltorch_cpu", "-o", str(partial),
    ]  # fmt: skip
    built = subprocess.run(command, check=False, capture_output=True, text=True)
    if built.returncode != 0:
        raise SimulationError(f"Compiling the simulation's stand-in CUDA runtime failed:\n{built.stderr[-2000:]}")
    partial.replace(library)  # atomic: a concurrent build finds a whole library or none
    return library


def _is_fake(value) -> bool:
    return isinstance(value, FakeTensor)


class SimulatedDevice(FakeTensorMode):
    """`FakeTensorMode` for a simulation: fake tensors on the accelerator and for large host memory, real host values
    elsewhere, shadows of small integer device tensors (module docstring)."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.shadows = WeakIdKeyDictionary()  # fake tensor -> its real values on the host
        self.bounds = WeakIdKeyDictionary()  # fake tensor without a shadow -> (lowest, highest) value
        self.answered_reads: Counter = Counter()  # reads without a shadow: "upper bound", "bool"
        self.collectives = None  # the simulated world's `MirroredCollectives` (world.py), in a world of several ranks
        self._fake_ops = 0  # fake ops under way: what their decompositions allocate is part of a fake output

    # ----------------------------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.detach.default or func in _METADATA:  # no values, no allocation, asked constantly
            return super().__torch_dispatch__(func, types, args, kwargs)
        flat = list(tensors_of(args, kwargs.values()))
        on_host = not self._fake_ops and not any(_is_fake(value) for value in flat)
        if on_host and self._stays_on_host(func, args, flat, kwargs):
            with unset_fake_temporarily():
                out = func(*args, **kwargs)
                self._mirror(func, args)
            return out
        if func is aten._local_scalar_dense.default:
            return self._read(args[0])
        if func in (aten._assert_async.default, aten._assert_async.msg):
            return None
        self._fake_ops += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            return self._from_shadows(func, args, kwargs)
        finally:
            self._fake_ops -= 1
        self._shadow(func, args, kwargs, out)
        self._bound(func, args, kwargs, out)
        return out

    @staticmethod
    def _stays_on_host(func, args, flat, kwargs) -> bool:
        """Whether an op without fake inputs runs for real: on the host, and not a large or pinned host allocation."""
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return False
        if any(tensor.device.type != "cpu" for tensor in flat):
            return False
        if func in _FACTORIES:
            dtype = kwargs.get("dtype") or (flat[0].dtype if flat else torch.get_default_dtype())
            # Room for data: pages, buffers, and the bytes FSDP2 gathers a group of mixed dtypes into. Fake.
            if kwargs.get("pin_memory") or dtype.is_floating_point or dtype == torch.uint8:
                return False
            size = next((value for value in args if isinstance(value, (list, tuple, torch.Size))), None)
            numel = _numel(size) if size is not None else (flat[0].numel() if flat else 1)
            return numel * dtype.itemsize <= HOST_REAL_BYTES
        return True

    # -- shadows -----------------------------------------------------------------------------------------------------
    def _host_values(self, value):
        """A fake tensor's shadow (None without one); anything else as it is."""
        if _is_fake(value):
            return self.shadows.get(value)
        return value

    def _shadow(self, func, args, kwargs, out) -> None:
        """Run `func` on the host on its inputs' real values and keep the results as `out`'s shadows, where `out`
        holds small integer tensors and every fake input has a shadow; drop a written input's stale shadow."""
        outputs = [tensor for tensor in tensors_of(out) if _is_fake(tensor)]
        if not outputs:
            return
        wanted = all(t.dtype in _INTEGRAL and t.numel() <= SHADOW_ELEMENTS for t in outputs)
        known = wanted and all(
            not _is_fake(value) or value in self.shadows for value in tensors_of(args, kwargs.values())
        )
        if not (wanted and known) or torch.Tag.nondeterministic_seeded in func.tags and not self._seeded(func):
            for tensor in outputs:  # an in-place op on unknown values leaves its input unknown
                self.shadows.pop(tensor, None)
            return
        host_args, host_kwargs = tree_map(self._host_values, (args, kwargs))
        if "device" in host_kwargs:
            host_kwargs["device"] = torch.device("cpu")
        with unset_fake_temporarily():
            result = func(*host_args, **host_kwargs)
            self._mirror(func, host_args)
        for tensor, values in zip(outputs, list(tensors_of(result))):
            self.shadows[tensor] = values

    def _mirror(self, func, host_args) -> None:
        """Host values through a collective, as the simulated world's peers would send them (world.py)."""
        if self.collectives is not None and func.namespace == "c10d":
            self.collectives.after(func, host_args)

    @staticmethod
    def _seeded(func) -> bool:
        """Random integer ops (token sampling) get host samples: any values are a valid draw."""
        return func in (aten.randint.default, aten.randint.low, aten.randperm.default)

    def _value_bound(self, value) -> tuple[int, int] | None:
        """What is known of an integer tensor's values: its shadow's or its bounds' extremes (None: nothing)."""
        if not isinstance(value, torch.Tensor):
            return (int(value), int(value)) if isinstance(value, (bool, int)) else None
        if value.dtype == torch.bool:
            return (0, 1)
        known = self._host_values(value)
        if known is not None and known.numel():
            with unset_fake_temporarily():
                return int(known.min()), int(known.max())
        return self.bounds.get(value)

    def _bound(self, func, args, kwargs, out) -> None:
        """Bounds `func` gives its integer outputs without shadows, from its inputs' (module docstring): indices into a
        dimension (top-k, sort, arg-extremes), the values of what they select or pass on, a count of flags."""
        outputs = [tensor for tensor in tensors_of(out) if _is_fake(tensor) and tensor not in self.shadows]
        outputs = [tensor for tensor in outputs if tensor.dtype in _INTEGRAL]
        if not outputs:
            return
        packet, source = func.overloadpacket, args[0] if args else None
        if packet in _INDEXING:  # (values, indices) or indices: positions along `dim`
            dim = kwargs.get("dim", args[2] if packet is aten.topk and len(args) > 2 else -1)
            dim = args[1] if packet in (aten.sort, aten.argsort, aten.argmax, aten.argmin) and len(args) > 1 else dim
            size = source.shape[dim] if source.dim() else 1
            self.bounds[outputs[-1]] = (0, max(size - 1, 0))
            return
        if packet is aten.where and len(args) == 3:
            parts = [self._value_bound(args[1]), self._value_bound(args[2])]
        elif packet in _ARITHMETIC and len(args) >= 2:
            parts = [_combined(packet, self._value_bound(args[0]), self._value_bound(args[1]))]
        elif packet is aten.clamp:
            low, high = (list(args[1:3]) + [None, None])[:2]
            bound = self._value_bound(source) or ((low, high) if low is not None and high is not None else None)
            parts = None if bound is None else [(max(bound[0], low or bound[0]), min(bound[1], high or bound[1]))]
        elif packet is aten.cat:
            parts = [self._value_bound(tensor) for tensor in args[0]]
        elif packet is aten.sum:
            bound = self._value_bound(source)
            count = max(source.numel() // max(outputs[0].numel(), 1), 1)
            parts = None if bound is None else [(min(bound[0] * count, bound[0]), bound[1] * count)]
        elif packet in _PASSING:
            parts = [self._value_bound(source)]
        else:
            parts = [(0, 1)] if outputs[0].dtype == torch.bool else None
        if parts and all(part is not None for part in parts):
            self.bounds[outputs[0]] = (min(part[0] for part in parts), max(part[1] for part in parts))

    def _read(self, tensor):
        """`.item()` of a device tensor: its shadow's value; else its upper bound, or for a boolean True (counted)."""
        shadow = self.shadows.get(tensor)
        if shadow is not None:
            return shadow.item()
        if tensor in self.bounds and tensor.dtype != torch.bool:
            self.answered_reads["upper bound"] += 1
            return self.bounds[tensor][1]
        if tensor.dtype == torch.bool:
            self.answered_reads["bool"] += 1
            return True
        raise SimulationError(
            f"The update read the value of a {tuple(tensor.shape)} {tensor.dtype} device tensor that no host value "
            "determines: a simulation runs without values."
        )

    def _from_shadows(self, func, args, kwargs):
        """An op whose output shape depends on values: boolean indices become the index tensors of their shadows'
        true entries; `nonzero` and `masked_select` take their shapes from the shadows."""
        if func is aten.index.Tensor:
            source, indices = args[0], []
            for index in args[1]:
                if index is not None and index.dtype == torch.bool:
                    indices.extend(self._true_entries(index).unbind(1))
                else:
                    indices.append(index)
            return aten.index.Tensor(source, indices)
        if func in (aten.nonzero.default, aten.argwhere.default):
            entries = self._true_entries(args[0])
            out = super().__torch_dispatch__(aten._to_copy.default, (), (entries,), {"device": args[0].device})
            self.shadows[out] = entries
            return out
        if func is aten.masked_select.default:
            return aten.index.Tensor(args[0], list(self._true_entries(args[1]).unbind(1)))
        if func is aten._unique2.default and (bound := self._value_bound(args[0])) is not None:
            return self._distinct(args[0], bound, *args[1:], **kwargs)
        raise SimulationError(f"{func}: its output's shape depends on device values the simulation does not know.")

    def _distinct(self, source, bound, sorted=True, return_inverse=False, return_counts=False):
        """`unique` of values known to lie within `bound`: as many distinct values as there can be (each position's
        own, at most the bound's range), what memory must be provisioned for; counted as a read answered so."""
        self.answered_reads["upper bound"] += 1
        count = min(source.numel(), bound[1] - bound[0] + 1)
        empty = aten.empty.memory_format
        values = super().__torch_dispatch__(empty, (), ((count,),), {"dtype": source.dtype, "device": source.device})
        self.bounds[values] = bound
        inverse = super().__torch_dispatch__(
            empty,
            (),
            ((tuple(source.shape) if return_inverse else (0,)),),
            {"dtype": torch.long, "device": source.device},
        )
        self.bounds[inverse] = (0, max(count - 1, 0))
        counts = super().__torch_dispatch__(
            empty, (), (((count,) if return_counts else (0,)),), {"dtype": torch.long, "device": source.device}
        )
        return values, inverse, counts

    def _true_entries(self, mask) -> torch.Tensor:
        shadow = self._host_values(mask)
        if shadow is None:
            raise SimulationError(
                f"A {tuple(mask.shape)} boolean device mask decides a shape, and no host value determines it."
            )
        with unset_fake_temporarily():
            return shadow.nonzero()


def _combined(packet, a: tuple[int, int] | None, b: tuple[int, int] | None) -> tuple[int, int] | None:
    """The bounds of `a op b` from the operands' bounds (None where either is unknown)."""
    if a is None or b is None:
        return None
    if packet is aten.add:
        return a[0] + b[0], a[1] + b[1]
    if packet is aten.sub:
        return a[0] - b[1], a[1] - b[0]
    if packet is aten.rsub:
        return b[0] - a[1], b[1] - a[0]
    products = [x * y for x in a for y in b]
    return min(products), max(products)


def _numel(size) -> int:
    count = 1
    for dim in size:
        count *= int(dim)
    return count
