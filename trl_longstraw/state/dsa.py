"""DSA (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5) indexer keys of the layers that compute their own top-k.

An index-computing layer keeps its indexer keys (`index_head_dim` per token). No gradient flows through them:
transformers' indexer runs under `no_grad`, and the selection it makes is discrete. IndexShare layers (GLM-5's
`indexer_types == "shared"`) have no indexer module and reuse the previous computing layer's selection, which the
model passes between layers itself, so they keep nothing here. The indexer reaches its keys through the Cache API
(`update_indexer`) and scores its queries against a mask spanning prompt + forward, so forwards present the prompt's
length to the model's masks (`extends_masks`).
"""

from __future__ import annotations

import torch

from .mla import is_multi_head_latent_attention
from .placement import Pages
from .registry import LayerAccount, LayerState, register_state_kind


@register_state_kind
class IndexerKeys(LayerState):
    """`[1, tokens, index_head_dim]` DSA indexer keys of one index-computing layer."""

    name = "dsa_indexer"
    layer_types = (None, "full_attention", "sliding_attention", "indexed_attention")
    differentiable = False
    extends_masks = True

    @classmethod
    def find_mixer(cls, layer, layer_type):
        for child in layer.children():
            if is_multi_head_latent_attention(child) and getattr(child, "indexer", None) is not None:
                return child.indexer
        return None

    @classmethod
    def account(cls, mixer, config, layer_type, dtype_bytes, exact):
        return LayerAccount("dsa_indexer_keys", per_token=mixer.head_dim * dtype_bytes)

    def __init__(self, mixer, layer_idx, layer_type, prompt):
        super().__init__(mixer, layer_idx, layer_type, prompt)
        self.keys = Pages(prompt.placement, prompt.num_tokens)

    def tensors(self) -> list[torch.Tensor]:
        return self.keys.tensors()

    @torch.no_grad()
    def extend(self, access, keys: torch.Tensor) -> torch.Tensor:
        """The indexer's keys for this forward: the prompt's, then this forward's own `keys [batch, tokens, dim]`.

        During capture this forward's keys are written into the pages and a view is returned (no copy); a replay
        gets a transient concatenation, since members of a batch differ after the prompt.
        """
        if access.mode == "capture":
            self.keys.append(keys[:1])
            return self.keys.read().to(keys.device)
        keys = access.own_entries(self, "keys", keys, dim=1)  # decoding: the rows' earlier indexer keys first
        prefix = self.keys.read(access.state.local_prefix(access.prefix_length))
        if prefix is None:
            return keys
        prefix = self.prompt.placement.stage(prefix, keys.device)
        return torch.cat([prefix.expand(keys.shape[0], -1, -1), keys], dim=1)
