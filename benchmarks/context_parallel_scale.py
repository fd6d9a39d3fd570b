"""Context parallelism at the paper's scale, computed (not measured): capture and step time per rank, and bytes each
rank sends, for Qwen3.6-27B and GLM-5 at 2,097,152 prompt positions and cp = 1, 8, 32.

    .venv/bin/python benchmarks/context_parallel_scale.py [--prompt-length 2097152] [--cps 1,8,32]

A model of the work LongStraw's CP scheme does (`trl_longstraw/context_parallel/`), from the architecture configs in
`trl_longstraw/accounting/architectures/`, under stated assumptions:

- FLOPs. Matmuls: 2 per multiply-add. The linear layers of a token: 2 x the active parameters of its decoder layers
  (embeddings and the LM head excluded: a capture computes neither). Causal softmax attention: 4 heads d per (query,
  key) pair (QK and PV), `P^2 / 2` pairs per layer, spread evenly over the ranks (the zigzag layout and the step's
  half-split balance them: `capture_attention_pairs`). MLA absorbed (GLM-5): 2 heads (kv_lora + rope) + 2 heads kv_lora
  per pair; DSA: k = index_topk pairs per query for the attention, and the indexer's `2 index_heads index_dim` per pair
  over every earlier key on each index-computing layer (IndexShare: 20 of GLM-5's 78). GatedDeltaNet (chunked, 64-token
  chunks): `value_heads (4 dk dv + 4 chunk (dk + dv))` per token. The last layer's attention is skipped in a capture.
- Time = FLOPs / (peak x MFU): H200 bf16 dense peak 989 TFLOP/s, MFU 40% (an assumption; flash attention reaches more
  on long sequences, small matmuls less). GatedDeltaNet crosses ranks by state passing
  (`trl_longstraw/state/linear_attention.py`): on a GPU the model's chunked kernel runs twice on every chunk but a
  step's first (from the zero state, then from the arriving starting state), and a run of k recurrent layers between
  attention layers waits `cp - 1` such second runs of one layer per step (each rank's starting state is the previous
  rank's corrected final state): the rule's time times `2 - 1/cp + (cp - 1)/k`, counted.
- Communication per rank (bf16 queries, keys and values; fp32 partials), per attention layer and prompt token:
  `(cp - 1) (2 (heads d + kv (d + dv)) + 4 heads (dv + 1))` bytes in a capture; a recompute sends that and
  `(cp - 1) (2 (2 heads d + 2 kv (d + dv)) + 4 heads (2 dv + 1))` more (`step.py`). Over NVLink 4 through NVSwitch:
  450 GB/s per direction per GPU; the time printed assumes no overlap with compute (an upper bound on its share).
- The step: capture, scoring (G members of R tokens over the whole prompt, forward), replay (forward and backward:
  3x a forward), exact mode's recompute (forward and backward: 3x the capture). G = 8, R = 2,048 (the paper's CP8 run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "trl_longstraw" / "accounting" / "architectures"
PEAK_FLOPS = 989e12  # H200 bf16 dense
MFU = 0.40
LINK_BYTES_PER_S = 450e9  # NVLink 4 per direction per GPU
GDN_CHUNK = 64


def text_config(name: str) -> dict:
    """The architecture's text config as transformers reads it (the class's defaults for what the file leaves out)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**json.loads((CONFIGS / f"{name}.json").read_text())).get_text_config()
    return config.to_dict()


def qwen36_model() -> dict:
    c = text_config("qwen3_6_27b")
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    interval = layers // sum(kind == "full_attention" for kind in c["layer_types"])
    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    vk, vv, dk, dv = (
        c["linear_num_key_heads"],
        c["linear_num_value_heads"],
        c["linear_key_head_dim"],
        c["linear_value_head_dim"],
    )
    mlp = 3 * hidden * c["intermediate_size"]
    attention_params = hidden * heads * d * 2 + hidden * kv * d * 2 + heads * d * hidden  # q (with gate), k, v, o
    gdn_params = hidden * (2 * vk * dk + 2 * vv * dv) + vv * dv * hidden  # q, k, v, z, out
    attention_layers = layers // interval
    return {
        "name": "Qwen3.6-27B",
        "layers": layers,
        "attention_layers": attention_layers,
        "recurrent_run": interval - 1,  # GatedDeltaNet layers between two attention layers
        "linear_flops_per_token": 2
        * (layers * mlp + attention_layers * attention_params + (layers - attention_layers) * gdn_params),
        "pair_flops": 4 * heads * d,  # per (query, key) pair and attention layer
        "sparse_pairs_per_query": None,
        "indexer_pair_flops": 0,
        "indexer_layers": 0,
        "recurrent_flops_per_token": (layers - attention_layers) * vv * (4 * dk * dv + 4 * GDN_CHUNK * (dk + dv)),
        "comm": (heads * d, kv * (d + d), heads * (d + 1)),  # per token: queries, keys + values, partials (elements)
        "comm_backward": (2 * heads * d + 2 * kv * 2 * d, heads * (2 * d + 1)),
    }


def glm5_model() -> dict:
    c = text_config("glm5")
    hidden, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    rank, rope, q_rank = c["kv_lora_rank"], c["qk_rope_head_dim"], c["q_lora_rank"]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    expert = 3 * hidden * c["moe_intermediate_size"]
    dense_mlp = 3 * hidden * c["intermediate_size"]
    dense = c["first_k_dense_replace"]
    active_mlp = dense * dense_mlp + (layers - dense) * (c["num_experts_per_tok"] + c["n_shared_experts"]) * expert
    attention_params = hidden * q_rank + q_rank * heads * (nope + rope) + hidden * (rank + rope)
    attention_params += rank * heads * (nope + v) + heads * v * hidden
    indexer_params = q_rank * c["index_n_heads"] * c["index_head_dim"] + hidden * c["index_head_dim"]
    return {
        "name": "GLM-5",
        "layers": layers,
        "attention_layers": layers,
        "recurrent_run": 0,
        "linear_flops_per_token": 2 * (active_mlp + layers * (attention_params + indexer_params)),
        "pair_flops": 2 * heads * (rank + rope) + 2 * heads * rank,  # absorbed MLA
        "sparse_pairs_per_query": c["index_topk"],
        "indexer_pair_flops": 2 * c["index_n_heads"] * c["index_head_dim"],
        "indexer_layers": sum(kind == "full" for kind in c["indexer_types"]),  # IndexShare: the others reuse it
        "recurrent_flops_per_token": 0,
        "comm": (heads * (rank + rope), (rank + rope) + rank, heads * (rank + 1)),  # latents: keys, their values
        "comm_backward": (2 * heads * (rank + rope) + 2 * (rank + rope), heads * (2 * rank + 1)),
    }


def capture(model: dict, prompt: int, cp: int) -> dict:
    """FLOPs, seconds and bytes per rank of one capture."""
    tokens = prompt / cp
    attention = model["attention_layers"] - 1  # the last layer's attention is skipped
    if model["sparse_pairs_per_query"] is None:
        pairs = prompt * prompt / 2 / cp
    else:
        pairs = tokens * min(model["sparse_pairs_per_query"], prompt)
    indexer_pairs = prompt * prompt / 2 / cp if model["indexer_pair_flops"] else 0
    flops = tokens * model["linear_flops_per_token"] + attention * pairs * model["pair_flops"]
    flops += model["indexer_layers"] * indexer_pairs * model["indexer_pair_flops"]
    recurrent = tokens * model["recurrent_flops_per_token"]
    run = model["recurrent_run"]
    passing = 2 - 1 / cp + (cp - 1) / run if run else 1.0  # the rule's time under state passing (docstring)
    seconds = (flops + recurrent * passing) / (PEAK_FLOPS * MFU)
    queries, keys, partials = model["comm"]
    sent = (cp - 1) * tokens * attention * (2 * (queries + keys) + 4 * partials)
    return {"flops": flops + recurrent, "seconds": seconds, "bytes": sent}


def step(model: dict, prompt: int, cp: int, members: int, completion: int, exact: bool) -> dict:
    taken = capture(model, prompt, cp)
    rows = members * completion / cp  # each rank scores and replays its share of the members
    if model["sparse_pairs_per_query"] is None:
        pairs = rows * prompt / cp * cp  # every rank's rows over this rank's pages: the same total
    else:
        pairs = rows * model["sparse_pairs_per_query"]
    row_flops = rows * model["linear_flops_per_token"] + model["attention_layers"] * pairs * model["pair_flops"]
    score_and_replay = 4 * row_flops / (PEAK_FLOPS * MFU)  # scoring forward + replay forward and backward
    seconds = taken["seconds"] + score_and_replay
    sent = taken["bytes"]
    if exact:
        seconds += 3 * taken["seconds"]
        extra, partial = model["comm_backward"]
        attention = model["attention_layers"] - 1
        sent += taken["bytes"] + (cp - 1) * prompt / cp * attention * (2 * extra + 4 * partial)
    return {"seconds": seconds, "bytes": sent}


def table(prompt: int, cps: list[int], members: int, completion: int) -> str:
    lines = [
        (
            f"P = {prompt:,}, G = {members}, R = {completion:,}; per rank; H200 at {MFU:.0%} of "
            f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s; NVLink {LINK_BYTES_PER_S / 1e9:.0f} GB/s per direction."
        ),
        "",
        "| model | cp | capture PFLOP | capture s | capture GB sent | link s (no overlap) | step s, detach | step s, exact |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for model in (qwen36_model(), glm5_model()):
        for cp in cps:
            taken = capture(model, prompt, cp)
            detach = step(model, prompt, cp, members, completion, exact=False)
            exact = step(model, prompt, cp, members, completion, exact=True)
            lines.append(
                f"| {model['name']} | {cp} | {taken['flops'] / 1e15:,.1f} | {taken['seconds']:,.0f} | "
                f"{taken['bytes'] / 1e9:,.0f} | {taken['bytes'] / LINK_BYTES_PER_S:,.1f} | {detach['seconds']:,.0f} | "
                f"{exact['seconds']:,.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-length", type=int, default=2_097_152)
    parser.add_argument("--cps", default="1,8,32")
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--completion-length", type=int, default=2048)
    args = parser.parse_args()
    print(table(args.prompt_length, [int(c) for c in args.cps.split(",")], args.members, args.completion_length))


if __name__ == "__main__":
    main()
