"""FSDP2 on 2 CPU ranks (gloo) against one process: the numbers behind docs/sharded-weights.md.

    PYTHONPATH=. .venv/bin/python benchmarks/sharded_weights.py

Runs `tests/fsdp_worker.py` (three optimizer steps of 12 rows in 2 micro-steps, detach and exact mode) for each family
and route of `tests/test_fsdp.py`, once alone and once on 2 ranks, and writes `benchmarks/results/sharded_weights.md`:
the largest relative differences of the logged loss and grad norm and of the trained weights, each rank's parameter,
gradient and AdamW bytes against one process's, and FSDP2's collectives per optimizer step (counted at
`torch.distributed`), with the passes LongStraw's protocol ran to keep the ranks in step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "fsdp_worker.py"
CASES = [
    ("qwen3", "shard_weights"),
    ("qwen3", "lora"),
    ("qwen3_5", "fully_shard"),
    ("qwen3_moe", "shard_weights"),
    ("glm_moe_dsa", "fully_shard"),
    ("qwen3", "loaded"),
    ("glm_moe_dsa", "loaded_lora"),
]


def run(out: Path, family: str, route: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).parent / "torchrun"
    for command in ([sys.executable], [str(torchrun), "--nproc_per_node", "2"]):
        subprocess.run(
            [*command, str(WORKER), str(out), f"{family}/{route}"], env=env, check=True, capture_output=True
        )


def largest_relative(want: list[float], got: list[float]) -> float:
    return max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(want, got, strict=True))


def row(out: Path, family: str, route: str, mode: str) -> str:
    single = torch.load(out / f"{family}-{route}-world1-rank0.pt")[mode]
    ranks = [torch.load(out / f"{family}-{route}-world2-rank{rank}.pt")[mode] for rank in range(2)]
    got = ranks[0]
    weights = max(
        float((got["weights"][name] - weight).norm() / weight.norm().clamp(min=1e-12))
        for name, weight in single["weights"].items()
    )
    share = {
        kind: max(r["bytes"][kind] for r in ranks) / single["bytes"][kind] for kind in ("parameters", "optimizer")
    }
    share["gradients"] = max(r["bytes"]["gradients"] for r in ranks) / single["bytes"]["gradients"]
    steps = got["optimizer_steps"]
    collectives = got["collectives"]
    return (
        f"| {family} | {route} | {mode} | {largest_relative(single['loss'], got['loss']):.1e} "
        f"| {largest_relative(single['grad_norm'], got['grad_norm']):.1e} | {weights:.1e} "
        f"| {share['parameters']:.3f} / {share['gradients']:.3f} / {share['optimizer']:.3f} "
        f"| {collectives['all_gather_single'] / steps:.0f} | {collectives['reduce_scatter_single'] / steps:.0f} "
        f"({got['sharded_modules']} units) | {got['rounds'] / steps:.0f} "
        f"| {sum(r['stand_ins'] for r in ranks) / steps:.1f} |"
    )


def main() -> None:
    lines = [
        "# FSDP2 on 2 CPU ranks against one process",
        "",
        "```",
        "PYTHONPATH=. .venv/bin/python benchmarks/sharded_weights.py",
        "```",
        "",
        (
            "Three optimizer steps of 12 rows (4 prompts x 3 generations) in 2 micro-steps, fp32, AdamW at 1e-3; one "
            "process takes 6 rows per micro-step, each rank 3. Errors: the largest relative difference over the steps "
            "(loss, grad norm) and over the trained weight tensors after the last step. Bytes: the larger rank's, as a "
            "share of one process's (parameters / gradients at the optimizer step / AdamW state). Collectives per "
            "optimizer step on one rank (reduce-scatters: one per FSDP2 unit holding trainable weights). Agreements: "
            "the ranks' one-integer all-reduces per optimizer step (one before "
            "every pass, one per rank finishing each phase). Stand-ins: passes per optimizer step, both ranks "
            "together, that LongStraw's protocol ran to keep the ranks in step (prompts of different lengths, kept "
            "states)."
        ),
        "",
        (
            "| family | route | mode | loss | grad norm | weights | bytes per rank | all-gathers | reduce-scatters "
            "| agreements | stand-ins |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        for family, route in CASES:
            run(out, family, route)
            lines += [row(out, family, route, mode) for mode in ("detach", "exact")]
    output = ROOT / "benchmarks" / "results" / "sharded_weights.md"
    output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
