"""GatedDeltaNet across context-parallel ranks: the wavefront LongStraw runs, against the chunked form's state passing.

A capture step gives each of the `cp` ranks one chunk. A recurrent layer's chunk starts from the previous chunk's final
state, held by another rank. Two ways to cross ranks:

- wavefront (what `context_parallel/` does for Mamba2): rank r runs layer l once rank r - 1 has finished it and sent
  its final states; a run of k recurrent layers between two attention layers (which gather every rank's chunk, a barrier) takes
  `k + cp - 1` layer times instead of `k`;
- state passing (flash-linear-attention's `fla.ops.cp`, and what `context_parallel/` does for GatedDeltaNet: each
  rank corrects from the previous rank's corrected final state, a chain of cp - 1 scans, instead of scanning the
  transitions): every rank runs its chunk from a zero state at once; the
  final state is affine in the starting one, `S_end = S_start A + B`, so each rank also computes its chunk's transition
  A (the recurrence again, from the identity, values zeroed), the ranks chain `S_start` along the ring (cp - 1 tiny
  products), and each rank corrects its outputs by the starting state's contribution (the recurrence a third time,
  from S_start, values zeroed). The intra-chunk work (the UT transform, the within-chunk attention) is shared; the
  extra cost per layer is two passes of the sequential scan over the kernel's 64-token blocks.

This measures, on one rank, the layer time and the scan's share of it for the hybrid preset's GatedDeltaNet layer at the
capture chunk, and from them the time per run of k recurrent layers under each scheme (communication not counted).

    .venv/bin/python benchmarks/gdn_state_passing.py --out benchmarks/results/gdn-state-passing.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from presets import build_model, load_config_kwargs
from transformers.models.qwen3_5 import modeling_qwen3_5


def timed(function, repeats: int) -> float:
    """Median seconds of `function()` over `repeats` calls, after one warm-up."""
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scan(query, key, new_values, k_cumdecay, intra_chunk_attn, chunk_decay, state):
    """The gated delta rule's sequential scan over 64-token blocks (transformers' `torch_chunk_gated_delta_rule`,
    second phase), from `state`: the part state passing runs twice more per layer."""
    out = torch.empty_like(new_values)
    for i in range(new_values.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra_chunk_attn[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    return out, state


def measure(chunk: int, repeats: int) -> dict[str, float]:
    _, kwargs = load_config_kwargs("hybrid-gdn-tiny")
    config, model = build_model(kwargs)
    layer = model.eval().model.layers[0]
    hidden = torch.randn(1, chunk, config.hidden_size)
    heads, dk, dv, block = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim, 64
    blocks = chunk // block
    query, key = (torch.randn(1, heads, blocks, block, dk) for _ in range(2))
    new_values, k_cumdecay = torch.randn(1, heads, blocks, block, dv), torch.randn(1, heads, blocks, block, dk)
    intra = torch.randn(1, heads, blocks, block, block).tril()
    chunk_decay = torch.rand(1, heads, blocks, 1, 1)
    state = torch.randn(1, heads, dk, dv)
    rule_inputs = (
        torch.randn(1, chunk, heads, dk),
        torch.randn(1, chunk, heads, dk),
        torch.randn(1, chunk, heads, dv),
        -torch.rand(1, chunk, heads),
        torch.rand(1, chunk, heads),
    )
    with torch.no_grad():
        return {
            "mixer": timed(lambda: layer.linear_attn(layer.input_layernorm(hidden)), repeats),
            "mlp": timed(lambda: layer.mlp(layer.post_attention_layernorm(hidden)), repeats),
            "rule": timed(
                lambda: modeling_qwen3_5.torch_chunk_gated_delta_rule(
                    *rule_inputs, initial_state=state, output_final_state=True
                ),
                repeats,
            ),
            "scan": timed(lambda: scan(query, key, new_values, k_cumdecay, intra, chunk_decay, state), repeats),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=2048, help="tokens per rank per capture step")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--run", type=int, default=3, help="recurrent layers between two attention layers (k)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    seconds = measure(args.chunk, args.repeats)
    layer = seconds["mixer"] + seconds["mlp"]
    k = args.run
    lines = [
        "# GatedDeltaNet across CP ranks: wavefront against state passing",
        "",
        "```bash",
        ".venv/bin/python benchmarks/gdn_state_passing.py --out benchmarks/results/gdn-state-passing.md",
        "```",
        "",
        (
            f"hybrid-gdn-tiny's GatedDeltaNet layer, {args.chunk} tokens per rank, one thread, fp32, medians of "
            f"{args.repeats}: mixer {seconds['mixer'] * 1e3:.2f} ms, MLP {seconds['mlp'] * 1e3:.2f} ms (a layer "
            f"{layer * 1e3:.2f} ms); the gated delta rule {seconds['rule'] * 1e3:.2f} ms, of which the sequential scan "
            f"{seconds['scan'] * 1e3:.2f} ms ({seconds['scan'] / layer:.2f} of a layer)."
        ),
        "",
        (
            f"A run of k = {k} recurrent layers per capture step, where one process runs the cp chunks one after another "
            "(`cp k` layer times), against that: the wavefront `(k + cp - 1) / (cp k)`, state passing "
            "`(1 + 2 scan / layer) / cp` (the ranks' chain of tiny products and all communication not counted)."
        ),
        "",
        "| cp | perfect | wavefront | state passing | faster |",
        "| ---: | ---: | ---: | ---: | --- |",
    ]
    passing_layers = 1 + 2 * seconds["scan"] / layer
    for cp in (2, 4, 8, 32):
        wavefront, passing = (k + cp - 1) / (cp * k), passing_layers / cp
        lines.append(
            f"| {cp} | {1 / cp:.3f} | {wavefront:.3f} | {passing:.3f} | "
            f"{'state passing' if passing < wavefront else 'wavefront'} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
