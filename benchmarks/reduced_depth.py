"""A recipe's simulation at reduced depth: its model's first layers at full width, for what a full-depth run (hours at
2M positions) would take too long to show, phase by phase.

    PYTHONPATH=. .venv/bin/python benchmarks/reduced_depth.py configs/glm5_lora_fsdp2_cp8.yaml \
        --layers 3 --prompt-tokens 262144 --context-parallel 32 --gpus 32 --device H20

Prints the simulation's report (`trl_longstraw.simulation.simulate`, docs/simulation.md) as one JSON line: each
phase's peak, what it added and held. Layer lists of the config (`layer_types`, `mlp_layer_types`, GLM-5's
`indexer_types`) are cut to the layers kept; `--dense-layers` sets how many of them have a dense FFN where the
model has `first_k_dense_replace` (GLM-5: 3 of 78; 1 here by default, so that 3 layers hold 2 MoE ones).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trl_longstraw.plan import recipe_plan_inputs
from trl_longstraw.simulation import simulate

LAYER_LISTS = ("layer_types", "mlp_layer_types", "indexer_types")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--dense-layers", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, required=True)
    parser.add_argument("--context-parallel", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--gpus", type=int, default=1, help="ranks in all (the FSDP2 world where the recipe shards)")
    parser.add_argument("--device", default="H200")
    args = parser.parse_args()
    config, name, setup, context_parallel, shards_weights = recipe_plan_inputs(args.recipe, args.prompt_tokens)
    text = config.get_text_config()
    if not 1 <= args.layers <= text.num_hidden_layers:
        parser.error(f"--layers {args.layers}: give 1 to {text.num_hidden_layers}")
    text.num_hidden_layers = args.layers
    if getattr(text, "first_k_dense_replace", None) is not None:
        text.first_k_dense_replace = args.dense_layers
    for key in LAYER_LISTS:
        if getattr(text, key, None) is not None:
            setattr(text, key, list(getattr(text, key))[: args.layers])
    report = simulate(
        config,
        setup,
        model=name,
        context_parallel=args.context_parallel or context_parallel,
        weight_shards=args.gpus if shards_weights else 1,
        device=args.device,
    )
    print(json.dumps(report.to_dict()))


if __name__ == "__main__":
    main()
