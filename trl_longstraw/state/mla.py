"""Durable prompt state of a multi-head latent attention (MLA) layer, and of its DSA indexer.

MLA caches, per token, the compressed latent (`kv_lora_rank`, after `kv_a_layernorm`) and the shared rope key
(`qk_rope_head_dim`): 576 values per token on GLM-5, instead of per-head K/V. LongStraw keeps exactly that, as one
`[1, tokens, kv_lora_rank + qk_rope_head_dim]` page tensor, and never expands it back to per-head K/V. Instead
`kv_b_proj` is absorbed into the query and the output side (measured choice, see README): with
`W_uk, W_uv = kv_b_proj` split per head,

    q_h . k_h,j = (W_uk_h^T q_nope_h) . c_j + q_rope_h . k_rope_j        o_h = W_uv_h (sum_j p_hj c_j)

so the prefix is read as multi-query attention over `[c_j, k_rope_j]` (values `c_j`, a view of the same page):
no per-token projection of the prefix at all, and only the replayed tokens touch `kv_b_proj`. The absorbed weights
are obtained by running `kv_b_proj` on the identity, which works unchanged for LoRA and 4-bit base layers and keeps
their gradients.

DSA: index-computing layers keep their indexer keys (`index_head_dim` per token, no gradient: transformers' indexer
runs under `no_grad`); IndexShare layers reuse the previous computing layer's selection, which the model itself
passes between layers. The selection reaches attention as `indices [batch, tokens, top_k]` over absolute key
positions and is applied to both the prefix and the replayed tokens.
"""

from __future__ import annotations

import torch

from ..attention import chunked_attention, merge_by_lse
from .attention import empty_state


def absorbed_weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    """`W_uk [kv_lora_rank, heads, qk_nope_head_dim]` and `W_uv [kv_lora_rank, heads, v_head_dim]` of `kv_b_proj`."""
    rank = module.kv_lora_rank
    projection = module.kv_b_proj
    weight = projection.weight if hasattr(projection, "weight") else None
    dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.get_default_dtype()
    basis = torch.eye(rank, dtype=dtype, device=module.kv_a_layernorm.weight.device)
    columns = projection(basis) - projection(torch.zeros_like(basis[:1]))  # minus the bias, if any
    columns = columns.view(rank, -1, module.qk_nope_head_dim + module.v_head_dim)
    return columns[..., : module.qk_nope_head_dim], columns[..., module.qk_nope_head_dim :]


def topk_selection(indices: torch.Tensor, offset: int):
    """`selected(start, end)`: which keys `offset + start .. offset + end - 1` each token's top-k picked."""
    picked = indices.long().sort(dim=-1).values  # [batch, tokens, top_k]

    def selected(start: int, end: int) -> torch.Tensor:
        keys = torch.arange(offset + start, offset + end, device=picked.device)
        keys = keys.expand(*picked.shape[:2], end - start).contiguous()
        slot = torch.searchsorted(picked, keys).clamp(max=picked.shape[-1] - 1)
        return picked.gather(-1, slot) == keys

    return selected


class LatentPages:
    """`[1, tokens, kv_lora_rank + qk_rope_head_dim]` latent pages of one MLA layer. Read-only after capture."""

    differentiable = True

    def __init__(self, capacity: int, start_position: int, device: torch.device):
        self.capacity = capacity
        self.start_position = start_position
        self.device = device
        self.pages: torch.Tensor | None = None
        self.length = 0

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.pages is None else [self.pages]

    def attend(self, access, module, query, scaling: float, indices: torch.Tensor | None) -> torch.Tensor:
        """Absorbed MLA of this forward's tokens over the latent pages and over themselves, LSE-merged."""
        latent, rope_key = access.cache_inputs[module.layer_idx]  # [batch, 1, tokens, rank], [batch, 1, tokens, rope]
        own_keys = torch.cat([latent, rope_key], dim=-1)[:, 0]  # [batch, tokens, rank + rope]
        rank = module.kv_lora_rank
        w_uk, w_uv = absorbed_weights(module)
        query_nope, query_rope = query.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
        absorbed = torch.cat([torch.einsum("bhtn,khn->bhtk", query_nope, w_uk.to(query.dtype)), query_rope], dim=-1)
        positions = access.query_positions
        prefix = access.prefix_length
        own_selected = None if indices is None else topk_selection(indices, prefix)
        own = [
            chunked_attention(
                absorbed[b : b + 1],
                own_keys[b : b + 1],
                own_keys[b : b + 1, :, :rank],
                positions,
                positions,
                scaling,
                None,
                access.attention_chunk_size,
                None if own_selected is None else (lambda s, e, b=b: own_selected(s, e)[b : b + 1]),
            )
            for b in range(absorbed.shape[0])
        ]
        out = torch.cat([o for o, _ in own])
        lse = torch.cat([lse for _, lse in own])
        if prefix > 0:
            pages = self.pages[:, :prefix]
            prefix_out, prefix_lse = chunked_attention(
                absorbed,
                pages,
                pages[..., :rank],
                positions,
                torch.arange(self.start_position, self.start_position + prefix, device=query.device),
                scaling,
                None,
                access.attention_chunk_size,
                None if indices is None else topk_selection(indices, 0),
            )
            out = merge_by_lse(prefix_out, prefix_lse, out, lse)
        if access.mode == "capture":
            self._append(own_keys[0])
        elif access.mode == "recompute":
            access.recorded[self] = own_keys[0]
        return torch.einsum("bhtk,khv->bhtv", out, w_uv.to(out.dtype))

    @torch.no_grad()
    def _append(self, keys: torch.Tensor) -> None:
        if self.pages is None:
            self.pages = empty_state(keys, (1, self.capacity, keys.shape[-1]), self.device)
        end = self.length + keys.shape[0]
        self.pages[0, self.length : end] = keys.to(self.device)
        self.length = end

    def recompute_pairs(self, recorded, chunk_index: int, start: int, end: int):
        if self.pages.grad is None:
            return []
        return [(recorded, self.pages.grad[0, start:end].to(recorded.device, recorded.dtype, copy=True))]


class IndexerKeys:
    """`[1, tokens, index_head_dim]` DSA indexer keys of one index-computing layer (no gradient flows through them)."""

    differentiable = False

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = capacity
        self.device = device
        self.keys: torch.Tensor | None = None
        self.length = 0

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.keys is None else [self.keys]

    @torch.no_grad()
    def extend(self, access, keys: torch.Tensor) -> torch.Tensor:
        """The indexer's keys for this forward: the prompt's, then this forward's own `keys [batch, tokens, dim]`.

        During capture this forward's keys are written into the pages and a view is returned (no copy); a replay
        gets a transient concatenation, since members of a batch differ after the prompt.
        """
        if access.mode == "capture":
            if self.keys is None:
                self.keys = empty_state(keys, (1, self.capacity, keys.shape[-1]), self.device)
            end = self.length + keys.shape[1]
            self.keys[:, self.length : end] = keys.to(self.device)
            self.length = end
            return self.keys[:, :end].to(keys.device)
        prefix = self.keys[:, : access.prefix_length].to(keys.device)
        return torch.cat([prefix.expand(keys.shape[0], -1, -1), keys], dim=1)
