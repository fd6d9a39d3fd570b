"""Layers without a token mixer (Nemotron-H's `"mlp"` and `"moe"` blocks): nothing of the prompt to keep.

Dense and MoE FFNs are per token: a replayed token's FFN output does not depend on the prompt. Registering the kind
keeps the support rule simple: every decoder layer maps to a registered kind.
"""

from __future__ import annotations

from .registry import LayerState


class FeedForwardOnly(LayerState):
    """A decoder layer that is only a (dense or MoE) feed-forward block."""

    name = "feed_forward"
    layer_types = ("mlp", "moe")
    roles = frozenset()  # nothing of a forward reaches it
    sharded_layer_types = layer_types

    @classmethod
    def find_mixer(cls, layer, layer_type):
        return layer

    @classmethod
    def account(cls, mixer, config, layer_type, dtype_bytes, exact, fp8_pages=False):
        return None

    def tensors(self):
        return []

    def captured(self) -> bool:
        return True
