"""Durable prompt state of a softmax-attention layer (GQA/MQA, optionally sliding-window): its K/V pages.

Pages hold the keys and values exactly as the layer hands them to attention (after projection, norm and RoPE), one
entry per captured prompt token, `[kv_heads, tokens, head_dim]`. A sliding-window layer keeps only the last
`window - 1` entries, all a later token can read (unless the prompt gradient is exact, which needs every entry).
"""

from __future__ import annotations

import torch

from ..attention import chunked_attention, merge_by_lse


def empty_state(like: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A state buffer on `device`; in pinned host memory when it is the host and the model runs on CUDA, so that
    staging each chunk to the GPU is an asynchronous copy."""
    pin = torch.device(device).type == "cpu" and like.device.type == "cuda"
    return torch.empty(shape, dtype=like.dtype, device=device, pin_memory=pin)


class AttentionPages:
    """K/V pages of one attention layer. Written only during capture; read-only afterwards."""

    differentiable = True

    def __init__(self, capacity: int, start_position: int, device: torch.device, keep_full_window: bool):
        self.capacity = capacity
        self.start_position = start_position  # absolute position of page entry 0
        self.device = device
        self.keep_full_window = keep_full_window
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None
        self.length = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.key, self.value) if t is not None]

    def positions(self, limit: int, device: torch.device) -> torch.Tensor:
        return torch.arange(self.start_position, self.start_position + limit, device=device)

    def attend(self, access, query, key, value, scaling: float, sliding_window: int | None) -> torch.Tensor:
        """Attention of this forward's tokens over the prompt pages and over themselves (causal), LSE-merged.

        `query [batch, heads, tokens, d]`, `key/value [batch, kv_heads, tokens, d]` are this forward's own tokens.
        """
        batch, heads, tokens, dim = query.shape
        kv_heads = key.shape[1]
        q_positions = access.query_positions
        chunk = access.attention_chunk_size
        # Each batch row has its own suffix keys: fold the batch into the heads so rows never see each other.
        own_out, own_lse = chunked_attention(
            query.reshape(1, batch * heads, tokens, dim),
            key.reshape(batch * kv_heads, tokens, dim),
            value.reshape(batch * kv_heads, tokens, value.shape[-1]),
            q_positions,
            q_positions,
            scaling,
            sliding_window,
            chunk,
        )
        own_out = own_out.view(batch, heads, tokens, -1)
        own_lse = own_lse.view(batch, heads, tokens)
        # Pages hold every captured token (or, sliding window, the last ones): all are visible except while the exact
        # recompute of a chunk reads only the pages before it.
        limit = access.prefix_length if access.mode == "recompute" else self.length
        if limit > 0:
            prefix_out, prefix_lse = chunked_attention(
                query,
                self.key[:, :limit],
                self.value[:, :limit],
                q_positions,
                self.positions(limit, query.device),
                scaling,
                sliding_window,
                chunk,
            )
            out = merge_by_lse(prefix_out, prefix_lse, own_out, own_lse)
        else:
            out = own_out
        if access.mode == "capture":
            self._append(key[0], value[0], sliding_window)
        elif access.mode == "recompute":
            access.recorded[self] = (key[0], value[0])
        return out

    @torch.no_grad()
    def _append(self, key: torch.Tensor, value: torch.Tensor, sliding_window: int | None) -> None:
        key = key.to(self.device)
        value = value.to(self.device)
        if sliding_window is not None and not self.keep_full_window:
            keep = sliding_window - 1
            if self.key is None:
                self.key, self.value = key[:, -keep:].clone(), value[:, -keep:].clone()
            else:
                self.key = torch.cat([self.key, key], dim=1)[:, -keep:].clone()
                self.value = torch.cat([self.value, value], dim=1)[:, -keep:].clone()
            dropped = self.length + key.shape[1] - self.key.shape[1]
            self.start_position += dropped
            self.length = self.key.shape[1]
            return
        if self.key is None:
            self.key = empty_state(key, (key.shape[0], self.capacity, key.shape[-1]), self.device)
            self.value = empty_state(value, (value.shape[0], self.capacity, value.shape[-1]), self.device)
        end = self.length + key.shape[1]
        self.key[:, self.length : end] = key
        self.value[:, self.length : end] = value
        self.length = end

    def recompute_pairs(
        self, recorded, chunk_index: int, start: int, end: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(recomputed K or V of pages [start, end), their accumulated gradient) for the exact prompt backward."""
        pairs = []
        for recomputed, leaf in zip(recorded, (self.key, self.value), strict=True):
            if leaf.grad is not None:
                pairs.append((recomputed, leaf.grad[:, start:end].to(recomputed.device, recomputed.dtype, copy=True)))
        return pairs
