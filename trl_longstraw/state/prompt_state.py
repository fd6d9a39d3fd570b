"""One group's captured prompt state, and the per-forward access through which a model reaches it.

[`PromptState`] holds one [`LayerState`] per (decoder layer, state kind) of the model's layer plan, stamped with the
weights it was computed under. A forward reaches it through a [`StateAccess`], which is both the `longstraw_state=`
kwarg read by the registered attention function and a transformers `Cache` read by the model's layers: reads hand out
the snapshot, continuations are computed out of place, nothing is concatenated onto the prompt's pages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from transformers.cache_utils import Cache

from ..block_attention import AttentionScalars, KeyBlock, attention_over_blocks
from .placement import Placement
from .registry import LayerPlan, LayerState, PromptGeometry, UnsupportedModelError
from .suffix import Suffix

if TYPE_CHECKING:
    from ..context_parallel.sharding import ShardLayout
    from ..context_parallel.state import PromptSharding
    from ..load_balancing import RouterLoad


class StaleStateError(RuntimeError):
    """A prompt state was read after the weights it was computed under changed."""


class UnpreparedModelError(RuntimeError):
    """The model's layers did not reach LongStraw's state during a capture (wrong attention implementation, or a
    mixer whose forward bypasses the Cache API / AttentionInterface). `layers`: those that did not, named."""

    def __init__(self, message: str, layers: tuple[str, ...] = ()):
        super().__init__(message)
        self.layers = layers


class PromptState:
    """The durable state of one group's prompt, captured once and read by every member's replay.

    `num_tokens` prompt tokens were captured (all but the last prompt token, which starts every replay), at absolute
    positions `start_position ... start_position + num_tokens - 1`. Under context parallelism this process holds its
    chunks of them (`layout`, `rank`: the layer states see those, through `geometry`) and `sharding` serves the rest
    across the group (`context_parallel.PromptSharding`: the attention, the DSA top-k and the recurrent hand-offs);
    None outside it.
    """

    def __init__(
        self,
        plans: list[LayerPlan],
        num_tokens: int,
        start_position: int,
        device: torch.device,
        weights_version: tuple[int, int],
        exact: bool,
        fp8_pages: bool = False,
        layout: ShardLayout | None = None,
        rank: int = 0,
        continues: PromptState | None = None,
    ):
        if exact and fp8_pages:
            raise ValueError(
                "fp8 prompt-state pages with the exact prompt gradient: the state's gradient is accumulated on its "
                "tensors, which fp8 cannot hold. Use prompt_state_dtype='auto' with prompt_gradient='exact'."
            )
        self.num_tokens = num_tokens
        self.start_position = start_position
        held, first_held, prompt_start = num_tokens, start_position, None
        if layout is not None:
            held, first_held = layout.held_tokens(rank), start_position + layout.held(rank)[0][0]
            prompt_start = start_position
        first_index = 0
        if continues is not None:  # a continuation: indices and positions go on from the state it continues
            prompt_start = continues.geometry.origin
            first_index = continues.geometry.first_index + continues.num_tokens
        self.geometry = PromptGeometry(
            held, first_held, Placement(device), exact, fp8_pages, prompt_start, layout, rank, first_index
        )
        self.weights_version = weights_version
        self.plans = plans
        self.parent = continues  # the state whose entries this one's forwards read first (`continuation`)
        self.layers: list[LayerState] = [
            kind(mixer, plan.layer_idx, plan.layer_type, self.geometry) for plan in plans for kind, mixer in plan.kinds
        ]
        if continues is not None:
            for layer, parent_layer in zip(self.layers, continues.layers, strict=True):
                layer.parent = parent_layer
        self.final_layer_idx = plans[-1].layer_idx
        self._by_mixer = {id(layer.mixer): layer for layer in self.layers}
        # the state serving each (layer, role) of the Cache API, looked up on every call (`of_layer`)
        self._by_role = {
            (layer.layer_idx, role): layer for layer in reversed(self.layers) for role in type(layer).roles
        }
        self.extends_masks = any(type(layer).extends_masks for layer in self.layers)
        # A MoE policy trained with the load-balancing loss: the captured tokens' routing sums (load_balancing.py), set
        # to zero sums by a capture that records them.
        self.router_load: RouterLoad | None = None
        self.sharding: PromptSharding | None = None  # context parallelism's serving, set by its distribution

    def continuation(self, num_tokens: int, chunk_size: int | None = None) -> PromptState:
        """An empty state for `num_tokens` tokens that follow this one's captured tokens (a long member's earlier
        segments, `LongStrawEngine`): its forwards read this state's entries first, then its own.

        Its own entries are captured like a prompt's and kept as exact mode keeps them (every entry, every segment
        boundary), in the model's dtype, and are always made autograd leaves: a member's own tokens get their full
        gradient whatever the prompt's gradient mode; this state's entries get gradients only in exact mode.

        Under context parallelism the continuation is spread over the CP group too, in chunks of at most about
        `chunk_size` tokens (`PromptSharding.continuation`).
        """
        if self.sharding is not None:
            if chunk_size is None:
                raise ValueError("A continuation of a state spread over a CP group needs its chunk_size.")
            return self.sharding.continuation(self, num_tokens, chunk_size)
        geometry = self.geometry
        return PromptState(
            self.plans,
            num_tokens=num_tokens,
            start_position=self.start_position + self.num_tokens,
            device=geometry.placement.device,
            weights_version=self.weights_version,
            exact=True,
            continues=self,
        )

    def add_router_load(self, load: RouterLoad | None) -> None:
        if load is not None:
            self.router_load = self.router_load + load

    @property
    def exact(self) -> bool:
        return self.geometry.exact

    def local_prefix(self, prefix_length: int) -> int:
        """How many of the first `prefix_length` captured tokens this process holds (all of them; a rank under
        context parallelism holds its chunks)."""
        return self.geometry.held_before(prefix_length)

    def for_mixer(self, module: torch.nn.Module) -> LayerState:
        layer = self._by_mixer.get(id(module))
        if layer is None:
            raise UnpreparedModelError(
                f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) called LongStraw's attention but "
                "is not in the layer plan this state was captured with: capture and replay must use the same model."
            )
        return layer

    def of_layer(self, layer_idx: int, role: str) -> LayerState:
        """The state of layer `layer_idx` that serves `role` (`registry.ROLES`): the Cache API call the layer made."""
        layer = self._by_role.get((layer_idx, role))
        if layer is not None:
            return layer
        raise UnpreparedModelError(
            f"Layer {layer_idx} made a {role!r} call of the Cache API, which no state kind of its layer plan serves: "
            "the model's layer types and its modules disagree.",
            (f"layer {layer_idx} (a {role!r} call of the Cache API that no state kind of its layer serves)",),
        )

    def attention(
        self,
        access: StateAccess,
        layer: LayerState,
        query: torch.Tensor,
        own_keys: list[torch.Tensor],
        own_values: list[torch.Tensor],
        scalars: AttentionScalars,
        sinks: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`query [batch, heads, tokens, d]` over `layer`'s pages (`LayerState.page_block`) and this forward's own
        entries `own_keys/own_values`, blocks of `[batch * key groups, entries, d]` (`StateAccess.own_entries`: the
        last ones at the forward's positions), as one softmax; DSA `indices` (global key indices: the prompt's tokens, then the own entries) restrict both.
        Every captured page is read, except while the exact recompute of a chunk reads only the pages before it. Under
        context parallelism, over every rank's pages as one softmax (`PromptSharding.attention`)."""
        if self.sharding is not None:
            return self.sharding.attention(access, layer, query, own_keys, own_values, scalars, sinks, indices)
        limit = self.local_prefix(access.prefix_length) if access.mode == "recompute" else None
        blocks = self.page_blocks(layer, query.dtype, limit, indices)
        for keys, values, (positions, first) in zip(own_keys, own_values, access.own_blocks(own_keys), strict=True):
            picked = None if indices is None else indices.long() - first
            blocks.append((keys, values, KeyBlock(positions, shared=False, picked=picked)))
        return attention_over_blocks(query, blocks, access.query_positions, scalars, sinks)

    def page_blocks(self, layer: LayerState, dtype: torch.dtype, limit: int | None, indices: torch.Tensor | None):
        """`(keys, values, KeyBlock)` of `layer`'s first `limit` pages (all by default), after every page of the
        states this one continues (`continuation`)."""
        blocks = [] if self.parent is None else self.parent.page_blocks(layer.parent, dtype, None, indices)
        page_blocks, page_tensors = layer.page_block(dtype, limit, indices)
        return blocks + [(*page_tensors[2 * i : 2 * i + 2], block) for i, block in enumerate(page_blocks)]

    def tensors(self) -> list[torch.Tensor]:
        return [tensor for layer in self.layers for tensor in layer.tensors()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def all_finite(self) -> bool:
        return self.geometry.placement.all_finite()

    def first_non_finite_layer(self) -> str | None:
        """The first decoder layer whose state holds NaN or inf, named (a scan of every tensor: for the rare step
        whose `all_finite` is False)."""
        for layer in self.layers:
            # fp8 pages: isfinite has no float8 kernel; the model's dtype is checked in place
            wide = (tensor.float() if tensor.element_size() == 1 else tensor for tensor in layer.tensors())
            if not all(bool(torch.isfinite(tensor).all()) for tensor in wide):
                return f"decoder layer {layer.layer_idx} ({type(layer).__name__})"
        return None

    def check_captured(self) -> None:
        """The prepared-model guard: after a capture of at least one token, every layer state must hold something."""
        if self.num_tokens == 0:
            return
        missing = [layer for layer in self.layers if not layer.captured()]
        if missing:
            layers = tuple(f"layer {m.layer_idx} {type(m).name} ({type(m.mixer).__name__})" for m in missing)
            raise UnpreparedModelError(
                f"The capture left no prompt state for {', '.join(layers[:6])}: their forward did not reach LongStraw "
                "(an attention implementation other than 'longstraw', or a mixer that bypasses transformers' "
                "AttentionInterface / Cache API). Scoring would silently ignore the prompt. Use LongStrawGRPOTrainer, "
                "which prepares the model, or call trl_longstraw.engine.prepare_model(model).",
                layers,
            )

    def check_fresh(self, weights_version: tuple[int, int]) -> None:
        if weights_version != self.weights_version:
            raise StaleStateError(
                f"The prompt state was captured under weights version {self.weights_version} but the weights are now "
                f"at version {weights_version}: replaying it would mix two models. Capture the prompt again after "
                "every optimizer step (LongStrawGRPOTrainer does this for you)."
            )

    def requires_grad_(self) -> PromptState:
        """Exact mode: make the differentiable state leaves of autograd, to accumulate the members' gradients."""
        for layer in self.layers:
            if layer.differentiable:
                for tensor in layer.tensors():
                    tensor.requires_grad_(True)
        return self


class StateAccess(Cache):
    """What one forward carries to reach the prompt state: the `longstraw_state=` kwarg and the `cache=`.

    `query_positions`: the forward's absolute positions, on the host (the attention's key-chunk decisions read them
    without a device sync; the model gets its own `position_ids`). `mode`: "capture" appends this forward's state (a chunk starting after `prefix_length` captured tokens); "read"
    only reads the final state (scoring and replay); "recompute" (exact prompt gradient, chunk `chunk_index` starting
    after `prefix_length` tokens) reads the state before the chunk and records this forward's state, with its graph,
    in `recorded`; "decode" (a rollout step) reads the final state and the rows' `suffix` (the tokens they decoded
    before this forward), and extends the suffix with this forward's tokens.

    As a `Cache` it stores nothing itself: `update` hands the layer's K/V (or MLA latents) back unchanged, keeping
    them for the registered attention function; recurrent layers get their snapshot states; DSA indexers get their
    own keys only (the prompt's are visited block by block when their top-k is taken: `dsa.py`).
    """

    def __init__(
        self,
        state: PromptState,
        mode: Literal["capture", "read", "recompute", "decode"],
        query_positions: torch.Tensor,
        attention_chunk_size: int,
        prefix_length: int,
        batch_size: int = 1,
        chunk_index: int = 0,
        suffix: Suffix | None = None,
        every_output_read: bool = False,
    ):
        if (mode == "decode") != (suffix is not None):
            raise ValueError("A decode forward needs the rows' suffix, and only a decode forward reads one.")
        super().__init__(layers=[])
        self.state = state
        self.mode = mode
        self.query_positions = query_positions
        self.attention_chunk_size = attention_chunk_size
        self.prefix_length = prefix_length
        self.forward_batch_size = batch_size
        self.chunk_index = chunk_index
        self.suffix = suffix
        self.every_output_read = every_output_read
        self.recorded: dict[LayerState, object] = {}
        self.cache_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.visited: set[int] = set()  # capture: the mixers this forward has run

    def own_entries(
        self, owner: LayerState, name: str, values: torch.Tensor, dim: int, window: int | None = None
    ) -> list[torch.Tensor]:
        """This forward's own entries of `owner` (its tokens along `dim`), as blocks along `dim` that end with them:
        `[values]`, or, decoding, the rows' suffix pages (`Suffix.extend`: one entry set per row, never beside a copy
        of the prompt's; with a sliding `window`, one block of the suffix entries the window still reads)."""
        if self.suffix is None:
            return [values]
        return self.suffix.extend(owner, name, values, dim, window)

    def own_blocks(self, blocks: list[torch.Tensor], dim: int = 1) -> list[tuple[torch.Tensor, int]]:
        """Each of `own_entries`'s `blocks`: the absolute positions of its entries (host) and the key index of its
        first entry (a DSA selection's global index: the captured tokens, then the own entries)."""
        counts = [block.shape[dim] for block in blocks]
        total, new = sum(counts), self.query_positions.numel()
        positions = self.query_positions if self.suffix is None else self.suffix.positions(total, new)
        first = self.prefix_length + (0 if self.suffix is None else self.suffix.length + new - total)
        starts = [first + sum(counts[:index]) for index in range(len(counts))]
        return list(zip(positions.split(counts), starts, strict=True))

    # -- attention-like mixers (through the registered attention function) -------------------------------------------
    def output_unread(self, layer_idx: int) -> bool:
        """Whether nothing reads what this forward's tokens attend to at `layer_idx`: the final decoder layer of a
        capture or recompute. Its outputs are the prompt tokens' last hidden states, which no replay reads (a replay
        starts at the last prompt token) and no exact-mode gradient reaches (it flows from the state's tensors). Its
        state is still written; attention kinds skip the attention itself, and a DSA indexer the top-k over the
        prompt that only that attention would apply (none where the final layer has no attention). Unless
        `every_output_read`: the MoE load-balancing loss reads every prompt token's routing at every layer."""
        return (
            not self.every_output_read
            and self.mode in ("capture", "recompute")
            and layer_idx == self.state.final_layer_idx
        )

    def visit(self, mixer: torch.nn.Module) -> None:
        """A capture writes each mixer's state once per forward; a second write means the model ran that layer twice
        in one forward (a looped, recurrent-depth model), which one state per layer cannot hold."""
        if self.mode != "capture":
            return
        if id(mixer) in self.visited:
            raise UnsupportedModelError(
                f"Layer {getattr(mixer, 'layer_idx', '?')} ({type(mixer).__name__}) ran more than once in one forward "
                "(a model that loops over some of its layers), or called the attention function more than once "
                "(DiffLlama's differential attention). "
                "LongStraw keeps one prompt state per decoder layer, written once. Train this model with GRPOTrainer."
            )
        self.visited.add(id(mixer))

    def attend(self, module, query, key, value, **features) -> torch.Tensor:
        """The mixer's attention over the prompt state and this forward's own keys (`[batch, heads, tokens, dv]`),
        its own entries kept as the mode says; where nothing reads the output (`output_unread`), only kept."""
        self.visit(module)
        target = self.state.for_mixer(module)
        if self.output_unread(module.layer_idx):  # under CP nothing is announced: the serving ranks have no work
            target.keep(self, key, value, **features)
            return query.new_zeros(*query.shape[:-1], value.shape[-1])
        return target.attend(self, query, key, value, **features)

    # -- Cache API: attention layers --------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.cache_inputs[layer_idx] = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # DSA's indexer scores its queries against the own keys through the masks (state/dsa.py)
        if not self.state.extends_masks:
            return 0
        return self.suffix.last_page_length if self.suffix is not None else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length + self.get_seq_length(layer_idx), 0

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.state.of_layer(layer_idx, "indexer").extend(self, indexer_key_states)

    # -- Cache API: recurrent layers (GatedDeltaNet, Mamba2) -----------------------------------------------------------

    def is_recording_past(self, layer_idx: int) -> bool:
        # Never take the single-token decode path: it updates the conv state in place.
        return True

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        # Intermediate recurrent states serve `crop` (assisted decoding); a prompt state keeps the final one only.
        return 0

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._chunk_states_of(layer_idx, "conv").conv_state(self)

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        layer = self._chunk_states_of(layer_idx, "conv")
        continued = layer.continue_conv(self, conv_states, conv_kernel_size)
        self._recorded_chunk_state(layer, "conv")
        return continued

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        layer = self.state.of_layer(layer_idx, "recurrent")
        sharding = self.state.sharding
        if sharding is not None and self.mode == "capture" and sharding.hand_offs.defers_starting_state(self, layer):
            return None  # the mixer's rule takes it when it arrives
        if sharding is not None and self.mode == "recompute":
            sharding.hand_offs.hands_off_state_gradients(self, layer)
        return self._chunk_states_of(layer_idx, "recurrent").recurrent_state(self, self.forward_batch_size)

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        layer = self._chunk_states_of(layer_idx, "recurrent")
        self.visit(layer.mixer)
        layer.finish_recurrent(self, recurrent_states)
        self._recorded_chunk_state(layer, "recurrent")
        return recurrent_states

    def _chunk_states_of(self, layer_idx: int, role: str) -> LayerState:
        """The layer's state for a conv or recurrent call; under context parallelism, in a capture, its chunk's
        starting `role` state (and those before it) in place first (`ChunkStateHandOffs.starting_chunk_states`)."""
        layer = self.state.of_layer(layer_idx, role)
        if self.state.sharding is not None and self.mode == "capture":
            self.state.sharding.hand_offs.starting_chunk_states(self, layer, layer.chunk_state_slot(role))
        return layer

    def _recorded_chunk_state(self, layer: LayerState, role: str) -> None:
        if self.state.sharding is not None and self.mode in ("capture", "recompute"):
            self.state.sharding.hand_offs.recorded_chunk_state(self, layer, layer.chunk_state_slot(role))
