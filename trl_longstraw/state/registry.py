"""The registry of state kinds: which durable prompt state each decoder layer keeps, found from the layer itself.

transformers picks a cache layer per entry of `config.layer_types` (`DynamicLayer`, `DynamicSlidingWindowLayer`,
`LinearAttentionLayer`, ...). LongStraw does the same with its own state kinds, one [`LayerState`] subclass per
token mixer, registered once with [`register_state_kind`]. A kind owns everything about its state: how it
recognises a layer (the layer's `config.layer_types` entry and the structure of the layer's module), its accounting
(bytes per prompt token and fixed bytes), how it is captured, read, continued out of place and recomputed for the
exact prompt gradient. Placement (`prompt_state_device`) is the [`Placement`] of the whole state, not a kind's.

Where this departs from transformers: a layer may hold several kinds (MLA latent pages and DSA indexer keys on one
layer), recognition looks at modules as well as layer types (transformers' `"full_attention"` covers both GQA and
MLA, whose states differ), and a kind is chosen for the token mixer module, not only by the layer index, because the
registered attention function is called with the module.

A model is supported when every decoder layer maps to at least one registered kind and every attention-like mixer
routes through transformers' `AttentionInterface`; [`plan_layers`] says which layer is not and why.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from .placement import Placement


class UnsupportedModelError(ValueError):
    """A decoder layer has no registered LongStraw state kind, or its attention bypasses the AttentionInterface."""


@dataclass(frozen=True)
class LayerAccount:
    """Bytes one layer keeps for a kind: `per_token` for each captured prompt token plus `fixed`.

    `window`: `fixed` is the entries of this many tokens (a rolling window), of which a shorter prompt keeps fewer.
    `per_chunk`: `fixed` is kept once per capture chunk of `chunk_size` tokens (the exact prompt gradient's recurrent
    states at every chunk boundary).
    """

    label: str
    per_token: int = 0
    fixed: int = 0
    window: int | None = None
    per_chunk: bool = False

    def bytes(self, num_tokens: int, chunk_size: int | None = None) -> int:
        fixed = self.fixed if self.window is None else self.fixed * min(num_tokens, self.window) // self.window
        if self.per_chunk and chunk_size:
            fixed *= max(1, -(-num_tokens // chunk_size))
        return self.per_token * num_tokens + fixed


class LayerState:
    """The durable prompt state of one token mixer of one layer. Subclass it, then `register_state_kind` it.

    Class attributes: `name` (the registry key), `layer_types` (the `config.layer_types` entries it serves, in
    transformers' vocabulary; `None` in the tuple means a config without layer types), `differentiable` (exact mode
    makes its tensors autograd leaves), `needs_attention_interface` (its mixer must call the registered attention
    function), `extends_masks` (forwards must present the forward's own entries, a decoding row's earlier ones
    included, to the model's masks: DSA's indexer scores its queries against its own keys through them).
    """

    name: ClassVar[str]
    layer_types: ClassVar[tuple[str | None, ...]]
    differentiable: ClassVar[bool] = True
    needs_attention_interface: ClassVar[bool] = False
    extends_masks: ClassVar[bool] = False

    # -- recognition and accounting (class level: they need a module, not a captured state) --------------------------
    @classmethod
    def find_mixer(cls, layer: nn.Module, layer_type: str | None) -> nn.Module | None:
        """The token-mixer module of decoder `layer` whose state this kind keeps, or None if it has none."""
        raise NotImplementedError

    @classmethod
    def account(
        cls, mixer: nn.Module, config: PretrainedConfig, layer_type: str | None, dtype_bytes: int, exact: bool
    ) -> LayerAccount:
        """What this kind keeps for `mixer`: bytes per captured prompt token and fixed bytes."""
        raise NotImplementedError

    # -- one captured state ------------------------------------------------------------------------------------------
    def __init__(self, mixer: nn.Module, layer_idx: int, layer_type: str | None, prompt: PromptGeometry):
        self.mixer = mixer
        self.layer_idx = layer_idx
        self.layer_type = layer_type
        self.prompt = prompt

    @property
    def device(self) -> torch.device:
        """Where this layer computes (its mixer's weights): its own device when `device_map` splits the model."""
        return next(self.mixer.parameters()).device

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def captured(self) -> bool:
        """Whether the capture wrote this state (the prepared-model guard: a mixer that bypassed LongStraw did not)."""
        return bool(self.tensors())

    def recompute_pairs(self, recorded, chunk_index: int, start: int, end: int) -> list[tuple[torch.Tensor, ...]]:
        """Exact mode: (recomputed tensor, gradient accumulated on the matching state leaf) for prompt chunk
        `[start, end)` (capture chunk `chunk_index`), from what the recompute forward `recorded` for this state."""
        return []


@dataclass
class PromptGeometry:
    """What every layer state of one capture shares: the captured tokens, where they sit, where the state lives."""

    num_tokens: int  # captured prompt tokens (all but the last prompt token)
    start_position: int  # absolute position of the first captured token (= the first real prompt token)
    placement: Placement
    exact: bool  # the exact prompt gradient needs every entry and every chunk boundary
    fp8_pages: bool = False  # per-token pages in float8_e4m3fn with per-(page, head) scales (detach mode only)


STATE_KINDS: dict[str, type[LayerState]] = {}


def register_state_kind(kind: type[LayerState]) -> type[LayerState]:
    """Register a state kind (usable as a class decorator). Kinds are tried in registration order."""
    STATE_KINDS[kind.name] = kind
    return kind


@dataclass
class LayerPlan:
    """The state kinds of one decoder layer: `(kind, mixer module)` pairs."""

    layer_idx: int
    layer_type: str | None
    kinds: list[tuple[type[LayerState], nn.Module]]


def find_child(layer: nn.Module, predicate) -> nn.Module | None:
    """The first direct child of `layer` (a decoder layer) that satisfies `predicate`."""
    return next((child for child in layer.children() if predicate(child)), None)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (or of its backbone): the module list with one entry per hidden layer."""
    num_layers = getattr(text_config(model.config), "num_hidden_layers", None)
    if num_layers is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: its config has no num_hidden_layers, so LongStraw cannot map decoder layers."
        )
    backbone = getattr(model, "base_model", model)
    layers = getattr(backbone, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise UnsupportedModelError(
        f"{type(model).__name__}: no module list of num_hidden_layers={num_layers} decoder layers was found, so "
        "LongStraw cannot map layers to prompt state."
    )


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (`get_text_config`), or `UnsupportedModelError` where there is no single one."""
    try:
        return config.get_text_config()
    except ValueError as error:  # e.g. several candidate text configs (encoder + decoder)
        raise UnsupportedModelError(f"{type(config).__name__}: {error}") from error


def layer_types(config: PretrainedConfig) -> list[str | None]:
    config = text_config(config)
    types = getattr(config, "layer_types", None)
    return list(types) if types else [None] * config.num_hidden_layers


@functools.cache
def routes_through_attention_interface(mixer_class: type) -> bool:
    """Whether `mixer_class.forward` looks its attention function up in transformers' `AttentionInterface`."""
    try:
        source = inspect.getsource(mixer_class.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source or "AttentionInterface" in source


def check_each_layer_runs_once(config: PretrainedConfig) -> None:
    """A prompt state holds one state per decoder layer, written once per capture forward: a model that runs some of
    its layers several times per forward (recurrent depth) is refused. Known by its config: Dory's
    `n_recurrent_loops`; any other is caught at its first capture (`StateAccess.visit`)."""
    loops = getattr(text_config(config), "n_recurrent_loops", None)
    if loops is not None and loops > 1:
        raise UnsupportedModelError(
            f"The model config sets n_recurrent_loops={loops}: its recurrent layers run {loops} times per forward, "
            "and LongStraw keeps one prompt state per decoder layer, written once. Set n_recurrent_loops=1 or train "
            "this model with GRPOTrainer."
        )


def plan_layers(model: nn.Module) -> list[LayerPlan]:
    """Map every decoder layer of `model` to its state kinds; raise `UnsupportedModelError` naming what is missing."""
    check_each_layer_runs_once(model.config)
    plans = []
    layers = decoder_layers(model)
    types = layer_types(model.config)
    for index, layer in enumerate(layers):
        layer_type = types[index]
        kinds = []
        for kind in STATE_KINDS.values():
            if layer_type not in kind.layer_types:
                continue
            mixer = kind.find_mixer(layer, layer_type)
            if mixer is None:
                continue
            if kind.needs_attention_interface and not routes_through_attention_interface(type(mixer)):
                raise UnsupportedModelError(
                    f"Layer {index} ({type(layer).__name__}, layer type {layer_type!r}): its attention "
                    f"{type(mixer).__name__} does not call transformers' AttentionInterface (ALL_ATTENTION_FUNCTIONS), "
                    "so LongStraw's attention cannot reach the prompt state. Port its forward to the "
                    "AttentionInterface (as every transformers decoder does) or load the model without remote code."
                )
            kinds.append((kind, mixer))
        if not kinds:
            children = ", ".join(f"{name}: {type(child).__name__}" for name, child in layer.named_children())
            served = sorted({str(t) for kind in STATE_KINDS.values() for t in kind.layer_types})
            raise UnsupportedModelError(
                f"Layer {index} ({type(layer).__name__}, layer type {layer_type!r}) has no registered LongStraw state "
                f"kind (children: {children}). Registered kinds: {', '.join(STATE_KINDS)}, for layer types "
                f"{', '.join(served)}. A new token mixer needs a LayerState subclass registered with "
                "trl_longstraw.state.register_state_kind."
            )
        plans.append(LayerPlan(index, layer_type, kinds))
    return plans


def check_deterministic_forward(config: PretrainedConfig) -> None:
    """Refuse a model whose training-mode forward draws random numbers (besides `nn.Dropout`, which the trainer
    checks): LongStraw scores each member once and replays it under autograd, and the replay must reproduce the
    scoring pass, which a new random draw per forward does not (stock's loss and backward share one forward)."""
    config = text_config(config)
    if config.model_type == "phimoe":
        raise UnsupportedModelError(
            "PhiMoE samples its experts in training mode (Gumbel sampling in `sparsemixer`, whatever its config), so "
            "LongStraw's replay would route the tokens differently from its scoring pass. No setting turns it off."
        )
    for field in ("attention_dropout", "router_jitter_noise", "input_jitter_noise"):
        value = getattr(config, field, 0.0)
        if value:
            raise UnsupportedModelError(
                f"The model config sets {field}={value}: that noise is drawn anew by every training-mode forward, "
                f"and LongStraw's replay must reproduce its scoring pass exactly. Set {field}=0.0 in the model config."
            )
