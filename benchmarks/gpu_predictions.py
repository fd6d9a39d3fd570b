"""The simulator's prediction for every LongStraw point benchmarks/gpu_check.sh measures, and the comparison of both.

    # here, without a GPU: simulate each point (one update on fake CUDA tensors, docs/simulation.md), H200 roofline
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_predictions.py [--only SUBSTRING ...]
    # after a GPU run (gpu_check.sh does this itself, into $OUT/predictions.txt): measured beside predicted
    python benchmarks/gpu_predictions.py --compare "$OUT"

The first form writes benchmarks/results/gpu-predictions.json (merged into the existing file: `--only` recomputes a
subset), the second reads it together with what gpu_check.sh wrote into its $OUT and prints one table: per point and
figure, the measured peak allocated GiB, the predicted GiB and their ratio, the measured seconds, the roofline seconds
(a lower bound: no overlap, no launch cost) and their ratio. `--compare` reads JSON only (no torch import: seconds),
and a missing file or point (a step that timed out, a point its budget skipped) is reported as such.

The points are gpu_check.sh's, with its arguments (keep `SWEEP`, `LONG_PROMPT` and `CONTEXT_PARALLEL` in step with it),
on the preset hybrid-qwen35-gpu (the Qwen3.5/3.6-27B layer geometry at full width, 4 layers) in bf16: full
fine-tuning (no LoRA, no NF4), activation checkpointing off, one process. What each benchmark measures, and so what is
compared (`MEASURES`, printed with the table):

- sweep (benchmarks/update_worker.py, a LongStrawGRPOTrainer's `replay_and_backward` after a warm-up update, then one
  `torch.optim.AdamW` step): `max_memory_allocated` over the update and over the optimizer step, each reset before
  it, beside `memory_allocated` before the update (the weights): the update's and the optimizer's absolute peaks, and
  the trainer's telemetry's per-phase `cuda_allocated_peak_gib` (capture, score, replay, prompt_backward). AdamW's
  state does not exist during the update (the worker's first step creates it): the prediction is the simulator's
  phase peak less the AdamW moments its update starts from. Times: the update and the optimizer step, synchronised;
  the per-phase times are host issue times (telemetry without `sync_phase_metrics`), shown but not comparable.
- long_prompt (benchmarks/long_prompt_point.py, engine level, fp8 state pages, detach): capture, score of G members
  and ONE member's replay with its backward, each phase's `max_memory_allocated` reset at its start (weights, and the
  state after the capture, included), no optimizer. Simulated with G = 1, so that the replay is one member with its
  backward as measured; the score phase's roofline is scaled by G (members are scored one at a time, each the same
  work); its peak is one member's, as it is with G members.
- context_parallel (benchmarks/context_parallel.py, exact mode, cp = 1 and 2 ranks sharing one GPU over gloo):
  each rank's process-wide `max_memory_allocated` from before the weights are moved to the GPU (so weights included)
  over capture, score, the rank's replays with their backward and the prompt backward, no optimizer and no gradient
  all-reduce; phase times per rank. The simulator plays rank 0 (it cannot play a later rank of a hybrid model's CP
  group); its gradient all-reduce and optimizer are left out of the prediction. At cp = 2 both ranks share the device:
  their times are not a device's alone.

Where the simulation runs what the benchmark does not (AdamW's state during the update, the gradient all-reduce),
the prediction leaves it out; where the benchmark allocates what the simulation does not model (the caching
allocator's own workspaces, the non-fused AdamW's intermediates, a state the trainer keeps alive through the
optimizer step in detach mode), the notes under the table say so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PREDICTIONS = HERE / "results" / "gpu-predictions.json"
PRESET = "hybrid-qwen35-gpu"
DEVICE = "H200"
UPDATE_PHASES = ("capture", "score", "replay", "prompt_backward")

# gpu_check.sh's arguments
SWEEP = {  # benchmarks/sweep.py: the LongStraw modes (stock modes need no prediction) and the --grid point
    "points": [(mode, P, 8) for mode in ("longstraw-detach", "longstraw-exact") for P in (8192, 32768, 131072)]
    + [("longstraw-detach", 32768, 2)],
    "completion": 512,
    "prefill_chunk": 16384,
    "attention_chunk": 16384,
}
LONG_PROMPT = {  # benchmarks/long_prompt_point.py
    "prompt_lengths": (131072, 262144, 524288, 1048576, 2097152),
    "group": 8,
    "completion": 512,
    "prefill_chunk": 8192,
    "attention_chunk": 8192,
    "state_dtype": "float8_e4m3fn",
}
CONTEXT_PARALLEL = {  # benchmarks/context_parallel.py
    "cps": (1, 2),
    "prompt": 16384,
    "members": 4,
    "completion": 256,
    "prefill_chunk": 4096,
    "attention_chunk": 4096,
    "mode": "exact",
}

MEASURES = {
    "sweep": "update_worker.py: LongStrawGRPOTrainer.replay_and_backward (capture, score, replay, exact: prompt "
    "backward) then one torch.optim.AdamW step (its state created by that step); full fine-tuning, bf16 weights, no "
    "autocast, no activation checkpointing; max_memory_allocated over the update and over the step (absolute); the "
    "trainer's per-phase telemetry peaks. Predicted: the simulator's phase peaks less AdamW's moments during the "
    "update (the worker has none yet), its optimizer phase as it is.",
    "long_prompt": "long_prompt_point.py: engine capture (fp8 pages), score of G members, ONE member's replay with its "
    "backward; full fine-tuning, bf16, no optimizer; max_memory_allocated per phase, reset at its start (absolute). "
    "Predicted: a G = 1 simulation's phase peaks less AdamW's moments; the score's roofline times G.",
    "context_parallel": "context_parallel.py: per rank, capture, score, the rank's replays with backward, exact "
    "prompt backward; full fine-tuning, bf16, no optimizer, no gradient all-reduce; process-wide max_memory_allocated "
    "(weights included). Predicted: rank 0's phase peaks (capture .. prompt backward) less AdamW's moments.",
}


# ----------------------------------------------------------------------------------------------------------------
# The points and their simulations
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Point:
    key: str
    benchmark: str  # sweep | long_prompt | context_parallel
    mode: str  # detach | exact
    prompt: int
    group: int  # the benchmark's group size
    completion: int
    prefill_chunk: int
    attention_chunk: int
    state_dtype: str = "auto"
    context_parallel: int = 1
    simulated_group: int | None = None  # the group size simulated, where it differs (long_prompt: one replay)
    min_positions: int | None = None  # the position table the benchmark builds

    def setup_fields(self) -> dict:
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "group_size": self.simulated_group or self.group,
            "quantization": "none",
            "lora_rank": None,
            "lora_targets": None,
            "state_dtype": self.state_dtype,
            "state_device": "device",
            "activation_checkpointing": False,
            "prefill_chunk_size": self.prefill_chunk,
            "attention_chunk_size": self.attention_chunk,
            "dtype_bytes": 2,
            "prompt_gradient": self.mode,
        }


def sweep_key(mode: str, P: int, G: int, R: int) -> str:
    return f"sweep/{mode}/P{P}/G{G}/R{R}"


def long_prompt_key(P: int, G: int, R: int) -> str:
    return f"long_prompt/P{P}/G{G}/R{R}"


def context_parallel_key(cp: int, P: int, G: int, R: int, mode: str) -> str:
    return f"context_parallel/cp{cp}/P{P}/G{G}/R{R}/{mode}"


def points() -> list[Point]:
    out = []
    s = SWEEP
    for mode, P, G in s["points"]:
        out.append(
            Point(
                sweep_key(mode, P, G, s["completion"]),
                "sweep",
                mode.split("-", 1)[1],
                P,
                G,
                s["completion"],
                s["prefill_chunk"],
                s["attention_chunk"],
                min_positions=P + s["completion"],
            )
        )
    lp = LONG_PROMPT
    for P in lp["prompt_lengths"]:
        out.append(
            Point(
                long_prompt_key(P, lp["group"], lp["completion"]),
                "long_prompt",
                "detach",
                P,
                lp["group"],
                lp["completion"],
                lp["prefill_chunk"],
                lp["attention_chunk"],
                state_dtype=lp["state_dtype"],
                simulated_group=1,
                min_positions=max(lp["prompt_lengths"]) + lp["completion"] + 1,
            )
        )
    c = CONTEXT_PARALLEL
    for cp in c["cps"]:
        out.append(
            Point(
                context_parallel_key(cp, c["prompt"], c["members"], c["completion"], c["mode"]),
                "context_parallel",
                c["mode"],
                c["prompt"],
                c["members"],
                c["completion"],
                c["prefill_chunk"],
                c["attention_chunk"],
                context_parallel=cp,
                min_positions=c["prompt"] + c["completion"] + 1,
            )
        )
    return out


def simulation_spec(point: Point):
    """The `SimulationSpec` of a point: the preset's config (position table as the benchmark builds it), its setup."""
    sys.path.insert(0, str(HERE))
    from presets import build_config, load_config_kwargs

    from trl_longstraw.accounting import UpdateSetup
    from trl_longstraw.simulation import busiest_rank
    from trl_longstraw.simulation.update import SimulationSpec

    _, kwargs = load_config_kwargs(PRESET)
    config, _ = build_config(kwargs, min_positions=point.min_positions)
    setup = UpdateSetup(**point.setup_fields())
    cp = point.context_parallel
    return SimulationSpec(
        config=config.to_dict(),
        setup=dataclasses.asdict(setup),
        model=PRESET,
        prompt_gradient=setup.prompt_gradient,
        context_parallel=cp,
        weight_shards=1,
        world_size=cp,
        rank=busiest_rank(setup, cp),
        device_spec=DEVICE,
    )


def prediction(point: Point, report) -> dict:
    """Like for like with what the point's benchmark measures (module docstring), from the simulator's report."""
    phases = report.phases
    weights = phases["weights"]["held_gib"]
    moments = phases["optimizer_state"]["held_gib"] - weights  # AdamW's state, held through the simulated update
    capture = phases["capture"]
    state = capture["held_gib"] - (capture["peak_gib"] - capture["added_gib"])
    present = [name for name in UPDATE_PHASES if name in phases]
    # the benchmarks hold no AdamW state while they update
    phase_peaks = {name: phases[name]["peak_gib"] - moments for name in present}
    roofline = {name: phases[name]["roofline_s"] for name in present}
    predicted = {"weights_gib": weights, "state_gib": state, "phases": {}}
    if point.benchmark == "long_prompt":
        roofline["score"] *= point.group / (point.simulated_group or point.group)  # G members, one at a time
    for name in present:
        predicted["phases"][name] = {"peak_gib": phase_peaks[name], "roofline_s": roofline[name]}
    update_peak = max(phase_peaks.values())
    update_roofline = sum(roofline.values())
    if point.benchmark == "sweep":  # world 1: the gradient sync is a no-op, kept in the sum for completeness
        update_roofline += phases.get("gradient_sync", {}).get("roofline_s", 0.0)
        optimizer = phases["optimizer"]
        predicted.update(
            update_peak_gib=update_peak,
            update_roofline_s=update_roofline,
            optimizer_peak_gib=optimizer["peak_gib"],
            optimizer_roofline_s=optimizer["roofline_s"],
            peak_gib=max(update_peak, optimizer["peak_gib"]),
            roofline_s=update_roofline + optimizer["roofline_s"],
        )
    else:
        predicted.update(peak_gib=update_peak, roofline_s=update_roofline)
    return predicted


def simulated_summary(report) -> dict:
    """The simulator's report as it is (its phases include AdamW's state): what the prediction was derived from."""
    keep = ("peak_gib", "added_gib", "held_gib", "flops", "roofline_s", "communication_gib", "wall_s")
    return {
        "peak_gib": report.peak_gib,
        "roofline_s": report.roofline_s,
        "rank": report.rank,
        "world_size": report.world_size,
        "phases": {
            name: {**{k: phase[k] for k in keep}, "at_peak": phase.get("at_peak", [])[:4]}
            for name, phase in report.phases.items()
        },
        "largest_allocation": report.largest_allocation,
        "oversized": len(report.oversized),
        "stand_ins": report.stand_ins,
        "sampled_iterations": report.sampled_iterations,
        "ops": report.ops,
        "wall_s": report.wall_s,
    }


def git_head() -> str:
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return result.stdout.strip()


def library_changes() -> list[str]:
    """trl_longstraw's files that differ from HEAD in the working tree the simulation ran (`git status`)."""
    result = subprocess.run(
        ["git", "status", "--porcelain", "trl_longstraw"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return [line[3:] for line in result.stdout.splitlines()]


def predict(only: list[str], out: Path) -> None:
    from trl_longstraw.simulation import SimulationFailed, run_simulations

    selected = [p for p in points() if not only or any(text in p.key for text in only)]
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update(
        script="benchmarks/gpu_predictions.py",
        preset=PRESET,
        device_spec=DEVICE,
        measures=MEASURES,
        gpu_check={"sweep": SWEEP, "long_prompt": LONG_PROMPT, "context_parallel": CONTEXT_PARALLEL},
    )
    data.setdefault("points", {})
    started = time.perf_counter()
    # one simulation process per benchmark (imports paid once each; a failure loses one benchmark's points only)
    for benchmark in ("sweep", "long_prompt", "context_parallel"):
        group = [p for p in selected if p.benchmark == benchmark]
        if not group:
            continue
        begin = time.perf_counter()
        print(f"simulating {len(group)} {benchmark} point(s) ...", flush=True)
        try:
            reports = run_simulations([simulation_spec(p) for p in group])
        except SimulationFailed as error:
            print(f"  FAILED: {str(error)[-2000:]}", flush=True)
            continue
        for point, report in zip(group, reports, strict=True):
            predicted = prediction(point, report)
            data["points"][point.key] = {
                "benchmark": benchmark,
                "settings": {
                    **dataclasses.asdict(point),
                    "preset": PRESET,
                    "dtype": "bfloat16",
                    "device_spec": DEVICE,
                    "full_fine_tuning": True,
                    "rank": report.rank,
                },
                "predicted": predicted,
                "simulated": simulated_summary(report),
            }
            print(
                f"  {point.key:<48} peak {predicted['peak_gib']:7.2f} GiB  roofline {predicted['roofline_s']:8.3f} s"
                f"  (simulated in {report.wall_s:.0f} s)",
                flush=True,
            )
        print(f"  {benchmark}: {time.perf_counter() - begin:.0f} s", flush=True)
        data["points"] = dict(sorted(data["points"].items(), key=lambda item: order(item[0])))
        data.update(git_head=git_head(), library_changes=library_changes(), wall_s=time.perf_counter() - started)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out} in {time.perf_counter() - started:.0f} s", flush=True)


def order(key: str) -> int:
    keys = [p.key for p in points()]
    return keys.index(key) if key in keys else len(keys)


# ----------------------------------------------------------------------------------------------------------------
# The comparison: what gpu_check.sh wrote into $OUT beside the predictions
# ----------------------------------------------------------------------------------------------------------------
def read_json(path: Path, notes: list[str], missing: str = "the step did not run, or timed out before writing it"):
    if not path.exists():
        notes.append(f"{path}: missing ({missing})")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        notes.append(f"{path}: unreadable ({type(error).__name__}: {error})")
        return None


class Table:
    HEADER = ("point", "figure", "meas GiB", "pred GiB", "ratio", "meas s", "roofline s", "ratio")

    def __init__(self):
        self.rows: list[tuple] = []

    def add(self, point: str, figure: str, measured_gib=None, predicted_gib=None, measured_s=None, roofline_s=None):
        self.rows.append(
            (
                point,
                figure,
                _number(measured_gib),
                _number(predicted_gib),
                _ratio(measured_gib, predicted_gib),
                _number(measured_s, 3),
                _number(roofline_s, 3),
                _ratio(measured_s, roofline_s),
            )
        )

    def note(self, point: str, figure: str, text: str):
        self.rows.append((point, figure, text))

    def format(self) -> str:
        full = [row for row in self.rows if len(row) == len(self.HEADER)] + [self.HEADER]
        widths = [max(len(str(row[i])) for row in full) for i in range(len(self.HEADER))]

        def line(row):
            if len(row) != len(self.HEADER):
                return f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}"
            cells = [f"{row[0]:<{widths[0]}}", f"{row[1]:<{widths[1]}}"]
            cells += [f"{cell:>{width}}" for cell, width in zip(row[2:], widths[2:], strict=True)]
            return "  ".join(cells)

        rule = "  ".join("-" * width for width in widths)
        lines, previous = [line(self.HEADER), rule], None
        for row in self.rows:  # a point's name on its first row only
            lines.append(line(row if row[0] != previous else ("", *row[1:])))
            previous = row[0]
        return "\n".join(lines)


def _number(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(measured, predicted) -> str:
    if measured is None or predicted is None or predicted <= 0:
        return "-"
    return f"{measured / predicted:.2f}"


GIB = 1024**3


def compare_sweep(out: Path, predictions: dict, table: Table, notes: list[str]) -> None:
    results = read_json(out / "results.json", notes)
    rows = {}
    for row in (results or {}).get("runs", []):
        mode = str(row.get("mode", ""))
        if row.get("kind", "sweep") == "sweep" and row.get("model") == PRESET and mode.startswith("longstraw"):
            rows[sweep_key(mode, row.get("P"), row.get("G"), row.get("R"))] = row
    keys = [k for k in predictions if k.startswith("sweep/")]
    for key in keys + [k for k in rows if k not in predictions]:
        entry, row = predictions.get(key), rows.get(key)
        predicted = (entry or {}).get("predicted", {})
        if row is None:
            table.note(key, "-", "not measured (not reached within the sweep's time budget, or no results.json)")
            continue
        if row.get("status") != "ok":
            table.note(key, "-", f"measured: {row.get('status')} ({str(row.get('reason', ''))[:100]})")
            continue
        if entry is None:
            table.note(key, "-", "measured, but no prediction for this point (run gpu_predictions.py here)")
        baseline = row.get("baseline_bytes", 0)
        table.add(
            key,
            "update + optimizer",
            row.get("peak_absolute_bytes", 0) / GIB,
            predicted.get("peak_gib"),
            row.get("time_s"),
            predicted.get("roofline_s"),
        )
        table.add(
            key,
            "  update",
            (row["update_peak_bytes"] + baseline) / GIB if "update_peak_bytes" in row else None,
            predicted.get("update_peak_gib"),
            row.get("update_time_s"),
            predicted.get("update_roofline_s"),
        )
        table.add(
            key,
            "  optimizer step",
            (row["optimizer_peak_bytes"] + baseline) / GIB if "optimizer_peak_bytes" in row else None,
            predicted.get("optimizer_peak_gib"),
            row.get("optimizer_time_s"),
            predicted.get("optimizer_roofline_s"),
        )
        telemetry = row.get("telemetry", {})
        for phase in UPDATE_PHASES:
            peak = telemetry.get(f"longstraw/{phase}/cuda_allocated_peak_gib")
            seconds = telemetry.get(f"longstraw/{phase}/time_s")
            guess = predicted.get("phases", {}).get(phase, {})
            if peak is None and seconds is None and not guess:
                continue
            table.add(key, f"  {phase} (host s)", peak, guess.get("peak_gib"), seconds, guess.get("roofline_s"))
        state = telemetry.get("longstraw/prompt_state_gib")
        if state is not None:
            table.add(key, "  prompt state", state, predicted.get("state_gib"))
        table.add(key, "  weights (baseline)", baseline / GIB, predicted.get("weights_gib"))


def compare_long_prompt(out: Path, predictions: dict, table: Table, notes: list[str]) -> None:
    results = read_json(out / "long_prompt.json", notes)
    measured = {long_prompt_key(p.get("P"), p.get("G"), p.get("R")): p for p in (results or {}).get("points", [])}
    skipped = {
        long_prompt_key(s.get("P"), LONG_PROMPT["group"], LONG_PROMPT["completion"]): s.get("reason", "")
        for s in (results or {}).get("skipped", [])
    }
    keys = [k for k in predictions if k.startswith("long_prompt/")]
    for key in keys + [k for k in measured if k not in predictions]:
        predicted = predictions.get(key, {}).get("predicted", {})
        point = measured.get(key)
        if point is None:
            reason = skipped.get(key, "not reached within the step's time budget, or no long_prompt.json")
            table.note(key, "-", f"not measured: {reason}")
            continue
        phases = point.get("phases", {})
        peaks = [entry.get("cuda_peak_allocated_gib") for entry in phases.values()]
        peaks = [peak for peak in peaks if peak is not None]
        table.add(
            key,
            "capture + score + 1 replay",
            max(peaks) if peaks else None,
            predicted.get("peak_gib"),
            point.get("total_time_s"),
            predicted.get("roofline_s"),
        )
        for phase in ("capture", "score", "replay"):
            entry = phases.get(phase, {})
            guess = predicted.get("phases", {}).get(phase, {})
            table.add(
                key,
                f"  {phase}",
                entry.get("cuda_peak_allocated_gib"),
                guess.get("peak_gib"),
                entry.get("time_s"),
                guess.get("roofline_s"),
            )
        table.add(key, "  prompt state", point.get("state_gib"), predicted.get("state_gib"))


def compare_context_parallel(out: Path, predictions: dict, table: Table, notes: list[str]) -> None:
    runs = read_json(out / "context_parallel" / "results.json", notes)
    records = {}
    for run in runs or []:
        for record in run:
            records.setdefault((record.get("cp"), record.get("rank")), []).append(record)
    c = CONTEXT_PARALLEL
    for cp in sorted({*c["cps"], *(cp for cp, _ in records if isinstance(cp, int))}):
        key = context_parallel_key(cp, c["prompt"], c["members"], c["completion"], c["mode"])
        predicted = predictions.get(key, {}).get("predicted", {})
        ranks = sorted(rank for size, rank in records if size == cp and isinstance(rank, int))
        if not ranks:
            table.note(key, "-", "not measured (the step timed out or did not run)")
            continue
        for rank in ranks:
            record = records[(cp, rank)][-1]  # gpu_check.sh runs one round
            whose = "" if rank == 0 else " (rank 0's prediction)"
            times = record.get("times_s", {})
            table.add(
                key,
                f"rank {rank}: update{whose}",
                record.get("peak_added_gib"),  # on CUDA the process's max_memory_allocated, weights included
                predicted.get("peak_gib"),
                record.get("step_s"),
                predicted.get("roofline_s"),
            )
            for phase in UPDATE_PHASES:
                if phase in times:
                    guess = predicted.get("phases", {}).get(phase, {})
                    table.add(key, f"  {phase}", None, guess.get("peak_gib"), times[phase], guess.get("roofline_s"))
            table.add(key, "  prompt state", record.get("state_gib"), predicted.get("state_gib"))


def compare(out: Path, predictions_path: Path) -> None:
    notes: list[str] = []
    data = read_json(predictions_path, notes, "run this script without --compare to write it") or {}
    predictions = data.get("points", {})
    table = Table()
    compare_sweep(out, predictions, table, notes)
    compare_long_prompt(out, predictions, table, notes)
    compare_context_parallel(out, predictions, table, notes)
    changes = data.get("library_changes") or []
    changed = f" with uncommitted changes to {', '.join(changes)}" if changes else ""
    print(
        f"The simulator's predictions ({predictions_path.name}: {data.get('device_spec', DEVICE)} roofline, "
        f"simulated at {str(data.get('git_head', '?'))[:12]}{changed}) beside what benchmarks/gpu_check.sh measured "
        f"in {out}."
    )
    print(
        "GiB: the caching allocator's allocated bytes at their peak (max_memory_allocated), weights included; "
        "ratio = measured / predicted. Roofline: a lower bound (no overlap, no launch cost, no collectives)."
    )
    print()
    print(table.format())
    print()
    print("What each benchmark measures, and what the prediction is:")
    for benchmark, text in data.get("measures", MEASURES).items():
        print(f"- {benchmark}: {text}")
    print(
        "Known gaps the simulator does not model: the CUDA kernels' own workspaces (cuBLAS, the fused attention "
        "kernels', fla's autotuning), the allocator's rounding (allocations round up to 512 bytes) and the CUDA "
        "context; in the sweep's optimizer step, torch.optim.AdamW's default foreach path allocates intermediates "
        "(an exp_avg_sq-sized sqrt, about the trainable bytes) that the simulated fused AdamW does not, and in "
        "detach mode the trainer keeps the last group's prompt state alive through the step (the simulated update "
        "drops it before the optimizer: `  prompt state` is that amount). The benchmarks run bf16 weights without "
        "autocast, the simulation under bf16 autocast (the trainer's `bf16: true`). Times: the '(host s)' rows are "
        "the trainer's unsynchronised phase times (kernel issue); at cp = 2 both ranks share the one GPU. The "
        "long-prompt point runs with TF32 on, while the roofline counts fp32 matmuls (the attention tiles) at the "
        "non-tensor-core rate."
    )
    for note in notes:
        print(f"note: {note}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", type=Path, default=None, help="gpu_check.sh's $OUT: print measured vs predicted")
    parser.add_argument("--predictions", type=Path, default=PREDICTIONS, help="the predictions JSON (read or written)")
    parser.add_argument("--only", action="append", default=[], help="simulate only points whose key contains this")
    args = parser.parse_args(argv)
    if args.compare is not None:
        compare(args.compare, args.predictions)
        return
    predict(args.only, args.predictions)


if __name__ == "__main__":
    main()
