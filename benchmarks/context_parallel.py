"""Context parallelism on CPU: per-rank time and peak memory of one group's update for cp = 1, 2, ..., and the
communication per prompt token and per replayed token, as formulas checked against the collectives' own counter.

    PYTHONPATH=. .venv/bin/python benchmarks/context_parallel.py --model-preset dense-tiny --prompt-length 8192 \
        --members 4 --completion-length 64 --cps 1,2 --rounds 3 --out benchmarks/results/context-parallel/dense-8192-detach

Each cp runs in `cp` fresh processes (gloo, one thread each): capture the prompt, score the G members, replay each
under autograd and back-propagate a fixed per-token gradient (the update's shape, without TRL's loss), exact mode
adding the prompt backward. Under cp > 1 each rank scores and replays its own members (a stand-in where the last
round has fewer), as the trainer does. Per rank: each phase's wall time, peak RSS above the pre-update baseline
(`ru_maxrss` against the RSS just before the update; on CUDA `max_memory_allocated`), the prompt state's bytes.
`--device cuda` puts every rank's model on the one GPU (gloo between them): the GPU check's cp = 2 point, a check of
the path at GPU scale and of per-rank memory, not of scaling.

`--rounds N` runs the cps N times, interleaved (cp = 1, 2, 1, 2, ...), and reports each phase's median per rank: on
a shared machine a single timing can be far off, and interleaving spreads any drift over both.

Communication (`trl_longstraw.context_parallel.COMMUNICATION`, elements each rank sends to the others), per attention
layer, with `heads` query heads of width `d`, `kv` key heads, value width `dv` (formulas in
`trl_longstraw/context_parallel/step.py`): a capture step sends `(cp - 1) n (heads d + kv (d + dv) + heads (dv + 1))`
for chunks of `n` tokens (the step's longest) and, for a recompute step, `(cp - 1) n (2 heads d + 2 kv (d + dv) +
heads (2 dv + 1))` more in its backward; a replayed or scored token `(cp - 1) heads (d + dv + 1)` forward and
`(cp - 1) heads (2 d + 2 dv + 1)` backward. The script counts what went through the collectives and checks it equals
the formulas.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from presets import PRESETS, build_model, load_config_kwargs

PHASES = ("capture", "score", "replay", "prompt_backward")


def rss_gib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def attention_shape(config) -> tuple[int, int, int, int, list[int]]:
    """(heads, kv heads, d, dv, the attention layers' indices) of the text config."""
    text = config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return heads, kv_heads, dim, dim, [i for i, t in enumerate(types) if t in ("full_attention", "sliding_attention")]


def step_elements(config, cp: int, tokens: int, backward: bool) -> int:
    """Elements one rank sends in one capture (or recompute) step of chunks of `tokens` tokens, per attention layer."""
    heads, kv, d, dv, _ = attention_shape(config)
    forward = tokens * (heads * d + kv * (d + dv) + heads * (dv + 1))
    extra = tokens * (heads * d + kv * (d + dv) + heads * (2 * dv + 1) + heads * d + kv * (d + dv))
    return (cp - 1) * (forward + (extra if backward else 0))


def rows_elements(config, cp: int, tokens: int, backward: bool) -> int:
    """Elements one rank sends for rows of `tokens` tokens (the longest of the round), per attention layer."""
    heads, _, d, dv, _ = attention_shape(config)
    forward = tokens * heads * (d + dv + 1)
    extra = tokens * heads * (d + (2 * dv + 1) + d)
    return (cp - 1) * (forward + (extra if backward else 0))


def formulas(config, layout, cp: int, args) -> dict[str, int]:
    """What each kind of collective should have counted over the update on every rank."""
    _, _, _, _, attention_layers = attention_shape(config)
    layers = config.get_text_config().num_hidden_layers
    in_capture = [i for i in attention_layers if i != layers - 1]  # the last layer's attention output is unread
    steps = [
        max(end - start for start, end in (layout.bounds[c] for c in layout.step_chunks(s)))
        for s in range(layout.steps)
    ]
    width = args.completion_length + 1
    rounds = -(-args.members // cp)
    counted = {
        "capture": sum(step_elements(config, cp, n, False) for n in steps) * len(in_capture),
        "rows": rounds
        * len(attention_layers)
        * (rows_elements(config, cp, width, False) + rows_elements(config, cp, width, True)),
    }
    if args.mode == "exact":
        counted["recompute"] = sum(step_elements(config, cp, n, True) for n in steps) * len(in_capture)
    return {kind: count for kind, count in counted.items() if count}


def rank_main(rank: int, size: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    from trl.trainer.utils import add_fused_lm_head

    from trl_longstraw.context_parallel import COMMUNICATION, ContextParallelGroup, ShardLayout, distribution_over
    from trl_longstraw.engine import LongStrawEngine, prepare_model

    cp = None
    if size > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
        cp = ContextParallelGroup.of()
    _, kwargs = load_config_kwargs(args.model_preset)
    config, model = build_model(kwargs, min_positions=args.prompt_length + args.completion_length + 1)
    device = torch.device(args.device)
    if device.type == "cuda":  # the ranks share one device (gloo): a check of the path at GPU scale, not of scaling
        torch.cuda.set_device(0)
        torch.cuda.reset_peak_memory_stats()
    model.to(device, getattr(torch, args.dtype))
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    vocab = config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, vocab, (args.prompt_length,), generator=generator)
    completions = torch.randint(2, vocab, (args.members, args.completion_length), generator=generator)
    upstream = torch.randn(args.members, args.completion_length, generator=generator).to(device)

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    lengths = torch.full((args.members,), args.completion_length)
    engine = LongStrawEngine(
        args.prefill_chunk_size,
        args.attention_chunk_size,
        prompt_gradient=args.mode,
        distribution=distribution_over(cp),
    )
    baseline = rss_gib()
    times, elements = {}, {}
    COMMUNICATION.clear()
    start = clock()
    state = engine.capture(model, prompt, first_position=0)
    times["capture"] = clock() - start
    if args.mode == "exact":
        state.requires_grad_()
    start = clock()
    with torch.no_grad():
        engine.score(model, state, prompt[-1:], completions, lengths, batch_size=1)
    times["score"] = clock() - start
    start = clock()
    for member in engine.distribution.members(list(range(args.members))):
        if member is None:
            engine.stand_in(model, state, prompt[-1:], completions[0])
            continue
        logps, _ = engine.replay(model, state, prompt[-1:], completions[member], args.completion_length)
        logps.backward(upstream[member])
    times["replay"] = clock() - start
    if args.mode == "exact":
        start = clock()
        engine.backward_prompt(model, state, prompt)
        times["prompt_backward"] = clock() - start
    elements = {kind: COMMUNICATION[kind] for kind in ("capture", "rows", "recompute") if COMMUNICATION[kind]}
    expected = None
    if size > 1:
        expected = formulas(config, ShardLayout.of(args.prompt_length - 1, size, args.prefill_chunk_size), size, args)
    record = {
        "cp": size,
        "rank": rank,
        "held_tokens": state.geometry.num_tokens,
        "state_gib": state.nbytes() / 2**30,
        "peak_rss_gib": peak_rss_gib(),
        "peak_added_gib": peak_rss_gib() - baseline
        if device.type == "cpu"
        else torch.cuda.max_memory_allocated() / 2**30,
        "times_s": times,
        "step_s": sum(times.values()),
        "elements": elements,
        "elements_formula": expected,
    }
    Path(out, f"cp{size}-rank{rank}.json").write_text(json.dumps(record))
    if size > 1:
        dist.destroy_process_group()


def median_records(runs: list[list[dict]]) -> list[dict]:
    """Per (cp, rank): each phase's median over the rounds (memory: the largest)."""
    merged = []
    for records in zip(*runs, strict=True):
        first = dict(records[0])
        first["times_s"] = {
            phase: statistics.median(r["times_s"][phase] for r in records) for phase in records[0]["times_s"]
        }
        first["step_s"] = statistics.median(r["step_s"] for r in records)
        first["peak_added_gib"] = max(r["peak_added_gib"] for r in records)
        first["peak_rss_gib"] = max(r["peak_rss_gib"] for r in records)
        first["rounds"] = len(records)
        merged.append(first)
    return merged


def table(records: list[dict], args) -> str:
    title = (
        f"Model preset `{args.model_preset}`, P = {args.prompt_length}, G = {args.members}, R = "
        f"{args.completion_length}, mode {args.mode}, prefill chunk {args.prefill_chunk_size}, one thread per rank, "
        f"median of {records[0].get('rounds', 1)} interleaved rounds."
    )
    lines = [
        title,
        "",
        (
            "| cp | rank | tokens held | state GiB | peak added GiB | capture s | score s | replay s | prompt backward "
            "s | step s |"
        ),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        t = r["times_s"]
        lines.append(
            f"| {r['cp']} | {r['rank']} | {r['held_tokens']} | {r['state_gib']:.4f} | {r['peak_added_gib']:.3f} | "
            f"{t['capture']:.2f} | {t['score']:.2f} | {t['replay']:.2f} | {t.get('prompt_backward', 0.0):.2f} | "
            f"{r['step_s']:.2f} |"
        )
    one = [r for r in records if r["cp"] == 1]
    if one:
        lines.append("")
        for size in sorted({r["cp"] for r in records if r["cp"] > 1}):
            slowest = max((r for r in records if r["cp"] == size), key=lambda r: r["step_s"])
            ratios = ", ".join(
                f"{phase} {slowest['times_s'][phase] / one[0]['times_s'][phase]:.2f}x"
                for phase in PHASES
                if phase in one[0]["times_s"] and one[0]["times_s"][phase] > 0
            )
            lines.append(
                f"cp = {size} over cp = 1 (the slowest rank): step {slowest['step_s'] / one[0]['step_s']:.2f}x; {ratios}."
            )
    sharded = [r for r in records if r["cp"] > 1]
    if sharded:
        r = sharded[0]
        lines += [
            "",
            f"Communication of rank 0 at cp = {r['cp']} (elements sent to the other ranks; counted = formula): "
            + "; ".join(
                f"{kind} {r['elements'].get(kind, 0):,} = {r['elements_formula'][kind]:,}"
                for kind in r["elements_formula"]
            )
            + ".",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-preset", default="dense-tiny", choices=sorted(PRESETS))
    parser.add_argument("--prompt-length", type=int, default=8192)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--prefill-chunk-size", type=int, default=2048)
    parser.add_argument("--attention-chunk-size", type=int, default=4096)
    parser.add_argument("--mode", choices=("detach", "exact"), default="detach")
    parser.add_argument("--cps", default="1,2")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cuda: every rank on the one GPU (the GPU check)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    sizes = [int(c) for c in args.cps.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            records = []
            for size in sizes:
                init = f"{scratch}/init{size}-{round_}"
                mp.spawn(rank_main, args=(size, init, args, scratch), nprocs=size, join=True)
                records += [json.loads(Path(scratch, f"cp{size}-rank{r}.json").read_text()) for r in range(size)]
            runs.append(records)
    for records in runs:
        for record in records:
            if record["elements_formula"] is not None:
                assert record["elements"] == record["elements_formula"], record
    records = median_records(runs)
    summary = table(records, args)
    print(summary)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "results.json").write_text(json.dumps(runs, indent=1))
        Path(args.out, "summary.md").write_text(summary)


if __name__ == "__main__":
    main()
