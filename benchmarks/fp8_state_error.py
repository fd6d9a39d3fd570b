"""What fp8 prompt-state pages cost: completion log-probs, distributions and the GRPO gradient, against bf16 pages.

    .venv/bin/python benchmarks/fp8_state_error.py --out benchmarks/results/fp8_state_error.md

For each model (a bf16 random-weight decoder: the tests' tiny Qwen3 and a wide one at hidden 1024; the tests' tiny
MLA model and a wide one at GLM-5's latent geometry, `--models` picks) and prompt length, one prompt is captured twice,
with K/V pages (MLA: latent pages) in the model dtype (bf16) and in `float8_e4m3fn` (per-(64-token page, kv head)
scales; MLA: per page), and G completions are scored and replayed from each:

- `max |dlogp|`, `mean |dlogp|`: completion-token log-probs, fp8 pages against bf16 pages;
- `KL`: mean over completion positions of KL(p_bf16 || p_fp8) of the next-token distributions;
- `grad cosine`: cosine between the detach-mode GRPO-style gradients (`sum_i A_i * mean_t logp_it`, random advantages)
  of all parameters, from the two states.

Random weights and random tokens are a stress test, not a trained model: attention is diffuse and values are not
outlier-heavy. Published evidence on trained models is mixed (fp8 KV in serving lost accuracy on some MLA models),
so the default stays the model dtype.
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

import torch
from trl.trainer.utils import add_fused_lm_head

from trl_longstraw.attention import STATE_KWARG
from trl_longstraw.embedded import build_model
from trl_longstraw.engine import LongStrawEngine, prepare_model
from trl_longstraw.state import StateAccess

MODELS = {
    "tiny (qwen3, hidden 64, 2 layers)": {"family": "qwen3"},
    "wide (qwen3, hidden 1024, 16/8 heads of 64, 2 layers)": {
        "family": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 65536,
    },
    "tiny MLA (deepseek_v3, hidden 64, latent 16 + rope 8, 3 layers)": {"family": "deepseek_v3"},
    "wide MLA (deepseek_v3, hidden 1024, 16 heads, latent 512 + rope 64 as GLM-5, 2 dense layers)": {
        "family": "deepseek_v3",
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 512,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "max_position_embeddings": 65536,
    },
}


def next_token_log_probs(model, engine, state, prompt, completion):
    """`[R, vocab]` log-probs of every next token of `[last prompt token, completion[:-1]]` given the state."""
    first = state.start_position + state.num_tokens
    inputs = torch.cat([prompt[-1:], completion[:-1]])[None]
    positions = torch.arange(first, first + inputs.shape[1])
    access = StateAccess(state, "read", positions, engine.attention_chunk_size, state.num_tokens)
    hidden = model.base_model(
        input_ids=inputs, position_ids=positions[None], cache=access, use_cache=False, **{STATE_KWARG: access}
    ).last_hidden_state
    return torch.log_softmax(model.lm_head(hidden[0]).float(), dim=-1)


def gradient(model, engine, state, prompt, completions, advantages):
    model.zero_grad(set_to_none=True)
    for completion, advantage in zip(completions, advantages, strict=True):
        logps, _ = engine.replay(model, state, prompt[-1:], completion, completion.numel())
        (advantage * logps.float().mean()).backward()
    return torch.cat([p.grad.double().reshape(-1) for p in model.parameters() if p.grad is not None])


def measure(model, prompt_length, group_size, completion_length, chunk):
    generator = torch.Generator().manual_seed(prompt_length)
    vocab = model.config.vocab_size
    prompt = torch.randint(2, vocab, (prompt_length,), generator=generator)
    completions = torch.randint(2, vocab, (group_size, completion_length), generator=generator)
    lengths = torch.full((group_size,), completion_length)
    advantages = torch.randn(group_size, generator=generator)
    results = {}
    for name, dtype in (("bf16", "auto"), ("fp8", "float8_e4m3fn")):
        engine = LongStrawEngine(chunk, chunk, prompt_state_dtype=dtype)
        begin = time.perf_counter()
        with torch.no_grad():
            state = engine.capture(model, prompt, 0)
            logps, _ = engine.score(model, state, prompt[-1:], completions, lengths, 1)
            dists = [next_token_log_probs(model, engine, state, prompt, c) for c in completions]
        grad = gradient(model, engine, state, prompt, completions, advantages)
        results[name] = {"logps": logps.float(), "dists": dists, "grad": grad, "bytes": state.nbytes()}
        results[name]["seconds"] = time.perf_counter() - begin
        del state
    bf16, fp8 = results["bf16"], results["fp8"]
    delta = (fp8["logps"] - bf16["logps"]).abs()
    kl = torch.stack(
        [(b.exp() * (b - f)).sum(-1).mean() for b, f in zip(bf16["dists"], fp8["dists"], strict=True)]
    ).mean()
    cosine = torch.nn.functional.cosine_similarity(bf16["grad"], fp8["grad"], dim=0)
    return {
        "max_dlogp": delta.max().item(),
        "mean_dlogp": delta.mean().item(),
        "kl": kl.item(),
        "cosine": cosine.item(),
        "bf16_mib": bf16["bytes"] / 2**20,
        "fp8_mib": fp8["bytes"] / 2**20,
        "seconds": bf16["seconds"] + fp8["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lengths", default="2048,8192,32768")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument(
        "--models", default="all", help="comma-separated prefixes of the model labels (tiny, wide, ...)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    rows = [
        "| model | P | max \\|dlogp\\| | mean \\|dlogp\\| | KL(bf16 \\|\\| fp8) | grad cosine | state bf16 -> fp8 MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    chosen = None if args.models == "all" else tuple(args.models.split(","))
    for label, spec in MODELS.items():
        if chosen is not None and not label.startswith(chosen):
            continue
        spec = dict(spec)
        model = build_model(spec.pop("family"), dtype=torch.bfloat16, **spec)
        add_fused_lm_head(prepare_model(model), outputs=("log_probs", "entropy"))
        for prompt_length in map(int, args.prompt_lengths.split(",")):
            r = measure(model, prompt_length, args.group_size, args.completion_length, args.chunk)
            rows.append(
                f"| {label} | {prompt_length:,} | {r['max_dlogp']:.2e} | {r['mean_dlogp']:.2e} | {r['kl']:.2e} | "
                f"{r['cosine']:.6f} | {r['bf16_mib']:.2f} -> {r['fp8_mib']:.2f} |"
            )
            print(rows[-1], f"({r['seconds']:.0f} s)", flush=True)
    table = "\n".join(rows)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "    .venv/bin/python benchmarks/fp8_state_error.py " + " ".join(
            f"--{k.replace('_', '-')} {shlex.quote(str(v))}" for k, v in vars(args).items() if k != "out"
        )
        args.out.write_text(f"# fp8 prompt-state pages vs bf16 pages\n\n```\n{command}\n```\n\n{table}\n")


if __name__ == "__main__":
    main()
