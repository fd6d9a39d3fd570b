"""Durable prompt state: what survives the no-grad capture of a group's prompt, one registered kind per token mixer.

Each kind is one module and one registration (`register_state_kind`); the registry (`registry.py`) maps every
decoder layer of a model to its kinds, the accounting reads the same kinds, and a model whose layers do not all map
is refused naming the layer. Registration order below is the order kinds are tried.

| kind | module | layer types | keeps |
| --- | --- | --- | --- |
| `attention` | `attention.py` | full / sliding / chunked attention | K/V pages (a window or chunk keeps only what it reads) |
| `mla_latent` | `mla.py` | MLA attention | latent + rope key per token |
| `dsa_indexer` | `dsa.py` | MLA layers computing a DSA top-k | indexer key per token |
| `gated_deltanet` | `linear_attention.py` | `linear_attention`, `hybrid` | conv + fp32 recurrent state |
| `mamba2` | `mamba.py` | `linear_attention`, `hybrid`, Mamba2 layers without layer types | conv + fp32 SSM state |
| `feed_forward` | `feed_forward.py` | `mlp`, `moe` (FFN-only layers) | nothing |
"""

from . import attention, dsa, feed_forward, linear_attention, mamba, mla  # noqa: F401  (registers the kinds)
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

__all__ = [
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
