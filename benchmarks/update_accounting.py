"""Predicted device memory of one whole LongStraw update (detach mode), next to one H200: the table in docs/memory.md.

    .venv/bin/python benchmarks/update_accounting.py                      # docs/memory.md's rows (2,097,152 positions)
    .venv/bin/python benchmarks/update_accounting.py --completion-tokens 2048 --breakdown
    .venv/bin/python benchmarks/update_accounting.py --context-parallel 8          # the same rows, per CP rank
    .venv/bin/python benchmarks/update_accounting.py \
        --recipe configs/qwen3_6_27b_qlora_cp8.yaml@2097152 --recipe configs/qwen3_8b_lora_cp2.yaml@32768

Each row is `trl_longstraw.accounting.update_account` on a file of `configs/architectures/` (meta-device skeleton, no
weights): weights (bf16, or NF4 as bitsandbytes stores it), LoRA adapters with their fp32 AdamW state (counted by
PEFT on the skeleton), the prompt state by dtype and placement, and the ESTIMATED working set, the larger of one
replay's autograd graph and one capture chunk's transients. Weights, LoRA and state are byte counts (checked against
real allocations in tests/test_accounting.py); the working set is an estimate. Nothing here is measured on a GPU.

Per context-parallel rank (`--context-parallel N`, or `--recipe PATH@P`, which reads the model, LoRA, chunk sizes,
completion length, G and `context_parallel_size` from a recipe YAML at P prompt positions): what CP shards by
sequence (full-attention K/V pages, MLA latent pages, DSA indexer keys) is counted for the largest shard of the
captured tokens (`context_parallel.shard_bounds`), what it replicates (GatedDeltaNet / Mamba2 conv and recurrent states
and sliding windows, fixed size) in full on every rank; every rank holds the whole model and the adapters with their
optimizer state, and its working set is one process's (every rank replays each member through every layer; a serving
rank holds one chunk of another rank's queries). Layer kinds CP refuses (chunked attention) mark a row refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from state_accounting import GIB, load_config

from trl_longstraw.accounting import UpdateAccount, UpdateSetup, prompt_state_bytes, update_account
from trl_longstraw.context_parallel import shard_bounds

ARCHITECTURES = HERE.parent / "configs" / "architectures"
H200_USABLE_GIB = 131  # 141 GB of HBM3e, about 131 GiB usable by CUDA
GLM5_TARGETS = (
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


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
    glm = UpdateSetup(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        group_size=group_size,
        lora_rank=8,
        lora_targets=GLM5_TARGETS,
        state_device="cpu",
        activation_checkpointing=True,
        prefill_chunk_size=8192,
        attention_chunk_size=8192,
    )
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


def table_row(name: str, label: str, account: UpdateAccount) -> str:
    setup = account.setup
    where = "host" if setup.state_device == "cpu" else "device"
    state_dtype = "fp8 pages" if setup.state_dtype == "float8_e4m3fn" else "model dtype"
    work = account.working_set
    which = "replay" if work is account.replay else "capture chunk"
    lora = account.lora.bytes if account.lora else 0
    return (
        f"| {name} | {label} | {gib(account.weights.bytes)} | {gib(lora)} | "
        f"{gib(account.state_bytes)} ({state_dtype}, {where}) | {gib(work.bytes)} ({which}) | "
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
    lines.append(f"  group scalars (G x R fp32 x 8): {account.group_scalars / 2**20:.2f} MiB")
    setup = account.setup
    on_device = account.state_bytes if setup.state_device == "device" else 0
    lines.append(
        f"  rollout: {setup.prompts_per_generation} prompt state(s) + {setup.prompts_per_generation} x G rows' decoded "
        f"tokens ({account.decoded_row / 2**20:,.1f} MiB a row) = {gib(account.rollout_bytes(on_device))} GiB on the "
        "device"
    )
    return "\n".join(lines)


# State labels (`LayerState.account`) context parallelism shards by sequence, and those it refuses; every other
# label (gated_deltanet, mamba2: fixed-size recurrent states) is replicated on every rank.
SHARDED_UNDER_CP = ("full_attention", "mla_latent", "dsa_indexer_keys")
REFUSED_UNDER_CP = ("chunked_attention",)


@dataclasses.dataclass(frozen=True)
class RankAccount:
    """One context-parallel rank's share of an update: `account` is the whole update on one device (its weights,
    LoRA, working set and group scalars are every rank's); `sharded` and `replicated` are this rank's state bytes."""

    account: UpdateAccount
    context_parallel: int
    sharded: int
    replicated: int
    refused: tuple[str, ...]

    @property
    def state_bytes(self) -> int:
        return self.sharded + self.replicated

    @property
    def device_bytes(self) -> int:
        """The whole update's device bytes with the whole prompt state replaced by this rank's share."""
        return self.account.device_total(self.state_bytes if self.on_device else 0)

    @property
    def on_device(self) -> bool:
        return self.account.setup.state_device == "device"

    @property
    def host_bytes(self) -> int:
        return 0 if self.on_device else self.state_bytes


def rank_account(config, account: UpdateAccount, context_parallel: int) -> RankAccount:
    """The largest rank's share of `account`'s prompt state under `context_parallel` ranks (module docstring)."""
    setup = account.setup
    captured = setup.prompt_tokens - 1  # all but the last prompt token are captured
    shard = max(end - start for start, end in shard_bounds(captured, context_parallel))
    per_shard = prompt_state_bytes(config, shard, setup.dtype_bytes, setup.state_dtype)
    sharded = sum(n for label, n in per_shard.items() if label in SHARDED_UNDER_CP)
    replicated = sum(n for label, n in account.state.items() if label not in SHARDED_UNDER_CP)
    refused = tuple(label for label in account.state if label in REFUSED_UNDER_CP) if context_parallel > 1 else ()
    return RankAccount(account, context_parallel, sharded, replicated, refused)


def recipe_setup(path: Path, prompt_tokens: int) -> tuple[str, str, UpdateSetup, int]:
    """(architecture file stem, label, setup, context_parallel_size) from a TrlParser recipe YAML (read as YAML,
    defaults as LongStrawGRPOConfig / ModelConfig have them). The architecture file is the one whose `_source` is the
    recipe's `model_name_or_path`."""
    import yaml

    recipe = yaml.safe_load(path.read_text())
    model = recipe["model_name_or_path"]
    stems = [
        config.stem
        for config in sorted(ARCHITECTURES.glob("*.json"))
        if json.loads(config.read_text()).get("_source") == model
    ]
    if not stems:
        raise SystemExit(f"{path}: no file in {ARCHITECTURES} has _source {model!r}")
    if recipe.get("prompt_gradient", "detach") != "detach":
        raise SystemExit(f"{path}: the update account is detach mode only (prompt_gradient: detach)")
    from trl import ModelConfig

    from trl_longstraw import LongStrawGRPOConfig

    defaults = {f.name: f.default for config in (LongStrawGRPOConfig, ModelConfig) for f in dataclasses.fields(config)}

    def get(key):
        return recipe.get(key, defaults[key])

    quantized = get("load_in_4bit") and get("bnb_4bit_quant_type") == "nf4"
    targets = get("lora_target_modules")
    checkpointing = recipe.get("activation_checkpointing", recipe.get("gradient_checkpointing")) or False
    # A rollout keeps one prompt state per distinct prompt of a process's generation batch; vLLM generates elsewhere.
    steps_per_generation = get("steps_per_generation") or get("gradient_accumulation_steps")
    rollout = get("rollout_from_prompt_state") is not False
    rollout = rollout and not get("use_vllm") and not get("use_transformers_continuous_batching")
    rows, group = get("per_device_train_batch_size") * steps_per_generation, get("num_generations")
    # a process's rows that do not hold whole groups can start mid-group: one more prompt at most
    prompts = (-(-rows // group) + (1 if rows % group else 0)) if rollout else 0
    setup = UpdateSetup(
        prompt_tokens=prompt_tokens,
        completion_tokens=get("max_completion_length"),
        group_size=get("num_generations"),
        quantization="nf4" if quantized else "none",
        double_quant=get("use_bnb_nested_quant"),
        lora_rank=get("lora_r") if get("use_peft") else None,
        lora_targets=tuple(targets) if isinstance(targets, list) else targets,
        state_dtype=get("prompt_state_dtype"),
        state_device="cpu" if get("prompt_state_device") == "cpu" else "device",
        activation_checkpointing=checkpointing,
        prefill_chunk_size=get("prefill_chunk_size"),
        attention_chunk_size=get("attention_chunk_size"),
        prompts_per_generation=max(prompts, 1) if rollout else 0,
    )
    weights = "NF4 QLoRA" if quantized else "bf16 LoRA"
    label = f"`{path.name}`: {weights} r{setup.lora_rank}, {'checkpointing' if checkpointing else 'no checkpointing'}"
    return stems[0], label, setup, recipe.get("context_parallel_size") or 1


def rank_row(name: str, label: str, rank: RankAccount) -> str:
    account, cp = rank.account, rank.context_parallel
    setup = account.setup
    lora = account.lora.bytes if account.lora else 0
    work = account.working_set
    which = "replay" if work is account.replay else "capture chunk"
    where = "" if rank.on_device else ", host"
    if rank.refused:
        fits = f"refused under CP ({', '.join(rank.refused)})"
    else:
        device = rank.device_bytes / GIB
        fits = f"fits ({H200_USABLE_GIB - device:,.1f} GiB spare)" if device <= H200_USABLE_GIB else "does not fit"
    return (
        f"| {name} | {label} | {cp} | {setup.prompt_tokens:,} | {gib(account.weights.bytes)} | {gib(lora)} | "
        f"{gib(account.state_bytes)} | {gib(rank.sharded)}{where} | {gib(rank.replicated)}{where} | "
        f"{gib(work.bytes)} ({which}) | **{gib(rank.device_bytes)}** | {fits} |"
    )


def print_rank_table(entries: list[tuple[str, str, UpdateSetup, int]]) -> None:
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
    for stem, label, setup, cp in entries:
        path = ARCHITECTURES / f"{stem}.json"
        config = load_config(str(path))
        account = update_account(config, setup)
        print(rank_row(f"`{path.name}`", label, rank_account(config, account, cp)))


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
            stem, label, setup, cp = recipe_setup(Path(path), int(tokens) if tokens else p)
            entries.append((stem, label, setup, args.context_parallel or cp))
        print_rank_table(entries)
        return
    if args.context_parallel:
        print_rank_table([(stem, label, setup, args.context_parallel) for stem, label, setup in rows(p, r, g)])
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
