"""Run one LongStraw update at full size on fake CUDA tensors: what it would hold, compute and send, without a GPU.

[`simulate`] builds the model from its config at full width on the simulated device (meta first: no weights, no
download) and runs one real update of the trainer's engine on it (`update.py`), tracked phase by phase
(`tracker.py`), in a process of its own (`runtime.py`: fake tensors, host values, a stand-in CUDA runtime on a torch
build without CUDA; `world.py`: the device's runtime API and the other ranks), and returns a [`SimulationReport`].
`trl-longstraw plan ... --simulate` prints it beside the formula plan. docs/simulation.md says what is simulated, how
it was validated, and what it does not model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass

from .devices import DEVICE_SPECS, DeviceSpec, device_spec

GIB = 1024**3
PAGE_TOKENS = 64  # shares of a prompt within this many tokens of each other count as equal (`busiest_rank`)
PROGRESS_MARK = "simulating "  # the child's progress bars begin so (`update.Progress`)

# The child process: the stand-in CUDA runtime is loaded before torch is imported (it registers torch's CUDA hooks,
# which torch reads once), then the update runs (`update.main`).
_BOOTSTRAP = (
    "import ctypes, sys\n"
    "if sys.argv[1]:\n"
    "    ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)\n"
    "from trl_longstraw.simulation.update import main\n"
    "main()\n"
)


class SimulationFailed(RuntimeError):
    """The simulation's process failed; the message carries the end of its output."""


@dataclass(frozen=True)
class SimulationReport:
    """One simulated update on one rank (every byte figure in GiB, of the simulated device unless named host):

    - `peak_gib`: the rank's largest live bytes over the update, weights and optimizer state included;
    - `phases`: per phase, `peak_gib` (live bytes at their highest), `added_gib` (above the phase's start), `held_gib`
      (at its end), `host_peak_gib`, `flops`, `roofline_s` (per op the larger of its FLOPs at the device's peak and its
      bytes at HBM bandwidth, summed), `communication_gib` (collective buffers), `runs`;
    - `largest_allocation`: `gib`, the `op` that made it, its `phase`, `shape` and `dtype`;
    - `oversized`: every allocation spanning the prompt and the model's width (`tracker.Oversize`), which the design
      never makes outside one chunk;
    - `stand_ins`: kernels run as stand-ins (`stand_ins.py`);
    - `answered_reads`: device values the update read that the simulation answered without knowing them (upper
      bounds, True for a boolean check);
    - `sampled_iterations`: loop iterations accounted rather than run (`block_attention.visits`);
    - `world`: the simulated rank, the world's size, the host values mirrored through collectives;
    - `wall_s`: the simulation's own time.
    """

    model: str
    rank: int
    world_size: int
    device_spec: str
    peak_gib: float
    phases: dict
    largest_allocation: dict | None
    oversized: list
    stand_ins: list
    answered_reads: dict
    sampled_iterations: int
    world: dict | None
    ops: int
    wall_s: float

    @property
    def roofline_s(self) -> float:
        """The update's roofline time: every phase's but the set-up ones (weights, optimizer state)."""
        return sum(phase["roofline_s"] for name, phase in self.phases.items() if name not in SETUP_PHASES)

    @property
    def communication_gib(self) -> float:
        return sum(phase["communication_gib"] for name, phase in self.phases.items() if name not in SETUP_PHASES)

    @property
    def weights_gib(self) -> float:
        return self.phases["weights"]["held_gib"]

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "roofline_s": self.roofline_s, "communication_gib": self.communication_gib}

    def format(self) -> str:
        """The report as the console shows it: a row per phase, the largest allocation, the stand-ins."""
        spec = DEVICE_SPECS[self.device_spec]
        where = f"rank {self.rank} of {self.world_size}" if self.world_size > 1 else "one process"
        title = f"simulated: one update on fake CUDA tensors, {where}; roofline on {spec.name}"
        lines = [
            f"{title} ({spec.bf16_tflops:,.0f} TFLOPS bf16, {spec.hbm_tbps} TB/s)",
            "",
            f"  {'phase':<18}{'peak GiB':>10}{'added GiB':>11}{'TFLOP':>11}{'roofline s':>12}{'comm GiB':>10}"
            + f"{'wall s':>9}",
        ]
        for name, phase in self.phases.items():
            lines.append(
                f"  {name:<18}{phase['peak_gib']:>10,.2f}{phase['added_gib']:>11,.2f}{phase['flops'] / 1e12:>11,.1f}"
                f"{phase['roofline_s']:>12,.2f}{phase['communication_gib']:>10,.2f}{phase['wall_s']:>9,.0f}"
            )
        lines.append(
            f"  {'update':<18}{self.peak_gib:>10,.2f}{'':>11}{self.update_flops / 1e12:>11,.1f}"
            f"{self.roofline_s:>12,.2f}{self.communication_gib:>10,.2f}"
        )
        peak_phase = max(
            (name for name in self.phases if name not in SETUP_PHASES), key=lambda name: self.phases[name]["peak_gib"]
        )
        held = self.phases[peak_phase].get("at_peak", [])
        if held:
            lines.append(f"at the peak ({peak_phase}), the largest live allocations:")
            for allocation in held[:8]:
                lines.append(
                    f"  {allocation['gib']:>8,.2f} GiB  {allocation['dtype']:<14}{tuple(allocation['shape'])!s:<30} "
                    f"{allocation['op']} ({allocation['phase']})"
                )
        if self.largest_allocation:
            largest = self.largest_allocation
            lines.append(
                f"largest allocation: {largest['gib']:,.2f} GiB, {largest['dtype']} {tuple(largest['shape'])} by "
                f"{largest['op']} in {largest['phase']}"
            )
        for allocation in self.oversized[:5]:
            lines.append(
                f"OVERSIZED: {allocation['gib']:,.2f} GiB {allocation['dtype']} {tuple(allocation['shape'])} by "
                f"{allocation['op']} in {allocation['phase']}"
            )
        if self.stand_ins:
            lines.append(f"stand-ins: {', '.join(self.stand_ins)}")
        lines.append(f"simulated in {self.wall_s:,.0f} s ({self.ops:,} ops, {self.sampled_iterations:,} sampled)")
        return "\n".join(lines)

    @property
    def update_flops(self) -> float:
        return sum(phase["flops"] for name, phase in self.phases.items() if name not in SETUP_PHASES)


SETUP_PHASES = ("weights", "optimizer_state")


def simulate(
    config,
    setup,
    *,
    model: str = "",
    context_parallel: int = 1,
    weight_shards: int = 1,
    rank: int | None = None,
    device: str | DeviceSpec = "H200",
    decode_steps: int = 0,
    progress: bool = False,
    sample: int = 2,
) -> SimulationReport:
    """Simulate one update of `config` (a `PretrainedConfig`) under `setup` (an `UpdateSetup`: the run's settings,
    the prompt gradient, beta and num_iterations included) on one rank: `context_parallel` ranks per prompt, the
    weights sharded over `weight_shards` ranks by FSDP2 (the world is the larger of the two), the process playing
    `rank` (default `busiest_rank`). `device`: the roofline's device (`DEVICE_SPECS`). `decode_steps`: rollout steps
    to simulate before the update. `progress`: a bar per phase on stderr. `sample`: iterations run of each run of
    interchangeable ones (0: every one; slower). Raises `SimulationFailed` with the process's output's end."""
    from .update import SimulationSpec

    spec_device = device if isinstance(device, DeviceSpec) else device_spec(device)
    world = max(context_parallel, weight_shards)
    if weight_shards > 1 and weight_shards % context_parallel:
        raise ValueError(
            f"weight_shards={weight_shards} must be a multiple of context_parallel={context_parallel}: FSDP2 shards "
            "the weights over every rank of the data-parallel x context-parallel world."
        )
    rank = busiest_rank(setup, context_parallel) if rank is None else rank
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside the simulated world of {world} ranks (0 .. {world - 1}).")
    spec = SimulationSpec(
        config=config.to_dict(),
        setup=dataclasses.asdict(setup),
        model=model,
        prompt_gradient=setup.prompt_gradient,
        context_parallel=context_parallel,
        weight_shards=weight_shards,
        world_size=world,
        rank=rank,
        device_spec=spec_device.name,
        decode_steps=decode_steps,
        reference=setup.beta != 0.0,
        old_scores=setup.num_iterations > 1,
        progress=progress,
        sample=sample,
    )
    return run_simulations([spec], progress=progress)[0]


def run_simulations(specs: list, progress: bool = False) -> list[SimulationReport]:
    """Run `specs` (`update.SimulationSpec`s) one after another in one simulation process (its imports paid once):
    their reports. Raises `SimulationFailed` with the end of the process's output."""
    from .runtime import fake_cuda_library

    library = fake_cuda_library()
    environment = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    child = subprocess.Popen(
        [sys.executable, "-c", _BOOTSTRAP, "" if library is None else str(library)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )
    errors: list[str] = []
    reader = threading.Thread(target=_read_errors, args=(child.stderr, errors, progress), daemon=True)
    reader.start()
    child.stdin.write(json.dumps([dataclasses.asdict(spec) for spec in specs]))
    child.stdin.close()
    out = child.stdout.read()
    child.wait()
    reader.join()
    if progress:
        sys.stderr.write("\n")
    if child.returncode != 0 or not out.strip():
        raise SimulationFailed(f"The simulation failed (exit status {child.returncode}):\n{''.join(errors)[-4000:]}")
    return [SimulationReport(**report) for report in json.loads(out.strip().splitlines()[-1])]


def _read_errors(stream, errors: list[str], progress: bool) -> None:
    """Keep the child's stderr (for a failure's message); pass its progress bars (`update.Progress`) on live."""
    for piece in iter(lambda: stream.read(256), ""):
        errors.append(piece)
        if progress:
            for part in re.split(r"(?=\r)|(?<=\n)", piece):
                if PROGRESS_MARK in part:
                    sys.stderr.write(part)
                    sys.stderr.flush()


def busiest_rank(setup, context_parallel: int) -> int:
    """The rank with the most to do: under context parallelism the one replaying the most members (they go
    round-robin from rank 0), then holding the most prompt tokens to within a page of 64 (the layout splits a prompt
    evenly: shares differ by a token or two), the lowest of equals; rank 0 otherwise (data-parallel ranks run the same
    update, and FSDP2 pads every rank's shards to one size). Rank 0 is also the rank whose recurrent hand-offs a
    simulated world can always answer (world.py)."""
    if context_parallel == 1:
        return 0
    from ..context_parallel import ShardLayout

    layout = ShardLayout.of(setup.prompt_tokens - 1, context_parallel, setup.prefill_chunk_size)
    members = [len(range(rank, setup.group_size, context_parallel)) for rank in range(context_parallel)]
    most = [rank for rank in range(context_parallel) if members[rank] == max(members)]
    fullest = max(layout.held_tokens(rank) for rank in most)
    return min(rank for rank in most if layout.held_tokens(rank) >= fullest - PAGE_TOKENS)


__all__ = ["DEVICE_SPECS", "SimulationFailed", "SimulationReport", "busiest_rank", "run_simulations", "simulate"]
