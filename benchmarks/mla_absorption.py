"""Why LongStraw absorbs `kv_b_proj` for MLA: one replay's prefix attention, absorbed vs re-projected per chunk.

    .venv/bin/python benchmarks/mla_absorption.py

Both compute the same attention of R replayed queries over a prefix of P latent pages (GLM-5-like head geometry at
reduced width: 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128), forward + backward into the queries and
`kv_b_proj`:

- absorbed (what `state/mla.py` does): queries pulled into the 576-wide latent space, multi-query attention over the
  pages themselves, output projected back; the prefix is never projected.
- re-projected: each chunk of latent pages is expanded to per-head K/V by `kv_b_proj` and attended to, under
  activation checkpointing per chunk so the expanded K/V never exist for the whole prefix at once.
"""

from __future__ import annotations

import time

import torch
from torch.utils.checkpoint import checkpoint

from trl_longstraw.block_attention import AttentionScalars, KeyBlock, attention_over_blocks, merge_by_lse

HEADS, RANK, ROPE, NOPE, VDIM, CHUNK = 16, 512, 64, 128, 128, 2048


def absorbed(q_nope, q_rope, pages, kv_b, positions, page_positions):
    """The library's path: absorbed queries over the latent pages as one shared key block (through PyTorch's fused
    kernels, the values zero-padded to the keys' width; the re-projected chunks below run in plain torch)."""
    w = kv_b.weight.t().view(RANK, HEADS, NOPE + VDIM)
    w_uk, w_uv = w[..., :NOPE], w[..., NOPE:]
    q = torch.cat([torch.einsum("bhtn,khn->bhtk", q_nope, w_uk), q_rope], dim=-1)
    block = (pages, pages[..., :RANK], KeyBlock(page_positions, shared=True))
    out = attention_over_blocks(q, [block], positions, AttentionScalars(0.1, CHUNK))
    return torch.einsum("bhtk,khv->bhtv", out, w_uv)


def reprojected(q_nope, q_rope, pages, kv_b, positions, page_positions):
    """Per chunk: latent pages expanded to per-head K/V by `kv_b_proj`, attention `(o, lse)` in plain torch (every
    prefix key is visible to the replayed queries), chunks merged by log-sum-exp."""
    q = torch.cat([q_nope, q_rope], dim=-1)

    def chunk_attention(q, latent, rope):
        kv = kv_b(latent).view(-1, HEADS, NOPE + VDIM).transpose(0, 1)
        keys = torch.cat([kv[..., :NOPE], rope.expand(HEADS, -1, -1)], dim=-1)
        scores = torch.einsum("bhtd,hnd->bhtn", q, keys) * 0.1
        lse = torch.logsumexp(scores, dim=-1)
        return torch.einsum("bhtn,hnv->bhtv", torch.exp(scores - lse[..., None]), kv[..., NOPE:]), lse

    out = lse = None
    for start in range(0, pages.shape[1], CHUNK):
        latent, rope = pages[0, start : start + CHUNK, :RANK], pages[:, start : start + CHUNK, RANK:]
        part_out, part_lse = checkpoint(chunk_attention, q, latent, rope, use_reentrant=False)
        out, lse = (part_out, part_lse) if out is None else merge_by_lse(out, lse, part_out, part_lse)
    return out


def measure(fn, prefix, replay):
    torch.manual_seed(0)
    kv_b = torch.nn.Linear(RANK, HEADS * (NOPE + VDIM), bias=False)
    pages = torch.randn(1, prefix, RANK + ROPE)
    q_nope = torch.randn(1, HEADS, replay, NOPE, requires_grad=True)
    q_rope = torch.randn(1, HEADS, replay, ROPE, requires_grad=True)
    positions = torch.arange(prefix, prefix + replay)
    begin = time.perf_counter()
    fn(q_nope, q_rope, pages, kv_b, positions, torch.arange(prefix)).sum().backward()
    return time.perf_counter() - begin


def check_same_attention() -> float:
    torch.manual_seed(0)
    kv_b = torch.nn.Linear(RANK, HEADS * (NOPE + VDIM), bias=False)
    pages, positions = torch.randn(1, 3000, RANK + ROPE, dtype=torch.float64), torch.arange(3000, 3008)
    q_nope, q_rope = (
        torch.randn(1, HEADS, 8, NOPE, dtype=torch.float64),
        torch.randn(1, HEADS, 8, ROPE, dtype=torch.float64),
    )
    kv_b = kv_b.double()
    a = absorbed(q_nope, q_rope, pages, kv_b, positions, torch.arange(3000))
    b = reprojected(q_nope, q_rope, pages, kv_b, positions, torch.arange(3000))
    return (a - b).abs().max().item()


def main() -> None:
    torch.set_num_threads(2)
    print(f"max |absorbed - re-projected| (float64): {check_same_attention():.1e}")
    print(f"{'P':>6} {'R':>5} {'absorbed s':>11} {'re-projected s':>15} {'speed-up':>9}")
    for prefix in (4096, 16384):
        for replay in (16, 256):
            a, b = measure(absorbed, prefix, replay), measure(reprojected, prefix, replay)
            print(f"{prefix:>6} {replay:>5} {a:>11.3f} {b:>15.3f} {b / a:>8.1f}x")


if __name__ == "__main__":
    main()
