"""Multi-head latent attention (MLA: DeepSeek-V3, DeepSeek-V3.2, GLM-5): the latent pages.

MLA caches, per token, the compressed latent (`kv_lora_rank`, after `kv_a_layernorm`) and the shared rope key
(`qk_rope_head_dim`): 576 values per token on GLM-5, instead of per-head K/V. LongStraw keeps exactly that, as one
`[1, tokens, kv_lora_rank + qk_rope_head_dim]` page tensor, and never expands it back to per-head K/V. Instead
`kv_b_proj` is absorbed into the query and the output side (measured choice: docs/benchmarks.md, "MLA"): with
`W_uk, W_uv = kv_b_proj` split per head,

    q_h . k_h,j = (W_uk_h^T q_nope_h) . c_j + q_rope_h . k_rope_j        o_h = W_uv_h (sum_j p_hj c_j)

so the prefix is read as multi-query attention over `[c_j, k_rope_j]` (values `c_j`, a view of the same page):
no per-token projection of the prefix at all, and only the replayed tokens touch `kv_b_proj`. The absorbed weights
are obtained by running `kv_b_proj` on the identity, which works unchanged for LoRA and 4-bit base layers and keeps
their gradients (a bias: `absorbed_weights`). The layer hands its latent to the cache (`Cache.update(latent,
rope_key)`) before expanding it; [`StateAccess`] keeps it for this kind.

With DSA (`deepseek_v32`, `glm_moe_dsa`) the top-k selection reaches attention as `indices [batch, tokens, top_k]`
over absolute key positions and is applied to both the prefix and the replayed tokens; the indexer's own keys are
the `dsa_indexer` kind (`dsa.py`).
"""

from __future__ import annotations

import torch

from ..block_attention import AttentionScalars, KeyBlock, Visibility
from .placement import Pages, page_bytes
from .registry import LayerAccount, LayerState, find_child


def is_multi_head_latent_attention(module) -> bool:
    return hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "kv_b_proj") and hasattr(module, "kv_lora_rank")


def absorbed_weights(module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`W_uk [kv_lora_rank, heads, qk_nope_head_dim]`, `W_uv [kv_lora_rank, heads, v_head_dim]` and the value bias
    `b_v [heads, v_head_dim]` (zeros without a bias) of `kv_b_proj`.

    The key bias adds the same `q_nope_h . b_k_h` to all of a query's scores, which the softmax ignores; the value
    bias comes out of the softmax unchanged (its weights sum to one) and is added to the output.
    """
    rank = module.kv_lora_rank
    projection = module.kv_b_proj
    weight = projection.weight if hasattr(projection, "weight") else None
    dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.get_default_dtype()
    basis = torch.eye(rank, dtype=dtype, device=module.kv_a_layernorm.weight.device)
    nope = module.qk_nope_head_dim
    bias = projection(torch.zeros_like(basis[:1]))
    columns = (projection(basis) - bias).view(rank, -1, nope + module.v_head_dim)
    bias = bias.view(-1, nope + module.v_head_dim)
    return columns[..., :nope], columns[..., nope:], bias[:, nope:]


def absorb(module, query: torch.Tensor):
    """`query [batch, heads, tokens, nope + rope]` as multi-query attention over the latent pages: the absorbed query
    `[batch, heads, tokens, rank + rope]`, and the map from that attention's output (latents) to the heads' values."""
    w_uk, w_uv, value_bias = absorbed_weights(module)
    query_nope, query_rope = query.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    absorbed = torch.cat([torch.einsum("bhtn,khn->bhtk", query_nope, w_uk.to(query.dtype)), query_rope], dim=-1)

    def values(out: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bhtk,khv->bhtv", out, w_uv.to(out.dtype)) + value_bias.to(out.dtype)[:, None]

    return absorbed, values


class LatentPages(LayerState):
    """`[1, tokens, kv_lora_rank + qk_rope_head_dim]` latent pages of one MLA layer. Read-only after capture."""

    name = "mla_latent"
    layer_types = (None, "full_attention", "sliding_attention", "indexed_attention")
    roles = frozenset({"attention"})
    sharded_layer_types = layer_types
    needs_attention_interface = True

    @classmethod
    def find_mixer(cls, layer, layer_type):
        return find_child(layer, is_multi_head_latent_attention)

    @classmethod
    def account(cls, mixer, config, layer_type, dtype_bytes, exact, fp8_pages=False):
        dim = mixer.kv_lora_rank + mixer.qk_rope_head_dim  # one page tensor: one "head"
        per_token, per_page = page_bytes(1, dim, dtype_bytes, fp8_pages and not exact)
        return LayerAccount("mla_latent", per_token=per_token, per_page=per_page)

    @classmethod
    def attention_heads(cls, mixer, config):
        return getattr(mixer, "num_heads", None) or config.num_attention_heads

    @classmethod
    def step_attention_elements(cls, mixer, config):
        """Absorbed: every head's query over one latent head `[c, k_rope]`, whose values are the latents `c`."""
        latent, width = mixer.kv_lora_rank, mixer.kv_lora_rank + mixer.qk_rope_head_dim
        heads = cls.attention_heads(mixer, config)
        return heads * width, width + latent, heads * (latent + 1)

    @classmethod
    def prompt_score_tiles(cls, mixer, config, layer_type):
        """Absorbed MLA's chunks go through the fused kernel (values zero-padded to the keys' width); a DSA top-k's
        gathered keys are bounded like a score tile (`attention._Picked`)."""
        return getattr(config, "index_topk", None) is not None

    def __init__(self, mixer, layer_idx, layer_type, prompt):
        super().__init__(mixer, layer_idx, layer_type, prompt)
        self.pages = Pages(prompt.placement, prompt.num_tokens, fp8=prompt.fp8_pages)

    def tensors(self) -> list[torch.Tensor]:
        return self.pages.tensors()

    def attend(self, access, query, key, value, scaling, indices=None, sliding_window=None, **_):
        """Absorbed MLA of this forward's tokens over the latent pages and over themselves, as one softmax (within
        the layer's window on a sliding layer: Dots 3 Note's)."""
        module = self.mixer
        latents = self.own_latents(access)
        own_keys = access.own_entries(self, "latent", latents, dim=1)  # decoding: the earlier ones' pages first
        absorbed, values = absorb(module, query)
        own_values = [keys[..., : module.kv_lora_rank] for keys in own_keys]
        visibility = self.visibility(sliding_window)
        scalars = AttentionScalars(scaling, access.attention_chunk_size, visibility)
        out = access.state.attention(access, self, absorbed, own_keys, own_values, scalars, indices=indices)
        self.keep(access, key, value, latents=latents)
        return values(out)

    def page_block(self, dtype, limit=None, indices=None):
        limit = self.pages.length if limit is None else limit
        if limit == 0:
            return (), ()
        positions = self.prompt.positions(0, limit)
        picked = None if indices is None else self.prompt.local_indices(indices.long())  # global -> the pages here
        block = KeyBlock(positions, shared=True, picked=picked, dequantize=self.dequantizer(dtype))
        data = self.pages.read(limit)
        return (block,), (data, data[..., : self.mixer.kv_lora_rank])  # the values are the latents' first columns

    def visibility(self, sliding_window):
        return Visibility(sliding_window)

    def accumulate_page_gradients(self, d_keys, d_values):
        self.pages.accumulate_grad(d_keys)
        if d_values is not None:  # None: a DSA block gave the values' gradient inside the keys' (`blocks_backward`)
            self.pages.accumulate_grad(d_values)

    def own_latents(self, access) -> torch.Tensor:
        """`[batch, tokens, rank + rope]`: the latents and rope keys this forward's layer handed to the cache."""
        latent, rope_key = access.cache_inputs[self.layer_idx]  # [batch, 1, tokens, rank], [batch, 1, tokens, rope]
        return torch.cat([latent, rope_key], dim=-1)[:, 0]

    def keep(self, access, key, value, latents: torch.Tensor | None = None, **_) -> None:
        """This forward's own latents (`own_latents`, unless given): appended to the pages by a capture, recorded
        with their graph by a recompute; nothing otherwise."""
        if access.mode not in ("capture", "recompute"):
            return
        latents = self.own_latents(access) if latents is None else latents
        if access.mode == "capture":
            self.pages.append(latents[:1])
        else:
            access.recorded[self] = latents[0]

    def dequantizer(self, dtype: torch.dtype):
        """fp8 pages: each chunk of latents (keys) in `dtype`, with their pages' scales (one per 64-token page), and
        its first `kv_lora_rank` columns as the values, as attention reads them; None in the model dtype."""
        if not self.pages.fp8:
            return None

        def dequantize(keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor):
            keys = self.pages.dequantize(keys, index, dtype)
            return keys, keys[..., : values.shape[-1]]  # the values are the latents' first columns

        return dequantize

    def recompute_pairs(self, recorded, chunk_index, start, end):
        leaf = self.pages.data
        if leaf is None or leaf.grad is None:
            return []
        return [(recorded, leaf.grad[0, start:end].to(recorded.device, recorded.dtype, copy=True))]
