"""Rollout memory and time: G completions of one P-token prompt, from the prompt state vs TRL's `generate` path.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/rollout.py --out benchmarks/results/rollout-cpu-2core

Each point runs in a fresh process (`--worker`), on the same model, prompt and sampling settings:
  stock-generate     what GRPOTrainer's transformers path does: the prompt repeated G times (RepeatSampler), one
                     `model.generate` over the G rows (G prefills, G prompt caches)
  longstraw-rollout  what LongStrawGRPOTrainer does: one capture of the prompt, the G rows decoded together against
                     it (`trl_longstraw.rollout.decode`)
Both sample (temperature 1) `--completion-length` tokens per row with EOS disabled, so both do the same decode steps.
Memory is the process's resident-set high-water mark during the rollout (VmHWM, reset through /proc/self/clear_refs
right before it) minus the resident set right before it: what the rollout added over the model. Time is wall time.

The prediction checked against the measurement (`suffix_formula_gib`): from G = a to G = b the rollout from the state
adds `(b - a) * capacity * bytes_per_token` of suffix entries (every per-token state kind's bytes per token, from
`trl_longstraw.accounting.prompt_state_account`, in the model's dtype) plus `(b - a) * fixed` recurrent bytes; the
prompt state itself does not grow with G.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
GIB = 1024**3
MODES = ("stock-generate", "longstraw-rollout")


def worker(args) -> dict:
    import torch
    from presets import build_model, load_config_kwargs
    from transformers import GenerationConfig
    from update_worker import _malloc_trim, _status_bytes

    from trl_longstraw.engine import LongStrawEngine, prepare_model
    from trl_longstraw.rollout import PromptRows, decode, prepare_sampling

    _, kwargs = load_config_kwargs(args.preset)
    config, model = build_model(kwargs, min_positions=args.prompt_length + args.completion_length + 1)
    model.eval()
    vocab = config.get_text_config().vocab_size
    prompt = torch.randint(2, vocab, (args.prompt_length,), generator=torch.Generator().manual_seed(1))
    rows = prompt[None].expand(args.group_size, -1)
    generation = GenerationConfig(
        max_new_tokens=args.completion_length,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        pad_token_id=0,
        eos_token_id=[],
        disable_compile=True,
    )
    if args.mode == "longstraw-rollout":
        prepare_model(model)
        engine = LongStrawEngine(prefill_chunk_size=args.prefill_chunk_size, attention_chunk_size=args.chunk_size)
    _malloc_trim()
    baseline = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    start = time.perf_counter()
    with torch.no_grad():
        if args.mode == "stock-generate":
            out = model.generate(input_ids=rows, attention_mask=torch.ones_like(rows), generation_config=generation)
            tokens = out[:, args.prompt_length :]
            capture_s = None
        else:
            state = engine.capture(model, prompt, 0)
            capture_s = time.perf_counter() - start
            sampling = prepare_sampling(model, generation, rows, torch.ones_like(rows))
            tokens = decode(engine, model, [PromptRows(list(range(args.group_size)), prompt, state)], rows, sampling)
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM") - baseline
    assert tokens.shape == (args.group_size, args.completion_length), tokens.shape
    return {
        "mode": args.mode,
        "preset": args.preset,
        "P": args.prompt_length,
        "G": args.group_size,
        "R": args.completion_length,
        "time_s": round(seconds, 3),
        "capture_s": None if capture_s is None else round(capture_s, 3),
        "peak_added_gib": round(peak / GIB, 4),
        "threads": torch.get_num_threads(),
    }


def suffix_bytes_per_row(preset: str, capacity: int, dtype_bytes: int = 4) -> int:
    from presets import build_config, load_config_kwargs

    from trl_longstraw.accounting import prompt_state_account

    _, kwargs = load_config_kwargs(preset)
    config, _ = build_config(kwargs)
    account = prompt_state_account(config, dtype_bytes=dtype_bytes)
    fixed = sum(a.layers * a.fixed for a in account.by_layer_type.values())
    return capacity * account.bytes_per_token() + fixed


def run_point(mode: str, preset: str, P: int, G: int, args) -> dict:
    command = [
        sys.executable, __file__, "--worker", "--mode", mode, "--preset", preset, "--prompt-length", str(P),
        "--group-size", str(G), "--completion-length", str(args.completion_length),
        "--chunk-size", str(args.chunk_size), "--prefill-chunk-size", str(args.prefill_chunk_size),
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.time_cap_s, check=False)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "preset": preset, "P": P, "G": G, "error": f"over the {args.time_cap_s} s cap"}
    if done.returncode != 0:
        return {"mode": mode, "preset": preset, "P": P, "G": G, "error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict], args) -> str:
    intro = (
        f"Rollout of G completions ({args.completion_length} sampled tokens each) of one P-token prompt, "
        f"preset(s) {', '.join(args.presets)}, fp32, {rows[0].get('threads', '?')} threads. "
        "Peak = resident-set high-water mark added during the rollout. Command: "
        f"`{' '.join(sys.argv)}`."
    )
    header = (
        "| preset | P | G | stock generate: peak GiB | time s | LongStraw rollout: peak GiB | time s "
        "| peak ratio | time ratio |"
    )
    lines = [
        intro,
        "",
        header,
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    keyed = {(r["preset"], r["P"], r["G"], r["mode"]): r for r in rows}
    for preset, P, G in sorted({(r["preset"], r["P"], r["G"]) for r in rows}):
        stock = keyed.get((preset, P, G, "stock-generate"), {})
        ours = keyed.get((preset, P, G, "longstraw-rollout"), {})

        def cell(row, key):
            return row.get(key, row.get("error", "-"))

        ratio = time_ratio = "-"
        if "peak_added_gib" in stock and "peak_added_gib" in ours:
            ratio = f"{ours['peak_added_gib'] / max(stock['peak_added_gib'], 1e-9):.3f}"
            time_ratio = f"{ours['time_s'] / stock['time_s']:.3f}"
        lines.append(
            f"| {preset} | {P} | {G} | {cell(stock, 'peak_added_gib')} | {cell(stock, 'time_s')} | "
            f"{cell(ours, 'peak_added_gib')} | {cell(ours, 'time_s')} | {ratio} | {time_ratio} |"
        )
    growth = []
    for preset in args.presets:
        by_g = {r["G"]: r for r in rows if r["preset"] == preset and r["mode"] == "longstraw-rollout"}
        by_g = {g: r for g, r in by_g.items() if r["P"] == args.group_sweep_p and "peak_added_gib" in r}
        if len(by_g) >= 2:
            low, high = min(by_g), max(by_g)
            predicted = (high - low) * suffix_bytes_per_row(preset, args.completion_length) / GIB
            measured = by_g[high]["peak_added_gib"] - by_g[low]["peak_added_gib"]
            growth.append(
                f"- {preset}, P = {args.group_sweep_p}: from G = {low} to G = {high} the rollout's peak grew by "
                f"{measured:.4f} GiB; the suffix formula `(G_high - G_low) * (R * bytes_per_token + fixed)` "
                f"predicts {predicted:.4f} GiB."
            )
    return "\n".join(lines + [""] + growth) + "\n"


def plot(rows: list[dict], args, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for preset in args.presets:
        for mode, style in zip(MODES, ("o--", "s-"), strict=True):
            points = sorted(
                (r["P"], r["peak_added_gib"], r["time_s"])
                for r in rows
                if r["preset"] == preset and r["mode"] == mode and r["G"] == args.group_size and "time_s" in r
            )
            if points:
                P, peak, seconds = zip(*points, strict=True)
                axes[0].loglog(P, peak, style, label=f"{mode} ({preset})")
                axes[1].loglog(P, seconds, style, label=f"{mode} ({preset})")
    axes[0].set(xlabel="prompt tokens P", ylabel="rollout peak added (GiB)", title=f"memory, G = {args.group_size}")
    axes[1].set(xlabel="prompt tokens P", ylabel="rollout wall time (s)", title=f"time, G = {args.group_size}")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "rollout_vs_P.png", dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--preset", default="dense-tiny")
    parser.add_argument("--presets", default="dense-tiny,hybrid-gdn-tiny")
    parser.add_argument("--prompt-length", type=int, default=1024)
    parser.add_argument("--prompt-lengths", default="1024,4096,16384,65536")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--group-sizes", default="2,4,8,16", help="swept at --group-sweep-p")
    parser.add_argument("--group-sweep-p", type=int, default=16384)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--prefill-chunk-size", type=int, default=2048)
    parser.add_argument("--time-cap-s", type=float, default=600)
    parser.add_argument("--out", default="benchmarks/results/rollout-cpu-2core")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    args.presets = args.presets.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = [(p, P, args.group_size) for p in args.presets for P in map(int, args.prompt_lengths.split(","))]
    points += [(p, args.group_sweep_p, G) for p in args.presets for G in map(int, args.group_sizes.split(","))]
    rows = []
    for preset, P, G in dict.fromkeys(points):
        for mode in MODES:
            row = run_point(mode, preset, P, G, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
            (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "summary.md").write_text(markdown(rows, args))
    plot(rows, args, out)
    print((out / "summary.md").read_text())


if __name__ == "__main__":
    main()
