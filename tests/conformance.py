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

A type is `verified` (with its errors; `verified, exact mode` where transformers' own cached forward disagrees with
its full forward, so that the detached reference is no reference), `refused` (with the reason: by the registry on the tiny config, or by the
trainer's pre-flight). Otherwise `wrong` (LongStraw differs from stock) or `not built` (transformers itself could not
build the tiny config or run its own forward on it: the shrinking must fit every accepted type).
`benchmarks/conformance.py` writes the table; `tests/test_conformance.py` fails on any status other than the one the
table records.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from trl_longstraw.architectures import check_supported
from trl_longstraw.engine import LongStrawEngine
from trl_longstraw.state import UnsupportedModelError

from .conftest import make_trainer, max_relative_error, synthetic_inputs
from .reference import DetachedReferenceTrainer, run_pair
from .test_engine import case, full_forward, prepared

LAYERS = 4  # decoder layers of a tiny config (per-layer lists keep their first LAYERS entries)
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers")
OTHER_TOWER_LAYERS = 2  # a multimodal config's vision or audio tower
# Fields set where the default config has them (a scalar, not None).
SIZES = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim"), 128),
    **dict.fromkeys(("num_attention_heads", "n_head", "decoder_attention_heads"), 4),
    "head_dim": 16,
    "rotary_dim": 16,
    "vocab_size": 102,
    "vocab_size_per_layer_input": 102,  # Gemma 4's per-layer input embeddings (262,144 x 256 per layer by default)
    "hidden_size_per_layer_input": 16,
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(
        ("moe_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"), 32
    ),
    **dict.fromkeys(("n_shared_experts", "n_group", "topk_group", "n_groups", "mamba_n_groups"), 1),
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
# MoE routing fields, set wherever the config has them, even as None (DeepSeek-V2's), and never above the default.
SET_EVEN_IF_NONE = {"num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}
# Per-forward noise, and the load-balancing loss (tested on its own: tests/test_load_balancing.py), off.
NO_NOISE = ("router_jitter_noise", "input_jitter_noise", "router_aux_loss_coef")
# Layer kinds a default config leaves out that the type's checkpoints have: added at the last tiny layer
# (GraniteMoeHybrid's default is Mamba throughout; Granite 4.0-H interleaves attention).
ADDED_LAYER_TYPES = {"granitemoehybrid": "full_attention"}
MLA_WIDTH = ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim")
MAX_SCORE_ERROR, MAX_GRAD_ERROR = 1e-4, 1e-4  # level 2 (log-probs) and level 4 (relative, per tensor)
EXACT_ONLY = "verified, exact mode"  # the detached reference is unusable for the type (transformers' cache path)


def accepted_model_types() -> list[str]:
    """The model types whose default config the registry accepts (meta-device skeletons: no weights), once the
    per-forward noise a user sets to 0 for LongStraw (`attention_dropout`, routing jitter) is off."""
    accepted = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        with contextlib.suppress(Exception):  # refused, or transformers cannot build its default skeleton
            config = AutoConfig.for_model(model_type)
            text = config.get_text_config()
            for key in ("attention_dropout", "router_jitter_noise", "input_jitter_noise"):
                if getattr(text, key, None):
                    setattr(text, key, 0.0)
            check_supported(config)
            accepted.append(model_type)
    return accepted


def tiny_config(model_type: str):
    """The default config of `model_type` shrunk by the rules above (a multimodal config's other towers too): sizes,
    LAYERS layers (per-layer lists cut to
    their first LAYERS entries), no dropout or routing noise, a sliding window of 6, MLA's key heads equal to its query
    heads, Mamba heads that tile `expand x hidden`, one group of experts and of SSM heads, no load-balancing loss, token ids within the
    tiny vocabulary. A heterogeneous config's per-layer overrides (Gemma 4's wider full-attention heads, Dots 3 Note's
    sliding MLA layers) keep their ratio to the global value and follow their layer type (`_shrunk_per_layer`); a layer
    kind the default config leaves out (`ADDED_LAYER_TYPES`) takes the last tiny layer."""
    config = AutoConfig.for_model(model_type)
    text = config.get_text_config()
    per_layer = _per_layer_overrides(text)  # a heterogeneous config: shrunk globally first, then per layer
    for sub in vars(config).values():  # a multimodal model's other towers (vision, audio): smaller still, and of
        if isinstance(sub, PretrainedConfig) and sub is not config.get_text_config():  # another depth than the text's
            tower_per_layer = _per_layer_overrides(sub)
            _shrink_sizes(sub, layers=OTHER_TOWER_LAYERS)
            if tower_per_layer:
                sub.per_layer_config = _shrunk_per_layer(sub, *tower_per_layer, layers=OTHER_TOWER_LAYERS)
    text = config.get_text_config()
    layers = next((getattr(text, key) for key in LAYER_COUNTS if isinstance(getattr(text, key, None), int)), None)
    _shrink_sizes(text)
    for key, value in list(vars(text).items()):
        if isinstance(value, (list, tuple)) and layers and len(value) == layers:
            setattr(text, key, list(value[:LAYERS]))
        elif isinstance(value, float) and ("drop" in key or key in NO_NOISE):
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
    if getattr(text, "mamba_d_ssm", None) is not None:  # Falcon-H1: the SSM width is its heads x head width
        text.mamba_d_ssm = text.mamba_n_heads * text.mamba_d_head
    for key, value in SET_EVEN_IF_NONE.items():
        if hasattr(text, key):
            default = getattr(text, key)
            setattr(text, key, value if default is None else min(value, default))  # ZAYA routes to one expert
    if hasattr(text, "attn_layer_indices"):  # hybrids that list their attention layers: one among LAYERS
        text.attn_layer_indices = [1]
    if layers and isinstance(getattr(text, "layer_types", None), list):  # every layer type among the first LAYERS
        kept = text.layer_types
        missing = [
            t
            for t in dict.fromkeys(
                getattr(AutoConfig.for_model(model_type).get_text_config(), "layer_types", []) or []
            )
            if t not in kept
        ]
        missing += [ADDED_LAYER_TYPES[model_type]] if model_type in ADDED_LAYER_TYPES else []
        for position, layer_type in zip(range(len(kept) - 1, 0, -1), missing, strict=False):
            kept[position] = layer_type
    if getattr(text, "sliding_window", None):
        text.sliding_window = 6
    for key, value in TOKENS.items():
        with contextlib.suppress(Exception):  # a config whose field is typed otherwise keeps its own
            setattr(text, key, value)
    if per_layer:
        text.per_layer_config = _shrunk_per_layer(text, *per_layer)
    return config


def _per_layer_overrides(text) -> tuple[dict, dict, list] | None:
    """A heterogeneous config's per-layer overrides, its global values of those fields and its layer types, with the
    overrides taken off (so that the global values shrink like any config's); None for a homogeneous config."""
    spec = getattr(text, "_heterogeneity_spec", None)
    if spec is None:
        return None
    overrides = {index: dict(fields) for index, fields in spec.per_layer_overrides.items()}
    text.per_layer_config = None
    fields = spec.per_layer_attributes | {field for field in MLA_WIDTH if getattr(text, field, None) is not None}
    globals_ = {field: getattr(text, field) for field in fields}
    return overrides, globals_, list(getattr(text, "layer_types", None) or [])


def _shrunk_per_layer(text, overrides: dict, globals_: dict, default_layer_types: list, layers: int = LAYERS) -> dict:
    """Per-layer overrides for the tiny config: each override keeps its ratio to the field's global value (Gemma 4's
    full-attention layers twice the head width of its sliding ones), and a tiny layer takes the override of the first
    default layer of its type (of its own index where the config has no layer types)."""
    layer_types = list(getattr(text, "layer_types", None) or [])
    shrunk = {}
    for index in range(layers):
        source = index
        if layer_types and default_layer_types:
            source = default_layer_types.index(layer_types[index])
        fields = overrides.get(source, {})
        shrunk[index] = {
            field: max(1, round(value * getattr(text, field) / globals_[field])) for field, value in fields.items()
        }
        if len(globals_.keys() & set(MLA_WIDTH)) == len(MLA_WIDTH):  # a layer whose head is MLA's nope + rope parts
            width = {field: fields.get(field, globals_[field]) for field in MLA_WIDTH}  # stays so (Dots 3 Note)
            if width["head_dim"] == width["qk_nope_head_dim"] + width["qk_rope_head_dim"]:
                tiny = {field: shrunk[index].get(field, getattr(text, field)) for field in MLA_WIDTH[1:]}
                shrunk[index]["head_dim"] = sum(tiny.values())
    return {index: fields for index, fields in shrunk.items() if fields}


def _shrink_sizes(config, layers: int = LAYERS) -> None:
    for key, value in SIZES.items():
        current = getattr(config, key, None)
        if current is not None and not isinstance(current, (list, dict)):
            setattr(config, key, value)
    for key in LAYER_COUNTS:
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, layers)


def _fresh_model_factory(model_type: str, root):
    """`run_pair`'s model factory: the tiny model saved to disk and reloaded (TRL builds the reference from its path)."""

    built = {}  # the class AutoModelForCausalLM picks for the full config: it reloads the model (Mllama's and Emu3's
    # text-only class has a config type AutoModelForCausalLM does not map)

    def fresh_model(model_type: str = model_type, dtype: torch.dtype = torch.float32, **_):
        path = root / "model"
        if not path.exists():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_config(model_type))
            model.save_pretrained(path)
            built["class"] = type(model)
        return built["class"].from_pretrained(path, dtype=dtype)

    return fresh_model


def level2_error(model: torch.nn.Module) -> float:
    """Largest |log-prob difference| between capture + score and the model's own forward (`test_families`' level 2,
    against the model's default attention rather than eager, which some of these types do not implement)."""
    reference = type(model)._from_config(model.config)
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
        with torch.no_grad():  # the model's own forward, no LongStraw: transformers must run the tiny config
            model(input_ids=torch.arange(2, 10)[None])
    except Exception as error:  # noqa: BLE001  (transformers could not build or run the tiny config)
        return {**result, "status": "not built", "detail": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    try:
        check_supported(model)
        for mode, reference in (("exact", GRPOTrainer), ("detach", DetachedReferenceTrainer)):
            if mode == "detach" and not detached_reference_is_stocks(fresh_model, tokenizer, dataset, root / "check"):
                # The detached reference runs the prompt through transformers' own cache: where that path fails or
                # disagrees with the model's full forward, it is no reference (level 2 and exact mode still are).
                result["detail"] = "detach mode unchecked: transformers' cached forward is not its full forward"
                continue
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
    checked = [mode for mode in ("exact", "detach") if mode in result]
    passed = all(result[mode][0] <= 1e-5 and result[mode][1] <= MAX_GRAD_ERROR for mode in checked)
    if result["level2"] > MAX_SCORE_ERROR or not passed:
        result["status"] = "wrong"
    else:
        result["status"] = "verified" if "detach" in result else EXACT_ONLY
    return result


def detached_reference_is_stocks(fresh_model, tokenizer, dataset, root) -> bool:
    """Whether the detached reference's log-probs (transformers' cache, `tests/reference.py`) equal stock's full
    forward on the conformance inputs (False where transformers' cached forward raises)."""
    trainer = make_trainer(DetachedReferenceTrainer, fresh_model(), tokenizer, dataset, root)
    inputs = synthetic_inputs(len(tokenizer))
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        stock, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, width)
        try:
            reference, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width)
        except Exception:  # noqa: BLE001  (transformers' cached forward of this type fails)
            return False
    return ((reference - stock) * inputs["completion_mask"]).abs().max().item() <= 1e-5
