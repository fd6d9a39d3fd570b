"""What phase telemetry and the guards cost, on and off, against one group's update (capture + score + replay).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py --out benchmarks/results/overhead.md

Engine level, on CPU, one thread: the `dense-tiny` preset (the README's CPU anchor: Qwen3, 4 layers, hidden 256),
fp32, one group of P prompt tokens, G members of R tokens: capture, score every member (no grad, one at a time),
replay every member under autograd with its backward. Measured:

1. In place (every call timed where it happens, during real groups): `weights_version(model)` (the stale-state
   stamp: the sum of the parameters' version counters, taken at capture and before every scoring and replay
   forward), `Placement.check` (the finiteness flag, one `isfinite().all()` per tensor written into the state,
   chunk by chunk), `PromptState.all_finite` (the one read of that flag per capture: the only sync),
   `check_prepared` (once per capture) and the trainer's `OutputFiniteness` hooks (one `isfinite().all()` per output
   of the input embeddings and of each decoder layer, every forward, ANDed into a device flag). Timing wrappers add
   about a microsecond per call.
2. End to end, A/B: the same group with telemetry on/off (`PhaseTelemetry(enabled=...)`, which is what
   `log_phase_metrics` switches; on, each phase also runs the 5 ms memory-sampling thread) and the guards on/off
   (replaced by no-ops), configurations interleaved round by round, medians reported. On a shared 2-core machine
   the run-to-run spread of a group is a few percent, larger than the guards: the in-place times are the
   measurement, the A/B says whether anything shows above the noise.
3. One empty phase span, telemetry on vs off (microseconds per span).
4. `weights_version` on the parameter lists of Qwen3.6-27B and GLM-5 (their meta-device skeletons), per call.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class CallTimer:
    """Counts the calls of a function and the seconds spent in them."""

    def __init__(self):
        self.calls = 0
        self.seconds = 0.0

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - begin
                self.calls += 1

        return timed


@contextlib.contextmanager
def patched(target, name, replacement):
    original = getattr(target, name)
    setattr(target, name, replacement)
    try:
        yield
    finally:
        setattr(target, name, original)


def build(args):
    from presets import build_model, load_config_kwargs
    from trl.trainer.utils import add_fused_lm_head

    from trl_longstraw.engine import prepare_model

    _, kwargs = load_config_kwargs(args.preset)
    _, model = build_model(kwargs, min_positions=args.prompt_length + args.completion_length + 1)
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def group_inputs(args, vocab):
    import torch

    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, vocab, (args.prompt_length,), generator=generator)
    completions = torch.randint(2, vocab, (args.group_size, args.completion_length), generator=generator)
    lengths = torch.full((args.group_size,), args.completion_length)
    return prompt, completions, lengths


def one_group(engine, model, telemetry, prompt, completions, lengths) -> tuple[float, float]:
    """Capture + score + replay (with backward) of one group: (wall seconds, process CPU seconds, all threads)."""
    import torch

    begin, cpu_begin = time.perf_counter(), time.process_time()
    with telemetry.phase("capture"):
        state = engine.capture(model, prompt, first_position=0)
    telemetry.record_state(state.nbytes())
    with telemetry.phase("score"), torch.no_grad():
        engine.score(model, state, prompt[-1:], completions, lengths, 1)
    with telemetry.phase("replay"):
        for member in range(len(completions)):
            logps, _ = engine.replay(model, state, prompt[-1:], completions[member], int(lengths[member]))
            logps.sum().backward()
    elapsed, cpu = time.perf_counter() - begin, time.process_time() - cpu_begin
    telemetry.flush()
    model.zero_grad(set_to_none=True)
    return elapsed, cpu


def watch_outputs(model, timer: CallTimer | None = None):
    """The trainer's `OutputFiniteness` on `model` (the input embeddings and every decoder layer), its hooks timed by
    `timer`; removed on exit."""
    from trl_longstraw.faults import OutputFiniteness

    stack = contextlib.ExitStack()
    hook = OutputFiniteness._hook
    if timer is not None:
        stack.enter_context(patched(OutputFiniteness, "_hook", lambda self, index: timer.wrap(hook(self, index))))
    stack.callback(OutputFiniteness.of_causal_lm(model).remove)
    return stack


def guards_off():
    """The guards replaced by no-ops (a constant weights version, no finiteness flag, no prepared-model check)."""
    from trl_longstraw import engine as engine_module
    from trl_longstraw.state.placement import Placement

    stack = contextlib.ExitStack()
    stack.enter_context(patched(engine_module, "weights_version", lambda model: (0, 0)))
    stack.enter_context(patched(engine_module, "check_prepared", lambda model: None))
    stack.enter_context(patched(Placement, "check", lambda self, written: None))
    return stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="dense-tiny")
    parser.add_argument("--prompt-length", type=int, default=8192)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=128)
    parser.add_argument("--prefill-chunk-size", type=int, default=2048)
    parser.add_argument("--attention-chunk-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch
    import transformers

    from trl_longstraw import engine as engine_module
    from trl_longstraw.engine import LongStrawEngine
    from trl_longstraw.state.placement import Placement
    from trl_longstraw.state.prompt_state import PromptState
    from trl_longstraw.telemetry import PhaseTelemetry

    device = torch.device("cpu")
    load_before = os.getloadavg()
    model = build(args)
    vocab = model.config.get_text_config().vocab_size
    prompt, completions, lengths = group_inputs(args, vocab)
    engine = LongStrawEngine(args.prefill_chunk_size, args.attention_chunk_size)
    telemetry_on, telemetry_off = PhaseTelemetry(device, enabled=True), PhaseTelemetry(device, enabled=False)
    width = min(16, args.completion_length)  # warm-up: a short prompt and two short members
    one_group(engine, model, telemetry_off, prompt[:1024], completions[:2, :width], torch.tensor([width, width]))

    # 1. the guards timed in place, during real groups (telemetry on, as by default)
    names = ("weights_version", "Placement.check", "all_finite", "check_prepared", "OutputFiniteness hook")
    timers = {name: CallTimer() for name in names}
    in_place, sampler_cpu = [], []
    (sampler,) = telemetry_on.meter.samplers  # the host's RSS sampler (CPU)
    for _ in range(args.repeats):
        for timer in timers.values():
            timer.calls, timer.seconds = 0, 0.0
        readings = []  # the sampling thread's own CPU clock at each of its reads

        def timed_read(read=sampler.read, readings=readings):
            if threading.current_thread().name == "longstraw-memory-sampler":
                readings.append(time.thread_time())
            return read()

        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(sampler, "read", timed_read))
            stack.enter_context(
                patched(
                    engine_module, "weights_version", timers["weights_version"].wrap(engine_module.weights_version)
                )
            )
            stack.enter_context(
                patched(engine_module, "check_prepared", timers["check_prepared"].wrap(engine_module.check_prepared))
            )
            stack.enter_context(patched(Placement, "check", timers["Placement.check"].wrap(Placement.check)))
            stack.enter_context(patched(PromptState, "all_finite", timers["all_finite"].wrap(PromptState.all_finite)))
            stack.enter_context(watch_outputs(model, timers["OutputFiniteness hook"]))
            group_s, _ = one_group(engine, model, telemetry_on, prompt, completions, lengths)
        in_place.append((group_s, {name: (t.calls, t.seconds) for name, t in timers.items()}))
        sampler_cpu.append((len(readings), readings[-1] - readings[0] if len(readings) > 1 else 0.0))

    # 2. end to end, A/B, interleaved
    configurations = {
        "telemetry on, guards on (default)": (telemetry_on, False),
        "telemetry off, guards on": (telemetry_off, False),
        "telemetry on, guards off": (telemetry_on, True),
        "telemetry off, guards off": (telemetry_off, True),
    }
    times = {name: [] for name in configurations}
    for _ in range(args.repeats):
        for name, (telemetry, no_guards) in configurations.items():
            with guards_off() if no_guards else watch_outputs(model):
                times[name].append(one_group(engine, model, telemetry, prompt, completions, lengths))

    # 3. one empty phase span
    spans = {}
    for label, telemetry in (("on", telemetry_on), ("off", telemetry_off)):
        count = 2000
        begin = time.perf_counter()
        for _ in range(count):
            with telemetry.phase("optimizer"):
                pass
        spans[label] = (time.perf_counter() - begin) / count
        telemetry.flush()

    # 4. weights_version on the parameter lists of the large configs (meta skeletons: version counters, no memory)
    from state_accounting import load_config

    from trl_longstraw.architectures import model_skeleton

    large = {}
    for stem in ("qwen3_6_27b", "glm5"):
        skeleton = model_skeleton(
            load_config(str(HERE.parent / "trl_longstraw" / "accounting" / "architectures" / f"{stem}.json"))
        )
        count = 50
        begin = time.perf_counter()
        for _ in range(count):
            engine_module.weights_version(skeleton)
        large[stem] = (sum(1 for _ in skeleton.parameters()), (time.perf_counter() - begin) / count)
        del skeleton

    load_after = os.getloadavg()
    baseline = statistics.median(wall for wall, _ in times["telemetry on, guards on (default)"])
    lines = [
        "# Telemetry and guard overhead (CPU, measured)",
        "",
        "```bash",
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} .venv/bin/python benchmarks/overhead.py "
        + shlex.join(sys.argv[1:]),  # the command as run
        "```",
        "",
        (
            f"Machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores shared with other work, "
            f"torch threads {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}); torch "
            f"{torch.__version__}, transformers {transformers.__version__}. Model `{args.preset}` (fp32), P = "
            f"{args.prompt_length:,}, G = {args.group_size}, R = {args.completion_length}, prefill chunk "
            f"{args.prefill_chunk_size}, attention chunk {args.attention_chunk_size}. One group = capture + score of "
            f"every member + replay (with backward) of every member. {args.repeats} repeats, medians. Load average "
            f"(1 min) {load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end: other jobs shared the cores."
        ),
        "",
        "## Guards, timed in place",
        "",
        f"Group time with the timers in place: median {statistics.median(g for g, _ in in_place):.3f} s.",
        "",
        "| guard | calls per group | total per group | per call | share of the group |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    total = 0.0
    for name in timers:
        calls = in_place[0][1][name][0]
        seconds = statistics.median(entry[name][1] for _, entry in in_place)
        total += seconds
        lines.append(
            f"| `{name}` | {calls} | {seconds * 1e3:.3f} ms | {seconds / max(calls, 1) * 1e6:.1f} us | "
            f"{seconds / baseline:.4%} |"
        )
    lines += [
        f"| all five | | {total * 1e3:.3f} ms | | {total / baseline:.4%} |",
        "",
        "## End to end, A/B",
        "",
        (
            "Wall time and process CPU time (all threads) of the whole group. Both move with the other jobs on the "
            "machine (see the load average): a difference inside the min-max spread is noise, and the in-place "
            "timings above and below are the measurement."
        ),
        "",
        "| configuration | wall, median (min-max) | wall vs default | CPU time, median | CPU vs default |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    default = times["telemetry on, guards on (default)"]
    default_cpu = statistics.median(cpu for _, cpu in default)
    for name, values in times.items():
        walls, cpus = [wall for wall, _ in values], [cpu for _, cpu in values]
        lines.append(
            f"| {name} | {statistics.median(walls):.3f} s ({min(walls):.3f}-{max(walls):.3f}) | "
            f"{statistics.median(walls) / baseline - 1:+.2%} | {statistics.median(cpus):.3f} s | "
            f"{statistics.median(cpus) / default_cpu - 1:+.2%} |"
        )
    reads = statistics.median(n for n, _ in sampler_cpu)
    thread_cpu = statistics.median(c for _, c in sampler_cpu)
    lines += [
        "",
        "## Telemetry's memory sampler, timed in place",
        "",
        (
            f"While a phase runs, a thread reads /proc/self/statm every 5 ms: {reads:,.0f} reads per group here, "
            f"{thread_cpu * 1e3:.1f} ms of that thread's own CPU time per group ({thread_cpu / baseline:.3%} of the "
            "group's wall time; `time.thread_time` between its first and last read, the wake-ups included). It runs "
            "beside the compute thread, so it costs wall time only where it competes for a core or the GIL."
        ),
    ]
    lines += [
        "",
        "## One phase span",
        "",
        (
            f"Entering and leaving an empty phase: {spans['on'] * 1e6:.1f} us with telemetry on (RSS read at both ends, "
            f"the sampler thread woken), {spans['off'] * 1e6:.2f} us off. A group opens 3 spans (capture, score, replay); "
            "the trainer adds the optimizer's once per step."
        ),
        "",
        "## `weights_version` on large models",
        "",
        (
            f"Called 1 + 2G = {1 + 2 * args.group_size} times per group (capture, then before every scoring and every "
            "replay forward; the trainer adds one per kept-state check). Timed on the meta-device skeletons (the sum of "
            "the version counters does not read the weights):"
        ),
        "",
        "| config | parameter tensors | per call | per group |",
        "| --- | ---: | ---: | ---: |",
        *(
            f"| `trl_longstraw/accounting/architectures/{stem}.json` | {n:,} | {per_call * 1e6:.0f} us | "
            f"{per_call * (1 + 2 * args.group_size) * 1e3:.2f} ms |"
            for stem, (n, per_call) in large.items()
        ),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()
