"""The memory planner (`trl_longstraw/plan.py`) and its console script (`trl-longstraw plan`, `trl_longstraw/cli.py`):
the plan's terms are the accounting's, context parallelism shares the sharded state, every suggestion re-plans as
fitting, the script refuses bad input before reading any config, and the trainer plans at construction before any
weights load."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

import trl_longstraw
from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer, cli
from trl_longstraw.accounting import UpdateSetup, prompt_state_bytes, replay_graph_account, update_account
from trl_longstraw.embedded import FAMILIES, build_model, tiny_config
from trl_longstraw.engine import LongStrawEngine
from trl_longstraw.plan import (
    GIB,
    MemoryPlanError,
    ModelSourceError,
    format_plan,
    load_model_config,
    plan_run,
    suggestion_flags,
    suggestion_yaml,
)

from .conftest import length_reward, make_trainer, trainer_args
from .test_accounting import saved_activation_bytes
from .test_engine import case, prepared

SETUP_FIELDS = {"prompt_state_dtype": "state_dtype", "prompt_state_device": "state_device"}  # config -> setup
SETUP = UpdateSetup(prompt_tokens=4097, completion_tokens=64, group_size=4, lora_rank=4, prefill_chunk_size=1024)
# a prompt whose pages outweigh what a context-parallel step gathers and exchanges (every rank's partials of a chunk)
LONG_PROMPT = dataclasses.replace(SETUP, prompt_tokens=65537)


def test_the_plan_is_the_accounting_of_the_update():
    config = tiny_config("qwen3")
    plan = plan_run(config, SETUP)
    account = update_account(config, SETUP)
    assert plan.state_bytes == account.state_bytes
    assert plan.device_bytes == account.device_bytes
    assert plan.fits is None  # no budget given


def test_context_parallelism_shares_the_attention_pages_and_replicates_recurrent_state():
    config = tiny_config("qwen3_5")  # GatedDeltaNet + attention
    whole, halves = plan_run(config, LONG_PROMPT), plan_run(config, LONG_PROMPT, context_parallel=2)
    attention = prompt_state_bytes(config, 32768, 2)["full_attention"]  # 65536 captured tokens: 32768 per rank
    assert halves.sharded_state == attention
    assert halves.replicated_state == whole.replicated_state > 0
    assert halves.device_bytes < whole.device_bytes


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "glm_moe_dsa"])
def test_a_long_member_in_segments_is_planned_as_one_segments_graph_beside_its_earlier_segments_state(family):
    """R = 4,096 in segments of 1,000 (4,097 replayed: five segments, the last of 97 tokens): the graph of 1,001 tokens
    (a segment, and the one token a last segment may take over), and the state of the 4,000 tokens before the last
    segment as exact mode keeps it, with its gradient (the DSA indexer keys take none)."""
    config = tiny_config(family)
    whole = dataclasses.replace(SETUP, completion_tokens=4096)
    segmented = dataclasses.replace(whole, replay_segment_size=1000)
    replay = plan_run(config, segmented).account.replay
    assert replay.tokens == 1001
    state = prompt_state_bytes(config, 4000, 2, exact=True, prefill_chunk_size=1000)
    gradient = sum(n for label, n in state.items() if label != "dsa_indexer_keys")
    assert replay.member_state == sum(state.values()) + gradient
    assert plan_run(config, segmented).device_bytes < plan_run(config, whole).device_bytes
    assert plan_run(config, dataclasses.replace(whole, replay_segment_size=8192)).account.replay.member_state == 0


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "glm_moe_dsa"])
def test_under_context_parallelism_a_long_member_is_planned_as_one_chunk_per_rank_of_its_steps(family):
    """R = 4,096 in segments of 1,000 on a CP group of 4 (4,097 replayed: two steps of 4 chunks of 512 or 513 tokens,
    `ContextParallel.in_steps`): each rank's graph is one chunk's, without activation checkpointing, beside the step
    attention's share and this rank's 1,025 tokens of the member's state as exact mode keeps it, with its gradient."""
    config = tiny_config(family)
    segmented = dataclasses.replace(SETUP, completion_tokens=4096, replay_segment_size=1000)
    replay = plan_run(config, segmented, context_parallel=4).account.replay
    assert replay.tokens == 513
    chunk = replay_graph_account(config, 512, SETUP.prompt_tokens - 1 + 4097, SETUP.attention_chunk_size, False)
    assert replay.saved == chunk.saved  # no activation checkpointing: every layer's activations
    state = prompt_state_bytes(config, 1025, 2, exact=True, prefill_chunk_size=513)
    gradient = sum(n for label, n in state.items() if label != "dsa_indexer_keys")
    assert replay.member_state == sum(state.values()) + gradient
    assert replay.step_attention > 0
    alone = dataclasses.replace(segmented, replay_segment_size=None)  # every rank replays a member whole
    assert plan_run(config, alone, context_parallel=4).account.replay.member_state == 0


def test_a_segment_size_is_suggested_where_the_replay_does_not_fit():
    config = tiny_config("qwen3")
    setup = dataclasses.replace(SETUP, completion_tokens=65536, group_size=1, prompts_per_generation=0)
    whole = plan_run(config, setup)
    budget = whole.device_bytes + plan_run(config, dataclasses.replace(setup, replay_segment_size=4096)).device_bytes
    plan = plan_run(config, setup, budget=budget // 2)
    sizes = [s["settings"]["replay_segment_size"] for s in plan.suggestions if "replay_segment_size" in s["settings"]]
    assert sizes and all(
        plan_run(config, dataclasses.replace(setup, replay_segment_size=n)).fits is not False for n in sizes
    )


def test_full_fine_tuning_counts_each_weights_gradient_and_adam_moments():
    config = tiny_config("qwen3")
    plan = plan_run(config, dataclasses.replace(SETUP, lora_rank=None))
    assert plan.trainable_bytes == 3 * plan.account.weights.dense_bytes


def test_every_suggestion_for_a_run_that_does_not_fit_fits_when_planned():
    config = tiny_config("qwen3")
    setup = LONG_PROMPT
    whole = plan_run(config, setup)
    budget = whole.device_bytes - whole.state_bytes // 3  # a third of the state too much
    plan = plan_run(config, setup, budget=budget, devices=8)
    assert plan.fits is False and plan.suggestions
    names = {key for suggestion in plan.suggestions for key in suggestion["settings"]}
    assert {"prompt_state_dtype", "prompt_state_device", "context_parallel_size"} <= names
    for suggestion in plan.suggestions:
        settings = dict(suggestion["settings"])
        context_parallel = settings.pop("context_parallel_size", 1)
        settings.pop("shard_weights", None)
        renamed = {SETUP_FIELDS.get(key, key): value for key, value in settings.items()}
        again = plan_run(
            config, dataclasses.replace(setup, **renamed), context_parallel, budget,
            weight_shards=suggestion["weight_shards"],
        )  # fmt: skip
        assert again.fits and again.device_bytes == suggestion["device_bytes"]


def replan(config, setup, budget, suggestion):
    settings = dict(suggestion["settings"])
    context_parallel = settings.pop("context_parallel_size", 1)
    settings.pop("shard_weights", None)
    renamed = {SETUP_FIELDS.get(key, key): value for key, value in settings.items()}
    return plan_run(
        config,
        dataclasses.replace(setup, **renamed),
        context_parallel,
        budget,
        weight_shards=suggestion["weight_shards"],
    )


def test_activation_checkpointing_is_suggested_where_it_fits_alone():
    config = tiny_config("qwen3")
    setup = dataclasses.replace(SETUP, activation_checkpointing=False, completion_tokens=4096)
    checkpointed = plan_run(config, dataclasses.replace(setup, activation_checkpointing=True))
    plan = plan_run(config, setup, budget=checkpointed.device_bytes)
    assert plan.fits is False
    assert {"activation_checkpointing": True} in [suggestion["settings"] for suggestion in plan.suggestions]


def test_where_no_single_setting_fits_the_fewest_that_do_together_are_searched(capsys):
    config = tiny_config("qwen3")
    # members already in the smallest segments the suggestions go down to: no segment size is suggested
    setup = dataclasses.replace(
        LONG_PROMPT, activation_checkpointing=False, completion_tokens=8192, replay_segment_size=512
    )
    both = {"state_device": "cpu", "activation_checkpointing": True}
    alone = min(
        plan_run(config, dataclasses.replace(setup, **{key: value})).device_bytes for key, value in both.items()
    )
    budget = (plan_run(config, dataclasses.replace(setup, **both)).device_bytes + alone) // 2
    plan = plan_run(config, setup, budget=budget, devices=1)
    assert plan.fits is False and plan.suggestions
    assert all(len(suggestion["settings"]) == 2 for suggestion in plan.suggestions)  # no single one fits
    assert plan.suggestions[0]["settings"] == {"prompt_state_device": "cpu", "activation_checkpointing": True}
    sizes = [suggestion["device_bytes"] for suggestion in plan.suggestions]
    assert sizes == sorted(sizes)
    for suggestion in plan.suggestions:
        assert replan(config, setup, budget, suggestion).device_bytes == suggestion["device_bytes"] <= budget
    print(format_plan(plan))
    out = capsys.readouterr().out
    assert "No single setting fits; together:" in out
    assert "--prompt-state-device cpu --activation-checkpointing:" in out
    assert "(recipe: prompt_state_device: cpu; activation_checkpointing: true)" in out


def test_suggestions_print_as_flags_and_recipe_lines():
    suggestion = {"settings": {"activation_checkpointing": True, "shard_weights": True}, "weight_shards": 8}
    assert suggestion_flags(suggestion) == "--activation-checkpointing --weight-shards 8"
    assert suggestion_yaml(suggestion) == "activation_checkpointing: true; shard_weights: true"


def test_fsdp2_shards_the_weights_and_adam_state_and_keeps_the_gradient_whole_through_the_window():
    config = tiny_config("qwen3")
    full = dataclasses.replace(SETUP, lora_rank=None)
    whole, sharded = plan_run(config, full), plan_run(config, full, weight_shards=4)
    weights = whole.account.weights.bytes
    gradient = whole.account.weights.dense_bytes  # one value per weight
    assert sharded.trainable_share == -(-2 * gradient // 4) + gradient
    assert sharded.weight_bytes == -(-weights // 4) + sharded.gathered_bytes
    assert sharded.device_bytes == whole.device_bytes - (weights - sharded.weight_bytes) - (
        whole.trainable_bytes - sharded.trainable_share
    )


def test_fsdp2_shards_nf4_codes_and_keeps_their_quantisation_states_whole():
    config = tiny_config("qwen3")
    qlora = dataclasses.replace(SETUP, quantization="nf4")
    whole, sharded = plan_run(config, qlora), plan_run(config, qlora, weight_shards=4)
    weights = whole.account.weights
    assert weights.quantization_state_bytes > 0
    share = -(-(weights.bytes - weights.quantization_state_bytes) // 4) + weights.quantization_state_bytes
    assert sharded.weight_share == share
    assert sharded.weight_bytes == share + sharded.gathered_bytes


def test_fsdp2s_gathered_weights_are_the_root_module_and_one_decoder_layer():
    model = build_model("qwen3")
    plan = plan_run(model.config, dataclasses.replace(SETUP, dtype_bytes=4), weight_shards=2)
    root = [model.model.embed_tokens, model.model.norm, model.lm_head]
    root_bytes = sum(p.nbytes for module in root for p in module.parameters())
    layer_bytes = max(sum(p.nbytes for p in layer.parameters()) for layer in model.model.layers)
    assert plan.gathered_bytes == pytest.approx(root_bytes + layer_bytes, rel=0.02)


def test_shard_weights_is_suggested_for_a_full_fine_tune_that_does_not_fit_one_device(capsys):
    args = ["plan", "qwen3_8b", "--prompt-length", "131072", "--rope-scaling", "yarn:4", "--lora-r", "0"]
    args += ["--gpu-memory", "80", "--gpus", "8"]
    assert cli.main(args) == 1
    out = capsys.readouterr().out
    assert "--weight-shards 8:" in out and "(recipe: shard_weights: true)" in out
    # the recipes of this model that fit as they are (qwen3_8b_lora.yaml is for 32K prompts: past its context here)
    recipes = out.split("Recipes of configs/ for this model that fit, each with its own settings:\n")[1].splitlines()
    assert [line.split(":")[0].strip() for line in recipes] == ["configs/qwen3_8b_full_fsdp2.yaml"]
    assert "--config configs/qwen3_8b_full_fsdp2.yaml --prompt-length 131072 --gpu-memory 80 --gpus 8" in recipes[0]
    assert cli.main([*args, "--weight-shards", "8"]) == 0
    assert "weights sharded over 8 ranks (FSDP2)" in capsys.readouterr().out


def test_a_recipe_that_does_not_fit_names_the_other_recipes_of_its_model_that_do(capsys):
    """GLM-5 on one process split by `device_map` (glm5_lora.yaml) at 2M positions on 64 x 141 GB: its FSDP2 + CP8
    recipe fits as it is."""
    args = ["plan", "--config", "configs/glm5_lora.yaml", "--prompt-length", "2097152", "--gpu-memory", "141"]
    assert cli.main([*args, "--gpus", "64"]) == 1
    out = capsys.readouterr().out
    recipes = out.split("Other recipes of configs/ for this model that fit, each with its own settings:\n")[1]
    assert [line.split(":")[0].strip() for line in recipes.splitlines()] == ["configs/glm5_lora_fsdp2_cp8.yaml"]


def test_a_recipe_that_shards_its_weights_is_planned_over_its_ranks(capsys):
    args = ["plan", "--config", "configs/qwen3_8b_full_fsdp2.yaml", "--prompt-length", "131072", "--gpu-memory", "80"]
    assert cli.main(args) == 2
    assert "shard_weights: true" in capsys.readouterr().err
    assert cli.main([*args, "--gpus", "8"]) == 0
    assert "weights sharded over 8 ranks (FSDP2)" in capsys.readouterr().out


def test_the_planners_adapter_defaults_are_trls(capsys):
    """No adapter unless a LoRA rank is given (TRL trains the whole model without a peft_config), and then PEFT's
    default modules for the model type (TRL's lora_target_modules default)."""
    base = ["plan", "qwen3_8b", "--prompt-length", "4096", "--json"]
    plans = {}
    for name, flags in (
        ("default", []),
        ("rank", ["--lora-r", "16"]),
        ("all", ["--lora-r", "16", "--lora-target-modules", "all-linear"]),
    ):
        assert cli.main([*base, *flags]) == 0
        plans[name] = json.loads(capsys.readouterr().out)["settings"]
    assert plans["default"]["lora_rank"] is None
    assert (plans["rank"]["lora_rank"], plans["rank"]["lora_targets"]) == (16, None)
    assert plans["all"]["lora_targets"] == "all-linear"


def test_a_prompt_past_the_models_positions_is_refused_naming_yarn_and_planned_with_it(capsys):
    """The trainer's context check (`validation.check_context`): Qwen3-8B holds 40,960 positions."""
    args = ["plan", "qwen3_8b", "--prompt-length", "131072", "--gpu-memory", "80"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_position_embeddings=40960" in err and "--rope-scaling yarn:4" in err
    assert "rope_parameters={'rope_type': 'yarn'," in err and "'factor': 4.0" in err
    assert "'original_max_position_embeddings': 40960} and max_position_embeddings=163840" in err
    assert cli.main([*args, "--rope-scaling", "yarn:4", "--lora-r", "16"]) == 0
    capsys.readouterr()
    for bad in ("yarn", "yarn:1", "linear:4"):
        with pytest.raises(SystemExit) as exited:
            cli.main([*args, "--rope-scaling", bad])
        assert exited.value.code == 2 and "give yarn:FACTOR" in capsys.readouterr().err


# The prompt length each recipe of a Hub model is written for (its comments, docs/planning.md, the simulation's
# scenarios); the demos' models are built by the recipe, their prompts counted in characters
RECIPE_PROMPT_LENGTHS = {
    "glm5_lora.yaml": 2_097_152,
    "glm5_lora_fsdp2_cp8.yaml": 2_097_152,
    "qwen3_30b_a3b_lora.yaml": 131_072,
    "qwen3_6_27b_qlora.yaml": 2_097_152,
    "qwen3_6_27b_qlora_cp8.yaml": 2_097_152,
    "qwen3_8b_full_fsdp2.yaml": 131_072,
    "qwen3_8b_lora.yaml": 32_768,
    "qwen3_8b_lora_cp2.yaml": 32_768,
}


def test_every_recipe_has_its_prompt_length_listed():
    listed = sorted([*RECIPE_PROMPT_LENGTHS, "demo_embedded.yaml", "demo_tools_embedded.yaml"])
    assert listed == sorted(path.name for path in Path("configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", sorted(RECIPE_PROMPT_LENGTHS))
def test_every_recipe_fits_its_models_context_at_the_length_it_is_written_for(recipe):
    """Prompt plus completion within the model's positions as the recipe loads it (`model_init_kwargs`): the trainer
    would refuse the run otherwise."""
    from trl_longstraw.plan import recipe_plan_inputs
    from trl_longstraw.validation import check_context

    config, _, setup, _, _ = recipe_plan_inputs(Path("configs") / recipe, RECIPE_PROMPT_LENGTHS[recipe])
    check_context(config, setup.prompt_tokens, setup.completion_tokens)


@pytest.mark.slow
def test_an_installed_wheel_plans_an_architecture_by_name(tmp_path):
    """The architecture configs ship in the wheel (package data): `trl-longstraw plan NAME` finds them from an
    installed wheel, away from the source tree."""
    import os
    import shutil
    import zipfile

    root, source = Path(__file__).resolve().parent.parent, tmp_path / "source"  # built away from the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(root / name, source / name)
    shutil.copytree(root / "trl_longstraw", source / "trl_longstraw", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--quiet", "-w", str(tmp_path / "dist"), str(source)], check=True)
    wheel = next((tmp_path / "dist").glob("trl_longstraw-*.whl"))
    assert "trl_longstraw/accounting/architectures/qwen3_8b.json" in zipfile.ZipFile(wheel).namelist()
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--quiet", "--target", str(site), str(wheel)], check=True)
    script = (
        "import trl_longstraw\n"
        f"assert trl_longstraw.__file__.startswith({str(site)!r}), trl_longstraw.__file__\n"
        "from trl_longstraw import cli\n"
        "raise SystemExit(cli.main(['plan', 'qwen3_8b', '--prompt-length', '4096']))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("qwen3_8b: P = 4,096")


def test_a_config_is_read_from_a_folder_a_json_file_or_an_architecture_name(tmp_path):
    tiny_config("qwen3").save_pretrained(tmp_path)
    assert load_model_config(str(tmp_path)).model_type == "qwen3"
    assert load_model_config(str(tmp_path / "config.json")).model_type == "qwen3"
    assert load_model_config("qwen3_8b").num_hidden_layers == 36


def test_an_unreadable_model_names_what_the_planner_accepts(tmp_path):
    with pytest.raises(ModelSourceError, match=r"'no-such/model'.*local model folder.*architecture name \(.*glm5"):
        load_model_config("no-such/model")
    (tmp_path / "other.json").write_text('{"hidden": 1}')
    with pytest.raises(ModelSourceError, match="no `model_type`"):
        load_model_config(str(tmp_path / "other.json"))


def test_the_script_prints_json_and_exits_1_when_the_run_does_not_fit(tmp_path, capsys):
    tiny_config("qwen3").save_pretrained(tmp_path)
    args = [str(tmp_path), "--prompt-length", "4097", "--lora-r", "4", "--json"]
    assert cli.main(["plan", *args, "--gpu-memory", "100"]) == 0
    fitting = json.loads(capsys.readouterr().out)
    assert fitting["fits"] is True and fitting["budget_bytes"] == 100 * GIB
    tight = str(fitting["device_bytes"] / 2 / GIB)
    assert cli.main(["plan", *args, "--gpu-memory", tight]) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False


def test_the_script_names_an_unreadable_model_and_exits_2(capsys):
    assert cli.main(["plan", "no-such/model", "--prompt-length", "10"]) == 2
    assert "Cannot read a model config from 'no-such/model'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt-length", "0"], "--prompt-length must be at least 1"),
        (["--prompt-length", "9", "--load-in-4bit", "--lora-r", "0"], "QLoRA.*--lora-r > 0"),
        (["--prompt-length", "9", "--context-parallel-size", "4", "--gpus", "2"], "exceeds --gpus 2"),
        (["--prompt-length", "9", "--weight-shards", "0"], "--weight-shards must be at least 1"),
        (["--prompt-length", "9", "--weight-shards", "3", "--gpus", "8"], "does not divide --gpus 8"),
        (["--prompt-length", "9", "--gpus", "0"], "--gpus must be at least 1, got 0"),
        (["--prompt-length", "9", "--lora-r", "-4"], "--lora-r must be 0 .* got -4"),
        (["--prompt-length", "9", "--lora-target-modules", "all-linear"], "--lora-target-modules needs --lora-r > 0"),
        (["--prompt-length", "9", "--attention-chunk-size", "0"], "--attention-chunk-size must be at least 1"),
        (["--prompt-length", "9", "--per-device-train-batch-size", "0"], "--per-device-train-batch-size must be"),
        (["--prompt-length", "9", "--replay-segment-size", "1"], "--replay-segment-size must be at least 2, got 1"),
    ],
)
def test_bad_flags_are_refused_before_any_config_is_read(flags, message, monkeypatch, capsys):
    monkeypatch.setattr("trl_longstraw.plan.load_model_config", lambda *_: pytest.fail("read a config"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "qwen3_8b", *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert re.search(message, error) and len(error.splitlines()) == 1  # one line, no usage block


def test_a_model_longstraw_does_not_train_exits_2_naming_it(tmp_path, capsys):
    config = tmp_path / "bloom.json"
    config.write_text(json.dumps({"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4}))
    assert cli.main(["plan", str(config), "--prompt-length", "100"]) == 2
    error = capsys.readouterr().err
    assert "is not a model LongStraw trains: Layer 0 (BloomBlock" in error and "docs/supported-models.md" in error
    assert len(error.splitlines()) == 1


def test_a_reader_that_stops_early_gets_no_traceback():
    """`trl-longstraw plan ... | head`: the plan's output meets a closed pipe; the command ends as Unix tools do."""
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run(
        [sys.executable, "-m", "trl_longstraw.cli", "plan", "qwen3_8b", "--prompt-length", "4096"],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    os.close(write)
    assert done.returncode == 128 + signal.SIGPIPE and done.stderr == ""


def small_config(tmp_path, model_type: str, **fields) -> str:
    """A config file of 2 layers of width 64 with 512 positions (fields add or override)."""
    path = tmp_path / f"{model_type}.json"
    fields = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 512,
        **fields,
    }
    path.write_text(json.dumps({"model_type": model_type, **fields}))
    return str(path)


def test_a_model_longstraw_does_not_train_is_named_before_its_positions(tmp_path, capsys):
    """The trainer's order: the model is refused before the run's length is measured against its positions."""
    assert cli.main(["plan", small_config(tmp_path, "bert"), "--prompt-length", "4096"]) == 2
    error = capsys.readouterr().err
    assert "is not a model LongStraw trains: Layer 0 (BertLayer" in error and len(error.splitlines()) == 1


def test_a_model_of_learned_positions_is_not_offered_yarn(tmp_path, capsys):
    """OPT numbers its positions by learned embeddings: past them, no RoPE scaling helps, and --rope-scaling says so."""
    config = small_config(tmp_path, "opt", ffn_dim=128, word_embed_proj_dim=64)
    assert cli.main(["plan", config, "--prompt-length", "1024"]) == 2
    error = capsys.readouterr().err
    assert "max_position_embeddings=512: its positions are learned embeddings" in error and "YaRN" not in error
    assert cli.main(["plan", config, "--prompt-length", "1024", "--rope-scaling", "yarn:4"]) == 2
    assert "model_type='opt' has no RoPE" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"), [("a: [1, 2\n", "cannot read the recipe .*: while parsing"), (None, "No such")]
)
def test_a_recipe_that_cannot_be_read_exits_2_in_one_line(text, message, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    if text is not None:
        recipe.write_text(text)
    assert cli.main(["plan", "--config", str(recipe), "--prompt-length", "100"]) == 2
    error = capsys.readouterr().err
    assert re.search(message, error) and len(error.splitlines()) == 1


def test_the_scripts_defaults_are_the_trainers():
    fields = {field.name: field.default for field in dataclasses.fields(LongStrawGRPOConfig)}
    assert cli.TRAINER_DEFAULTS == {name: fields[name] for name in cli.TRAINER_DEFAULTS}


def test_the_script_answers_help_and_version_without_importing_torch():
    script = (
        "import contextlib, io, sys\n"
        "from trl_longstraw import cli\n"
        "for flags in (['--version'], ['plan', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        cli.main(flags)\n"
        "print(sorted({'torch', 'transformers', 'trl'} & set(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]" and done.stderr == ""


def test_the_version_is_the_packages(capsys):
    with pytest.raises(SystemExit) as exit_status:
        cli.main(["--version"])
    assert exit_status.value.code == 0
    assert capsys.readouterr().out.strip() == f"trl-longstraw {trl_longstraw.__version__}"


def test_a_plan_prints_nothing_on_stderr():
    flags = ["plan", "qwen3_8b", "--prompt-length", "4096", "--gpu-memory", "80"]
    script = f"import sys; from trl_longstraw import cli; sys.exit(cli.main({flags!r}))"
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True)
    assert done.returncode == 0 and "FITS" in done.stdout
    assert done.stderr == ""


def test_a_run_that_does_not_fit_is_stopped_before_any_weights_load(tokenizer, prompt_dataset, tmp_path, monkeypatch):
    tiny_config("qwen3").save_pretrained(tmp_path / "model")  # a config only: loading weights would fail
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", lambda *_, **__: pytest.fail("loaded weights"))
    args = trainer_args(LongStrawGRPOConfig, tmp_path, memory_plan_prompt_length=100_000, memory_plan_device_gib=0.01)
    with pytest.raises(MemoryPlanError, match=r"(?s)does not fit the device.*DOES NOT FIT"):
        LongStrawGRPOTrainer(
            model=str(tmp_path / "model"),
            reward_funcs=length_reward,
            args=args,
            train_dataset=prompt_dataset,
            processing_class=tokenizer,
        )


def test_warn_mode_builds_the_trainer_with_its_plan(fresh_model, tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(
        LongStrawGRPOTrainer,
        fresh_model(),
        tokenizer,
        prompt_dataset,
        tmp_path,
        memory_plan_prompt_length=100_000,
        memory_plan_device_gib=0.01,
        memory_plan="warn",
    )
    assert trainer._memory_plan.fits is False
    assert trainer._memory_plan.setup.prompt_tokens == 100_000 and trainer._memory_plan.setup.lora_rank is None


def test_the_plan_at_construction_reaches_the_console(fresh_model, tokenizer, prompt_dataset, tmp_path, capsys):
    make_trainer(
        LongStrawGRPOTrainer, fresh_model(), tokenizer, prompt_dataset, tmp_path, memory_plan_prompt_length=1024
    )
    assert re.search(
        r"(?s)LongStraw memory plan \(memory_plan_prompt_length=1024\):.*per device", capsys.readouterr().out
    )


def test_no_plan_without_a_prompt_length(fresh_model, tokenizer, prompt_dataset, tmp_path):
    trainer = make_trainer(LongStrawGRPOTrainer, fresh_model(), tokenizer, prompt_dataset, tmp_path)
    assert trainer._memory_plan is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("memory_plan", "maybe"), ("memory_plan_prompt_length", 0), ("memory_plan_device_gib", -1.0)],
)
def test_bad_plan_settings_are_refused_naming_the_field(field, value, tmp_path):
    with pytest.raises(ValueError, match=field):
        trainer_args(LongStrawGRPOConfig, tmp_path, **{field: value})


def test_a_recipe_is_planned_with_its_own_settings(capsys):
    args = ["plan", "--config", "configs/qwen3_6_27b_qlora_cp8.yaml", "--prompt-length", "2097152", "--json"]
    assert cli.main([*args, "--gpu-memory", "131"]) == 0
    plan = json.loads(capsys.readouterr().out)
    settings = plan["settings"]
    assert plan["model"] == "Qwen/Qwen3.6-27B" and settings["context_parallel_size"] == 8
    assert (settings["quantization"], settings["lora_rank"], settings["prefill_chunk_size"]) == ("nf4", 16, 16384)
    assert settings["activation_checkpointing"] and settings["completion_tokens"] == 2048


def test_a_hub_id_outside_the_cache_reads_the_architecture_file_written_from_it():
    assert load_model_config("Qwen/Qwen3-8B").to_dict() == load_model_config("qwen3_8b").to_dict()


def test_a_model_and_a_recipe_together_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "qwen3_8b", "--config", "configs/qwen3_8b_lora.yaml", "--prompt-length", "9"])
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_plan_against_what_a_capture_a_replay_and_an_adamw_step_allocate(family):
    """fp32, full fine-tuning, no checkpointing: weights, prompt state and the trainable values' gradients and AdamW
    state are byte counts (equal to the allocations, up to AdamW's scalar step counters); the replay's working set is
    an estimate, as this CPU run holds it (the recurrent kernels' torch fallbacks, not the GPU's fla kernels the plan
    counts, which hold less) at least what autograd saves for one replay and at most 5x it (measured: 1.6x to
    4.2x)."""
    model = prepared(build_model(family))
    setup = UpdateSetup(
        prompt_tokens=61,
        completion_tokens=70,  # two chunks of the recurrent kernels
        group_size=1,
        lora_rank=None,
        activation_checkpointing=False,
        prefill_chunk_size=32,
        attention_chunk_size=16,
        dtype_bytes=4,
        prompts_per_generation=0,
    )
    plan = plan_run(model.config, setup)
    parameters = list(model.parameters())
    assert plan.account.weights.bytes == sum(p.nbytes for p in parameters) + sum(b.nbytes for b in model.buffers())
    prompt, _, _ = case(prompt_length=setup.prompt_tokens)
    engine = LongStrawEngine(setup.prefill_chunk_size, setup.attention_chunk_size)
    state = engine.capture(model, prompt, first_position=0)
    assert plan.state_bytes == state.nbytes()
    completion = torch.randint(2, 100, (setup.completion_tokens,), generator=torch.Generator().manual_seed(1))
    saved = saved_activation_bytes(
        model, state, lambda: engine.replay(model, state, prompt[-1:], completion, setup.completion_tokens)
    )
    on_cpu = replay_graph_account(
        model.config, setup.completion_tokens, setup.prompt_tokens - 1, setup.attention_chunk_size, False, 4,
        fused_kernels=False,
    )  # fmt: skip
    assert plan.account.replay.bytes <= on_cpu.bytes
    assert saved <= on_cpu.bytes <= 5 * saved
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    optimizer = torch.optim.AdamW(parameters)
    optimizer.step()
    moments = sum(value.nbytes for slot in optimizer.state.values() for value in slot.values())
    step_counters = 4 * len(parameters)  # one fp32 `step` per parameter
    assert plan.trainable_bytes == sum(p.grad.nbytes for p in parameters) + moments - step_counters


def test_a_cpu_budget_is_the_containers_memory_limit_where_lower(tmp_path, monkeypatch):
    from trl_longstraw import plan

    limit = tmp_path / "memory.max"
    monkeypatch.setattr(plan, "CGROUP_MEMORY_MAX", str(limit))
    limit.write_text("max\n")
    physical = plan.memory_budget(torch.device("cpu"))
    assert physical > GIB
    limit.write_text(f"{GIB}\n")
    assert plan.memory_budget(torch.device("cpu")) == GIB
    assert plan.memory_budget(torch.device("cpu"), device_gib=3) == 3 * GIB  # memory_plan_device_gib wins
