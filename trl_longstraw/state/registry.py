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

import abc
import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from .placement import FP8_PAGE_TOKENS, Placement

if TYPE_CHECKING:
    from ..context_parallel.sharding import ShardLayout


class UnsupportedModelError(ValueError):
    """A decoder layer has no registered LongStraw state kind, or its attention bypasses the AttentionInterface."""


@dataclass(frozen=True)
class LayerAccount:
    """Bytes one layer keeps for a kind: `per_token` for each captured prompt token, `per_page` for each page of
    `FP8_PAGE_TOKENS` tokens (fp8 pages' scales), plus `fixed`.

    `window`: `fixed` is the entries of this many tokens (a rolling window), of which a shorter prompt keeps fewer.
    `per_chunk`: `fixed` is kept once per capture chunk of `chunk_size` tokens (the exact prompt gradient's recurrent
    states at every chunk boundary).
    """

    label: str
    per_token: int = 0
    fixed: int = 0
    window: int | None = None
    per_chunk: bool = False
    per_page: int = 0
    under_context_parallelism: str = "replicated"  # the kind's answer (`LayerState.under_context_parallelism`)

    def bytes(self, num_tokens: int, chunk_size: int | None = None) -> int:
        fixed = self.fixed if self.window is None else self.fixed * min(num_tokens, self.window) // self.window
        if self.per_chunk and chunk_size:
            fixed *= max(1, -(-num_tokens // chunk_size))
        return self.per_token * num_tokens + self.per_page * -(-num_tokens // FP8_PAGE_TOKENS) + fixed


class LayerState(abc.ABC):
    """The durable prompt state of one token mixer of one layer: the protocol every state kind implements.

    Subclass it, then `register_state_kind` it; registration refuses a kind that leaves a duty out (an abstract
    method, an undeclared class attribute, or a method of a role it declares), so a new kind learns its duties from
    this class, not from a crash. Every duty is declared here, with the shapes it takes and returns; nothing outside
    `state/` branches on a kind.

    Class attributes (declared by every kind):
        name (`str`): the registry key.
        layer_types (`tuple[str | None, ...]`): the `config.layer_types` entries it serves, in transformers'
            vocabulary; `None` in the tuple means a config without layer types.
        roles (`frozenset[str]`): which calls of a forward reach it, each a set of methods it must implement
            (`ROLES`): `"attention"` (the registered attention function, through `StateAccess.attend`), `"conv"` and
            `"recurrent"` (the Cache API of linear-attention mixers: `get/update_conv_state`,
            `get/update_recurrent_state`), `"indexer"` (the Cache API's `update_indexer` and the DSA top-k). Empty:
            nothing reaches it (a layer without a token mixer).
        sharded_layer_types (`tuple[str | None, ...]`): the layer types context parallelism shards for this kind;
            empty: the kind is refused under context parallelism.

    Optional class attributes: `differentiable` (exact mode makes its tensors autograd leaves),
    `needs_attention_interface` (its mixer must call the registered attention function), `extends_masks` (forwards
    must present the forward's own entries, a decoding row's earlier ones included, to the model's masks: DSA's
    indexer scores its queries against its own keys through them).
    """

    name: ClassVar[str]
    layer_types: ClassVar[tuple[str | None, ...]]
    roles: ClassVar[frozenset[str]]
    sharded_layer_types: ClassVar[tuple[str | None, ...]]
    differentiable: ClassVar[bool] = True
    needs_attention_interface: ClassVar[bool] = False
    extends_masks: ClassVar[bool] = False

    # -- recognition and accounting (class level: they need a module, not a captured state) --------------------------
    @classmethod
    @abc.abstractmethod
    def find_mixer(cls, layer: nn.Module, layer_type: str | None) -> nn.Module | None:
        """The token-mixer module of decoder `layer` whose state this kind keeps, or None if it has none.

        Args:
            layer (`nn.Module`): one decoder layer of the model.
            layer_type (`str` or `None`): its `config.layer_types` entry (None: the config has none).
        """

    @classmethod
    @abc.abstractmethod
    def account(
        cls,
        mixer: nn.Module,
        config: PretrainedConfig,
        layer_type: str | None,
        dtype_bytes: int,
        exact: bool,
        fp8_pages: bool = False,
    ) -> LayerAccount | None:
        """What a capture keeps for `mixer`, as it allocates it; None: nothing.

        Args:
            mixer (`nn.Module`): the module `find_mixer` returned (on the meta device when accounting a config).
            config (`PretrainedConfig`): the decoder's text config.
            layer_type (`str` or `None`): the layer's `config.layer_types` entry.
            dtype_bytes (`int`): bytes per value of the model's activation dtype (2 for bf16).
            exact (`bool`): the exact prompt gradient's state (every entry, every chunk boundary).
            fp8_pages (`bool`): `prompt_state_dtype="float8_e4m3fn"` (detach mode): per-token pages in fp8 with
                their scales (`placement.page_bytes`), where the kind keeps them so.
        """

    @classmethod
    def under_context_parallelism(cls, layer_type: str | None, part: LayerAccount) -> str:
        """How context parallelism holds this kind's state of a `layer_type` layer accounted as `part`: "split" (each
        rank keeps the entries of its own chunks: a state that grows with the prompt), "replicated" (every rank keeps
        the whole: a state of fixed size, handed from chunk to chunk), or "refused" (a layer type not in
        `sharded_layer_types`). The planner asks this; a kind whose CP state is held otherwise overrides it."""
        if layer_type not in cls.sharded_layer_types:
            return "refused"
        return "split" if part.per_token else "replicated"

    @classmethod
    def attention_heads(cls, mixer: nn.Module, config: PretrainedConfig) -> int:
        """Query heads of this kind's attention over the prompt state (the accounting's score tiles); 0: none."""
        return 0

    @classmethod
    def step_attention_elements(cls, mixer: nn.Module, config: PretrainedConfig) -> tuple[int, int, int]:
        """Per token, over all heads, the elements of this kind's queries, of its keys and values, and of its
        partial output `heads x (dv + 1)` (the output and its log-sum-exp), as its attention over the prompt receives
        and returns them: what a context-parallel step gathers and exchanges (the accounting). Zeros: none."""
        return 0, 0, 0

    @classmethod
    def prompt_score_tiles(cls, mixer: nn.Module, config: PretrainedConfig, layer_type: str | None) -> bool:
        """Whether this kind's attention over a chunk of the prompt holds a `[heads, tokens, chunk]` fp32 score tile
        (plain-torch tiles, or gathered top-k keys of that size) rather than a fused kernel's `[heads, tokens, d]`
        output (the accounting's working set). True by default: the larger."""
        return True

    @classmethod
    def step_selection_elements(cls, mixer: nn.Module) -> int:
        """Per token, the keys this kind's top-k selects: what a context-parallel step gathers from every rank and
        turns into this rank's picks of its pages for every rank's queries (the accounting); 0: none."""
        return 0

    @classmethod
    def index_heads(cls, mixer: nn.Module) -> int:
        """Heads of a DSA indexer scoring the prompt's keys (the accounting's indexer scores); 0: none."""
        return 0

    @classmethod
    def replay_saved_bytes(cls, mixer: nn.Module, dtype_bytes: int, fused: bool) -> int:
        """Bytes per replayed token that this kind's own kernels hold for backward beyond the linear maps' inputs and
        outputs, with their backward's workspace: `fused`, the GPU's kernels (what a plan is for), else transformers'
        torch fallbacks (their fp32 chunk matrices: what a CPU run saves); 0 by default."""
        return 0

    # -- one captured state ------------------------------------------------------------------------------------------
    def __init__(self, mixer: nn.Module, layer_idx: int, layer_type: str | None, prompt: PromptGeometry):
        self.mixer = mixer
        self.layer_idx = layer_idx
        self.layer_type = layer_type
        self.prompt = prompt
        # a member's segments (`PromptState.continuation`): the same layer's state of the prompt they continue, read
        # before this one's own entries
        self.parent: LayerState | None = None

    @property
    def device(self) -> torch.device:
        """Where this layer computes (its mixer's weights): its own device when `device_map` splits the model."""
        return next(self.mixer.parameters()).device

    @abc.abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this state holds (its bytes, its finiteness, exact mode's autograd leaves)."""

    def captured(self) -> bool:
        """Whether the capture wrote this state (the prepared-model guard: a mixer that bypassed LongStraw did not)."""
        return bool(self.tensors())

    def recompute_pairs(self, recorded, chunk_index: int, start: int, end: int) -> list[tuple[torch.Tensor, ...]]:
        """Exact mode: (recomputed tensor, gradient accumulated on the matching state leaf) pairs for prompt chunk
        `[start, end)` (capture chunk `chunk_index`), from what the recompute forward `recorded` for this state
        (`StateAccess.recorded[self]`). None by default: a kind that records nothing has no gradient to push."""
        return []

    def chunk_states(self) -> list[list[torch.Tensor]]:
        """The states a later prompt chunk starts from, one list per state, with one entry per capture-chunk boundary
        (the last entry: after the whole captured prompt). Context parallelism carries them across shards: the next
        shard starts from the last entry, the exact-mode gradient of a shard's first entry goes back to the previous
        shard's last. None for a kind whose later tokens read per-token entries (pages) instead."""
        return []

    def chunk_state_slot(self, role: str) -> int:
        """The index in `chunk_states()` of the state a `role` call of the Cache API ("conv" or "recurrent") reads
        and records: a kind lists its conv state before its recurrent state."""
        return [name for name in ("conv", "recurrent") if name in self.roles].index(role)

    def pass_state(self, passing) -> bool:
        """Whether this forward's mixer takes `passing` (an `ops.gated_delta_rule.StatePassing`: its recurrent starting
        state given later, or its state's gradients handed across ranks inside its own backward; state passing under
        context parallelism, state/linear_attention.py) in its next rule call. Otherwise the mixer reads its starting
        state as its forward begins and receives its final state's gradient as the backward reaches the layer."""
        return False

    def withdraw_state_passing(self) -> None:
        """Withdraw a state passing this forward's mixer did not take (`pass_state`)."""

    def keep_chunk_state(self, states: list[torch.Tensor], value: torch.Tensor) -> None:
        """Keep `value` as the newest entry of one of `chunk_states()`'s lists: appended in exact mode (the recompute
        starts each chunk from its boundary), else in place of the last (only the final state is read)."""
        if self.prompt.exact or not states:
            states.append(value)
        else:
            states[-1] = value

    # -- role "attention": reached through the registered attention function ---------------------------------------
    def attend(self, access, query, key, value, scaling: float, **features) -> torch.Tensor:
        """Attention of this forward's tokens over the prompt state and over themselves, as one softmax, keeping this
        forward's own entries as the access's mode says (`keep`).

        Args:
            access (`StateAccess`): the forward's access (mode, positions, the rows' suffix when decoding).
            query (`torch.Tensor` of shape `[batch, heads, tokens, d]`): this forward's queries.
            key, value (`torch.Tensor` of shape `[batch, kv_heads, tokens, d]`): this forward's own keys and values,
                as the layer hands them to the attention function.
            scaling (`float`): the softmax scale.
            features: the attention call's keyword features (`sliding_window`, `sinks`, `softcap`, DSA `indices`).

        Returns:
            `torch.Tensor` of shape `[batch, heads, tokens, dv]`.
        """
        raise NotImplementedError

    def keep(self, access, key, value, **features) -> None:
        """This forward's own entries (`key`, `value` as `attend` takes them): appended to the state by a capture,
        recorded with their graph in `access.recorded` by an exact-mode recompute, nothing otherwise."""
        raise NotImplementedError

    def page_block(self, dtype: torch.dtype, limit: int | None = None, indices: torch.Tensor | None = None):
        """This process's pages as key blocks of `block_attention.blocks_forward`: `(blocks, tensors)`, `tensors` the
        `(keys, values)` of each block, or `((), ())` where there is none.

        Args:
            dtype (`torch.dtype`): the dtype attention reads them in (fp8 pages are dequantised to it).
            limit (`int`, *optional*): only the first `limit` entries (all by default).
            indices (`torch.Tensor` of shape `[batch, tokens, top_k]`, *optional*): a DSA selection in global key
                indices (the captured prompt's tokens first): only the keys it picks.
        """
        raise NotImplementedError

    def visibility(self, sliding_window: int | None):
        """The `block_attention.Visibility` of this layer's keys for a call with `sliding_window` (chunks counted from the
        whole prompt's first position)."""
        raise NotImplementedError

    def accumulate_page_gradients(self, d_keys: torch.Tensor, d_values: torch.Tensor | None) -> None:
        """Add the gradients of `page_block`'s keys and values (their first entries) to the page leaves (exact mode,
        context parallelism: another rank's recompute reached these pages). `d_values` None: given inside
        `d_keys` (values that are a view of the keys)."""
        raise NotImplementedError

    # -- roles "conv" and "recurrent": the Cache API of linear-attention mixers ----------------------------------
    def conv_state(self, access) -> torch.Tensor | None:
        """`[batch or 1, conv_dim, kernel - 1]`: the conv inputs before this forward's tokens, or None (a zero state)."""
        raise NotImplementedError

    def continue_conv(self, access, inputs: torch.Tensor, kernel_size: int) -> torch.Tensor:
        """`inputs [batch, conv_dim, T]` preceded by the conv state (out of place); records the new state."""
        raise NotImplementedError

    def recurrent_state(self, access, batch_size: int) -> torch.Tensor | None:
        """`[batch_size, ...]`: the recurrent state before this forward's tokens, or None (a zero state)."""
        raise NotImplementedError

    def finish_recurrent(self, access, state: torch.Tensor) -> None:
        """Record the recurrent `state` after this forward's tokens, as the access's mode says."""
        raise NotImplementedError

    # -- role "indexer": the Cache API's update_indexer and the DSA top-k over the prompt ----------------------------
    def extend(self, access, keys: torch.Tensor) -> torch.Tensor:
        """The indexer keys `[batch, tokens, dim]` the model's indexer scores in this forward: its own (decoding:
        after the rows' earlier ones), never the prompt's; a capture also keeps them."""
        raise NotImplementedError

    def prompt_candidates(self, call: dict, best, k: int, limit: int, block: int, first: int):
        """`best` (or nothing) merged with the top-`k` `(scores, global key indices)` candidates of this process's
        first `limit` prompt keys (global indices from `first`) for the queries of indexer `call`, visited `block`
        keys at a time."""
        raise NotImplementedError


# What each role asks of a kind: the methods `register_state_kind` checks it defines.
ROLES: dict[str, tuple[str, ...]] = {
    "attention": ("attend", "keep", "page_block", "visibility", "accumulate_page_gradients"),
    "conv": ("conv_state", "continue_conv", "chunk_states"),
    "recurrent": ("recurrent_state", "finish_recurrent", "chunk_states"),
    "indexer": ("extend", "prompt_candidates"),
}
DECLARED_ATTRIBUTES = ("name", "layer_types", "roles", "sharded_layer_types")


@dataclass
class PromptGeometry:
    """What every layer state of one capture shares: the captured tokens, where they sit, where the state lives.

    Under context parallelism a rank holds some chunks of the prompt (`layout`, `rank`): `num_tokens` counts the
    tokens held here, `start_position` is the first one's position and `prompt_start` the whole prompt's first
    position (a chunked layer counts its chunks from there, a DSA selection indexes keys from there). A kind reads its
    entries' positions and indices through the methods below, never by arithmetic of its own: a rank's entries are not
    contiguous in the prompt.
    """

    num_tokens: int  # captured prompt tokens held here (all but the last prompt token; a rank's chunks under CP)
    start_position: int  # absolute position of the first token held here
    placement: Placement
    exact: bool  # the exact prompt gradient needs every entry and every chunk boundary
    fp8_pages: bool = False  # per-token pages in float8_e4m3fn with per-(page, head) scales (detach mode only)
    prompt_start: int | None = None  # absolute position of the whole prompt's first captured token (None: ours)
    layout: ShardLayout | None = None  # context parallelism: the whole prompt's chunks and the rank holding each
    rank: int = 0  # this process's rank in `layout`
    # a member's segments (`PromptState.continuation`): the index of their first entry among the captured tokens of
    # the prompt and the segments together (the prompt's count); 0 for a prompt. Under context parallelism `layout`
    # then cuts the segments' tokens (its indices count from here).
    first_index: int = 0

    @property
    def origin(self) -> int:
        """Absolute position of the whole captured prompt's first token."""
        return self.start_position if self.prompt_start is None else self.prompt_start

    def global_indices(self, first: int, end: int) -> torch.Tensor:
        """Indices among the whole prompt's captured tokens of the entries `first .. end - 1` held here (host)."""
        if self.layout is None:
            return torch.arange(self.first_index + first, self.first_index + end)
        return self.first_index + self.layout.global_indices(self.rank, first, end)

    def positions(self, first: int, end: int) -> torch.Tensor:
        """Absolute positions of the entries `first .. end - 1` held here (host)."""
        return self.origin + self.global_indices(first, end)

    def local_indices(self, indices: torch.Tensor) -> torch.Tensor:
        """Captured-token `indices` as indices of the entries held here; -1 (or out of range) where not held here."""
        indices = indices - self.first_index if self.first_index else indices
        return indices if self.layout is None else self.layout.local_indices(self.rank, indices)

    def held_before(self, index: int) -> int:
        """How many of the captured tokens before index `index` are held here."""
        if self.layout is None:
            return min(max(0, index - self.first_index), self.num_tokens)
        return self.layout.held_before(self.rank, index - self.first_index)

    def next_query(self, end: int) -> int:
        """The first captured-token index a query may have once the tokens before `end` are captured: what a sliding
        window must still keep entries for (under CP, the start of the next capture step)."""
        if self.layout is None:
            return end
        return self.first_index + self.layout.next_query(end - self.first_index)


STATE_KINDS: dict[str, type[LayerState]] = {}


def register_state_kind(kind: type[LayerState]) -> type[LayerState]:
    """Register a state kind (usable as a class decorator). Kinds are tried in registration order (the built-in ones
    first, in `state.BUILT_IN_KINDS`'s order). A kind that leaves a duty of `LayerState` out is refused here, naming
    it."""
    missing = [name for name in DECLARED_ATTRIBUTES if not hasattr(kind, name)]
    missing += sorted(getattr(kind, "__abstractmethods__", ()))
    unknown = sorted(set(getattr(kind, "roles", ())) - set(ROLES))
    if unknown:
        raise TypeError(f"State kind {kind.__name__} declares unknown roles {unknown}; the roles are {sorted(ROLES)}.")
    for role in getattr(kind, "roles", ()):
        missing += [
            f"{method} (role {role!r})"
            for method in ROLES[role]
            if getattr(kind, method) is getattr(LayerState, method)
        ]
    if missing:
        raise TypeError(
            f"State kind {kind.__name__} does not implement {', '.join(dict.fromkeys(missing))}: every duty of "
            "trl_longstraw.state.LayerState must be declared before the kind is registered."
        )
    if kind.name in STATE_KINDS and STATE_KINDS[kind.name] is not kind:
        raise ValueError(
            f"A state kind named {kind.name!r} is registered already ({STATE_KINDS[kind.name].__name__})."
        )
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
    # The text decoder first (`get_decoder`): a multimodal model's vision tower may have as many layers.
    decoder = model
    with contextlib.suppress(Exception):  # transformers raises for the few models it has no rule for
        decoder = model.get_decoder()
    for owner in (decoder, getattr(model, "base_model", model)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
            return layers
    for root in (decoder, model):
        for module in root.modules():
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
