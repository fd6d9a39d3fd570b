"""Soak: hundreds of optimizer steps of a small LongStraw run, its resident set sampled from outside the process.

    .venv/bin/python benchmarks/soak.py --out benchmarks/results/soak

Each `--modes` entry trains in a fresh child process (`--worker`): `LongStrawGRPOTrainer` on the embedded tiny
Qwen3.5-style hybrid (3 GatedDeltaNet + 1 full-attention layer, random weights, the character-level tokenizer; nothing
downloaded), one prompt and its G completions per optimizer step, every prompt `--prompt-length` tokens and every
completion exactly `--completion-length` tokens (`min_new_tokens`), so each step does the same work; evaluation every
`--eval-every` steps, no checkpoints, one torch thread (`--threads`).

- `detach`: the trainer's defaults (`prompt_gradient="detach"`, rollouts from the prompt state, the scored state kept
  for the first replay).
- `exact`: `prompt_gradient="exact"`, the mode with the most autograd state (the prompt state's gradient accumulated
  over the members, then one recompute and backward of the prompt per group).

The parent reads the child's `VmRSS` from `/proc/<pid>/status` every `--interval-s`. The child writes one JSON line
per optimizer step from a `TrainerCallback` (`on_step_begin` to `on_step_end`: generation, scoring, the update and the
optimizer, not logging or evaluation) and, every `--census-every` steps and at the end of warm-up and of the run, a
census after `gc.collect()`: live tensor objects (all, with a `grad_fn`, and the bytes of their distinct storages),
the hooks registered on the model's modules and parameters, the Python objects the collector tracks and the Python
allocator's live blocks (`sys.getallocatedblocks()`). A leaked autograd graph, prompt state or hook shows there as a
count that grows step after step.

Warm-up is the first `--warmup-fraction` of the steps. Reported per mode: the RSS at the end of warm-up (median of
the samples from `warmup - s` to `warmup + s` steps, s = max(2, steps // 20)), the largest RSS after warm-up, the
growth (median of the last post-warm-up quarter's samples against that warm-up-end median), the least-squares slope
of the post-warm-up samples in MiB per 100 steps, the step's wall time, median over the first and the last
post-warm-up quarters, and their ratio, the same for the child's CPU time per step (every thread; reported, not
checked: on a shared machine it tells a slowdown of the run from other work, which moves the wall time only), and the
census at the end of warm-up and at the end. The run fails (exit status 1) when
the growth exceeds `--max-growth-pct`, the step-time ratio leaves `--step-time-ratio` (flat), or live tensors or
hooks grew by more than `--max-tensor-growth` between the end of warm-up and the end.

The child imports trl_longstraw from a `git archive` of `--longstraw-ref` (default `HEAD`) in /tmp, so edits to the
working tree during a soak do not reach it; `--longstraw-ref worktree` measures the checkout.

Results: `soak.json` (settings, per-mode summary, every step's time, the census, every RSS sample), `summary.md` and,
with matplotlib, `soak.png` under `--out`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
MIB = 1024**2
ROOT = Path(__file__).resolve().parents[1]
MODES = ("detach", "exact")
CENSUS_KEYS = ("tensors", "tensors_with_grad_fn", "tensor_mib", "hooks", "gc_objects", "python_blocks")


# ---------------------------------------------------------------------------------------------------------------------
# Child: the training run.


def census(model) -> dict:
    """What is alive in this process after a full collection (about 0.1-0.3 s with the libraries loaded)."""
    gc.collect()
    objects = gc.get_objects()
    import torch

    tensors = with_grad_fn = 0
    storages: dict[int, int] = {}
    for obj in objects:
        if not issubclass(type(obj), torch.Tensor):
            continue
        tensors += 1
        with_grad_fn += obj.grad_fn is not None
        try:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # meta, sparse or wrapper tensors
            pass
    hooks = sum(
        len(getattr(module, name, None) or {})
        for module in model.modules()
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    )
    hooks += sum(len(p._backward_hooks or {}) + len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    modules = torch.nn.modules.module
    hooks += sum(
        len(getattr(modules, name, None) or {})
        for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")
    )
    return {
        "gc_objects": len(objects),
        "tensors": tensors,
        "tensors_with_grad_fn": with_grad_fn,
        "tensor_mib": sum(storages.values()) / MIB,
        "hooks": hooks,
        "python_blocks": sys.getallocatedblocks(),
    }


def census_steps(steps: int, warmup: int, every: int) -> set[int]:
    """The steps whose end takes a census: every `every`-th, the end of warm-up and the last."""
    return set(range(every, steps + 1, every) if every else ()) | {warmup, steps}


def prompts(count: int, length: int, seed: int) -> list[str]:
    """`count` distinct prompts of exactly `length` characters (= tokens under the embedded tokenizer)."""
    import random

    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    return [f"key {1000 + i}: " + "".join(rng.choices(alphabet, k=length - 10)) for i in range(count)]


def char_code_reward(completions, **kwargs):
    return [float(sum(map(ord, str(completion))) % 7) for completion in completions]


def step_recorder(path: str, record_at: set[int]):
    """A callback writing one JSON line per optimizer step: its wall and CPU time, and a census at the steps
    `record_at`."""
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def __init__(self):
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 (closed at on_train_end)
            self.begin = self.cpu = None

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin, self.cpu = time.monotonic(), time.process_time()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            end = time.monotonic()
            cpu = time.process_time() - self.cpu  # every thread of the process
            record = {"step": state.global_step, "begin": self.begin, "end": end, "step_s": end - self.begin}
            record["cpu_s"] = cpu
            if state.global_step in record_at:
                record["census"] = {**census(model), "log_history": len(state.log_history)}
            self.file.write(json.dumps(record) + "\n")

        def on_train_end(self, args, state, control, **kwargs):
            self.file.close()

    return StepRecorder()


def build_trainer(options, callbacks=()):
    """The soak's trainer: one group per optimizer step, fixed prompt and completion lengths, no checkpoints."""
    import torch
    from datasets import Dataset

    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
    from trl_longstraw.embedded import build_model, build_tokenizer

    torch.set_num_threads(options.threads)
    group, length = options.group_size, options.completion_length
    evaluate = options.eval_every > 0
    args = LongStrawGRPOConfig(
        output_dir=str(Path(options.steps_log).parent / f"{options.mode}-trainer"),  # the parent's temporary dir
        per_device_train_batch_size=group,
        per_device_eval_batch_size=group,
        num_generations=group,
        max_completion_length=length,
        generation_kwargs={"min_new_tokens": length},  # every step decodes, scores and replays the same tokens
        max_steps=options.steps,
        learning_rate=options.learning_rate,
        logging_steps=1,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=options.eval_every if evaluate else None,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        seed=0,
        prompt_gradient=options.mode,
        prefill_chunk_size=options.prefill_chunk_size,
        attention_chunk_size=options.attention_chunk_size,
    )
    tokenizer = build_tokenizer()
    model = build_model(options.family, seed=0, vocab_size=len(tokenizer))
    train = Dataset.from_dict({"prompt": prompts(options.num_prompts, options.prompt_length, seed=0)})
    held_out = Dataset.from_dict({"prompt": prompts(2, options.prompt_length, seed=1)}) if evaluate else None
    return LongStrawGRPOTrainer(
        model=model,
        reward_funcs=char_code_reward,
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )


def worker(options, extra_callbacks=()) -> None:
    import trl_longstraw

    with open(options.steps_log, "a") as log:  # which package ran (a snapshot of --longstraw-ref, or the checkout)
        log.write(json.dumps({"package": str(Path(trl_longstraw.__file__).parent)}) + "\n")
    record_at = census_steps(options.steps, warmup_steps(options), options.census_every)
    trainer = build_trainer(options, [step_recorder(options.steps_log, record_at), *extra_callbacks])
    trainer.train()


# ---------------------------------------------------------------------------------------------------------------------
# Parent: launch, sample, analyse.


def warmup_steps(options) -> int:
    return max(1, round(options.steps * options.warmup_fraction))


def read_rss_kib(pid: int) -> tuple[int, int] | None:
    """`(VmRSS, RssAnon)` of `pid` in KiB, or None once it is gone."""
    values = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon"):
                    values[key] = int(rest.split()[0])
    except (OSError, ValueError):
        return None
    return (values["VmRSS"], values.get("RssAnon", 0)) if "VmRSS" in values else None


WORKER_FLAGS = (
    "steps",
    "warmup_fraction",
    "census_every",
    "eval_every",
    "family",
    "group_size",
    "prompt_length",
    "completion_length",
    "num_prompts",
    "prefill_chunk_size",
    "attention_chunk_size",
    "learning_rate",
    "threads",
)


def worker_command(options, mode: str, steps_log: Path) -> list[str]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--mode",
        mode,
        "--steps-log",
        str(steps_log),
    ]
    for name in WORKER_FLAGS:
        command += [f"--{name.replace('_', '-')}", str(getattr(options, name))]
    return command


def run_mode(options, mode: str, work: Path) -> dict:
    """Train `mode` in a child process, sampling its resident set every `interval_s`; returns the raw record."""
    steps_log, console = work / f"{mode}.steps.jsonl", work / f"{mode}.console.log"
    steps_log.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(options.threads), "WANDB_MODE": "disabled"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [options.snapshot, str(ROOT), env.get("PYTHONPATH")]))
    samples = []
    started = time.monotonic()
    with open(console, "w") as log:
        child = subprocess.Popen(
            worker_command(options, mode, steps_log), stdout=log, stderr=subprocess.STDOUT, env=env
        )
        while child.poll() is None:
            rss = read_rss_kib(child.pid)
            if rss is not None:
                samples.append((time.monotonic(), *rss, os.getloadavg()[0]))
            if time.monotonic() - started > options.time_cap_s:
                child.kill()
                child.wait()
                break
            time.sleep(options.interval_s)
    wall = time.monotonic() - started
    lines = [json.loads(line) for line in steps_log.read_text().splitlines()] if steps_log.exists() else []
    steps = [line for line in lines if "step" in line]
    package = next((line["package"] for line in lines if "package" in line), None)
    if child.returncode != 0 or len(steps) < options.steps:
        tail = "".join(console.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(
            f"soak worker ({mode}) ended with status {child.returncode} after {len(steps)} of {options.steps} steps "
            f"in {wall:.0f} s (cap {options.time_cap_s:.0f} s); last lines of {console}:\n{tail}"
        )
    return {"mode": mode, "package": package, "wall_s": wall, "steps": steps, "samples": samples}


def step_positions(samples, steps) -> list[tuple[float, float]]:
    """Each sample's `(position, VmRSS MiB)`, position in optimizer steps (k = the end of step k, fractions
    in between, 0 = the start of the first step); samples before the first step or after the last are dropped."""
    ends = [steps[0]["begin"]] + [s["end"] for s in steps]
    placed, k = [], 1
    for t, rss_kib, *_ in samples:
        if t < ends[0] or t > ends[-1]:
            continue
        while ends[k] < t:
            k += 1
        placed.append((k - 1 + (t - ends[k - 1]) / max(ends[k] - ends[k - 1], 1e-9), rss_kib / 1024))
    return placed


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y on x."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0


def analyse(record: dict, warmup: int) -> dict:
    """The soak's numbers for one mode (see the module docstring)."""
    steps = sorted(record["steps"], key=lambda s: s["step"])
    total = len(steps)
    placed = step_positions(record["samples"], steps)
    after = [(x, y) for x, y in placed if x > warmup]
    half_window = max(2, total // 20)
    at_warmup = [y for x, y in placed if warmup - half_window < x <= warmup + half_window]
    quarter = (total - warmup) / 4
    last_quarter = [y for x, y in placed if x > total - quarter]
    reference = statistics.median(at_warmup)
    end = statistics.median(last_quarter)
    q = max(1, (total - warmup) // 4)

    def quarters(key):
        values = [s[key] for s in steps]
        return statistics.median(values[warmup : warmup + q]), statistics.median(values[total - q :])

    (first_time, last_time), (first_cpu, last_cpu) = quarters("step_s"), quarters("cpu_s")
    censuses = {s["step"]: s["census"] for s in steps if "census" in s}
    start_census, end_census = censuses.get(warmup), censuses.get(total)
    return {
        "mode": record["mode"],
        "package": record["package"],
        "steps": total,
        "warmup_steps": warmup,
        "wall_s": record["wall_s"],
        "samples": len(placed),
        "samples_after_warmup": len(after),
        "rss_warmup_end_mib": reference,
        "rss_max_after_warmup_mib": max(y for _, y in after),
        "rss_last_quarter_mib": end,
        "rss_growth_pct": 100 * (end - reference) / reference,
        "rss_slope_mib_per_100_steps": 100 * slope(after),
        "step_s_first_quarter": first_time,
        "step_s_last_quarter": last_time,
        "step_time_ratio": last_time / first_time,
        "cpu_s_first_quarter": first_cpu,
        "cpu_s_last_quarter": last_cpu,
        "cpu_time_ratio": last_cpu / first_cpu,
        "load_1min_max": max((sample[3] for sample in record["samples"]), default=None),
        "census_warmup_end": start_census,
        "census_end": end_census,
        "census_growth": {key: end_census[key] - start_census[key] for key in CENSUS_KEYS}
        if start_census and end_census
        else None,
        "census": censuses,
    }


def failures(result: dict, options) -> list[str]:
    """The checks a mode failed (empty: it passed)."""
    low, high = options.step_time_ratio
    problems = []
    if result["rss_growth_pct"] > options.max_growth_pct:
        problems.append(f"RSS grew {result['rss_growth_pct']:.2f}% after warm-up (limit {options.max_growth_pct}%)")
    if not low <= result["step_time_ratio"] <= high:
        problems.append(f"step-time ratio {result['step_time_ratio']:.3f} outside [{low}, {high}]")
    growth = result["census_growth"]
    if growth is None:
        problems.append("no census at the end of warm-up and at the end")
    else:
        for key in ("tensors", "tensors_with_grad_fn", "hooks"):
            if growth[key] > options.max_tensor_growth:
                problems.append(f"{key} grew by {growth[key]} after warm-up (limit {options.max_tensor_growth})")
    return problems


def markdown(results: list[dict], options, environment: dict) -> str:
    command = f".venv/bin/python benchmarks/soak.py {' '.join(options.argv)}"
    machine = (
        f"Machine: {environment['machine']}, {environment['cpus']} cores shared with other work, torch threads "
        f"{options.threads}; torch {environment['torch']}, transformers {environment['transformers']}, trl "
        f"{environment['trl']}; trl_longstraw: {environment['trl_longstraw']}. Load average (1 min) "
        f"{environment['load_start']:.1f} at the start, {environment['load_end']:.1f} at the end, at most "
        f"{max(r['load_1min_max'] or 0 for r in results):.1f} during the runs."
    )
    evaluation = f"evaluation every {options.eval_every} steps" if options.eval_every else "no evaluation"
    run = (
        f"Model: the embedded `{options.family}` (random weights, fp32), prompts of {options.prompt_length} tokens "
        f"({options.num_prompts} distinct), G = {options.group_size}, completions of exactly "
        f"{options.completion_length} tokens, one group per optimizer step, lr {options.learning_rate}, prefill chunk "
        f"{options.prefill_chunk_size}, attention chunk {options.attention_chunk_size}, {evaluation}, "
        f"`save_strategy='no'`. {options.steps} optimizer steps per mode, the first {warmup_steps(options)} warm-up; "
        f"RSS (VmRSS) sampled from the parent every {options.interval_s} s."
    )
    header = (
        "| mode | RSS at warm-up end MiB | max after MiB | last quarter MiB | growth | slope MiB / 100 steps "
        "| step s first / last quarter | ratio | CPU s first / last | CPU ratio | tensors warm-up end -> end "
        "| with grad_fn | hooks | GC objects | Python blocks | checks |"
    )
    low, high = options.step_time_ratio
    checks = (
        f"Checks: growth <= {options.max_growth_pct}%, step-time ratio (last / first post-warm-up quarter, medians) "
        f"in [{low}, {high}], live tensors, tensors with a `grad_fn` and hooks grown by at most "
        f"{options.max_tensor_growth} from the end of warm-up to the end. The census is taken after `gc.collect()` "
        f"every {options.census_every} steps. CPU time is the child's (every thread), per step; it is reported, not "
        "checked, to tell a slowdown of the run from other work on the machine (the wall-time ratio moves with both). "
        "GC objects and Python allocator blocks are reported, not checked: the "
        "trainer's `state.log_history` keeps one entry per logged step for the whole run (logging every step here)."
    )
    lines = ["# Soak (CPU, measured)", "", "```bash", command.rstrip(), "```", "", machine, "", run, "", header]
    lines.append(
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | --- | --- | --- | --- | --- | --- |"
    )
    for r in results:
        start, end = r["census_warmup_end"] or {}, r["census_end"] or {}
        pairs = " | ".join(
            f"{start.get(key, '-')} -> {end.get(key, '-')}"
            for key in ("tensors", "tensors_with_grad_fn", "hooks", "gc_objects", "python_blocks")
        )
        lines.append(
            f"| {r['mode']} | {r['rss_warmup_end_mib']:.1f} | {r['rss_max_after_warmup_mib']:.1f} "
            f"| {r['rss_last_quarter_mib']:.1f} | {r['rss_growth_pct']:+.2f}% "
            f"| {r['rss_slope_mib_per_100_steps']:+.2f} "
            f"| {r['step_s_first_quarter']:.3f} / {r['step_s_last_quarter']:.3f} | {r['step_time_ratio']:.3f} "
            f"| {r['cpu_s_first_quarter']:.3f} / {r['cpu_s_last_quarter']:.3f} | {r['cpu_time_ratio']:.3f} "
            f"| {pairs} | {'; '.join(r['failures']) or 'pass'} |"
        )
    return "\n".join([*lines, "", checks, ""])


def plot(results: list[dict], records: list[dict], options, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (memory, timing) = plt.subplots(1, 2, figsize=(11, 4))
    for result, record in zip(results, records, strict=True):
        steps = sorted(record["steps"], key=lambda s: s["step"])
        placed = step_positions(record["samples"], steps)
        memory.plot([x for x, _ in placed], [y for _, y in placed], lw=0.8, label=result["mode"])
        line = timing.plot([s["step"] for s in steps], [s["step_s"] for s in steps], lw=0.8, label=result["mode"])
        cpu = [s["cpu_s"] for s in steps]
        timing.plot([s["step"] for s in steps], cpu, lw=0.6, ls="--", color=line[0].get_color(), label="  CPU time")
    for axis in (memory, timing):
        axis.axvline(warmup_steps(options), color="grey", ls=":", lw=0.8)
        axis.set_xlabel("optimizer step")
        axis.legend()
    memory.set_ylabel("child VmRSS, MiB (sampled from the parent)")
    timing.set_ylabel("step wall time (solid) and process CPU time (dashed), s")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)
    plt.close(fig)


def library_snapshot(ref: str) -> tuple[str | None, str]:
    """`git archive` of trl_longstraw at `ref` into /tmp, put first on the child's `PYTHONPATH` (other people edit
    the working tree while a soak runs); `"worktree"`: the checkout itself. Returns the path and a description."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    if ref == "worktree":
        dirty = " (uncommitted changes in trl_longstraw/)" if git("status", "--porcelain", "trl_longstraw") else ""
        return None, f"worktree at {git('rev-parse', 'HEAD')[:12]}{dirty}"
    commit = git("rev-parse", ref)
    target = Path(tempfile.gettempdir()) / f"trl_longstraw-snapshot-{commit[:12]}"
    if not (target / "trl_longstraw").exists():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", commit, "trl_longstraw"], cwd=ROOT, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return str(target), f"git {commit[:12]}"


def environment() -> dict:
    from importlib import metadata

    return {
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        **{name: metadata.version(name) for name in ("torch", "transformers", "trl")},
        "load_start": os.getloadavg()[0],
    }


def run_soak(options) -> tuple[list[dict], list[dict]]:
    """Every mode of `options.modes`, one after the other; writes `soak.json`, `summary.md` (and `soak.png`) under
    `options.out` and returns the per-mode results and the raw records."""
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    options.snapshot, library = library_snapshot(options.longstraw_ref)
    env = {**environment(), "trl_longstraw": library}
    results, records = [], []
    with tempfile.TemporaryDirectory(prefix="soak-") as work:
        for mode in options.modes:
            record = run_mode(options, mode, Path(work))
            result = analyse(record, warmup_steps(options))
            result["failures"] = failures(result, options)
            results.append(result)
            records.append(record)
            print(summary_line(result), flush=True)
    env["load_end"] = os.getloadavg()[0]
    settings = {k: v for k, v in vars(options).items() if k not in ("argv", "out", "snapshot")}
    (out / "soak.json").write_text(
        json.dumps({"settings": settings, "environment": env, "results": results, "raw": records}, indent=1)
    )
    (out / "summary.md").write_text(markdown(results, options, env))
    plot(results, records, options, out)
    return results, records


def summary_line(r: dict) -> str:
    growth = r["census_growth"] or {}
    return (
        f"{r['mode']}: {r['steps']} steps in {r['wall_s']:.0f} s; RSS {r['rss_warmup_end_mib']:.1f} MiB at warm-up "
        f"end, max {r['rss_max_after_warmup_mib']:.1f} after, growth {r['rss_growth_pct']:+.2f}%, slope "
        f"{r['rss_slope_mib_per_100_steps']:+.2f} MiB/100 steps; step {r['step_s_first_quarter']:.3f} -> "
        f"{r['step_s_last_quarter']:.3f} s (x{r['step_time_ratio']:.3f}), CPU x{r['cpu_time_ratio']:.3f}; growth of "
        f"tensors {growth.get('tensors')}, with grad_fn {growth.get('tensors_with_grad_fn')}, hooks "
        f"{growth.get('hooks')}, GC objects {growth.get('gc_objects')}; {'; '.join(r['failures']) or 'pass'}"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--steps-log", help=argparse.SUPPRESS)
    p.add_argument("--modes", default=",".join(MODES), type=lambda s: s.split(","))
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per mode")
    p.add_argument("--warmup-fraction", type=float, default=0.1)
    p.add_argument("--census-every", type=int, default=10, help="steps between censuses (0: warm-up end and end)")
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations (0: none)")
    p.add_argument("--family", default="qwen3_5", help="embedded model family (trl_longstraw.embedded.FAMILIES)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=512)
    p.add_argument("--completion-length", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prefill-chunk-size", type=int, default=128)
    p.add_argument("--attention-chunk-size", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--interval-s", type=float, default=0.2, help="RSS sampling interval of the parent")
    p.add_argument("--time-cap-s", type=float, default=1800, help="per mode; the child is killed past it")
    p.add_argument("--max-growth-pct", type=float, default=2.0)
    p.add_argument("--step-time-ratio", type=lambda s: tuple(map(float, s.split(","))), default=(0.8, 1.25))
    p.add_argument("--max-tensor-growth", type=int, default=0)
    p.add_argument(
        "--longstraw-ref",
        default="HEAD",
        help="git ref of trl_longstraw to measure (exported to /tmp), or 'worktree' for the checkout",
    )
    p.add_argument("--out", default="benchmarks/results/soak")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options = parser().parse_args(argv)
    if options.worker:
        worker(options)
        return 0
    options.argv = argv
    results, _ = run_soak(options)
    print((Path(options.out) / "summary.md").read_text())
    return 1 if any(r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
