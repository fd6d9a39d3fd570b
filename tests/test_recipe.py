"""The demo recipe runs end to end (shortened): TrlParser config, embedded model and task, the phase table; every
shipped recipe config parses into the recipe's arguments."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
CONFIGS = Path(RECIPES).parent / "configs"


@pytest.mark.slow
def test_demo_recipe_runs_and_prints_the_phase_table(tmp_path):
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    command = [
        launcher,
        "launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--cpu",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        os.path.join(RECIPES, "grpo_longstraw.py"),
        "--config",
        os.path.join(RECIPES, os.pardir, "configs", "demo_embedded.yaml"),
        "--prompt_chars",
        "600",
        "--max_steps",
        "1",
        "--output_dir",
        str(tmp_path),
        "--report_to",
        "none",
        "--beta",
        "0.04",
        "--prompt_gradient",
        "exact",
        "--compare_with_stock_prompt_chars",
        "300",
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=dict(os.environ, WANDB_MODE="disabled"), check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "LongStraw phases over 1 steps" in result.stdout
    assert (tmp_path / "reward_curve.png").is_file()
    assert "stock GRPOTrainer" in result.stdout and "LongStrawGRPOTrainer" in result.stdout
    for phase in ("capture", "capture_ref", "score", "optimizer"):
        assert any(line.startswith(phase) and "not logged" not in line for line in result.stdout.splitlines()), phase


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda path: path.name)
def test_every_recipe_config_parses_into_the_recipe_arguments(config, monkeypatch):
    """Every key of every shipped YAML is a field the recipe's TrlParser knows (a typo would stop a GPU run)."""
    from trl import ModelConfig, TrlParser

    from trl_longstraw import LongStrawGRPOConfig

    monkeypatch.syspath_prepend(RECIPES)
    from grpo_longstraw import LongStrawScriptArguments

    monkeypatch.setenv("WANDB_MODE", "disabled")
    parser = TrlParser((LongStrawScriptArguments, LongStrawGRPOConfig, ModelConfig))
    # bf16 and the CP size are the GPU runs' own; everything else is parsed and validated as written
    _, training, model = parser.parse_args_and_config(
        args=["--config", str(config), "--bf16", "false", "--use_cpu", "true", "--output_dir", "/tmp/unused"]
    )
    assert model.model_name_or_path and training.num_generations


@pytest.fixture
def recipe(monkeypatch):
    monkeypatch.syspath_prepend(RECIPES)
    import grpo_longstraw

    return grpo_longstraw


def test_reward_funcs_are_resolved_as_trls_grpo_script_resolves_them(recipe):
    """TRL's names, this task's, dotted import paths, a reward model first; the needle task's two by default."""
    from needle_task import digits_only_reward, needle_reward
    from trl.rewards import accuracy_reward

    arguments = recipe.LongStrawScriptArguments(
        dataset_name="org/data",
        reward_funcs=["accuracy_reward", "needle_task.digits_only_reward"],
        reward_model_name_or_path="org/reward-model",
    )
    assert recipe.reward_functions(arguments) == ["org/reward-model", accuracy_reward, digits_only_reward]
    assert recipe.reward_functions(recipe.LongStrawScriptArguments()) == [needle_reward, digits_only_reward]


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"reward_funcs": ["accuracy"]}, "--reward_funcs 'accuracy': give one of accuracy_reward"),
        ({"dataset_name": "org/data"}, "--dataset_name org/data: give its rewards with --reward_funcs"),
    ],
)
def test_a_reward_that_cannot_be_found_is_refused_naming_the_flag(recipe, arguments, message):
    with pytest.raises(ValueError, match=message):
        recipe.reward_functions(recipe.LongStrawScriptArguments(**arguments))


def test_the_needle_task_gives_an_eval_set_when_evaluating(recipe, tmp_path):
    from trl_longstraw import LongStrawGRPOConfig

    arguments = recipe.LongStrawScriptArguments(num_prompts=2, prompt_chars=100)
    for strategy, evaluated in (("no", False), ("steps", True)):
        args = LongStrawGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, eval_strategy=strategy)
        train, evaluation = recipe.load_datasets(arguments, args)
        assert len(train) == 2 and (evaluation is not None) == evaluated
        if evaluated:
            assert evaluation["prompt"] != train["prompt"]


def test_the_tools_demo_trains_through_the_tool_loop_in_segments(recipe, tmp_path, monkeypatch, capsys):
    """configs/demo_tools_embedded.yaml, shortened (reports of 300 characters, segments of 64 tokens), in process: the
    embedded tool-calling model calls read_report through TRL's tool loop, and the run prints its phases, rewards and
    tool calls."""
    from trl import ModelConfig, TrlParser

    from trl_longstraw import LongStrawGRPOConfig

    monkeypatch.setenv("WANDB_MODE", "disabled")
    parser = TrlParser((recipe.LongStrawScriptArguments, LongStrawGRPOConfig, ModelConfig))
    overrides = {"report_chars": 300, "max_completion_length": 1200, "replay_segment_size": 64, "max_steps": 1}
    arguments = ["--config", str(CONFIGS / "demo_tools_embedded.yaml"), "--output_dir", str(tmp_path)]
    arguments += [
        "--report_to",
        "none",
        *(item for key, value in overrides.items() for item in (f"--{key}", str(value))),
    ]
    recipe.main(*parser.parse_args_and_config(args=arguments))
    printed = capsys.readouterr().out
    assert "LongStraw phases over 1 steps" in printed
    calls = printed.split("tool calls per completion per step: ")[1].split()
    assert float(calls[0]) > 0


def test_the_report_tool_reads_the_report_each_prompt_asks_about(recipe, tmp_path):
    """The report task's prompts, answers and tool agree; `--tools` resolves its tool by name or dotted paths, and a
    name it cannot find is refused naming the flag."""
    from tool_task import report_key_reward

    from trl_longstraw import LongStrawGRPOConfig

    arguments = recipe.LongStrawScriptArguments(dataset_name="embedded:tools", num_prompts=3, report_chars=200)
    args = LongStrawGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    task = recipe.report_task(arguments, args)
    train, _ = recipe.load_datasets(arguments, args, task)
    (read_report,) = recipe.tool_functions(arguments, task)
    for index, row in enumerate(train):
        report = read_report(f"r{index}")
        assert len(report) == 200 and f"the secret key is {row['answer']}." in report
        assert f"report r{index}" in row["prompt"][0]["content"]
    assert report_key_reward(
        [[{"role": "assistant", "content": f"It is {train[0]['answer']}."}]], [train[0]["answer"]]
    ) == [1.0]
    assert recipe.tool_functions(recipe.LongStrawScriptArguments(), None) is None
    dotted = recipe.LongStrawScriptArguments(tools=["trl_longstraw.embedded.add"])
    assert recipe.tool_functions(dotted, None)[0].__name__ == "add"
    with pytest.raises(ValueError, match="--tools 'search': give one of read_report"):
        recipe.tool_functions(recipe.LongStrawScriptArguments(tools=["search"]), task)
