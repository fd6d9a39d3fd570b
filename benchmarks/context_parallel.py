"""Context parallelism on CPU: per-rank peak memory and time of one group's update for cp = 1, 2, ..., and the
communication per replayed token, as a formula checked against the collectives' own counter.

    PYTHONPATH=. .venv/bin/python benchmarks/context_parallel.py --model-preset dense-tiny --prompt-length 8192 \
        --members 4 --completion-length 64 --cps 1,2 --out benchmarks/results/context-parallel

Each cp runs in `cp` fresh processes (gloo, one thread each): capture the prompt, score the G members, replay each
under autograd and back-propagate a fixed per-token gradient (the update's shape, without TRL's loss), exact mode
adding the prompt backward. Per rank: peak RSS above the pre-update baseline (`ru_maxrss`, the kernel's high-water
mark of this process, against the RSS just before the update), each phase's wall time, the prompt state's bytes.

Communication: every replayed token (input width R + 1 per member: the last prompt token starts the replay) at every
attention layer all-reduces `heads * (dv + 2)` elements in the forward (the max log-sum-exp, then the weighted
outputs with their weights) and `heads * d + kv_heads * (d + dv)` in the backward (dq and the own keys' and values'
gradients); scoring has the forward part only. The script counts what went through the replay's collectives
(`trl_longstraw.context_parallel.COMMUNICATION`) and checks it equals the formula.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from presets import PRESETS, build_model, load_config_kwargs


def rss_gib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def replay_elements_per_token(config) -> tuple[int, int]:
    """(forward, backward) elements all-reduced per replayed token, summed over the attention layers."""
    text = config.get_text_config()
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    layers = sum(t == "full_attention" for t in types)
    return layers * heads * (dim + 2), layers * (heads * dim + kv_heads * 2 * dim)


def rank_main(rank: int, size: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    from trl.trainer.utils import add_fused_lm_head

    from trl_longstraw.context_parallel import COMMUNICATION, ContextParallelEngine, ContextParallelGroup
    from trl_longstraw.engine import prepare_model

    cp = None
    if size > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
        cp = ContextParallelGroup.of()
    _, kwargs = load_config_kwargs(args.model_preset)
    config, model = build_model(kwargs, min_positions=args.prompt_length + args.completion_length + 1)
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    vocab = config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, vocab, (args.prompt_length,), generator=generator)
    completions = torch.randint(2, vocab, (args.members, args.completion_length), generator=generator)
    upstream = torch.randn(args.members, args.completion_length, generator=generator)
    lengths = torch.full((args.members,), args.completion_length)
    engine = ContextParallelEngine(
        args.prefill_chunk_size, args.attention_chunk_size, prompt_gradient=args.mode, context_parallel=cp
    )
    baseline = rss_gib()
    times = {}
    start = time.perf_counter()
    state = engine.capture(model, prompt, first_position=0)
    times["capture"] = time.perf_counter() - start
    if args.mode == "exact":
        state.requires_grad_()
    start = time.perf_counter()
    with torch.no_grad():
        engine.score(model, state, prompt[-1:], completions, lengths, batch_size=1)
    times["score"] = time.perf_counter() - start
    COMMUNICATION.clear()
    start = time.perf_counter()
    for member in range(args.members):
        logps, _ = engine.replay(model, state, prompt[-1:], completions[member], args.completion_length)
        logps.backward(upstream[member])
    times["replay"] = time.perf_counter() - start
    counted = {kind: COMMUNICATION[kind] for kind in ("merge", "backward")}
    if args.mode == "exact":
        start = time.perf_counter()
        engine.backward_prompt(model, state, prompt)
        times["prompt_backward"] = time.perf_counter() - start
    forward, backward = replay_elements_per_token(config)
    replayed_tokens = args.members * (args.completion_length + 1)
    record = {
        "cp": size,
        "rank": rank,
        "held_tokens": state.geometry.num_tokens,
        "state_gib": state.nbytes() / 2**30,
        "peak_rss_gib": peak_rss_gib(),
        "peak_added_gib": peak_rss_gib() - baseline,
        "times_s": times,
        "step_s": sum(times.values()),
        "capture_served": served,
        "replay_elements_counted": counted if size > 1 else None,
        "replay_elements_formula": {"merge": forward * replayed_tokens, "backward": backward * replayed_tokens}
        if size > 1
        else None,
        "elements_per_replayed_token": {"forward": forward, "backward": backward},
    }
    Path(out, f"cp{size}-rank{rank}.json").write_text(json.dumps(record))
    if size > 1:
        dist.destroy_process_group()


def table(records: list[dict], args) -> str:
    title = (
        f"Model preset `{args.model_preset}`, P = {args.prompt_length}, G = {args.members}, R = "
        f"{args.completion_length}, mode {args.mode}, prefill chunk {args.prefill_chunk_size}, one thread per rank."
    )
    lines = [
        title,
        "",
        (
            "| cp | rank | tokens held | state GiB | peak RSS GiB | peak added GiB | capture s | score s | replay s | prompt "
            "backward s | step s |"
        ),
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        t = r["times_s"]
        lines.append(
            f"| {r['cp']} | {r['rank']} | {r['held_tokens']} | {r['state_gib']:.4f} | "
            f"{r['peak_rss_gib']:.3f} | {r['peak_added_gib']:.3f} | {t['capture']:.2f} | {t['score']:.2f} | "
            f"{t['replay']:.2f} | {t.get('prompt_backward', 0.0):.2f} | {r['step_s']:.2f} |"
        )
    sharded = [r for r in records if r["cp"] > 1]
    if sharded:
        r = sharded[0]
        per = r["elements_per_replayed_token"]
        communication = (
            f"Replay communication per replayed token (all attention layers, fp32 elements all-reduced per rank): "
            f"forward {per['forward']} ({4 * per['forward']} B), backward {per['backward']} "
            f"({4 * per['backward']} B). Counted over the replay: {r['replay_elements_counted']}; formula: "
            f"{r['replay_elements_formula']}."
        )
        served = "; ".join(
            f"rank {r['rank']}: {r['capture_served'].get('seconds', 0.0):.2f} s, "
            f"{int(r['capture_served'].get('query_key_pairs', 0)):,} query-key pairs"
            for r in sharded
        )
        imbalance = f"Capture attention each rank computed for other ranks' queries: {served}."
        lines += ["", communication, "", imbalance]
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
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    records = []
    with tempfile.TemporaryDirectory() as scratch:
        for size in (int(c) for c in args.cps.split(",")):
            mp.spawn(rank_main, args=(size, f"{scratch}/init{size}", args, scratch), nprocs=size, join=True)
            records += [json.loads(Path(scratch, f"cp{size}-rank{r}.json").read_text()) for r in range(size)]
    for record in records:
        if record["replay_elements_counted"] is not None:
            assert record["replay_elements_counted"] == record["replay_elements_formula"], record
    summary = table(records, args)
    print(summary)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "results.json").write_text(json.dumps(records, indent=1))
        Path(args.out, "summary.md").write_text(summary)


if __name__ == "__main__":
    main()
