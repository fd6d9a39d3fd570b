"""The simulation at the paper's scale and on the recipes of configs/: one command, one docs page.

    PYTHONPATH=. .venv/bin/python benchmarks/simulation.py [--scenarios NAME ...] [--render-only]

Each scenario is a recipe of configs/ at a prompt length (and, for the paper's anchors, its group size, completion
length and rank count), simulated with `trl_longstraw.simulation.simulate` (one update at full width on fake CUDA
tensors, docs/simulation.md) beside the formula plan (`trl_longstraw.plan.plan_run`). Each finished scenario is saved
to benchmarks/results/simulation/NAME.json (so an interrupted run keeps what finished); the page
docs/simulation-results.md is rendered from every saved result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from trl_longstraw.plan import GIB, plan_run, recipe_plan_inputs
from trl_longstraw.simulation import SimulationReport, simulate

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "simulation"
PAGE = ROOT / "docs" / "simulation-results.md"


@dataclass(frozen=True)
class Scenario:
    name: str
    recipe: str
    prompt_tokens: int
    gpus: int = 1  # ranks in all (the FSDP2 world when the recipe shards the weights)
    device: str = "H200"
    changes: tuple = ()  # (UpdateSetup field, value) beside the recipe's
    context_parallel: int | None = None  # None: the recipe's
    paper: str = ""  # the paper's figure this scenario is set beside


SCENARIOS = [
    Scenario(
        "qwen3.6-27b-1xh200-2m",
        "configs/qwen3_6_27b_qlora.yaml",
        2_097_152,
        changes=(("state_dtype", "float8_e4m3fn"),),
        paper="the goal: 2,097,152 positions on one H200",
    ),
    Scenario(
        "qwen3.6-27b-cp8-h20-g2",
        "configs/qwen3_6_27b_qlora_cp8.yaml",
        2_088_960,
        gpus=8,
        device="H20",
        changes=(("group_size", 2), ("completion_tokens", 8192)),
        paper="8 H20, CP8, G = 2: 5,198.78 s per step",
    ),
    Scenario(
        "qwen3.6-27b-cp8-h20-g8",
        "configs/qwen3_6_27b_qlora_cp8.yaml",
        2_088_960,
        gpus=8,
        device="H20",
        changes=(("group_size", 8), ("completion_tokens", 8192)),
        paper="8 H20, CP8, G = 8: 6,785.23 s per step, +0.208 GB of peak over G = 2",
    ),
    Scenario("qwen3-8b-lora-32k", "configs/qwen3_8b_lora.yaml", 32_768),
    Scenario("qwen3-8b-lora-cp2-32k", "configs/qwen3_8b_lora_cp2.yaml", 32_768, gpus=2),
    Scenario("qwen3-8b-full-fsdp2-128k", "configs/qwen3_8b_full_fsdp2.yaml", 131_072, gpus=8),
    Scenario("qwen3.6-27b-qlora-128k", "configs/qwen3_6_27b_qlora.yaml", 131_072),
    Scenario("qwen3-30b-a3b-lora-128k", "configs/qwen3_30b_a3b_lora.yaml", 131_072),
    Scenario("qwen3.6-27b-cp8-2m", "configs/qwen3_6_27b_qlora_cp8.yaml", 2_097_152, gpus=8),
    Scenario(
        "glm-5-64-ranks-2m",
        "configs/glm5_lora_fsdp2_cp8.yaml",
        2_097_152,
        gpus=64,
        device="H20",
        paper="GLM-5 on 32 H20 (CP32 x EP32): 112.6-145.1 GB per rank",
    ),
    Scenario(
        "glm-5-32-ranks-2m",
        "configs/glm5_lora_fsdp2_cp8.yaml",
        2_097_152,
        gpus=32,
        device="H20",
        context_parallel=32,
        paper="GLM-5 on 32 H20 (CP32 x EP32): 112.6-145.1 GB per rank",
    ),
]


def scenario_inputs(scenario: Scenario):
    """(config, model name, setup, context-parallel size, weight shards) of a scenario: its recipe's, changed."""
    config, name, setup, context_parallel, shards_weights = recipe_plan_inputs(
        ROOT / scenario.recipe, scenario.prompt_tokens
    )
    setup = dataclasses.replace(setup, **dict(scenario.changes))
    return config, name, setup, scenario.context_parallel or context_parallel, scenario.gpus if shards_weights else 1


def run_scenario(scenario: Scenario) -> dict:
    config, name, setup, context_parallel, shards = scenario_inputs(scenario)
    report = simulate(
        config, setup, model=name, context_parallel=context_parallel, weight_shards=shards, device=scenario.device
    )
    return {"scenario": dataclasses.asdict(scenario), "simulated": report.to_dict()}


def plan_of(scenario: Scenario):
    """The formula plan of a scenario's settings, computed when the page is rendered (the planner's current one)."""
    config, name, setup, context_parallel, shards = scenario_inputs(scenario)
    budget = int(_device_gib(scenario.device) * GIB)
    return plan_run(config, setup, context_parallel, budget, model=name, devices=scenario.gpus, weight_shards=shards)


def _device_gib(device: str) -> float:
    from trl_longstraw.simulation.devices import device_spec

    return device_spec(device).memory_bytes / GIB


def terms(plan, simulated: SimulationReport) -> dict[str, tuple[float, float]]:
    """(plan, simulation) GiB of each term both count: what the device holds before the update (weights with the
    adapters' values, AdamW's moments), the prompt state, the capture's transients above it, the replay's growth (the
    gradients and one member's graph), and the peak."""
    phases = simulated.phases
    lora = plan.account.lora
    values = lora.params * lora.value_bytes if lora else 0  # LoRA's values; full fine-tuning's are the weights
    moments = plan.trainable_share - plan.gradient_bytes - values * (1 if plan.weight_shards == 1 else 0)
    if plan.weight_shards > 1:
        moments = plan.trainable_share - plan.gradient_bytes - -(-values // plan.weight_shards)
    capture = phases["capture"]
    capture_start = capture["peak_gib"] - capture["added_gib"]
    replay = phases["replay"]
    return {
        "weights and adapters": (plan.weight_bytes + values / plan.weight_shards, phases["weights"]["held_gib"] * GIB),
        "AdamW moments": (moments, (phases["optimizer_state"]["held_gib"] - phases["weights"]["held_gib"]) * GIB),
        "prompt state": (plan.state_on_device, (capture["held_gib"] - capture_start) * GIB),
        "capture transients": (plan.account.capture.bytes, (capture["peak_gib"] - capture["held_gib"]) * GIB),
        "replay: gradients + graph": (plan.account.replay.bytes + plan.gradient_bytes, replay["added_gib"] * GIB),
        "peak": (plan.device_bytes, simulated.peak_gib * GIB),
    }


def paper_table(rows) -> list[str]:
    """The scenarios set beside a figure of the paper, and the peak's growth between two scenarios that differ only in
    their group size."""
    lines = [
        "",
        "## The paper's runs, side by side",
        "",
        "| scenario | settings beside the recipe's | simulated peak GiB per rank | roofline s per step | comm GiB per step"
        + " | the paper |",
        "|---|---|---:|---:|---:|---|",
    ]
    for scenario, simulated, plan in rows:
        if scenario.paper:
            changes = ", ".join(f"{field} = {value}" for field, value in scenario.changes) or "none"
            lines.append(
                f"| {scenario.name} | {changes} | {simulated.peak_gib:,.2f} | {simulated.roofline_s:,.0f} | "
                f"{simulated.communication_gib:,.1f} | {scenario.paper} |"
            )
    for scenario, simulated, plan in rows:
        for other, other_simulated, other_plan in rows:
            same_run = (scenario.recipe, scenario.prompt_tokens, scenario.device, scenario.gpus) == (
                other.recipe,
                other.prompt_tokens,
                other.device,
                other.gpus,
            )
            if same_run and plan.setup.group_size < other_plan.setup.group_size:
                growth = other_simulated.peak_gib - simulated.peak_gib
                groups = f"G = {plan.setup.group_size} ({scenario.name}) to G = {other_plan.setup.group_size}"
                lines += ["", f"Peak growth from {groups}: {growth:+.3f} GiB per rank ({growth * GIB / 1e9:+.3f} GB)."]
    return lines


def render(results: list[dict]) -> str:
    lines = [
        "# The simulation at scale",
        "",
        "Generated by `PYTHONPATH=. .venv/bin/python benchmarks/simulation.py` from benchmarks/results/simulation/: one",
        "update of each recipe of `configs/` simulated at full width on fake CUDA tensors ([simulation](simulation.md)),",
        "beside the formula plan (`trl-longstraw plan`) of the same settings, computed when this page was rendered.",
        "Peaks are the simulated rank's live bytes (the allocator's allocated bytes: fragmentation and the CUDA context",
        "are not modelled); times are roofline bounds per step on the named device, not measurements; `sim wall s` is",
        "the simulation's own time on a 2-core CPU host.",
        "",
        "| scenario | device x ranks | CP | shards | P | G | R | simulated peak GiB | plan GiB | plan / sim | roofline s"
        + " | comm GiB | sim wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows, notes = [], []
    for result in results:
        scenario = Scenario(**{**result["scenario"], "changes": tuple(map(tuple, result["scenario"]["changes"]))})
        if "note" in result:  # a saved result a later change of the library moves, until it is simulated again
            notes.append(f"- {scenario.name}: {result['note']}")
        simulated = SimulationReport(**_report(result))
        plan = plan_of(scenario)
        setup = plan.setup
        rows.append((scenario, simulated, plan))
        lines.append(
            f"| {scenario.name} | {scenario.device} x {scenario.gpus} | {plan.context_parallel} | "
            f"{plan.weight_shards} | {setup.prompt_tokens:,} | {setup.group_size} | {setup.completion_tokens:,} | "
            f"{simulated.peak_gib:,.2f} | {plan.device_bytes / GIB:,.2f} | {plan.device_bytes / GIB / simulated.peak_gib:.2f}"
            f" | {simulated.roofline_s:,.0f} | {simulated.communication_gib:,.1f} | {simulated.wall_s:,.0f} |"
        )
    lines += ["", *notes] if notes else []
    lines += paper_table(rows)
    lines += [
        "",
        "## The plan against the simulation, term by term",
        "",
        "GiB per device, plan / simulated (docs/simulation.md#the-plan-against-the-simulation says where they differ",
        "and why):",
        "",
    ]
    names = list(terms(rows[0][2], rows[0][1])) if rows else []
    lines += ["| scenario | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for scenario, simulated, plan in rows:
        cells = [f"{a / GIB:,.2f} / {b / GIB:,.2f}" for a, b in terms(plan, simulated).values()]
        lines.append(f"| {scenario.name} | " + " | ".join(cells) + " |")
    lines += ["", "## Per phase", ""]
    for scenario, simulated, _ in rows:
        lines += [f"### {scenario.name}", ""]
        if scenario.paper:
            lines += [f"Paper: {scenario.paper}.", ""]
        lines += ["```", simulated.format(), "```", ""]
    return "\n".join(lines)


def _report(result: dict) -> dict:
    fields = {field.name for field in dataclasses.fields(SimulationReport)}
    return {key: value for key, value in result["simulated"].items() if key in fields}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=None, help="names to run (default: every one)")
    parser.add_argument("--render-only", action="store_true", help="render the page from the saved results")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.render_only:
        wanted = set(args.scenarios or [scenario.name for scenario in SCENARIOS])
        for scenario in SCENARIOS:
            if scenario.name in wanted:
                print(f"simulating {scenario.name} ...", flush=True)
                result = run_scenario(scenario)
                (RESULTS / f"{scenario.name}.json").write_text(json.dumps(result, indent=1))
                print(f"  peak {result['simulated']['peak_gib']:.2f} GiB in {result['simulated']['wall_s']:.0f} s")
    order = [scenario.name for scenario in SCENARIOS]
    saved = [
        json.loads((RESULTS / f"{name}.json").read_text()) for name in order if (RESULTS / f"{name}.json").exists()
    ]
    PAGE.write_text(render(saved) + "\n")
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(saved)} scenarios)")


if __name__ == "__main__":
    main()
