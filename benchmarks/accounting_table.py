"""One row per architecture file: durable prompt state by kind, at P tokens, next to stock GRPO's lower bound.

    .venv/bin/python benchmarks/accounting_table.py

Reads every `trl_longstraw/accounting/architectures/*.json` (or the files given), accounts each with
`trl_longstraw.accounting.prompt_state_account` (on the meta-device skeleton: no weights) and prints a markdown table.
The model column is the file's `_source` (the Hub model its values were written from), else the file name. Stock
GRPO's lower bound is `stock_activation_bytes` (checkpointed layer inputs of all G members, P + R tokens each).
Computed, not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from state_accounting import GIB, load_config

from trl_longstraw.accounting import prompt_state_account, stock_activation_bytes

ARCHITECTURES = HERE.parent / "trl_longstraw" / "accounting" / "architectures"

KIND_NAMES = {
    "full_attention": "full attention",
    "sliding_attention": "sliding attention",
    "chunked_attention": "chunked attention",
    "gated_deltanet": "GatedDeltaNet",
    "mamba2": "Mamba2",
    "mla_latent": "MLA latent",
    "dsa_indexer_keys": "DSA indexer keys",
}


def human_bytes(num_bytes: float) -> str:
    """`4 KiB`, `3.06 MiB`, `256 B`: binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            break
        num_bytes /= 1024
    if unit == "B":
        return f"{num_bytes:.0f} B"
    digits = 0 if num_bytes >= 100 else 1 if num_bytes >= 10 else 2
    text = f"{num_bytes:.{digits}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text} {unit}"


def model_name(path: Path) -> str:
    source = json.loads(path.read_text()).get("_source")
    return source if source else path.stem


def row(path: Path, prompt_tokens: int, completion_tokens: int, group_size: int, dtype_bytes: int) -> str:
    config = load_config(str(path))
    account = prompt_state_account(config, dtype_bytes=dtype_bytes)
    kinds = []
    for label, part in account.by_layer_type.items():
        name = KIND_NAMES.get(label, label)
        sizes = []
        if part.per_token:
            sizes.append(f"{human_bytes(part.per_token)}/token")
        if part.fixed:
            sizes.append(f"{human_bytes(part.fixed)} fixed")
        kinds.append(f"{part.layers} {name} x {' + '.join(sizes) or '0 B'}")
    durable = account.bytes(prompt_tokens)
    stock = stock_activation_bytes(config, prompt_tokens, completion_tokens, group_size, dtype_bytes)
    return (
        f"| {model_name(path)} (`{config.model_type}`) | {'; '.join(kinds)} | "
        f"{durable / GIB:,.2f} GiB ({human_bytes(account.bytes_per_token())}/token) | {stock / GIB:,.0f} GiB |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "configs", nargs="*", help="architecture JSON files (default: trl_longstraw/accounting/architectures/*.json)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=2_097_152)
    parser.add_argument("--completion-tokens", type=int, default=8192)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--dtype-bytes", type=int, default=2)
    args = parser.parse_args()
    paths = [Path(p) for p in args.configs] or sorted(ARCHITECTURES.glob("*.json"))
    p, r, g = args.prompt_tokens, args.completion_tokens, args.group_size
    print(
        f"P = {p:,} prompt tokens, G = {g}, R = {r:,} completion tokens, {8 * args.dtype_bytes}-bit activations "
        "(recurrent states fp32). Durable state: what LongStraw keeps of one group's prompt (per token: the part "
        "that grows with P). Stock GRPO lower bound: checkpointed layer inputs, layers x G x (P + R) x hidden. "
        "Computed from configs, not measured.\n"
    )
    short = f"{p // 2**20}M" if p % 2**20 == 0 else f"{p:,}"
    print(f"| model | per kind | durable state at {short} tokens | stock GRPO (lower bound) |")
    print("| --- | --- | ---: | ---: |")
    for path in paths:
        print(row(path, p, r, g, args.dtype_bytes))


if __name__ == "__main__":
    main()
