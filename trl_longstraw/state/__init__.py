"""Durable prompt state: what survives the no-grad capture of a group's prompt, one class per token mixer.

[`PromptState`] is one group's collection of per-layer states ([`AttentionPages`] for softmax attention,
[`LatentPages`] and [`IndexerKeys`] for MLA/DSA, [`LinearAttentionState`] for GatedDeltaNet), stamped with the
weights it was computed under. A forward reaches it through a [`StateAccess`], which is both the `longstraw_state=`
kwarg read by the registered attention function and a transformers `Cache` read by the model's layers: reads hand out
the snapshot, continuations are computed out of place, nothing is concatenated onto the prompt's pages.
"""

from __future__ import annotations

from typing import Literal

import torch
from transformers.cache_utils import Cache

from .attention import AttentionPages
from .linear_attention import LinearAttentionState
from .mla import IndexerKeys, LatentPages

__all__ = [
    "AttentionPages",
    "IndexerKeys",
    "LatentPages",
    "LinearAttentionState",
    "PromptState",
    "StaleStateError",
    "StateAccess",
]

LayerState = AttentionPages | LatentPages | IndexerKeys | LinearAttentionState


class StaleStateError(RuntimeError):
    """A prompt state was read after the weights it was computed under changed."""


class PromptState:
    """The durable state of one group's prompt, captured once and read by every member's replay.

    `num_tokens` prompt tokens were captured (all but the last prompt token, which starts every replay), at absolute
    positions `start_position ... start_position + num_tokens - 1`. `indexed` models (DSA) see the prompt's length in
    their attention masks, which their indexer needs; others get masks over their own tokens only.
    """

    def __init__(self, num_tokens, start_position, device, weights_version, exact: bool, indexed: bool):
        self.num_tokens = num_tokens
        self.start_position = start_position
        self.device = device
        self.weights_version = weights_version
        self.exact = exact
        self.indexed = indexed
        self.layers: dict[tuple[int, str], LayerState] = {}

    def layer(self, layer_idx: int, mode: str, kind: type[LayerState]) -> LayerState:
        key = (layer_idx, kind.__name__)
        if key not in self.layers:
            if mode != "capture":
                raise KeyError(f"layer {layer_idx} has no captured {kind.__name__}")
            if kind is AttentionPages:
                self.layers[key] = AttentionPages(self.num_tokens, self.start_position, self.device, self.exact)
            elif kind is LatentPages:
                self.layers[key] = LatentPages(self.num_tokens, self.start_position, self.device)
            elif kind is IndexerKeys:
                self.layers[key] = IndexerKeys(self.num_tokens, self.device)
            else:
                self.layers[key] = LinearAttentionState(self.device, keep_boundaries=self.exact)
        return self.layers[key]

    def tensors(self) -> list[torch.Tensor]:
        return [t for key in sorted(self.layers) for t in self.layers[key].tensors()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def check_fresh(self, weights_version: int) -> None:
        if weights_version != self.weights_version:
            raise StaleStateError(
                f"The prompt state was captured under weights version {self.weights_version} but the weights are now "
                f"at version {weights_version}: replaying it would mix two models. Capture the prompt again after "
                "every optimizer step (LongStrawGRPOTrainer does this for you)."
            )

    def requires_grad_(self) -> PromptState:
        """Exact mode: make the differentiable state leaves of autograd, to accumulate the members' gradients."""
        for layer in self.layers.values():
            if layer.differentiable:
                for tensor in layer.tensors():
                    tensor.requires_grad_(True)
        return self


class StateAccess(Cache):
    """What one forward carries to reach the prompt state: the `longstraw_state=` kwarg and the `cache=`.

    `mode`: "capture" appends this forward's state (a chunk starting after `prefix_length` captured tokens); "read"
    only reads the final state (scoring and replay); "recompute" (exact prompt gradient, chunk `chunk_index` starting
    after `prefix_length` tokens) reads the state before the chunk and records this forward's state, with its graph,
    in `recorded`.

    As a `Cache` it stores nothing itself: `update` hands the layer's K/V (or MLA latents) back unchanged, keeping
    them for the registered attention function; linear-attention layers get their snapshot states; DSA indexers get
    the prompt's indexer keys followed by their own.
    """

    def __init__(
        self,
        state: PromptState,
        mode: Literal["capture", "read", "recompute"],
        query_positions: torch.Tensor,
        attention_chunk_size: int,
        prefix_length: int,
        batch_size: int = 1,
        chunk_index: int = 0,
    ):
        super().__init__(layers=[])
        self.state = state
        self.mode = mode
        self.query_positions = query_positions
        self.attention_chunk_size = attention_chunk_size
        self.prefix_length = prefix_length
        self.forward_batch_size = batch_size
        self.chunk_index = chunk_index
        self.recorded: dict[LayerState, object] = {}
        self.cache_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # -- softmax attention and MLA (through the registered attention function) ---------------------------------------
    def attend(self, module, query, key, value, scaling, sliding_window, indices=None):
        if hasattr(module, "kv_b_proj"):  # multi-head latent attention
            pages = self.state.layer(module.layer_idx, self.mode, LatentPages)
            return pages.attend(self, module, query, scaling, indices)
        pages = self.state.layer(module.layer_idx, self.mode, AttentionPages)
        return pages.attend(self, query, key, value, scaling, sliding_window)

    # -- Cache API: attention layers --------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.cache_inputs[layer_idx] = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prefix_length if self.state.indexed else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length + self.get_seq_length(layer_idx), 0

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.state.layer(layer_idx, self.mode, IndexerKeys).extend(self, indexer_key_states)

    # -- Cache API: linear-attention layers ---------------------------------------------------------------------------
    def _linear(self, layer_idx: int) -> LinearAttentionState:
        return self.state.layer(layer_idx, self.mode, LinearAttentionState)

    def is_recording_past(self, layer_idx: int) -> bool:
        # Never take the single-token decode path: it updates the conv state in place.
        return True

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._linear(layer_idx).conv_state(self)

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        return self._linear(layer_idx).continue_conv(self, conv_states, conv_kernel_size)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._linear(layer_idx).recurrent_state(self, self.forward_batch_size)

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._linear(layer_idx).finish_recurrent(self, recurrent_states)
        return recurrent_states
