"""Durable prompt state: what survives the no-grad capture of a group's prompt, one class per token mixer.

[`PromptState`] is one group's collection of per-layer states ([`AttentionPages`] for softmax attention,
[`LinearAttentionState`] for GatedDeltaNet), stamped with the weights it was computed under. A forward reaches it
through a [`StateAccess`], which is both the `longstraw_state=` kwarg read by the registered attention function and a
transformers `Cache` read by linear-attention layers: reads hand out the snapshot, continuations are out of place.
"""

from __future__ import annotations

from typing import Literal

import torch
from transformers.cache_utils import Cache

from .attention import AttentionPages
from .linear_attention import LinearAttentionState

__all__ = ["AttentionPages", "LinearAttentionState", "PromptState", "StaleStateError", "StateAccess"]

LayerState = AttentionPages | LinearAttentionState


class StaleStateError(RuntimeError):
    """A prompt state was read after the weights it was computed under changed."""


class PromptState:
    """The durable state of one group's prompt, captured once and read by every member's replay.

    `num_tokens` prompt tokens were captured (all but the last prompt token, which starts every replay), at absolute
    positions `start_position ... start_position + num_tokens - 1`, in chunks of `chunk_size`.
    """

    def __init__(self, num_tokens, start_position, chunk_size, device, weights_version, exact: bool):
        self.num_tokens = num_tokens
        self.start_position = start_position
        self.chunk_size = chunk_size
        self.device = device
        self.weights_version = weights_version
        self.exact = exact
        self.layers: dict[int, LayerState] = {}

    def layer(self, layer_idx: int, mode: str, kind: type[LayerState]) -> LayerState:
        if layer_idx not in self.layers:
            if mode != "capture":
                raise KeyError(f"layer {layer_idx} has no captured prompt state")
            if kind is AttentionPages:
                self.layers[layer_idx] = AttentionPages(self.num_tokens, self.start_position, self.device, self.exact)
            else:
                self.layers[layer_idx] = LinearAttentionState(self.device, keep_boundaries=self.exact)
        return self.layers[layer_idx]

    def tensors(self) -> list[torch.Tensor]:
        return [t for idx in sorted(self.layers) for t in self.layers[idx].tensors()]

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
        for tensor in self.tensors():
            tensor.requires_grad_(True)
        return self


class StateAccess(Cache):
    """What one forward carries to reach the prompt state: the `longstraw_state=` kwarg and the `cache=`.

    `mode`: "capture" appends this forward's state; "read" only reads the final state (scoring and replay);
    "recompute" (exact prompt gradient, chunk `chunk_index` starting at page `page_limit`) reads the state before the
    chunk and records this forward's state with its graph in `recorded`.

    As a `Cache`, it reports no past tokens (attention masks stay `[tokens, tokens]`; the registered attention reads
    the prefix itself), returns attention K/V unchanged, and serves linear-attention layers their snapshot states.
    """

    def __init__(
        self,
        state: PromptState,
        mode: Literal["capture", "read", "recompute"],
        query_positions: torch.Tensor,
        attention_chunk_size: int,
        batch_size: int = 1,
        chunk_index: int = 0,
        page_limit: int | None = None,
    ):
        super().__init__(layers=[])
        self.forward_batch_size = batch_size
        self.state = state
        self.mode = mode
        self.query_positions = query_positions
        self.attention_chunk_size = attention_chunk_size
        self.chunk_index = chunk_index
        self.page_limit = page_limit
        self.recorded: dict[LayerState, list] = {}

    # -- softmax attention (through the registered attention function) -------------------------------------------
    def attend(self, layer_idx, query, key, value, scaling, sliding_window):
        pages = self.state.layer(layer_idx, self.mode, AttentionPages)
        return pages.attend(self, query, key, value, scaling, sliding_window)

    # -- Cache API: attention layers --------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return query_length, 0

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
