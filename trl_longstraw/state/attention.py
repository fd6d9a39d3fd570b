"""Softmax attention (GQA/MQA): K/V pages, with causal, sliding-window or chunked visibility, sinks and soft-capping.

Pages hold the keys and values exactly as the layer hands them to attention (after projection, norm and RoPE), one
entry per captured prompt token, `[kv_heads, tokens, head_dim]`. What a later token can read decides what is kept:
every entry under causal attention; the last `window - 1` under a sliding window (transformers'
`DynamicSlidingWindowLayer` keeps the same); the entries of the current chunk under Llama 4's chunked attention. The
exact prompt gradient keeps every entry (a recompute of chunk c reads the pages before it).

Per-call features come from the model's own attention call: `sliding_window`, `s_aux` (gpt-oss attention sinks: one
logit per head in every softmax denominator, with its gradient) and `softcap` (Gemma 2 logit soft-capping, applied to
the scores of prefix and suffix alike).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from ..block_attention import AttentionScalars, KeyBlock, Visibility
from .placement import Pages, page_bytes
from .registry import LayerAccount, LayerState, UnsupportedModelError, find_child

ATTENTION_LAYER_TYPES = (None, "full_attention", "sliding_attention", "chunked_attention", "hybrid")


def is_softmax_attention(module: nn.Module) -> bool:
    has_query = hasattr(module, "q_proj") or hasattr(module, "qkv_proj") or hasattr(module, "c_attn")
    return has_query and not hasattr(module, "kv_b_proj") and hasattr(module, "layer_idx")


def sliding_window_of(mixer: nn.Module, config: PretrainedConfig, layer_type: str | None) -> int | None:
    """The layer's window, for the accounting (a capture follows the window the layer passes to attention).

    With layer types, only `"sliding_attention"` layers have one (some models set `sliding_window` on every attention
    module and pass it only on sliding layers); without, the module's own window or the config's (Mistral applies
    `config.sliding_window` to every layer)."""
    if layer_type is not None and layer_type != "sliding_attention":
        return None
    window = getattr(mixer, "sliding_window", None)
    return window if window is not None else getattr(config, "sliding_window", None)


class AttentionPages(LayerState):
    """K/V pages of one softmax-attention layer. Written only during capture; read-only afterwards."""

    name = "attention"
    layer_types = ATTENTION_LAYER_TYPES
    roles = frozenset({"attention"})
    sharded_layer_types = (None, "full_attention", "sliding_attention", "hybrid")  # not Llama 4's chunked layers
    needs_attention_interface = True

    @classmethod
    def find_mixer(cls, layer, layer_type):
        mixer = find_child(layer, is_softmax_attention)
        if mixer is not None and getattr(mixer, "is_kv_shared_layer", False):
            raise UnsupportedModelError(
                f"Layer {mixer.layer_idx} ({type(mixer).__name__}) reuses the K/V of another layer (KV sharing), "
                "which LongStraw's attention state does not implement."
            )
        if mixer is not None and hasattr(mixer, "prepare_dynamic_mask"):
            raise UnsupportedModelError(
                f"Layer {mixer.layer_idx} ({type(mixer).__name__}) hands the attention function a dynamic mask (Doge's: "
                "a learned per-key score bias, and only its top keep_window_size keys), which LongStraw's attention "
                "over the prompt state does not implement. Train this model with GRPOTrainer."
            )
        return mixer

    @classmethod
    def account(cls, mixer, config, layer_type, dtype_bytes, exact, fp8_pages=False):
        head_dim = getattr(mixer, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        window = sliding_window_of(mixer, config, layer_type)
        chunk = getattr(config, "attention_chunk_size", None) if layer_type == "chunked_attention" else None
        if exact or (window is None and chunk is None):  # K and V pages: 2 x kv_heads heads
            per_token, per_page = page_bytes(2 * kv_heads, head_dim, dtype_bytes, fp8_pages and not exact)
            return LayerAccount("full_attention", per_token=per_token, per_page=per_page)
        per_token = 2 * kv_heads * head_dim * dtype_bytes  # a window's few entries stay in the model dtype
        if chunk is not None:
            return LayerAccount("chunked_attention", fixed=per_token * (chunk - 1))  # at most: the current chunk
        return LayerAccount("sliding_attention", fixed=per_token * (window - 1), window=window - 1)

    @classmethod
    def attention_heads(cls, mixer, config):
        return getattr(mixer, "num_heads", None) or config.num_attention_heads

    @classmethod
    def step_attention_elements(cls, mixer, config):
        head_dim = getattr(mixer, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        heads = cls.attention_heads(mixer, config)
        return heads * head_dim, 2 * kv_heads * head_dim, heads * (head_dim + 1)

    @classmethod
    def prompt_score_tiles(cls, mixer, config, layer_type):
        """A chunk the fused kernel cannot take keeps its scores: soft-capped logits, and a window's or an attention
        chunk's edges (measured on the simulation: a full-attention layer's chunks are fused on CUDA)."""
        windowed = layer_type in ("sliding_attention", "chunked_attention") or (
            layer_type is None and getattr(config, "sliding_window", None) is not None
        )
        return windowed or getattr(config, "attn_logit_softcapping", None) is not None

    def __init__(self, mixer, layer_idx, layer_type, prompt):
        super().__init__(mixer, layer_idx, layer_type, prompt)
        self.chunk_size = None
        if layer_type == "chunked_attention":
            self.chunk_size = getattr(mixer.config, "attention_chunk_size", None)
        self.rolling = None  # decided at the first capture call, from the call's sliding_window
        self.first_entry = 0  # index among the entries held here of page entry 0 (moves as a window rolls)
        self.key: Pages | None = None
        self.value: Pages | None = None

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.key is None else self.key.tensors() + self.value.tensors()

    @property
    def length(self) -> int:
        return 0 if self.key is None else self.key.length

    def visibility(self, sliding_window: int | None) -> Visibility:
        return Visibility(sliding_window, self.chunk_size, self.prompt.origin)

    def attend(self, access, query, key, value, scaling, sliding_window=None, sinks=None, softcap=None, **_):
        """Attention of this forward's tokens over the prompt pages and over themselves (causal), as one softmax.

        `query [batch, heads, tokens, d]`, `key/value [batch, kv_heads, tokens, d]` are this forward's own tokens
        (decoding: preceded by the rows' earlier decoded tokens, kept in the access's suffix).
        """
        batch, kv_heads, tokens, _ = key.shape
        visibility = self.visibility(sliding_window)
        # Each batch row has its own suffix keys: one key set per (row, kv head).
        window = visibility.sliding_window
        own_keys = access.own_entries(self, "key", key.reshape(batch * kv_heads, tokens, -1), dim=1, window=window)
        own_values = access.own_entries(self, "value", value.reshape(batch * kv_heads, tokens, -1), 1, window)
        scalars = AttentionScalars(scaling, access.attention_chunk_size, visibility, softcap)
        out = access.state.attention(access, self, query, own_keys, own_values, scalars, sinks=sinks)
        self.keep(access, key, value, visibility=visibility)
        return out

    def page_block(self, dtype, limit=None, indices=None):
        # Pages hold every captured token (or the ones a window/chunk still sees).
        limit = self.length if limit is None else limit
        if limit == 0:
            return (), ()
        positions = self.prompt.positions(self.first_entry, self.first_entry + limit)
        dequantize = self._dequantizer(dtype) if self.key.fp8 else None
        block = KeyBlock(positions, shared=True, dequantize=dequantize)
        return (block,), (self.key.read(limit), self.value.read(limit))

    def accumulate_page_gradients(self, d_keys, d_values):
        self.key.accumulate_grad(d_keys)
        self.value.accumulate_grad(d_values)

    def keep(self, access, key, value, sliding_window=None, visibility: Visibility | None = None, **_) -> None:
        """This forward's own entries: appended to the pages by a capture (a windowed layer keeps what later tokens
        read), recorded with their graph by a recompute; nothing otherwise."""
        if access.mode == "capture":
            self._append(key[0], value[0], visibility or self.visibility(sliding_window))
        elif access.mode == "recompute":
            access.recorded[self] = (key[0], value[0])

    def _dequantizer(self, dtype: torch.dtype):
        """fp8 pages: each chunk's keys and values in `dtype`, with their pages' scales, as attention reads them."""

        def dequantize(keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor):
            return self.key.dequantize(keys, index, dtype), self.value.dequantize(values, index, dtype)

        return dequantize

    def _keep_from(self, visibility: Visibility, appended: int) -> int:
        """Index (after appending `appended` entries) of the first entry a later token can still read."""
        end = self.first_entry + self.length + appended
        origin = self.prompt.origin
        next_position = origin + self.prompt.next_query(int(self.prompt.global_indices(end - 1, end)[0]) + 1)
        first_needed = next_position - (visibility.sliding_window - 1) if visibility.sliding_window else None
        if visibility.chunk_size is not None:
            chunk_origin, size = visibility.chunk_origin, visibility.chunk_size
            chunk_start = chunk_origin + (next_position - chunk_origin) // size * size
            first_needed = chunk_start if first_needed is None else max(first_needed, chunk_start)
        return max(0, self.prompt.held_before(max(0, first_needed - origin)) - self.first_entry)

    @torch.no_grad()
    def _append(self, key: torch.Tensor, value: torch.Tensor, visibility: Visibility) -> None:
        if self.key is None:
            self.rolling = visibility.windowed() and not self.prompt.exact
            capacity = None if self.rolling else self.prompt.num_tokens
            fp8 = self.prompt.fp8_pages and not self.rolling  # a window's few entries stay in the model dtype
            self.key = Pages(self.prompt.placement, capacity, fp8=fp8)
            self.value = Pages(self.prompt.placement, capacity, fp8=fp8)
        keep_from = self._keep_from(visibility, key.shape[1]) if self.rolling else 0
        self.key.append(key, keep_from)
        self.first_entry += self.value.append(value, keep_from)

    def recompute_pairs(self, recorded, chunk_index, start, end):
        pairs = []
        for recomputed, leaf in zip(recorded, self.tensors(), strict=True):
            if leaf.grad is not None:
                pairs.append((recomputed, leaf.grad[:, start:end].to(recomputed.device, recomputed.dtype, copy=True)))
        return pairs
