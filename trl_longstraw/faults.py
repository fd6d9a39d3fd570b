"""What a failure says: the phase it happened in, what would have fitted, and, across ranks, which peer failed and how.

A LongStraw update is a sequence of phases (`capture`, `score`, `replay`, `prompt_backward`, `rollout`, ...: the
telemetry's phases). `in_phase` records the phase in progress; an exception that leaves it is noted with the phase
and, in a distributed run, reported to the other ranks through the process group's store (`report_failure`). An
allocation failure (CUDA's `OutOfMemoryError`, the CPU allocator's `can't allocate memory`) leaves it as
`PhaseOutOfMemoryError`, a `torch.OutOfMemoryError` whose message the caller's `explain` writes (the trainer: the
phase, P, G, the predicted state bytes and the settings that would fit, from its memory plan).

Every LongStraw collective runs under `collective`: where one fails (a peer exited, or stopped answering until the
group's timeout, the Trainer's `ddp_timeout`), this rank reports it too, waits briefly for its peers' reports and
raises `RankFailure` naming the phase, the collective and, for each peer of the group, what it reported: the
exception it raised, a failure like this one, or nothing (stalled, or killed). So every rank of a group stops within
the timeout (plus `REPORT_GRACE_S`), and says why.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .state.registry import decoder_layers

_PHASE: ContextVar[str | None] = ContextVar("longstraw_phase", default=None)
# The store keys under which each rank reports its failure (one report per process: the first failure is the cause).
REPORT_KEY = "longstraw/failure/rank{rank}"
# How long a failed collective waits for its peers' reports before naming the silent ones.
REPORT_GRACE_S = 2.0
_reported = False


class RankFailure(RuntimeError):
    """A collective of a LongStraw phase failed because a peer rank failed, exited or stopped answering."""


class Preempted(RuntimeError):
    """Training stopped on a termination signal (SIGTERM), at once or after the checkpoint save in progress
    (`preemption.PreemptionCallback`)."""


class PhaseOutOfMemoryError(torch.OutOfMemoryError):
    """An allocation failed in a LongStraw phase: the message says where, at what size, and what would fit."""


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's (and any accelerator's) `OutOfMemoryError`, or the CPU allocator's failure (a plain RuntimeError)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    )


def current_phase() -> str:
    return _PHASE.get() or "outside a LongStraw phase"


@contextmanager
def in_phase(name: str, explain: Callable[[str], str] | None = None) -> Iterator[None]:
    """Run a phase: an exception leaving it is reported to the other ranks and notes the phase it came from; an
    allocation failure becomes `PhaseOutOfMemoryError` with `explain(name)`'s message (the original as its cause)."""
    token = _PHASE.set(name)
    try:
        yield
    except GeneratorExit:  # the phase's generator closed unfinished: no failure of the phase
        raise
    except BaseException as error:
        if isinstance(error, RankFailure | PhaseOutOfMemoryError):
            raise
        if explain is not None and is_out_of_memory(error):
            report_failure(f"ran out of memory (phase {name!r})")  # before the explanation, which plans the run
            try:
                text = explain(name)
            except Exception as failure:  # noqa: BLE001 (no plan for this model: say what is known)
                text = f"Out of memory in LongStraw phase {name!r} (no memory plan: {failure})"
            raise PhaseOutOfMemoryError(f"{text}\n(allocator: {_first_line(error)})") from error
        report_failure(f"raised {type(error).__name__}: {_first_line(error)} (phase {name!r})")
        if not any("LongStraw phase" in note for note in getattr(error, "__notes__", ())):
            error.add_note(f"LongStraw phase {name!r}, rank {_global_rank()}")
        raise
    finally:
        _PHASE.reset(token)


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _store():
    """The default process group's store (every rank can read and write it), or None outside a distributed run."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def report_failure(description: str) -> None:
    """Tell the other ranks why this one stops (once per process; a store that is gone already is ignored)."""
    global _reported
    store = _store()
    if _reported or store is None:
        return
    _reported = True
    try:
        store.set(REPORT_KEY.format(rank=_global_rank()), description)
    except (RuntimeError, ValueError):
        pass


def forget_reports() -> None:
    """A new run in this process: its first failure is reported again, and no earlier report of this rank stands."""
    global _reported
    _reported = False
    store = _store()
    if store is not None:
        try:
            store.delete_key(REPORT_KEY.format(rank=_global_rank()))
        except (RuntimeError, ValueError):
            pass


def peer_reports(ranks: list[int], grace_s: float = REPORT_GRACE_S) -> dict[int, str | None]:
    """What each of `ranks` reported, waiting up to `grace_s` for the missing ones (None: no report)."""
    store = _store()
    reports: dict[int, str | None] = dict.fromkeys(ranks)
    if store is None:
        return reports
    deadline = time.monotonic() + grace_s
    while True:
        for rank in ranks:
            key = REPORT_KEY.format(rank=rank)
            try:
                if reports[rank] is None and store.check([key]):
                    reports[rank] = store.get(key).decode()
            except (RuntimeError, ValueError):  # the store's host is gone
                return reports
        if all(report is not None for report in reports.values()) or time.monotonic() >= deadline:
            return reports
        time.sleep(0.05)


@contextmanager
def collective(kind: str, group: dist.ProcessGroup | None = None, timeout: timedelta | None = None) -> Iterator[None]:
    """Run one collective of `group` (None: the default group): a failure raises `RankFailure` naming the phase, the
    collective and what each peer reported."""
    try:
        yield
    except RuntimeError as error:
        # a peer's failure is already named; a signal's or an allocation's is this rank's own, named by `in_phase`
        if isinstance(error, RankFailure | Preempted) or is_out_of_memory(error):
            raise
        phase = current_phase()
        me = _global_rank()
        report_failure(f"failed in {kind} (phase {phase!r}): {_first_line(error)}")
        peers = [rank for rank in dist.get_process_group_ranks(group or dist.group.WORLD) if rank != me]
        reports = peer_reports(peers)
        lines = [
            f"rank {rank}: " + (report or "no report (it stopped answering, or was killed)")
            for rank, report in reports.items()
        ]
        bound = f" (timeout {timeout.total_seconds():g} s, the Trainer's `ddp_timeout`)" if timeout else ""
        raise RankFailure(
            f"LongStraw's {kind} in phase {phase!r} failed on rank {me}{bound}: {_first_line(error)}\n"
            "The other ranks of the group:\n  " + "\n  ".join(lines)
        ) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def first_non_finite_gradient(model: torch.nn.Module) -> str | None:
    """The name of the first parameter whose gradient holds NaN or inf, or None: one fused pass over every gradient
    and one device read.

    FSDP2: each rank checks its own shards, with no collective. A parameter of fewer rows than ranks (a per-head
    `A_log` over more ranks than heads, a LoRA `lora_A` of rank r over more than r ranks, Qwen3-Next's one-row
    `shared_expert_gate`) leaves some ranks an empty shard: nothing to check there (and the infinity norm has no value
    on an empty tensor), so it is left out.
    """
    named = [
        (name, grad)
        for name, param in model.named_parameters()
        if param.grad is not None
        for grad in (param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad,)
        if grad.numel() > 0
    ]
    if not named:
        return None
    norms = torch._foreach_norm([grad for _, grad in named], float("inf"))  # one fused pass, NaN stays NaN
    finite = torch.stack([norm.to(norms[0].device) for norm in norms]).isfinite().cpu()
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


class NonFiniteWarning(RuntimeWarning):
    """NaN or inf in a LongStraw phase. The step goes on as stock `GRPOTrainer`'s would on it (the NaN reaches the
    loss, and the gradients through it); `warnings.filterwarnings("error", category=NonFiniteWarning)` stops the run
    at the first one instead."""


def warn_non_finite(where: str, step: int, source: str | None = None) -> None:
    """Warn that `where` holds NaN or inf in optimizer step `step`, naming the phase and, where known, the first
    module whose output was not finite (`source`)."""
    phase = _PHASE.get()
    context = ([f"LongStraw phase {phase!r}"] if phase else []) + [f"optimizer step {step}"]
    context += [f"the first non-finite output: {source}"] if source else []
    warnings.warn(
        f"Non-finite values (NaN or inf) in {where} ({', '.join(context)}). The step goes on as stock GRPOTrainer's would (its loss, and the gradients it reaches, turn NaN). "
        "Check the inputs and the weights (a learning rate too high, fp16 overflow): lower the learning rate or train "
        "in bf16/fp32.",
        NonFiniteWarning,
        stacklevel=3,
    )


class OutputFiniteness:
    """Which module's output first went non-finite: one flag per watched module (the input embeddings, then each
    decoder layer, in order), ANDed on the device by a forward hook at every forward (no host synchronisation), read
    only when a phase's result is non-finite (`first_non_finite`, which resets them)."""

    def __init__(self, modules: list[tuple[str, nn.Module]]):
        self.names = [name for name, _ in modules]
        self._flags: torch.Tensor | None = None
        self._handles = [module.register_forward_hook(self._hook(index)) for index, (_, module) in enumerate(modules)]

    @classmethod
    def of_causal_lm(cls, causal_lm: nn.Module) -> OutputFiniteness:
        """Watching the input embeddings, then each decoder layer."""
        modules = [("the input embeddings", causal_lm.get_input_embeddings())]
        return cls(
            modules + [(f"decoder layer {index}", layer) for index, layer in enumerate(decoder_layers(causal_lm))]
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, index: int):
        def record(module: nn.Module, args, output) -> None:
            tensor = output if isinstance(output, torch.Tensor) else output[0]
            if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
                return
            finite = torch.isfinite(tensor.detach()).all()
            if self._flags is None:  # on the first output's device; outputs on others (device_map) are moved to it
                self._flags = torch.ones(len(self.names), dtype=torch.bool, device=tensor.device)
            self._flags[index].logical_and_(finite.to(self._flags.device))

        return record

    def first_non_finite(self) -> str | None:
        """The first watched module whose output was not finite since the last call (None: all were)."""
        if self._flags is None:
            return None
        flags, self._flags = self._flags.cpu(), None
        bad = (~flags).nonzero()
        return self.names[int(bad[0])] if len(bad) else None
