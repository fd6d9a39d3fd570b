"""Predicted device memory of one whole LongStraw update (detach mode), next to one H200: the table in docs/memory.md.

    .venv/bin/python benchmarks/update_accounting.py                      # docs/memory.md's rows (2,097,152 positions)
    .venv/bin/python benchmarks/update_accounting.py --completion-tokens 2048 --breakdown
    .venv/bin/python benchmarks/update_accounting.py --context-parallel 8          # the same rows, per CP rank
    .venv/bin/python benchmarks/update_accounting.py \
        --recipe configs/qwen3_6_27b_qlora_cp8.yaml@2097152 --recipe configs/qwen3_8b_lora_cp2.yaml@32768

Each row is `trl_longstraw.accounting.update_account` on a file of `trl_longstraw/accounting/architectures/` (meta-device skeleton, no
weights): weights (bf16, or NF4 as bitsandbytes stores it), LoRA adapters with their fp32 AdamW state (counted by
PEFT on the skeleton), the prompt state by dtype and placement, and the ESTIMATED working set, the larger of one
replay's autograd graph and one capture chunk's transients. Weights, LoRA and state are byte counts (checked against
real allocations in tests/test_accounting.py); the working set is an estimate. Nothing here is measured on a GPU.

Per context-parallel rank (`--context-parallel N`, or `--recipe PATH@P`, which reads the model, LoRA, chunk sizes,
completion length, G and `context_parallel_size` from a recipe YAML at P prompt positions): what CP shards by
sequence (full-attention K/V pages, MLA latent pages, DSA indexer keys) is counted for the rank holding the most of
the captured tokens (`context_parallel.ShardLayout`: one chunk per rank per capture step), what it replicates
(GatedDeltaNet / Mamba2 conv and recurrent states and sliding windows, fixed size) in full on every rank; every rank
holds the whole model and the adapters with their optimizer state, and its working set is one process's (a capture
step adds the step's gathered queries, keys and values, one chunk per rank). Layer kinds CP refuses (chunked attention) mark a row refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from state_accounting import GIB, load_config

from trl_longstraw.accounting import UpdateAccount, UpdateSetup, update_account
from trl_longstraw.plan import Plan, plan_run, recipe_plan_inputs

ARCHITECTURES = HERE.parent / "trl_longstraw" / "accounting" / "architectures"
H200_USABLE_GIB = 139  # 141 GB of HBM3e: CUDA reports about 140 GiB, about 139 GiB free to a process after its context
GLM5_RECIPE = HERE.parent / "configs" / "glm5_lora_fsdp2_cp8.yaml"


def rows(prompt_tokens: int, completion_tokens: int, group_size: int) -> list[tuple[str, str, UpdateSetup]]:
    """(architecture file, label, setup): the recipes' chunk sizes, LoRA scope and placement."""
    qwen = UpdateSetup(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        group_size=group_size,
        quantization="nf4",
        double_quant=True,  # use_bnb_nested_quant in configs/qwen3_6_27b_qlora.yaml
        lora_rank=16,
        lora_targets="all-linear",
        state_dtype="float8_e4m3fn",
        activation_checkpointing=True,
        prefill_chunk_size=16384,
        attention_chunk_size=8192,
    )
    # the recipe's own LoRA scope, chunk sizes and placement
    recipe = recipe_plan_inputs(GLM5_RECIPE, prompt_tokens)[2]
    glm = dataclasses.replace(recipe, completion_tokens=completion_tokens, group_size=group_size)
    return [
        ("qwen3_6_27b", "NF4 QLoRA r16 all-linear, fp8 state, checkpointing", qwen),
        (
            "qwen3_6_27b",
            "NF4 QLoRA r16 all-linear, bf16 state, checkpointing",
            dataclasses.replace(qwen, state_dtype="auto"),
        ),
        (
            "qwen3_6_27b",
            "NF4 QLoRA r16 all-linear, fp8 state, no checkpointing",
            dataclasses.replace(qwen, activation_checkpointing=False),
        ),
        ("glm5", "bf16 LoRA r8 (recipe scope), bf16 state in host memory, checkpointing", glm),
    ]


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:,.1f}"


def verdict(account: UpdateAccount) -> str:
    device = account.device_bytes / GIB
    if device <= H200_USABLE_GIB:
        return f"fits ({H200_USABLE_GIB - device:,.1f} GiB spare)"
    return f"does not fit (>= {math.ceil(device / H200_USABLE_GIB)} H200s of memory)"


def working_set_cell(account: UpdateAccount) -> str:
    """The working set and which graph it is, with PEFT's merged expert stack where LoRA adapts fused experts."""
    work = account.working_set
    which = "replay" if work is account.replay else "capture chunk"
    if account.merge_check:
        which += " + merged expert stack"
    return f"{gib(work.bytes + account.merge_check)} ({which})"


def table_row(name: str, label: str, account: UpdateAccount) -> str:
    setup = account.setup
    where = "host" if setup.state_device == "cpu" else "device"
    state_dtype = "fp8 pages" if setup.state_dtype == "float8_e4m3fn" else "model dtype"
    work = account.working_set
    lora = account.lora.bytes if account.lora else 0
    return (
        f"| {name} | {label} | {gib(account.weights.bytes)} | {gib(lora)} | "
        f"{gib(account.state_bytes)} ({state_dtype}, {where}) | {working_set_cell(account)} | "
        f"{gib(work.indexer)} | **{gib(account.device_bytes)}** | {gib(account.host_bytes)} | {verdict(account)} |"
    )


def breakdown(name: str, label: str, account: UpdateAccount) -> str:
    lines = [f"{name}, {label}:"]
    weights = account.weights
    lines.append(
        f"  weights {gib(weights.bytes)} GiB: {weights.quantized_params / 1e9:.2f}B NF4 values "
        f"({gib(weights.quantized_bytes)} GiB), {weights.dense_params / 1e9:.2f}B full-width ({gib(weights.dense_bytes)} "
        "GiB)"
    )
    if account.lora:
        dtype = {2: "bf16", 4: "fp32"}.get(account.lora.value_bytes, f"{account.lora.value_bytes}-byte")
        lines.append(
            f"  LoRA rank {account.lora.rank}: {account.lora.params / 1e6:,.1f}M values x {4 * account.lora.value_bytes} "
            f"B ({dtype} weight, grad, exp_avg, exp_avg_sq) = {gib(account.lora.bytes)} GiB"
        )
    lines.append("  state: " + ", ".join(f"{label} {gib(n)} GiB" for label, n in account.state.items()))
    for graph_name, graph in (("replay (estimate)", account.replay), ("capture chunk (estimate)", account.capture)):
        terms = ", ".join(
            f"{field.name} {gib(getattr(graph, field.name))}"
            for field in dataclasses.fields(graph)
            if field.name != "tokens" and getattr(graph, field.name)
        )
        lines.append(f"  {graph_name}, {graph.tokens:,} tokens: {gib(graph.bytes)} GiB = {terms}")
    if account.merge_check:
        lines.append(
            f"  merged expert stack, once per forward (PEFT's parametrization check): {gib(account.merge_check)} GiB"
        )
    lines.append(f"  group scalars (G x R fp32 x 8): {account.group_scalars / 2**20:.2f} MiB")
    setup = account.setup
    on_device = account.state_bytes if setup.state_device == "device" else 0
    lines.append(
        f"  rollout: {setup.prompts_per_generation} prompt state(s) + {setup.prompts_per_generation} x G rows' decoded "
        f"tokens ({account.decoded_row / 2**20:,.1f} MiB a row) = {gib(account.rollout_bytes(on_device))} GiB on the "
        "device"
    )
    return "\n".join(lines)


def recipe_entry(path: Path, prompt_tokens: int) -> tuple[str, str, object, UpdateSetup, int]:
    """(model column, label, config, setup, context_parallel_size) of a recipe YAML at `prompt_tokens` positions, read
    as `trl-longstraw plan --config` reads it (`trl_longstraw.plan.recipe_plan_inputs`)."""
    config, name, setup, context_parallel, _ = recipe_plan_inputs(path, prompt_tokens)
    if setup.lora_rank is None:
        raise SystemExit(f"{path}: the table's rows are LoRA runs (use_peft: true)")
    weights = "NF4 QLoRA" if setup.quantization == "nf4" else "bf16 LoRA"
    checkpointing = "checkpointing" if setup.activation_checkpointing else "no checkpointing"
    label = f"`{path.name}`: {weights} r{setup.lora_rank}, {checkpointing}"
    return f"`{name}`", label, config, setup, context_parallel


def rank_row(name: str, label: str, plan: Plan) -> str:
    account, cp = plan.account, plan.context_parallel
    setup = account.setup
    lora = account.lora.bytes if account.lora else 0
    where = "" if setup.state_device == "device" else ", host"
    if plan.refused_under_cp:
        fits = f"refused under CP ({', '.join(plan.refused_under_cp)})"
    else:
        device = plan.device_bytes / GIB
        fits = f"fits ({H200_USABLE_GIB - device:,.1f} GiB spare)" if device <= H200_USABLE_GIB else "does not fit"
    return (
        f"| {name} | {label} | {cp} | {setup.prompt_tokens:,} | {gib(account.weights.bytes)} | {gib(lora)} | "
        f"{gib(account.state_bytes)} | {gib(plan.sharded_state)}{where} | {gib(plan.replicated_state)}{where} | "
        f"{working_set_cell(account)} | **{gib(plan.device_bytes)}** | {fits} |"
    )


def print_rank_table(entries: list[tuple[str, str, object, UpdateSetup, int]]) -> None:
    print(
        "Per context-parallel rank, detach mode, bf16 compute, GiB. Weights, LoRA + AdamW and state: computed byte "
        "counts (every rank holds the whole model and adapters; sharded state: the largest rank's 1/cp share of the "
        "K/V / MLA pages; replicated: the fixed-size recurrent states, whole on every rank). Working set: ESTIMATE, "
        "the same on every rank as in one process. Not measured.\n"
    )
    print(
        "| model | setup | cp | P | weights | LoRA + AdamW | prompt state (whole) | per rank: sharded state | "
        f"per rank: replicated state | working set (est.) | per-rank device total | one H200 ({H200_USABLE_GIB} GiB) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |")
    for name, label, config, setup, cp in entries:
        print(rank_row(name, label, plan_run(config, setup, cp)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=2_097_152)
    parser.add_argument("--completion-tokens", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--breakdown", action="store_true", help="also print every term of every row")
    parser.add_argument(
        "--context-parallel",
        type=int,
        default=None,
        metavar="N",
        help="per-rank memory with the prompt sharded over N context-parallel ranks (with --recipe: overrides the "
        "recipe's context_parallel_size)",
    )
    parser.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="PATH[@P]",
        help="a recipe YAML (model, LoRA, chunks, R, G, context_parallel_size read from it) at P prompt positions "
        "(default --prompt-tokens): per-rank rows; repeatable",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # transformers' deprecations and PEFT's notes on the MoE conversion
    p, r, g = args.prompt_tokens, args.completion_tokens, args.group_size
    if args.recipe:
        entries = []
        for spec in args.recipe:
            path, _, tokens = spec.partition("@")
            name, label, config, setup, cp = recipe_entry(Path(path), int(tokens) if tokens else p)
            entries.append((name, label, config, setup, args.context_parallel or cp))
        print_rank_table(entries)
        return
    if args.context_parallel:
        print_rank_table(
            [
                (
                    f"`{stem}.json`",
                    label,
                    load_config(str(ARCHITECTURES / f"{stem}.json")),
                    setup,
                    args.context_parallel,
                )
                for stem, label, setup in rows(p, r, g)
            ]
        )
        return
    print(
        f"P = {p:,} prompt positions, G = {g}, R = {r:,} completion tokens, detach mode, bf16 compute. GiB. Weights, "
        "LoRA + AdamW and state: computed byte counts. Working set: ESTIMATE (the larger of one replay's graph and "
        "one capture chunk's transients, plain-torch attention tiles). Not measured.\n"
    )
    print(
        "| model | setup | weights | LoRA + AdamW | prompt state | working set (est.) | of which DSA indexer "
        f"(est.) | device total | host | one H200 ({H200_USABLE_GIB} GiB) |"
    )
    print("| --- | --- | ---: | ---: | --- | --- | ---: | ---: | ---: | --- |")
    accounts = []
    for stem, label, setup in rows(p, r, g):
        path = ARCHITECTURES / f"{stem}.json"
        account = update_account(load_config(str(path)), setup)
        accounts.append((f"`{path.name}`", label, account))
        print(table_row(f"`{path.name}`", label, account))
    if args.breakdown:
        print()
        for name, label, account in accounts:
            print(breakdown(name, label, account) + "\n")


if __name__ == "__main__":
    main()
