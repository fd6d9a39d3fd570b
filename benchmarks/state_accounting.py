"""Durable prompt-state bytes per layer type for a model config, next to stock GRPO's lower bound (computed).

    .venv/bin/python benchmarks/state_accounting.py \
        trl_longstraw/accounting/architectures/qwen3_6_27b.json trl_longstraw/accounting/architectures/glm5.json

Each argument is a Hub model directory/id (its `config.json`) or a JSON file of config kwargs with a `model_type`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from trl_longstraw.accounting import prompt_state_account, stock_activation_bytes

GIB = 1024**3


def load_config(source: str) -> PretrainedConfig:
    if source.endswith(".json") and Path(source).is_file():
        kwargs = {k: v for k, v in json.loads(Path(source).read_text()).items() if not k.startswith("_")}
        return AutoConfig.for_model(**kwargs)
    return AutoConfig.from_pretrained(source)


def report(source: str, prompt_tokens: int, completion_tokens: int, group_size: int, dtype_bytes: int) -> str:
    config = load_config(source)
    account = prompt_state_account(config, dtype_bytes=dtype_bytes)
    lines = [
        (
            f"### {Path(source).stem} ({config.model_type}), P = {prompt_tokens:,}, G = {group_size}, "
            f"R = {completion_tokens:,}, {8 * dtype_bytes}-bit activations"
        ),
        "",
        "| layer type | layers | bytes / token / layer | fixed bytes / layer | total at P |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for layer_type, part in account.by_layer_type.items():
        lines.append(
            f"| {layer_type} | {part.layers} | {part.per_token:,} | {part.fixed:,} | "
            f"{part.bytes(prompt_tokens) / GIB:,.2f} GiB |"
        )
    stock = stock_activation_bytes(config, prompt_tokens, completion_tokens, group_size, dtype_bytes)
    lines += [
        (
            f"| **LongStraw durable state** | | {account.bytes_per_token():,} (all layers) | | "
            f"**{account.bytes(prompt_tokens) / GIB:,.2f} GiB** |"
        ),
        (
            f"| stock GRPO, checkpointed layer inputs (lower bound) | {config.get_text_config().num_hidden_layers} | | | "
            f"{stock / GIB:,.0f} GiB |"
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--prompt-tokens", type=int, default=2_097_152)
    parser.add_argument("--completion-tokens", type=int, default=8192)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--dtype-bytes", type=int, default=2)
    args = parser.parse_args()
    for source in args.configs:
        print(report(source, args.prompt_tokens, args.completion_tokens, args.group_size, args.dtype_bytes) + "\n")


if __name__ == "__main__":
    main()
