"""The prefix-suffix attention: blocks merged by log-sum-exp as one softmax, its backward from the global output and
log-sum-exp, the fused CPU kernels against plain torch, visibility, soft-capping and sinks."""

import gc
import weakref

import pytest
import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from trl_longstraw import block_attention
from trl_longstraw.block_attention import (
    CAUSAL,
    AttentionScalars,
    KeyBlock,
    Visibility,
    attention_over_blocks,
    merge_by_lse,
)

VISIBILITIES = {
    "causal": CAUSAL,
    "window": Visibility(sliding_window=5),
    "chunked": Visibility(chunk_size=4, chunk_origin=3),
}
BATCH, HEADS, KV_HEADS, TOKENS, PREFIX, DIM = 2, 4, 2, 5, 9, 8


def inputs(dtype, seed=0, value_dim=DIM):
    """Queries at positions 9..13 over 9 shared prompt keys (positions 0..8) and their own 5 keys per batch row."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_(True)

    q = randn(BATCH, HEADS, TOKENS, DIM)
    prefix_k, prefix_v = randn(KV_HEADS, PREFIX, DIM), randn(KV_HEADS, PREFIX, value_dim)
    own_k, own_v = randn(BATCH * KV_HEADS, TOKENS, DIM), randn(BATCH * KV_HEADS, TOKENS, value_dim)
    sinks = randn(HEADS)
    return q, prefix_k, prefix_v, own_k, own_v, sinks


def ours(q, prefix_k, prefix_v, own_k, own_v, sinks, visibility, chunk, softcap=None, picked=None):
    """`picked [batch, tokens, k]`: a DSA top-k in key indices over [prompt keys, own keys], as MLA passes it."""
    q_positions = torch.arange(PREFIX, PREFIX + TOKENS)  # on the host, as LongStraw builds positions
    own_picked = None if picked is None else picked - PREFIX
    blocks = [
        (prefix_k, prefix_v, KeyBlock(torch.arange(PREFIX), shared=True, picked=picked)),
        (own_k, own_v, KeyBlock(q_positions, shared=False, picked=own_picked)),
    ]
    return attention_over_blocks(
        q, blocks, q_positions, AttentionScalars(0.3, chunk, visibility, softcap), sinks=sinks
    )


def reference(q, prefix_k, prefix_v, own_k, own_v, sinks, visibility, softcap=None, picked=None):
    """Plain softmax over [prompt keys, own keys] per batch row, kv heads repeated, masked by absolute position."""
    groups = HEADS // KV_HEADS
    outs = []
    for b in range(BATCH):
        keys = torch.cat([prefix_k, own_k.view(BATCH, KV_HEADS, TOKENS, -1)[b]], dim=1).repeat_interleave(groups, 0)
        values = torch.cat([prefix_v, own_v.view(BATCH, KV_HEADS, TOKENS, -1)[b]], 1).repeat_interleave(groups, 0)
        scores = torch.matmul(q[b], keys.transpose(-1, -2)) * 0.3
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos, k_pos = torch.arange(PREFIX, PREFIX + TOKENS), torch.arange(PREFIX + TOKENS)
        visible = k_pos[None, :] <= q_pos[:, None]
        if visibility.sliding_window is not None:
            visible &= (q_pos[:, None] - k_pos[None, :]) < visibility.sliding_window
        if visibility.chunk_size is not None:
            size, origin = visibility.chunk_size, visibility.chunk_origin
            visible &= (k_pos[None, :] - origin) // size == (q_pos[:, None] - origin) // size
        if picked is not None:  # a mask over every key, as transformers applies a DSA top-k
            visible = visible & torch.zeros(TOKENS, PREFIX + TOKENS, dtype=torch.bool).scatter(-1, picked[b], True)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks[:, None, None].expand(HEADS, TOKENS, 1)], dim=-1)
        probs = torch.softmax(scores, -1)
        outs.append(torch.matmul(probs[..., : values.shape[1]], values))
    return torch.stack(outs)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("visibility", list(VISIBILITIES))
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_blocks_equal_one_softmax_over_their_union(visibility, chunk, softcap, sinks):
    q, prefix_k, prefix_v, own_k, own_v, sink = inputs(torch.float64)
    sink = sink if sinks else None
    got = ours(q, prefix_k, prefix_v, own_k, own_v, sink, VISIBILITIES[visibility], chunk, softcap)
    want = reference(q, prefix_k, prefix_v, own_k, own_v, sink, VISIBILITIES[visibility], softcap)
    assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("row_block", [1024, 3])  # 3: the backward tiles the query rows too
@pytest.mark.parametrize("visibility", list(VISIBILITIES))
def test_gradients_float64(visibility, row_block, softcap, monkeypatch):
    """Plain-torch path (float64): gradcheck on queries, prompt keys/values, own keys/values and sinks."""
    monkeypatch.setattr(block_attention, "BACKWARD_ROW_BLOCK", row_block)
    tensors = inputs(torch.float64)

    def fn(*tensors):
        return ours(*tensors, VISIBILITIES[visibility], 2, softcap)

    # fast mode: per input, v^T J u for random u, v against finite differences; its default atol is scaled by the
    # projections, so the tolerances are set here (a 1e-3 relative error in one gradient fails; slow mode's defaults
    # let it pass)
    assert torch.autograd.gradcheck(fn, tensors, fast_mode=True, atol=1e-8, rtol=1e-5)


@pytest.mark.parametrize("chunk", [3, 64])
@pytest.mark.parametrize("sinks", [False, True])
def test_fused_cpu_kernels_agree_with_plain_torch(chunk, sinks):
    """float32 goes through the fused CPU flash forward and backward (prompt chunks all visible, own tokens a square
    causal block), float64 through plain torch: outputs and every gradient agree to fp32 rounding."""
    fused_inputs, plain_inputs = inputs(torch.float32), inputs(torch.float64)
    grad_out = torch.randn(BATCH, HEADS, TOKENS, DIM, dtype=torch.float64)
    results = []
    for tensors in (fused_inputs, plain_inputs):
        sink = tensors[5] if sinks else None
        out = ours(*tensors[:5], sink, CAUSAL, chunk)
        out.backward(grad_out.to(out.dtype))
        results.append(
            [out.double()] + [t.grad.double() for t in tensors[:5]] + ([sink.grad.double()] if sinks else [])
        )
    for fused, plain in zip(*results, strict=True):
        assert torch.allclose(fused, plain, atol=2e-5, rtol=1e-4), (fused - plain).abs().max()


# A window or chunking wider than every distance here drops no pair: the same fused blocks as plain causal attention
WIDE = {
    "causal": CAUSAL,
    "wide-window": Visibility(sliding_window=PREFIX + TOKENS),
    "wide-chunks": Visibility(chunk_size=64),
}


@pytest.fixture
def fused_backward_calls(monkeypatch) -> list[bool]:
    """The `causal` flag of every call of the fused backward kernel, in order."""
    calls = []
    kernel = block_attention._fused_backward_kernel

    def counting(*args, **kwargs):
        calls.append(args[6])  # causal
        return kernel(*args, **kwargs)

    monkeypatch.setattr(block_attention, "_fused_backward_kernel", counting)
    return calls


@pytest.mark.parametrize("visibility", list(WIDE))
@pytest.mark.parametrize("chunk", [64, 3])
def test_fused_path_is_taken_for_float32_on_cpu(fused_backward_calls, chunk, visibility):
    """Prompt chunks all visible go through the fused kernel, and so do the own keys as one square causal block, even
    when they outnumber the attention chunk (cut there, their causal pieces would not be square); a window or chunking
    that drops none of a block's pairs does not change that."""
    q, prefix_k, prefix_v, own_k, own_v, _ = inputs(torch.float32)
    ours(q, prefix_k, prefix_v, own_k, own_v, None, WIDE[visibility], chunk).sum().backward()
    assert sorted(fused_backward_calls) == [False] * -(-PREFIX // chunk) + [
        True
    ]  # the prompt's chunks, then the own block whole


@pytest.mark.parametrize("chunk", [64, 3])
def test_chunks_the_fused_kernels_take_build_no_mask(fused_backward_calls, chunk, monkeypatch):
    """Choosing a chunk's kernel reads its positions' ends only: a chunk the fused kernels take (the prompt's, all
    visible; the own keys, one square causal block) builds no `[rows, keys]` mask, forward or backward."""
    masks = []
    pairs = block_attention.visible_pairs
    monkeypatch.setattr(block_attention, "visible_pairs", lambda *args: masks.append(args) or pairs(*args))
    ours(*inputs(torch.float32)[:5], None, CAUSAL, chunk).sum().backward()
    assert sorted(fused_backward_calls) == [False] * -(-PREFIX // chunk) + [True]
    assert masks == []


def test_a_window_edge_takes_plain_tiles_and_the_chunks_inside_it_the_fused_kernel(fused_backward_calls):
    """Window 11, queries at 9..13, prompt keys 0..8 in chunks of 3: keys 0-2 are beyond query 13's window (plain
    tiles), keys 3-5 and 6-8 inside every query's (fused); the own block's pairs are all within 11 (fused, causal)."""
    fused = inputs(torch.float32)
    ours(*fused[:5], None, Visibility(sliding_window=11), 3).sum().backward()
    assert sorted(fused_backward_calls) == [False, False, True]
    plain = inputs(torch.float64)
    got = ours(*fused[:5], None, Visibility(sliding_window=11), 3)
    want = reference(*plain[:5], None, Visibility(sliding_window=11))
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_the_cuda_kernel_calls_are_well_formed(monkeypatch):
    """The CUDA pair (memory-efficient forward and backward) called as `BlockAttention` calls them, on meta tensors
    (shapes and arguments only: the numbers are checked on a GPU, tests/test_gpu.py). Its log-sum-exp comes padded
    to a multiple of 32 rows and must be cut to the rows."""
    query = torch.empty(4, 2, 100, 32, device="meta")
    key, value = torch.empty(4, 2, 300, 32, device="meta"), torch.empty(4, 2, 300, 32, device="meta")
    out, lse = block_attention._fused_forward_kernel(query, key, value, False, 0.2)
    assert out.shape == query.shape and lse.shape == (4, 2, 100) and lse.dtype == torch.float32
    dq, dk, dv = block_attention._fused_backward_kernel(out, query, key, value, out, lse, False, 0.2)
    assert (dq.shape, dk.shape, dv.shape) == (query.shape, key.shape, value.shape)


def test_the_cuda_backward_gets_its_operands_laid_out_as_its_forward_returns_them():
    """The causal own block's output comes `[groups, heads, rows, dv]`-contiguous and its log-sum-exp compact; the
    CUDA kernel reads the output at a row stride of `heads * dv` and wants log-sum-exp strides multiple of 8."""
    out = torch.randn(3, 4, 5, 6)  # [batch, heads, rows, dv], rows-within-head contiguous
    lse = torch.randn(3, 4, 5)
    laid_out, padded = block_attention.efficient_backward_operands(out, lse)
    assert torch.equal(laid_out, out) and laid_out.transpose(1, 2).is_contiguous()
    assert laid_out.stride(2) == 4 * 6  # a row of every head, then the next row
    assert padded.shape == (3, 4, 32) and padded.stride(0) % 8 == 0 and padded.stride(1) % 8 == 0
    assert torch.equal(padded[..., :5], lse) and torch.all(padded[..., 5:] == 0)


def test_values_narrower_than_the_keys_go_through_the_fused_kernels(fused_backward_calls):
    """MLA reads latent pages as keys and their first `rank` columns as values: zero-padded to the keys' width, they
    take the fused kernels (three prompt chunks, the own causal block), and the output and every gradient equal the
    plain-torch path's (float64) and the reference's."""
    fused, plain = inputs(torch.float32, value_dim=5), inputs(torch.float64, value_dim=5)
    grad_out = torch.randn(BATCH, HEADS, TOKENS, 5, dtype=torch.float64)
    results = []
    for tensors in (fused, plain):
        out = ours(*tensors[:5], None, CAUSAL, 4)
        out.backward(grad_out.to(out.dtype))
        results.append([out.double()] + [t.grad.double() for t in tensors[:5]])
    assert sorted(fused_backward_calls) == [False, False, False, True]
    assert torch.allclose(results[0][0], reference(*plain[:5], None, CAUSAL), atol=1e-5)
    for got, want in zip(*results, strict=True):
        assert got.shape == want.shape and torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()


def top_k(k: int, seed: int = 1) -> torch.Tensor:
    """A DSA-like top-k `[batch, tokens, k]` over [prompt keys, own keys]: each token's own key and `k - 1` others,
    some of them later tokens (invisible: a top-k over fewer visible keys than `k` picks some, masked)."""
    generator = torch.Generator().manual_seed(seed)
    picked = torch.empty(BATCH, TOKENS, k, dtype=torch.long)
    for b in range(BATCH):
        for t in range(TOKENS):
            others = torch.randperm(PREFIX + TOKENS, generator=generator)
            picked[b, t] = torch.cat([torch.tensor([PREFIX + t]), others[others != PREFIX + t][: k - 1]])
    return picked


@pytest.fixture(params=["pages-here", "pages-elsewhere"])
def page_placement(request, monkeypatch):
    """ "pages-elsewhere": the prompt's pages as host-resident state on a GPU has them, on another device than the
    queries, so each picked entry is staged once before the gathers (forced here: this machine has one device)."""
    if request.param == "pages-elsewhere":
        monkeypatch.setattr(block_attention, "pages_elsewhere", lambda keys, q: True)
    return request.param


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("visibility", ["causal", "window"])
@pytest.mark.parametrize("chunk", [1, 64])  # 1: one query token per gathering step
@pytest.mark.usefixtures("page_placement")
def test_dsa_top_k_reads_only_the_picked_keys(chunk, visibility, softcap):
    """The gathered path (each token's picked keys only) equals a softmax over every key masked by the top-k."""
    tensors = inputs(torch.float64)
    picked = top_k(6)
    got = ours(*tensors[:5], None, VISIBILITIES[visibility], chunk, softcap, picked=picked)
    want = reference(*tensors[:5], None, VISIBILITIES[visibility], softcap, picked=picked)
    assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("chunk", [1, 64])
@pytest.mark.usefixtures("page_placement")
def test_dsa_top_k_gradients_float64(chunk, softcap):
    """gradcheck of the gathered path: queries, prompt and own keys and values (gradients scattered back to the
    picked entries, summed where several tokens picked one), and sinks."""
    tensors = inputs(torch.float64)
    picked = top_k(6, seed=2)

    def fn(*tensors):
        return ours(*tensors, VISIBILITIES["window"], chunk, softcap, picked=picked)

    assert torch.autograd.gradcheck(fn, tensors, fast_mode=True, atol=1e-8, rtol=1e-5)


def test_dsa_top_k_agrees_in_float32_with_float64():
    """fp32 through the gathered path (no fused kernel takes a top-k) against float64: output and gradients."""
    picked = top_k(6, seed=3)
    grad_out = torch.randn(BATCH, HEADS, TOKENS, DIM, dtype=torch.float64)
    results = []
    for tensors in (inputs(torch.float32), inputs(torch.float64)):
        out = ours(*tensors[:5], None, CAUSAL, 4, picked=picked)
        out.backward(grad_out.to(out.dtype))
        results.append([out.double()] + [t.grad.double() for t in tensors[:5]])
    for single, double in zip(*results, strict=True):
        assert torch.allclose(single, double, atol=2e-5, rtol=1e-4), (single - double).abs().max()


def test_dsa_picks_are_freed_by_activation_checkpointing_and_recomputed_for_backward():
    """The top-k a forward builds is saved for backward, not kept beside it: under non-reentrant checkpointing it
    dies with the layer's forward (one `[tokens, k]` index tensor per layer otherwise stays for the whole replay), and
    the backward's recomputed one gives the gradients of the unchecked run."""
    tensors = inputs(torch.float64)
    built = []

    def layer(q, prefix_k, prefix_v, own_k, own_v):
        picked = top_k(6, seed=2)  # made inside the layer, as the DSA indexer's selection is
        built.append(weakref.ref(picked))
        return ours(q, prefix_k, prefix_v, own_k, own_v, None, CAUSAL, 4, picked=picked)

    grad_out = torch.randn(BATCH, HEADS, TOKENS, DIM, dtype=torch.float64)
    want = torch.autograd.grad(layer(*tensors[:5]), tensors[:5], grad_out)
    out = torch.utils.checkpoint.checkpoint(layer, *tensors[:5], use_reentrant=False)
    gc.collect()
    assert built[-1]() is None
    got = torch.autograd.grad(out, tensors[:5], grad_out)
    assert len(built) == 3  # the recompute built it again
    for mine, theirs in zip(got, want, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("top_k", [False, True])
def test_a_row_that_sees_no_key_gets_zero_output_and_gradients(top_k):
    """A block's rows past the window of all its keys (and without a block of their own here) see nothing: `o = 0`,
    `lse = -inf`, and the backward, which subtracts that `lse`, must give them zero gradients, not NaN."""
    q, prefix_k, prefix_v, *_ = inputs(torch.float64)
    q_positions = torch.arange(PREFIX, PREFIX + TOKENS)  # 9..13: with a window of 3, rows 11..13 see no prompt key
    picked = torch.arange(PREFIX - 3, PREFIX).expand(BATCH, TOKENS, 3) if top_k else None  # keys 6..8, every row

    def fn(q, prefix_k, prefix_v):
        blocks = [(prefix_k, prefix_v, KeyBlock(torch.arange(PREFIX), shared=True, picked=picked))]
        return attention_over_blocks(q, blocks, q_positions, AttentionScalars(0.3, 4, Visibility(sliding_window=3)))

    out = fn(q, prefix_k, prefix_v)
    out.backward(torch.randn_like(out))
    assert torch.all(out[:, :, 2:] == 0) and out[:, :, :2].abs().sum() > 0
    assert torch.all(q.grad[:, :, 2:] == 0) and torch.isfinite(q.grad).all()
    assert torch.isfinite(prefix_k.grad).all() and torch.isfinite(prefix_v.grad).all()
    assert torch.autograd.gradcheck(fn, (q, prefix_k, prefix_v), fast_mode=True, atol=1e-8, rtol=1e-5)


def test_merge_by_lse_keeps_rows_that_saw_no_key_at_zero():
    out = torch.randn(1, 2, 3, 4)
    no_keys = torch.full((1, 2, 3), float("-inf"))
    merged, lse = merge_by_lse(out, no_keys, torch.zeros_like(out), no_keys)
    assert torch.all(merged == 0) and torch.all(torch.isneginf(lse))


def test_bf16_under_autocast_accumulates_like_fp32(device="cpu"):
    """The function disables autocast inside, forward and backward, and accumulates in fp32: bf16 inputs give the
    fp32 output and gradients to bf16 rounding of the inputs, not of every intermediate (tests/test_gpu.py runs this
    under CUDA autocast)."""
    fp32 = [t.detach().to(device).requires_grad_(True) for t in inputs(torch.float32)]
    bf16 = [t.detach().to(torch.bfloat16).requires_grad_(True) for t in fp32]
    with torch.autocast(device, dtype=torch.bfloat16):
        got = ours(*bf16[:5], bf16[5], CAUSAL, 4)
        got.float().square().sum().backward()
    rounded = [t.detach().to(torch.bfloat16).float().requires_grad_(True) for t in fp32]
    want = ours(*rounded[:5], rounded[5], CAUSAL, 4)
    want.square().sum().backward()
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 1e-2
    for ours_bf16, fp32_of_rounded in zip(bf16, rounded, strict=True):
        scale = fp32_of_rounded.grad.abs().max()
        assert (ours_bf16.grad.float() - fp32_of_rounded.grad).abs().max() <= 2e-2 * scale


def test_pages_elsewhere_stage_each_picked_entry_once(monkeypatch):
    """Host-resident pages cross once per distinct entry picked, not once per query that picked it."""
    monkeypatch.setattr(block_attention, "pages_elsewhere", lambda keys, q: True)
    q, pages, _, _, _, _ = inputs(torch.float64)
    picked = top_k(6, seed=5)
    block = KeyBlock(torch.arange(PREFIX), shared=True, picked=picked)
    staged = block_attention._Picked(
        q, pages, pages, block, torch.arange(PREFIX, PREFIX + TOKENS), AttentionScalars(1.0, 64)
    )
    prompt_picks = picked[picked < PREFIX]
    distinct = set(prompt_picks.tolist())
    assert distinct <= set(staged.entries.tolist()) <= distinct | {0}  # 0: where a token picked fewer here
    assert staged.keys.shape[1] == staged.entries.numel() < prompt_picks.numel()


@pytest.mark.usefixtures("page_placement")
def test_dsa_top_k_with_values_that_are_the_keys_first_columns():
    """MLA passes its latent pages as keys and their first columns as values (one tensor): one gather, and both
    gradients land in the pages, as with two separate tensors."""
    tensors = inputs(torch.float64, value_dim=DIM)
    q = tensors[0]
    picked = top_k(6, seed=4)
    grad_out = torch.randn(BATCH, HEADS, TOKENS, 5, dtype=torch.float64)
    pages, own = tensors[1], tensors[3]
    ours(q, pages, pages[..., :5], own, own[..., :5], None, CAUSAL, 4, picked=picked).backward(grad_out)
    shared = [pages.grad, own.grad]
    separate = [t.detach().clone().requires_grad_() for t in (pages, pages[..., :5], own, own[..., :5])]
    ours(q.detach(), *separate, None, CAUSAL, 4, picked=picked).backward(grad_out)
    for got, (keys, values) in zip(shared, (separate[:2], separate[2:]), strict=True):
        want = keys.grad + torch.nn.functional.pad(values.grad, (0, DIM - 5))
        assert torch.allclose(got, want, atol=1e-12)


class _Crossings(TorchDispatchMode):
    """Whether the source of each copy onto another device is contiguous."""

    def __init__(self):
        super().__init__()
        self.contiguous_sources = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            target, source = args[0].device, args[1]
        elif func is torch.ops.aten._to_copy.default:
            source = args[0]
            target = torch.device(kwargs.get("device") or source.device)
        else:
            return func(*args, **kwargs)
        if target != source.device:
            self.contiguous_sources.append(source.is_contiguous())
        return func(*args, **kwargs)


@pytest.mark.parametrize("latents", [False, True])
def test_host_pages_cross_to_the_compute_device_contiguous_and_once(latents):
    """Staging a chunk of `[heads, entries, d]` pages that live elsewhere (host-resident state) copies only contiguous
    memory across, each head's entries of the chunk, so PyTorch makes no pageable host copy of it first; MLA's values,
    the latents' first columns, are not staged again beside them. ("meta" stands in for the GPU.)"""
    heads = 1 if latents else KV_HEADS
    keys = torch.randn(heads, PREFIX, DIM)
    values = keys[..., : DIM - 2] if latents else torch.randn(heads, PREFIX, DIM)
    q = torch.empty(BATCH, HEADS, TOKENS, DIM, device="meta")
    fold = block_attention._Fold(BATCH, HEADS, TOKENS, heads, shared=True)
    block = KeyBlock(torch.arange(PREFIX), shared=True)
    with _Crossings() as crossings:
        positions = torch.arange(PREFIX, PREFIX + TOKENS)
        key_chunks = block_attention._KeyChunks(q, keys, values, block, fold, positions, AttentionScalars(1.0, 4))
        chunks = [(span, key_chunks.chunk(span)) for span in key_chunks.spans]
    assert [span for span, _ in chunks] == [slice(0, 4), slice(4, 8), slice(8, 9)]
    assert all(chunk.keys.device.type == chunk.values.device.type == "meta" for _, chunk in chunks)
    assert crossings.contiguous_sources == [True] * len(chunks) * heads * (1 if latents else 2)
