"""Layers without a token mixer (Nemotron-H's `"mlp"` and `"moe"` blocks): nothing of the prompt to keep.

Dense and MoE FFNs are per token: a replayed token's FFN output does not depend on the prompt. Registering the kind
keeps the support rule simple: every decoder layer maps to a registered kind.
"""

from __future__ import annotations

from .registry import LayerAccount, LayerState, register_state_kind


@register_state_kind
class FeedForwardOnly(LayerState):
    """A decoder layer that is only a (dense or MoE) feed-forward block."""

    name = "feed_forward"
    layer_types = ("mlp", "moe")

    @classmethod
    def find_mixer(cls, layer, layer_type):
        return layer

    @classmethod
    def account(cls, mixer, config, layer_type, dtype_bytes, exact):
        return LayerAccount("feed_forward")

    def tensors(self):
        return []

    def captured(self) -> bool:
        return True
