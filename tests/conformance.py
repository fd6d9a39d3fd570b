"""Conformance over every model type the registry accepts: each one verified against stock, or refused.

For every model type of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` whose default config the registry accepts
(`check_supported` on its meta-device skeleton), a tiny config is built by shrinking the default one (`tiny_config`:
the rules are the constants below, applied to whichever of the fields the config has), then:

- the trainer is constructed on it (its pre-flight refuses, naming the reason, what LongStraw does not reproduce);
- ladder level 2: the completion log-probs from a capture (chunks of 8, key blocks of 5) equal the model's own
  forward of prompt + completion (29 prompt tokens from position 3, 3 members);
- levels 3 and 4: `replay_and_backward` against stock `GRPOTrainer.compute_loss().backward()` (exact mode) and
  against the detached reference (detach mode): loss and every gradient (`tests/reference.py`'s `run_pair`, TRL's
  `dapo` loss, `beta` 0.04).

A type is `verified` (with its errors), `refused` (with the reason: by the registry on the tiny config, or by the
trainer's pre-flight), or `not built` (transformers itself could not build or run the tiny config: the shrinking does
not fit that type). `tests/test_conformance.py` asserts that no accepted type is anything else;
`benchmarks/conformance.py` writes the table.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from trl_longstraw.architectures import check_supported
from trl_longstraw.engine import LongStrawEngine
from trl_longstraw.state import UnsupportedModelError

from .conftest import max_relative_error
from .reference import DetachedReferenceTrainer, run_pair
from .test_engine import case, full_forward, prepared

LAYERS = 4  # decoder layers of a tiny config (per-layer lists keep their first LAYERS entries)
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers")
# Fields set where the default config has them (a scalar, not None).
SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim"), 128),
    **dict.fromkeys(("num_attention_heads", "n_head", "decoder_attention_heads"), 4),
    "head_dim": 16,
    "rotary_dim": 16,
    "vocab_size": 102,
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    "num_experts_per_tok": 2,
    **dict.fromkeys(
        ("moe_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"), 32
    ),
    **dict.fromkeys(("n_shared_experts", "n_group", "topk_group"), 1),
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    **dict.fromkeys(("ssm_state_size", "mamba_d_state", "state_size"), 16),
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 64,
}
MAMBA_HEADS = (
    ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ("mamba_num_heads", "mamba_head_dim", "expand"),
    ("num_heads", "head_dim", "expand"),  # Mamba2's own config
)
TOKENS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
MAX_SCORE_ERROR, MAX_GRAD_ERROR = 1e-4, 1e-4  # level 2 (log-probs) and level 4 (relative, per tensor)


def accepted_model_types() -> list[str]:
    """The model types whose default config the registry accepts (meta-device skeletons: no weights)."""
    accepted = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        with contextlib.suppress(Exception):  # refused, or transformers cannot build its default skeleton
            check_supported(AutoConfig.for_model(model_type))
            accepted.append(model_type)
    return accepted


def tiny_config(model_type: str):
    """The default config of `model_type` shrunk by the rules above: sizes, LAYERS layers (per-layer lists cut to
    their first LAYERS entries), no dropout or routing noise, a sliding window of 6, MLA's key heads equal to its query
    heads, Mamba heads that tile `expand x hidden`, token ids within the tiny vocabulary."""
    config = AutoConfig.for_model(model_type)
    text = config.get_text_config()
    layers = next((getattr(text, key) for key in LAYER_COUNTS if isinstance(getattr(text, key, None), int)), None)
    for key, value in SIZES.items():
        current = getattr(text, key, None)
        if current is not None and not isinstance(current, (list, dict)):
            setattr(text, key, value)
    for key in LAYER_COUNTS:
        if isinstance(getattr(text, key, None), int):
            setattr(text, key, LAYERS)
    for key, value in list(vars(text).items()):
        if isinstance(value, (list, tuple)) and layers and len(value) == layers:
            setattr(text, key, list(value[:LAYERS]))
        elif isinstance(value, float) and ("drop" in key or key in ("router_jitter_noise", "input_jitter_noise")):
            setattr(text, key, 0.0)
    if getattr(text, "num_key_value_heads", None) is not None:
        mla = getattr(text, "kv_lora_rank", None) is not None
        text.num_key_value_heads = text.num_attention_heads if mla else 2
    if getattr(text, "kv_lora_rank", None) is not None and getattr(text, "head_dim", None) is not None:
        text.head_dim = text.qk_rope_head_dim
    for heads, head_dim, expand in MAMBA_HEADS:
        if getattr(text, heads, None) is not None and getattr(text, expand, None) is not None:
            setattr(text, heads, 4)
            setattr(text, head_dim, int(getattr(text, expand) * text.hidden_size) // 4)
    if getattr(text, "sliding_window", None):
        text.sliding_window = 6
    for key, value in TOKENS.items():
        with contextlib.suppress(Exception):  # a config whose field is typed otherwise keeps its own
            setattr(text, key, value)
    return config


def _fresh_model_factory(model_type: str, root):
    """`run_pair`'s model factory: the tiny model saved to disk and reloaded (TRL builds the reference from its path)."""

    def fresh_model(model_type: str = model_type, dtype: torch.dtype = torch.float32, **_):
        path = root / "model"
        if not path.exists():
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(tiny_config(model_type)).save_pretrained(path)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)

    return fresh_model


def level2_error(model: torch.nn.Module) -> float:
    """Largest |log-prob difference| between capture + score and the model's own forward (`test_families`' level 2,
    against the model's default attention rather than eager, which some of these types do not implement)."""
    reference = AutoModelForCausalLM.from_config(model.config)
    reference.load_state_dict(model.state_dict())
    add_fused_lm_head(reference, outputs=("log_probs", "entropy"))
    model = prepared(model)
    prompt, completions, lengths = case()
    engine = LongStrawEngine(8, 5)
    with torch.no_grad():
        want, _ = full_forward(reference, prompt, completions, lengths, offset=3)
        state = engine.capture(model, prompt, first_position=3)
        got, _ = engine.score(model, state, prompt[-1:], completions, lengths, batch_size=3)
    return (got - want).abs().max().item()


def conform(model_type: str, tokenizer, dataset, root) -> dict:
    """One model type through the checks of the module docstring: `{"status", "detail", "level2", "exact",
    "detach"}` (errors: level 2's log-prob difference, levels 3/4's max relative gradient error per mode)."""
    result = {"model_type": model_type}
    fresh_model = _fresh_model_factory(model_type, root)
    try:
        model = fresh_model()
    except Exception as error:  # noqa: BLE001  (transformers could not build the tiny config)
        return {**result, "status": "not built", "detail": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    try:
        check_supported(model)
        for mode, reference in (("exact", GRPOTrainer), ("detach", DetachedReferenceTrainer)):
            ref_loss, loss, ref_grads, grads = run_pair(  # the trainer's pre-flight runs at its construction
                reference,
                fresh_model,
                tokenizer,
                dataset,
                root / mode,
                model_type=model_type,
                loss_type="dapo",
                beta=0.04,
                prompt_gradient=mode,
            )
            result[mode] = (abs(loss - ref_loss).item(), max_relative_error(grads, ref_grads, floor_fraction=1e-3))
    except UnsupportedModelError as error:
        return {**result, "status": "refused", "detail": str(error).split(". ")[0]}
    result["level2"] = level2_error(model)
    verified = result["level2"] <= MAX_SCORE_ERROR and all(
        result[mode][0] <= 1e-5 and result[mode][1] <= MAX_GRAD_ERROR for mode in ("exact", "detach")
    )
    result["status"] = "verified" if verified else "wrong"
    return result
