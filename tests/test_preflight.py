"""The trainer's pre-flight (`trl_longstraw/preflight.py`): how the model numbers a padded row's positions, and that
every layer reaches the prompt state once per forward, found before training and refused naming the layer."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from trl_longstraw import LongStrawGRPOTrainer
from trl_longstraw.architectures import UnsupportedModelError, check_supported
from trl_longstraw.embedded import build_model
from trl_longstraw.engine import prepare_model
from trl_longstraw.preflight import positions_follow_mask

from .conftest import make_trainer

TINY = {
    "vocab_size": 102,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": None,
}


def tiny_model(model_type, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**TINY, **overrides}))


@pytest.mark.parametrize(
    "family, counts_real_tokens", [("opt", True), ("qwen3", False), ("gemma2", False), ("qwen3_5", False)]
)
def test_positions_follow_the_mask_only_where_the_models_own_forward_counts_real_tokens(family, counts_real_tokens):
    assert positions_follow_mask(prepare_model(build_model(family))) is counts_real_tokens


def test_absolute_positions_numbered_by_padded_index_are_kept():
    """GPT-2 learns absolute positions too, but numbers a padded row by index (`cache_position`), as the default."""
    assert positions_follow_mask(tiny_model("gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=256)) is False


def test_a_decoder_layer_that_drops_the_attention_kwargs_is_refused_at_construction(
    tokenizer, prompt_dataset, tmp_path
):
    with pytest.raises(UnsupportedModelError, match=r"layer 0 attention \(StableLmAttention\).*StableLM's decoder"):
        make_trainer(LongStrawGRPOTrainer, tiny_model("stablelm"), tokenizer, prompt_dataset, tmp_path)


def test_an_attention_called_twice_per_layer_is_refused_at_construction(tokenizer, prompt_dataset, tmp_path):
    with pytest.raises(UnsupportedModelError, match=r"Layer 0 \(DiffLlamaAttention\).*attention function more than"):
        make_trainer(LongStrawGRPOTrainer, tiny_model("diffllama", head_dim=16), tokenizer, prompt_dataset, tmp_path)


def test_an_attention_with_a_dynamic_mask_is_refused_from_its_config():
    with pytest.raises(UnsupportedModelError, match=r"Layer 0 \(DogeAttention\) hands the attention function a dyn"):
        check_supported(AutoConfig.for_model("doge", **TINY))


def test_the_probes_leave_nf4_weights_as_training_needs_them(tokenizer, prompt_dataset, tmp_path):
    """bitsandbytes repacks NF4 weights for inference at the first eval-mode forward on a CPU with AVX512-BF16, and its
    repacked matmul has no backward: the probes run in training mode, so construction repacks nothing."""
    import bitsandbytes as bnb
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    build_model("qwen3").save_pretrained(tmp_path / "base")
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=nf4)  # in eval mode
    lora = LoraConfig(r=4, target_modules="all-linear")
    trainer = make_trainer(LongStrawGRPOTrainer, model, tokenizer, prompt_dataset, tmp_path / "run", peft_config=lora)
    states = [m.weight.quant_state for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert states and not any(getattr(state, "packing_format_for_cpu", False) for state in states)


def test_a_decoder_that_counts_positions_from_the_cache_is_refused_at_construction(
    tokenizer, prompt_dataset, tmp_path
):
    """BART's decoder numbers positions from the cache's length and ignores `position_ids`: scored from a capture,
    its completion tokens would sit at position 0. The pre-flight's level 2 refuses it, with the difference."""
    model = tiny_model(
        "bart", d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, dropout=0.0
    )
    with pytest.raises(UnsupportedModelError, match=r"BartForCausalLM: the log-probs LongStraw scores .* differ"):
        make_trainer(LongStrawGRPOTrainer, model, tokenizer, prompt_dataset, tmp_path)


def test_a_model_whose_own_forward_grpo_cannot_run_is_refused_at_construction(tokenizer, prompt_dataset, tmp_path):
    # MllamaForCausalLM's forward returns no last_hidden_state for TRL's fused LM head: stock fails too.
    from .conformance import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("mllama"))
    with pytest.raises(UnsupportedModelError, match=r"MllamaForCausalLM: its own forward, as GRPOTrainer runs it"):
        make_trainer(LongStrawGRPOTrainer, model, tokenizer, prompt_dataset, tmp_path)
