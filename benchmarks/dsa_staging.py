"""Entries a DSA attention call moves from host-resident prompt pages: each distinct pick once (what LongStraw
stages) against every query's picks (gathering on the host) and against the whole prefix (staging it chunk by chunk,
as a dense block is).

Counted, not timed: on a GPU with `prompt_state_device="cpu"` these entries cross PCIe; on this CPU nothing moves, so
the staging is forced (`block_attention.pages_elsewhere`) and every `_Picked` built on the prompt's pages is recorded. The
model and its chunk sizes are the DSA benchmark's (`results/cpu-2core-dsa-sparse-attention/`: GLM-5's ratio of
attention to indexer work, top-256, P / k of GLM-5 at 64K positions when P = 8,192), random weights and tokens:

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/dsa_staging.py --prompt-lengths 4096,8192
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODEL = HERE / "results" / "cpu-2core-dsa-sparse-attention" / "dsa-glm5-proportions.json"


def count(prompt_length: int, args) -> dict:
    import torch
    from presets import build_model, load_config_kwargs
    from trl.trainer.utils import add_fused_lm_head

    from trl_longstraw import block_attention
    from trl_longstraw.engine import LongStrawEngine, prepare_model

    _, kwargs = load_config_kwargs(None, str(args.model_config))
    _, model = build_model(kwargs, min_positions=prompt_length + args.completion_length + 1, dtype="float32", seed=0)
    prepare_model(model)
    add_fused_lm_head(model, outputs=("log_probs",))
    phase = ["capture"]
    moved = defaultdict(lambda: {"calls": 0, "staged": 0, "gathered": 0, "prefix": 0})
    build = block_attention._Picked.__init__

    def recording(self, q, keys, values, block, *rest):
        build(self, q, keys, values, block, *rest)
        if self.entries is not None:  # a call on the prompt's pages
            entry = moved[phase[0]]
            entry["calls"] += 1
            entry["staged"] += self.entries.numel()
            entry["gathered"] += self.index.numel()
            entry["prefix"] += keys.shape[1]

    block_attention.pages_elsewhere = lambda keys, q: True
    block_attention._Picked.__init__ = recording
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(prompt_length)
    prompt = torch.randint(2, vocab, (prompt_length,), generator=generator)
    completions = torch.randint(2, vocab, (args.group_size, args.completion_length), generator=generator)
    lengths = torch.full((args.group_size,), args.completion_length)
    engine = LongStrawEngine(args.prefill_chunk_size, args.attention_chunk_size)
    with torch.no_grad():
        state = engine.capture(model, prompt, first_position=0)
        phase[0] = "score"
        engine.score(model, state, prompt[-1:], completions, lengths, 1)
    return {"P": prompt_length, "G": args.group_size, "R": args.completion_length, "phases": dict(moved)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", type=Path, default=MODEL, help="a Hub-style config of a DSA model")
    parser.add_argument("--prompt-lengths", default="4096,8192", help="comma-separated prompt lengths P")
    parser.add_argument("--group-size", type=int, default=4, help="members scored, G")
    parser.add_argument("--completion-length", type=int, default=64, help="completion tokens per member, R")
    parser.add_argument("--prefill-chunk-size", type=int, default=1024, help="capture chunk (tokens)")
    parser.add_argument("--attention-chunk-size", type=int, default=1024, help="prefix attention chunk (keys)")
    args = parser.parse_args(argv)
    for prompt_length in (int(p) for p in args.prompt_lengths.split(",")):
        print(json.dumps(count(prompt_length, args)), flush=True)


if __name__ == "__main__":
    main()
