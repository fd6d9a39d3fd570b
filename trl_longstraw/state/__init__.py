"""Durable prompt state: what survives the no-grad capture of a group's prompt, one registered kind per token mixer.

Each kind is one module and one registration (`register_state_kind`); the registry (`registry.py`) maps every
decoder layer of a model to its kinds, the accounting reads the same kinds, and a model whose layers do not all map
is refused naming the layer. The kinds are registered below, in `BUILT_IN_KINDS`'s order, which is the order
`plan_layers` tries them (a kind registered later, by a user, is tried after these).

| kind | module | layer types | keeps |
| --- | --- | --- | --- |
| `attention` | `attention.py` | full / sliding / chunked attention | K/V pages (a window or chunk keeps only what it reads) |
| `mla_latent` | `mla.py` | MLA attention | latent + rope key per token |
| `dsa_indexer` | `dsa.py` | MLA layers computing a DSA top-k | indexer key per token |
| `gated_deltanet` | `linear_attention.py` | `linear_attention`, `hybrid` | conv + fp32 recurrent state |
| `mamba2` | `mamba.py` | `linear_attention`, `hybrid`, Mamba2 layers without layer types | conv + fp32 SSM state |
| `feed_forward` | `feed_forward.py` | `mlp`, `moe` (FFN-only layers) | nothing |
"""

from .attention import AttentionPages
from .dsa import IndexerKeys
from .feed_forward import FeedForwardOnly
from .linear_attention import LinearAttentionState
from .mamba import Mamba2State
from .mla import LatentPages
from .prompt_state import PromptState, StaleStateError, StateAccess, UnpreparedModelError
from .recurrent import ConvRecurrentState
from .registry import (
    STATE_KINDS,
    LayerAccount,
    LayerPlan,
    LayerState,
    UnsupportedModelError,
    plan_layers,
    register_state_kind,
)

BUILT_IN_KINDS = (AttentionPages, LatentPages, IndexerKeys, FeedForwardOnly, LinearAttentionState, Mamba2State)
for _kind in BUILT_IN_KINDS:
    register_state_kind(_kind)

__all__ = [
    "BUILT_IN_KINDS",
    "STATE_KINDS",
    "AttentionPages",
    "ConvRecurrentState",
    "FeedForwardOnly",
    "IndexerKeys",
    "LatentPages",
    "LayerAccount",
    "LayerPlan",
    "LayerState",
    "LinearAttentionState",
    "Mamba2State",
    "PromptState",
    "StaleStateError",
    "StateAccess",
    "UnpreparedModelError",
    "UnsupportedModelError",
    "plan_layers",
    "register_state_kind",
]
