"""State accounting from the registry agrees with what a capture actually keeps, for every family, and with the
paper's figures for GLM-5 and Qwen3.6-27B; the whole-update accounting agrees with what bitsandbytes, PEFT and an fp8
capture allocate, and its replay-graph estimate bounds what autograd saves."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

from trl_longstraw.accounting import (
    StateAccount,
    UpdateSetup,
    lora_account,
    nf4_weight_bytes,
    prompt_state_account,
    prompt_state_bytes,
    replay_graph_account,
    stock_activation_bytes,
    under_context_parallelism,
    update_account,
    weight_account,
)
from trl_longstraw.architectures import UnsupportedModelError, shared_skeleton
from trl_longstraw.embedded import FAMILIES, build_model, tiny_config
from trl_longstraw.engine import LongStrawEngine
from trl_longstraw.state.registry import LayerAccount, decoder_layers

from .test_engine import case, chunked_attention_model, prepared


def architecture(name):
    kwargs = json.loads(Path(f"trl_longstraw/accounting/architectures/{name}.json").read_text())
    return AutoConfig.for_model(**{k: v for k, v in kwargs.items() if not k.startswith("_")})


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("prompt_gradient", ["detach", "exact"])
@pytest.mark.parametrize("prompt_length", [45, 3])  # 3: shorter than the tiny configs' sliding window of 6
def test_accounting_matches_a_captured_state(family, prompt_gradient, prompt_length):
    model = prepared(build_model(family))
    prompt, _, _ = case(prompt_length=prompt_length)
    engine = LongStrawEngine(64, 16, prompt_gradient=prompt_gradient)  # one capture chunk: one exact-mode boundary
    state = engine.capture(model, prompt, first_position=0)
    account = prompt_state_account(model.config, dtype_bytes=4, exact=prompt_gradient == "exact")
    assert account.bytes(prompt_length - 1) == state.nbytes()


def test_a_chunked_layers_fixed_bytes_are_its_fullest_chunk():
    """A chunked-attention layer keeps the entries of the next token's chunk before it: at most `chunk - 1`."""
    model = prepared(chunked_attention_model(chunk_size=8))
    prompt, _, _ = case(prompt_length=16)  # 15 captured: the next token is the last of its chunk
    state = LongStrawEngine(64, 16).capture(model, prompt, first_position=0)
    assert [layer.length for layer in state.layers] == [7, 7, 7, 15]
    assert prompt_state_account(model.config, dtype_bytes=4, exact=False).bytes(15) == state.nbytes()


@pytest.mark.parametrize(
    "family, held",
    [
        ("qwen3_5", {"full_attention": "split", "gated_deltanet": "replicated"}),
        ("nemotron_h", {"full_attention": "split", "mamba2": "replicated"}),
        ("olmo3", {"full_attention": "split", "sliding_attention": "replicated"}),
        ("glm_moe_dsa", {"mla_latent": "split", "dsa_indexer_keys": "split"}),
    ],
)
def test_each_state_kind_says_how_context_parallelism_holds_it(family, held):
    """The planner's split / replicated / refused comes from the kinds (`LayerState.under_context_parallelism`)."""
    assert under_context_parallelism(tiny_config(family)) == held


def test_a_layer_type_context_parallelism_does_not_shard_is_refused_by_its_kind():
    assert under_context_parallelism(chunked_attention_model(chunk_size=8).config)["chunked_attention"] == "refused"


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h", "mistral", "qwen3"])
def test_exact_accounting_counts_every_capture_chunk_boundary(family):
    """The exact prompt gradient keeps the recurrent states at every capture chunk's boundary (3 chunks here)."""
    model = prepared(build_model(family))
    prompt, _, _ = case(prompt_length=45)
    state = LongStrawEngine(16, 16, prompt_gradient="exact").capture(model, prompt, first_position=0)
    account = prompt_state_account(model.config, dtype_bytes=4, exact=True, prefill_chunk_size=16)
    assert account.bytes(44) == state.nbytes()
    assert sum(prompt_state_bytes(model.config, 44, 4, exact=True, prefill_chunk_size=16).values()) == state.nbytes()


def test_glm5_keeps_576_latent_values_per_token_per_layer():
    account = prompt_state_account(architecture("glm5"), dtype_bytes=2)
    assert account.by_layer_type["mla_latent"].per_token == 576 * 2
    assert account.by_layer_type["mla_latent"].layers == 78
    assert account.by_layer_type["dsa_indexer_keys"].layers == 21


def test_state_is_far_below_stock_at_long_prompts():
    config = architecture("qwen3_6_27b")
    account = prompt_state_account(config)
    assert account.by_layer_type["gated_deltanet"].per_token == 0  # GatedDeltaNet state does not grow with P
    assert account.bytes(2_097_152) * 50 < stock_activation_bytes(config, 2_097_152, 8192, group_size=8)


def test_a_config_the_engine_refuses_is_refused_by_the_accounting():
    config = tiny_config("qwen3")
    config.layer_types = ["full_attention", "linear_attention"]  # a layer type its modules do not have
    with pytest.raises(UnsupportedModelError, match="Layer 1 .*layer type 'linear_attention'"):
        prompt_state_account(config)


# -- the whole update: weights, LoRA + AdamW, state by dtype and placement, the replay's graph (estimate) -------------


def allocated_bytes(model):
    """Distinct storages of a model's parameters, buffers and bitsandbytes quantisation states (absmax, code books,
    offsets, nested states): what the loaded weights occupy."""
    tensors = list(model.parameters()) + list(model.buffers())
    for param in model.parameters():
        quant_state = getattr(param, "quant_state", None)
        if quant_state is not None:
            tensors += [t for t in (quant_state.absmax, quant_state.code, quant_state.offset) if torch.is_tensor(t)]
            if quant_state.state2 is not None:
                tensors += [quant_state.state2.absmax, quant_state.state2.code]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_weight_bytes_are_what_bitsandbytes_allocates(family, double_quant, tmp_path):
    pytest.importorskip("bitsandbytes")
    model = build_model(family)
    model.save_pretrained(tmp_path)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, quantization_config=quantization)
    predicted = weight_account(model.config, "nf4", double_quant=double_quant, dtype_bytes=2)
    assert predicted.params == sum(p.numel() for p in model.parameters())
    assert predicted.quantized_params > 0.8 * predicted.params  # the linear maps; embeddings and LM head stay bf16
    assert predicted.bytes == allocated_bytes(quantized)
    assert weight_account(model.config).bytes == allocated_bytes(build_model(family, dtype=torch.bfloat16))
    # what FSDP2 shards of them: the packed codes (the quantisation states stay whole on every rank)
    packed = sum(p.nbytes for p in quantized.parameters() if getattr(p, "quant_state", None) is not None)
    assert predicted.quantized_bytes - predicted.quantization_state_bytes == packed


def test_nf4_costs_about_half_a_byte_per_value():
    assert nf4_weight_bytes(2**20, double_quant=False) == 2**19 + 4 * 2**14 + 64
    assert 0.515 < nf4_weight_bytes(2**30, double_quant=True) / 2**30 < 0.516


@pytest.mark.parametrize(
    ("family", "targets"),
    [
        ("qwen3", "all-linear"),
        ("qwen3_5", "all-linear"),
        ("qwen3_5", ["q_proj", "in_proj_qkv", "down_proj"]),
        # GLM-5's recipe scope: PEFT adapts the fused expert tensors under these names (gate_up at twice the rank)
        ("glm_moe_dsa", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj"]),
    ],
)
def test_lora_parameter_count_is_what_peft_adds_to_the_real_model(family, targets):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_model(family), peft.LoraConfig(r=4, target_modules=targets))
    trainable, _ = model.get_nb_trainable_parameters()
    account = lora_account(tiny_config(family), rank=4, target_modules=targets)
    assert account.params == trainable
    assert account.bytes == 16 * trainable  # fp32 weight, gradient, exp_avg, exp_avg_sq


def test_lora_on_fused_experts_counts_the_merged_stack_peft_checks():
    peft = pytest.importorskip("peft")
    config = tiny_config("glm_moe_dsa")
    on_experts = lora_account(config, rank=4, target_modules=["kv_b_proj", "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(
        build_model("glm_moe_dsa"), peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj"])
    )
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    assert on_experts.largest_fused_target == experts.gate_up_proj.numel()
    assert on_experts.merge_check_bytes(2) == 2 * on_experts.largest_fused_target
    assert lora_account(config, rank=4, target_modules=["kv_b_proj"]).merge_check_bytes(2) == 0


def test_lora_on_every_linear_map_of_a_dense_model_is_rank_times_in_plus_out():
    config = tiny_config("qwen3")
    hidden, heads, kv_heads, head_dim = config.hidden_size, 4, 2, 16
    q, kv, mlp = heads * head_dim, kv_heads * head_dim, config.intermediate_size
    per_layer = (hidden + q) + 2 * (hidden + kv) + (q + hidden) + 3 * (hidden + mlp)  # q, k, v, o, gate, up, down
    assert lora_account(config, rank=8).params == 8 * config.num_hidden_layers * per_layer


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "olmo3", "gpt_oss", "glm_moe_dsa"])
def test_fp8_state_bytes_are_what_a_capture_keeps(family):
    model = prepared(build_model(family))
    prompt, _, _ = case(prompt_length=150)  # 149 captured tokens: two full 64-token pages and a partial one
    engine = LongStrawEngine(40, 16, prompt_state_dtype="float8_e4m3fn")
    state = engine.capture(model, prompt, first_position=0)
    predicted = prompt_state_bytes(model.config, 149, dtype_bytes=4, state_dtype="float8_e4m3fn")
    assert sum(predicted.values()) == state.nbytes()
    assert sum(prompt_state_bytes(model.config, 149, dtype_bytes=4).values()) == prompt_state_account(
        model.config, dtype_bytes=4
    ).bytes(149)


def saved_activation_bytes(model, state, forward):
    """Distinct storages autograd saves during `forward()`, other than parameters and the prompt state."""
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *state.tensors()]}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(saved.values())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_estimate_bounds_the_saved_activations(family):
    """The replay-graph estimate's `saved` term against what autograd really saves for one replay (fp32, no
    checkpointing): an upper bound, and not a vacuous one."""
    completion_tokens = 70  # two chunks of the recurrent kernels
    model = prepared(build_model(family))
    prompt, _, _ = case(prompt_length=60)
    completion = torch.randint(2, 100, (completion_tokens,), generator=torch.Generator().manual_seed(1))
    engine = LongStrawEngine(32, 16)
    state = engine.capture(model, prompt, first_position=0)
    measured = saved_activation_bytes(
        model, state, lambda: engine.replay(model, state, prompt[-1:], completion, completion_tokens)
    )
    estimate = replay_graph_account(
        model.config, completion_tokens, 59, 16, activation_checkpointing=False, dtype_bytes=4, fused_kernels=False
    )  # the CPU's torch fallbacks of the recurrent kernels
    assert measured <= estimate.saved <= 3 * measured


def test_one_h200_holds_the_qwen3_6_27b_update_at_2m_positions_only_with_fp8_state():
    setup = UpdateSetup(
        prompt_tokens=2_097_152,
        completion_tokens=4096,
        quantization="nf4",
        lora_rank=16,
        state_dtype="float8_e4m3fn",
        activation_checkpointing=True,
        prefill_chunk_size=16384,
        attention_chunk_size=8192,
    )
    h200 = 131 * 1024**3
    fp8 = update_account(architecture("qwen3_6_27b"), setup)
    bf16 = update_account(architecture("qwen3_6_27b"), dataclasses.replace(setup, state_dtype="auto"))
    assert fp8.state["full_attention"] * 2 < bf16.state["full_attention"] * 1.01  # half, plus the page scales
    assert fp8.state["gated_deltanet"] == bf16.state["gated_deltanet"]  # recurrent states stay fp32
    assert fp8.device_bytes < h200 < bf16.device_bytes
    assert fp8.host_bytes == 0
    # A rollout holds one prompt state per prompt of its generation batch: TRL's default steps_per_generation (the
    # recipe's 4 micro-steps) would put four on the device at once.
    four = update_account(architecture("qwen3_6_27b"), dataclasses.replace(setup, prompts_per_generation=4))
    assert four.rollout_bytes(four.state_bytes) == 4 * (four.state_bytes + 8 * four.decoded_row)
    assert four.device_bytes - four.weights.bytes - four.lora.bytes == four.rollout_bytes(four.state_bytes) > h200
    assert fp8.lora.value_bytes == 2  # TRL keeps QLoRA adapters (and so AdamW's moments) in bf16


def test_host_resident_state_leaves_the_device():
    setup = UpdateSetup(prompt_tokens=65_536, completion_tokens=1024, lora_rank=None, state_device="cpu")
    host = update_account(architecture("glm5"), setup)
    device = update_account(architecture("glm5"), dataclasses.replace(setup, state_device="device"))
    assert host.host_bytes == device.state_bytes > 0
    assert device.device_bytes - host.device_bytes == device.state_bytes
    assert host.state["mla_latent"] == prompt_state_account(architecture("glm5")).by_layer_type["mla_latent"].bytes(
        65_535
    )


def test_layers_of_one_kind_with_two_geometries_are_counted_apart():
    """Two full-attention geometries (e.g. a model whose global layers have more kv heads): both kept, both counted."""
    account = StateAccount()
    for per_token in (64, 64, 256):
        account.add(LayerAccount("full_attention", per_token=per_token))
    assert sorted(part.layers for part in account.by_layer_type.values()) == [1, 2]
    assert account.bytes(10) == 10 * (64 + 64 + 256) and account.bytes_per_token() == 384


def test_a_skeleton_is_shared_by_equal_configs_and_rebuilt_for_a_changed_one():
    """The planner reads one skeleton per config (`shared_skeleton`); a config changed in place since (a wider MLP)
    gets its own, and LoRA counted on a changed config follows it."""
    config = tiny_config("qwen3")
    first = shared_skeleton(config)
    assert shared_skeleton(tiny_config("qwen3")) is first
    before = lora_account(config, rank=4).params
    config.intermediate_size *= 2
    wider = shared_skeleton(config)
    assert wider is not first
    assert decoder_layers(wider)[0].mlp.up_proj.out_features == 2 * decoder_layers(first)[0].mlp.up_proj.out_features
    assert lora_account(config, rank=4).params > before
