"""Bad input fails before expensive work, with an error that names the field and the fix."""

import dataclasses
import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, MambaConfig, MambaForCausalLM

from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
from trl_longstraw.architectures import UnsupportedModelError, check_supported
from trl_longstraw.embedded import build_model, tiny_config

from .conftest import accelerate_launch_env, make_trainer, synthetic_inputs, trainer_args


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("prompt_gradient", "full", "prompt_gradient='full'"),
        ("prefill_chunk_size", 0, "prefill_chunk_size=0"),
        ("attention_chunk_size", -1, "attention_chunk_size=-1"),
        ("prompt_state_device", "gpu7", "prompt_state_device='gpu7'"),
        ("prompt_state_dtype", "int8", "prompt_state_dtype='int8' is not supported"),
        (
            "neftune_noise_alpha",
            5.0,
            "neftune_noise_alpha=5.0: NEFTune adds fresh noise .* Set neftune_noise_alpha=None",
        ),
        ("rollout_from_prompt_state", "yes", "rollout_from_prompt_state='yes' must be True or False or None (unset)"),
        ("shard_weights", "true", "shard_weights='true' must be True or False."),
        ("prefill_chunk_size", True, "prefill_chunk_size=True must be a positive integer"),
        ("context_parallel_size", 2.0, "context_parallel_size=2.0 must be a positive integer, or None"),
        (
            "memory_plan_prompt_length",
            1.5e6,
            "memory_plan_prompt_length=1500000.0 must be a positive integer, or None",
        ),
        ("shard_layer_classes", "Qwen3DecoderLayer", "shard_layer_classes='Qwen3DecoderLayer' must be a list"),
        ("fp16", True, "fp16=True is not supported: .* Use bf16=True."),
    ],
)
def test_config_rejects_bad_fields(field, value, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        trainer_args(LongStrawGRPOConfig, tmp_path, **{field: value})


@pytest.mark.parametrize("optim", ["galore_adamw_layerwise", "apollo_adamw_layerwise", "lomo", "adalomo"])
def test_optimizers_that_step_inside_the_backward_are_refused(optim, tmp_path):
    """They move the weights as each gradient arrives: between the members one step replays (measured before the
    refusal: a StaleStateError mid-update with the layerwise GaLore, weights off by 3% of stock's update with LOMO)."""
    with pytest.raises(ValueError, match=f"optim='{optim}' is not supported: it updates the weights inside the"):
        trainer_args(LongStrawGRPOConfig, tmp_path, optim=optim, optim_target_modules=["q_proj"])


def test_fp8_prompt_state_with_the_exact_gradient_is_refused(tmp_path):
    with pytest.raises(ValueError, match="prompt_state_dtype='float8_e4m3fn' with prompt_gradient='exact'"):
        trainer_args(LongStrawGRPOConfig, tmp_path, prompt_state_dtype="float8_e4m3fn", prompt_gradient="exact")


def test_a_batch_of_partial_groups_names_the_batch_size_and_the_fix(tmp_path):
    with pytest.raises(
        ValueError, match=r"per_device_train_batch_size=4 x 1 process\(es\) x steps_per_generation=1 = 4 "
    ):
        trainer_args(LongStrawGRPOConfig, tmp_path, per_device_train_batch_size=4, num_generations=3)


def test_stock_config_is_refused(tmp_path, tokenizer, prompt_dataset, fresh_model):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="needs a LongStrawGRPOConfig"):
        LongStrawGRPOTrainer(
            model=fresh_model(),
            reward_funcs=len,
            args=trainer_args(GRPOConfig, tmp_path),
            train_dataset=prompt_dataset,
            processing_class=tokenizer,
        )


def test_fp16_is_refused(tmp_path, tokenizer, prompt_dataset, fresh_model):
    args = trainer_args(LongStrawGRPOConfig, tmp_path)
    args.fp16 = True
    with pytest.raises(ValueError, match="fp16=True"):
        LongStrawGRPOTrainer(
            model=fresh_model(), reward_funcs=len, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
        )


def test_a_layer_without_a_registered_state_kind_is_named(tmp_path, tokenizer, prompt_dataset):
    model = MambaForCausalLM(MambaConfig(num_hidden_layers=1, hidden_size=32, state_size=4, vocab_size=102))
    with pytest.raises(
        UnsupportedModelError, match=r"Layer 0 \(MambaBlock, layer type 'linear_attention'\).*mixer: MambaMixer"
    ):
        LongStrawGRPOTrainer(
            model=model,
            reward_funcs=len,
            args=trainer_args(LongStrawGRPOConfig, tmp_path),
            train_dataset=prompt_dataset,
            processing_class=tokenizer,
        )


def test_unsupported_layer_type_is_named():
    config = tiny_config("qwen3")
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(UnsupportedModelError, match="Layer 1 .* 'linear_attention'"):
        check_supported(config)


def write_remote_code_model(path):
    """A tiny qwen3 saved as a remote-code model: its own model_type and classes, built from supported modules."""
    build_model("qwen3", seed=0).save_pretrained(path)
    (path / "configuration_tiny.py").write_text(
        "from transformers import Qwen3Config\n\n\nclass TinyConfig(Qwen3Config):\n    model_type = 'tiny_remote'\n"
    )
    (path / "modeling_tiny.py").write_text(
        "from transformers import Qwen3ForCausalLM\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
        "class TinyForCausalLM(Qwen3ForCausalLM):\n    config_class = TinyConfig\n"
    )
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="tiny_remote",
        auto_map={
            "AutoConfig": "configuration_tiny.TinyConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
        },
    )
    (path / "config.json").write_text(json.dumps(config))


def test_support_is_decided_by_the_modules_not_the_model_type(tmp_path):
    write_remote_code_model(tmp_path)
    remote = AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
    plans = check_supported(remote, trust_remote_code=True)
    assert [kind.name for plan in plans for kind, _ in plan.kinds] == ["attention", "attention"]


def test_trust_remote_code_of_the_config_reaches_the_architecture_check(tmp_path, tokenizer, prompt_dataset):
    """As in GRPOTrainer, `args.trust_remote_code` applies when `model_init_kwargs` does not set it."""
    write_remote_code_model(tmp_path / "remote")
    trainer = LongStrawGRPOTrainer(
        model=str(tmp_path / "remote"),
        reward_funcs=len,
        args=trainer_args(LongStrawGRPOConfig, tmp_path, trust_remote_code=True),
        train_dataset=prompt_dataset,
        processing_class=tokenizer,
    )
    assert trainer.model.config.model_type == "tiny_remote"  # without the fallback: "contains custom code" error


def test_a_prompt_learning_adapter_is_refused(tmp_path, tokenizer, prompt_dataset, fresh_model):
    from peft import PromptTuningConfig

    with pytest.raises(ValueError, match="peft_config is a PromptTuningConfig.*Use an adapter on the weights"):
        make_trainer(
            LongStrawGRPOTrainer,
            fresh_model(),
            tokenizer,
            prompt_dataset,
            tmp_path,
            peft_config=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        )


def test_active_dropout_is_refused(tmp_path, tokenizer, prompt_dataset, fresh_model):
    from peft import LoraConfig

    lora = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj"], lora_dropout=0.3)
    with pytest.raises(
        ValueError, match=r"Dropout \S+q_proj.lora_dropout.default has p=0.3.*Set disable_dropout=True"
    ):
        make_trainer(
            LongStrawGRPOTrainer, fresh_model(), tokenizer, prompt_dataset, tmp_path, lora, disable_dropout=False
        )


def test_disable_dropout_false_is_accepted_for_a_model_without_dropout(tmp_path, tokenizer, prompt_dataset):
    trainer = make_trainer(
        LongStrawGRPOTrainer, build_model("qwen3"), tokenizer, prompt_dataset, tmp_path, disable_dropout=False
    )
    assert trainer.args.disable_dropout is False


def test_an_eval_dataset_handed_to_evaluate_is_checked_under_context_parallelism(tmp_path, tokenizer, prompt_dataset):
    from types import SimpleNamespace

    trainer = make_trainer(LongStrawGRPOTrainer, build_model("qwen3"), tokenizer, prompt_dataset, tmp_path)
    # the check alone: one process cannot build a CP group
    trainer.parallel_layout = dataclasses.replace(
        trainer.parallel_layout, context_parallel=2, cp_group=SimpleNamespace()
    )
    with pytest.raises(ValueError, match="context_parallel_size=2 with an iterable eval dataset"):
        trainer.get_eval_dataloader(prompt_dataset.to_iterable_dataset())


@pytest.mark.parametrize(
    "device_map, offloaded",
    [
        ({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "disk", "lm_head": "cpu"}, None),
        ({"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "disk", "lm_head": "cpu"}, "model.norm"),
    ],
    ids=["beside-a-gpu", "on-the-host"],
)
def test_layers_offloaded_by_a_device_map_are_refused(tmp_path, tokenizer, prompt_dataset, device_map, offloaded):
    model = build_model("qwen3")
    model.hf_device_map = device_map
    names = r"\['lm_head', 'model.layers.1'\]" if offloaded is None else rf"\['{offloaded}'\]"
    with pytest.raises(ValueError, match=rf"offloads {names} to cpu/disk.*max_memory"):
        make_trainer(LongStrawGRPOTrainer, model, tokenizer, prompt_dataset, tmp_path)


def test_a_model_on_the_host_alone_is_not_offloaded(tmp_path, tokenizer, prompt_dataset):
    model = build_model("qwen3")
    model.hf_device_map = {"": torch.device("cpu")}
    make_trainer(LongStrawGRPOTrainer, model, tokenizer, prompt_dataset, tmp_path)


def test_deepspeed_is_refused_naming_the_fsdp2_accelerate_config(tmp_path, monkeypatch):
    fix = "configs/accelerate/fsdp2.yaml.*shard_weights=True"
    with pytest.raises(ValueError, match=f"not through DeepSpeed.*\\(`deepspeed`\\).*{fix}"):
        trainer_args(LongStrawGRPOConfig, tmp_path, deepspeed={"zero_optimization": {"stage": 3}})
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "1")  # transformers reads it with strtobool
    with pytest.raises(ValueError, match=f"\\(ACCELERATE_USE_DEEPSPEED set by an accelerate config\\).*{fix}"):
        trainer_args(LongStrawGRPOConfig, tmp_path)


@pytest.fixture
def fsdp2_launch(monkeypatch):
    """The variables `accelerate launch --config_file configs/accelerate/fsdp2.yaml` exports (TRL's fsdp2.yaml), and
    the ones the config sets in reply, restored after the test."""
    for name, value in accelerate_launch_env("configs/accelerate/fsdp2.yaml").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LONGSTRAW_FSDP_FROM_ACCELERATE", "false")
    return monkeypatch


def test_an_fsdp2_accelerate_config_shards_the_weights_under_the_trainer(tmp_path, fsdp2_launch):
    """The launch's variables become shard_weights, and Accelerate is to be left without its FSDP plugin (nor
    transformers' first-rank-only loading): the config says so (`launch_environment`), the trainer sets it."""
    args = trainer_args(LongStrawGRPOConfig, tmp_path)
    assert args.shard_weights and args.shard_layer_classes is None and args.fsdp_plugin_args is None
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"  # creating a config changes no environment
    assert args.launch_environment() == {"ACCELERATE_USE_FSDP": "false", "LONGSTRAW_FSDP_FROM_ACCELERATE": "true"}
    os.environ.update(args.launch_environment())  # as the trainer's construction does
    args = trainer_args(LongStrawGRPOConfig, tmp_path)  # the process's next config (a second run, an evaluation's)
    assert args.shard_weights and args.fsdp_plugin_args is None


def test_fsdp2_training_arguments_shard_the_weights_with_their_layer_classes_and_checkpointing(tmp_path):
    args = trainer_args(
        LongStrawGRPOConfig,
        tmp_path,
        fsdp=True,
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": "Qwen3DecoderLayer",
            "activation_checkpointing": True,
        },
    )
    assert args.shard_weights and args.shard_layer_classes == ["Qwen3DecoderLayer"]
    assert args.activation_checkpointing and not args.fsdp and args.fsdp_plugin_args is None


def test_a_sharded_state_dict_type_is_not_followed_and_says_so(tmp_path, fsdp2_launch):
    fsdp2_launch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")  # TRL's fsdp2.yaml
    with pytest.warns(UserWarning, match="fsdp_state_dict_type: SHARDED_STATE_DICT in the accelerate config is not"):
        assert trainer_args(LongStrawGRPOConfig, tmp_path).shard_weights


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"FSDP_VERSION": "1"}, "fsdp_version: 1 in the accelerate config.*Set fsdp_version: 2"),
        (
            {"FSDP_RESHARD_AFTER_FORWARD": "false"},
            "fsdp_reshard_after_forward: False .*Set fsdp_reshard_after_forward: ",
        ),
        ({"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params: true .*Set fsdp_offload_params: false"),
        ({"FSDP_AUTO_WRAP_POLICY": "NO_WRAP"}, "fsdp_auto_wrap_policy: NO_WRAP .*TRANSFORMER_BASED_WRAP"),
        ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"}, "fsdp_auto_wrap_policy: size_based_auto_wrap_policy .*"),
    ],
)
def test_fsdp_settings_the_trainer_does_not_follow_are_refused(tmp_path, fsdp2_launch, variables, message):
    for name, value in variables.items():
        fsdp2_launch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        trainer_args(LongStrawGRPOConfig, tmp_path)


def test_shard_layer_classes_without_shard_weights_are_refused(tmp_path):
    with pytest.raises(ValueError, match="shard_layer_classes=\\['Qwen3DecoderLayer'\\] without shard_weights=True"):
        trainer_args(LongStrawGRPOConfig, tmp_path, shard_layer_classes=["Qwen3DecoderLayer"])


@pytest.mark.parametrize("size", ["dp_shard_size", "tp_size"])
def test_weights_sharded_by_accelerates_parallelism_config_are_refused(tmp_path, monkeypatch, size):
    """FSDP2 (`dp_shard_size`) and tensor parallelism (`tp_size`), given in the training arguments or, as
    `PARALLELISM_CONFIG_*` variables, by an accelerate config file; replicas alone (`dp_replicate_size`) are DDP."""
    from accelerate.parallelism_config import ParallelismConfig

    match = f"tensor parallelism or Accelerate's parallelism_config \\(Accelerate's parallelism_config {size}=2\\)"
    with pytest.raises(ValueError, match=match):
        trainer_args(LongStrawGRPOConfig, tmp_path, parallelism_config=ParallelismConfig(**{size: 2}))
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv(f"PARALLELISM_CONFIG_{size.upper()}", "2")
    with pytest.raises(ValueError, match=match):
        trainer_args(LongStrawGRPOConfig, tmp_path)
    monkeypatch.delenv(f"PARALLELISM_CONFIG_{size.upper()}")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    trainer_args(LongStrawGRPOConfig, tmp_path)


def test_attention_that_bypasses_the_attention_interface_is_refused():
    from trl_longstraw.state import registry

    class Handwritten(torch.nn.Module):  # attention-shaped, but its forward never asks the AttentionInterface
        def __init__(self):
            super().__init__()
            self.q_proj, self.o_proj, self.layer_idx = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), 0

        def forward(self, hidden_states):
            return self.o_proj(self.q_proj(hidden_states))

    assert not registry.routes_through_attention_interface(Handwritten)
    model = build_model("qwen3")
    model.model.layers[0].self_attn = Handwritten()
    with pytest.raises(
        UnsupportedModelError, match="Layer 0 .*Handwritten does not call transformers' AttentionInterface"
    ):
        check_supported(model)


def looped_model(loops: int):
    """A tiny Dory: one input layer, two recurrent layers run `loops` times per forward, one output layer."""
    config = AutoConfig.for_model(
        "dory",
        vocab_size=102,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_input_layers=1,
        n_output_layers=1,
        n_recurrent_loops=loops,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        attention_dropout=0.0,
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "model_type, noise, message",
    [
        ("qwen3", {"attention_dropout": 0.1}, "attention_dropout=0.1: .*Set attention_dropout=0.0"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1: .*Set router_jitter_noise=0.0"),
        ("phimoe", {"router_jitter_noise": 0.0}, "PhiMoE samples its experts in training mode"),
    ],
)
def test_a_model_whose_training_forward_draws_noise_is_refused_by_its_config(model_type, noise, message):
    """Noise drawn anew per training-mode forward (besides nn.Dropout, refused by the trainer) cannot be replayed."""
    sizes = {"vocab_size": 102, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    sizes |= {"num_attention_heads": 4, "num_key_value_heads": 2}
    if model_type != "phimoe":
        check_supported(AutoConfig.for_model(model_type, **sizes))
    with pytest.raises(UnsupportedModelError, match=message):
        check_supported(AutoConfig.for_model(model_type, **sizes, **noise))


def test_positions_counted_from_the_cache_are_refused():
    """Llama 4's attention temperature tuning numbers the NoPE layers' tokens from the cache's length."""
    sizes = {"vocab_size": 102, "hidden_size": 64, "intermediate_size": 128, "intermediate_size_mlp": 128}
    sizes |= {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    check_supported(AutoConfig.for_model("llama4_text", attn_temperature_tuning=False, **sizes))
    with pytest.raises(UnsupportedModelError, match=r"attn_temperature_tuning=True: .*NoPE layers \(\[3\]\)"):
        check_supported(AutoConfig.for_model("llama4_text", **sizes))


def test_a_model_that_loops_over_its_layers_is_refused_by_its_config():
    check_supported(looped_model(1).config)
    with pytest.raises(UnsupportedModelError, match="n_recurrent_loops=2: .*Set n_recurrent_loops=1"):
        check_supported(looped_model(2).config)


def test_a_layer_run_twice_in_one_capture_forward_is_refused(monkeypatch):
    """A looped model the config check does not know (say, remote code) is refused at its first capture."""
    from trl_longstraw.engine import LongStrawEngine, prepare_model
    from trl_longstraw.state import registry

    monkeypatch.setattr(registry, "check_each_layer_runs_once", lambda config: None)
    model = prepare_model(looped_model(2))
    with pytest.raises(UnsupportedModelError, match=r"Layer 1 \(DoryAttention\) ran more than once in one forward"):
        LongStrawEngine(8, 4).capture(model, torch.arange(2, 20), first_position=0)


@pytest.fixture
def trainer(fresh_model, tokenizer, prompt_dataset, tmp_path):
    return make_trainer(
        LongStrawGRPOTrainer, fresh_model(max_position_embeddings=24), tokenizer, prompt_dataset, tmp_path
    )


def test_prompt_longer_than_the_model_positions(trainer, tokenizer):
    inputs = synthetic_inputs(len(tokenizer), prompt_lengths=(20, 7))
    with pytest.raises(ValueError, match="max_position_embeddings=24"):
        trainer.replay_and_backward(trainer.model, inputs)


# GRPOTrainer lets generation_kwargs override max_new_tokens: the generated tokens must fit the positions too. vLLM's
# `max_tokens` does not stand for the completion length of transformers' generate, which ignores it.
@pytest.mark.parametrize("key, refused", [("max_new_tokens", True), ("max_tokens", False)])
def test_the_generated_length_generate_reads_from_generation_kwargs_must_fit_the_positions(
    key, refused, fresh_model, tokenizer, prompt_dataset, tmp_path
):
    def build():
        model = fresh_model(max_position_embeddings=24)
        make_trainer(LongStrawGRPOTrainer, model, tokenizer, prompt_dataset, tmp_path, generation_kwargs={key: 30})

    if refused:
        with pytest.raises(ValueError, match=f"generation_kwargs {key}=30 spans 31 positions.*=24"):
            build()
    else:
        build()


def longrope(original_max_position_embeddings):
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [8.0] * 8}
    rope["original_max_position_embeddings"] = original_max_position_embeddings
    return {"rope_parameters": rope, "original_max_position_embeddings": original_max_position_embeddings}


def test_longrope_past_its_original_length_is_refused(tokenizer, prompt_dataset, tmp_path):
    model = build_model("phi3", **longrope(8))
    with pytest.raises(ValueError, match="spans 9 positions, more than this longrope model's .*=8"):
        make_trainer(LongStrawGRPOTrainer, model, tokenizer, prompt_dataset, tmp_path, max_completion_length=8)


def assert_scores_as_stock(stock, ours, vocab_size: int) -> None:
    """The synthetic rows' completion log-probs of both trainers, equal."""
    inputs = synthetic_inputs(vocab_size)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        want = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, width)[0]
        got = ours._get_per_token_logps_and_entropies(ours.model, ids, mask, width)[0]
    assert ((got - want) * inputs["completion_mask"]).abs().max() <= 1e-5


def test_longrope_within_its_original_length_scores_as_stock(tokenizer, prompt_dataset, tmp_path):
    from trl import GRPOTrainer

    model = build_model("phi3", **longrope(32))  # 11 prompt + 6 completion positions: short factors throughout
    stock = make_trainer(GRPOTrainer, model, tokenizer, prompt_dataset, tmp_path / "stock")
    ours = make_trainer(
        LongStrawGRPOTrainer, build_model("phi3", **longrope(32)), tokenizer, prompt_dataset, tmp_path / "ours"
    )
    assert_scores_as_stock(stock, ours, len(tokenizer))


def test_a_prompt_past_the_positions_is_refused_naming_the_yarn_extension_which_then_scores_as_stock(
    tokenizer, prompt_dataset, tmp_path
):
    """The refusal names the YaRN scaling that covers the run (`architectures.yarn_extension`); a model loaded with
    it is accepted, and LongStraw's chunked capture rotates the prompt as stock's one forward does."""
    import re

    from trl import GRPOTrainer

    short = build_model("qwen3", max_position_embeddings=12)  # the synthetic rows run to position 16
    with pytest.raises(ValueError, match="max_position_embeddings=12. .*YaRN") as refused:
        make_trainer(LongStrawGRPOTrainer, short, tokenizer, prompt_dataset, tmp_path, max_completion_length=16)
    rope = re.search(r"rope_parameters=(\{.*?\}) and max_position_embeddings=(\d+)", str(refused.value))
    extended = {"rope_parameters": eval(rope.group(1)), "max_position_embeddings": int(rope.group(2))}
    assert extended["rope_parameters"]["rope_type"] == "yarn" and extended["rope_parameters"]["factor"] > 1
    stock = make_trainer(GRPOTrainer, build_model("qwen3", **extended), tokenizer, prompt_dataset, tmp_path / "stock")
    ours = make_trainer(
        LongStrawGRPOTrainer, build_model("qwen3", **extended), tokenizer, prompt_dataset, tmp_path / "ours"
    )
    assert_scores_as_stock(stock, ours, len(tokenizer))


def test_load_balancing_loss_without_an_expert_count_is_refused_at_construction(
    fresh_model, tokenizer, prompt_dataset, tmp_path
):
    # GLM-5's config names its experts n_routed_experts: stock would fail inside the fused LM head at the first loss
    with pytest.raises(ValueError, match=r"GlmMoeDsaConfig has no num_experts.*Set router_aux_loss_coef=0.0"):
        make_trainer(
            LongStrawGRPOTrainer,
            fresh_model("glm_moe_dsa"),
            tokenizer,
            prompt_dataset,
            tmp_path,
            router_aux_loss_coef=0.01,
        )


def test_activation_checkpointing_is_off_by_default_and_still_honoured(tmp_path):
    assert trainer_args(LongStrawGRPOConfig, tmp_path).activation_checkpointing is False
    assert trainer_args(LongStrawGRPOConfig, tmp_path, gradient_checkpointing=True).activation_checkpointing is True


def test_a_vision_tower_as_deep_as_the_text_model_is_not_taken_for_the_decoder():
    """Gemma 3's vision tower and text model with 2 layers each: the layer plan maps the text decoder's layers."""
    from trl_longstraw.state import plan_layers

    config = AutoConfig.for_model("gemma3")
    text, vision = config.text_config, config.vision_config
    for tower in (text, vision):
        tower.hidden_size, tower.intermediate_size, tower.num_hidden_layers, tower.num_attention_heads = 64, 128, 2, 4
    text.num_key_value_heads, text.head_dim, text.vocab_size, text.sliding_window = 2, 16, 300, 6
    text.layer_types = ["sliding_attention", "full_attention"]
    plans = plan_layers(AutoModelForCausalLM.from_config(config))
    assert [type(mixer).__name__ for plan in plans for _, mixer in plan.kinds] == ["Gemma3Attention"] * 2
