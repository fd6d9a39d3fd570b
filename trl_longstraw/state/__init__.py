"""Durable prompt state: what survives the no-grad capture of a group's prompt, one object per token mixer.

Every per-layer state answers one small interface: `attend(...)` during a forward that carries a
[`StateAccess`], `tensors()` for accounting, device moves and exact-mode gradients. [`PromptState`] is one group's
collection of them, stamped with the weights it was computed under.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from .attention import AttentionPages

__all__ = ["AttentionPages", "PromptState", "StaleStateError", "StateAccess"]


class StaleStateError(RuntimeError):
    """A prompt state was read after the weights it was computed under changed."""


@dataclass
class PromptState:
    """The durable state of one group's prompt, captured once and read by every member's replay.

    `num_tokens` prompt tokens were captured (all but the last prompt token, which starts every replay), at absolute
    positions `start_position ... start_position + num_tokens - 1`.
    """

    num_tokens: int
    start_position: int
    device: torch.device
    weights_version: int
    keep_full_window: bool
    layers: dict[int, AttentionPages] = field(default_factory=dict)

    def layer(self, layer_idx: int, mode: str) -> AttentionPages:
        if layer_idx not in self.layers:
            if mode != "capture":
                raise KeyError(f"layer {layer_idx} has no captured prompt state")
            self.layers[layer_idx] = AttentionPages(
                self.num_tokens, self.start_position, self.device, self.keep_full_window
            )
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


@dataclass
class StateAccess:
    """What one forward carries (as the `longstraw_state=` model kwarg) so attention layers reach the prompt state.

    `mode`: "capture" appends this forward's K/V to the state; "read" only reads it (scoring and replay);
    "recompute" (exact prompt gradient) reads the pages before `page_limit` and records this forward's K/V with
    their graph in `recorded`.
    """

    state: PromptState
    mode: Literal["capture", "read", "recompute"]
    query_positions: torch.Tensor
    attention_chunk_size: int
    page_limit: int | None = None
    recorded: dict[AttentionPages, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def attend(self, layer_idx, query, key, value, scaling, sliding_window):
        layer = self.state.layer(layer_idx, self.mode)
        return layer.attend(self, query, key, value, scaling, sliding_window)
