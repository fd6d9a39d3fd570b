"""The prefix-suffix attention: chunked online softmax, its recomputing backward, and the LSE merge."""

import pytest
import torch

from trl_longstraw import attention
from trl_longstraw.attention import CAUSAL, ChunkedAttention, Visibility, add_sinks, chunked_attention, merge_by_lse

VISIBILITIES = {
    "causal": CAUSAL,
    "window": Visibility(sliding_window=5),
    "chunked": Visibility(chunk_size=4, chunk_origin=3),
}


def reference_attention(q, k, v, q_positions, k_positions, scaling, visibility=CAUSAL, softcap=None):
    """Plain softmax attention with repeated kv heads, masked by absolute position."""
    groups = q.shape[1] // k.shape[0]
    keys, values = k.repeat_interleave(groups, 0)[None], v.repeat_interleave(groups, 0)[None]
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = k_positions[None, :] <= q_positions[:, None]
    if visibility.sliding_window is not None:
        visible &= (q_positions[:, None] - k_positions[None, :]) < visibility.sliding_window
    if visibility.chunk_size is not None:
        origin = visibility.chunk_origin
        visible &= (k_positions[None, :] - origin) // visibility.chunk_size == (
            q_positions[:, None] - origin
        ) // visibility.chunk_size
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), values), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("visibility", list(VISIBILITIES))
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_attention_matches_softmax(visibility, chunk, softcap):
    torch.manual_seed(0)
    visibility = VISIBILITIES[visibility]
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k, v = torch.randn(2, 13, 8, dtype=torch.float64), torch.randn(2, 13, 8, dtype=torch.float64)
    q_positions, k_positions = torch.arange(13, 19), torch.arange(13)
    out, lse = chunked_attention(q, k, v, q_positions, k_positions, 0.3, visibility, chunk, softcap=softcap)
    want_out, want_lse = reference_attention(q, k, v, q_positions, k_positions, 0.3, visibility, softcap)
    visible = torch.isfinite(want_lse)
    assert torch.allclose(out[visible], want_out[visible], atol=1e-12)
    assert torch.equal(visible, torch.isfinite(lse))
    assert torch.all(out[~visible] == 0)


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("row_block", [1024, 3])  # 3: the backward tiles the query rows too
@pytest.mark.parametrize("visibility", list(VISIBILITIES))
def test_chunked_attention_gradients_float64(visibility, row_block, softcap, monkeypatch):
    monkeypatch.setattr(attention, "BACKWARD_ROW_BLOCK", row_block)
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 9, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 9, 3, dtype=torch.float64, requires_grad=True)
    q_positions = torch.tensor([6, 7, 8, 9, 10])
    k_positions = torch.arange(9)
    visibility = VISIBILITIES[visibility]
    fn = lambda q, k, v: ChunkedAttention.apply(  # noqa: E731
        q, k, v, q_positions, k_positions, 0.5, visibility, 2, softcap
    )
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_merge_by_lse_equals_attention_over_the_union():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    k, v = torch.randn(2, 20, 8, dtype=torch.float64), torch.randn(2, 20, 8, dtype=torch.float64)
    positions = torch.arange(20)
    q_positions = torch.arange(17, 20)
    whole, whole_lse = reference_attention(q, k, v, q_positions, positions, 0.35)
    prefix = chunked_attention(q, k[:, :17], v[:, :17], q_positions, positions[:17], 0.35, CAUSAL, 4)
    suffix = chunked_attention(q, k[:, 17:], v[:, 17:], q_positions, positions[17:], 0.35, CAUSAL, 4)
    out, lse = merge_by_lse(prefix[0], prefix[1], *suffix)
    assert torch.allclose(out, whole, atol=1e-12) and torch.allclose(lse, whole_lse, atol=1e-12)


def test_merge_by_lse_keeps_rows_that_saw_no_key_at_zero():
    out = torch.randn(1, 2, 3, 4)
    no_keys = torch.full((1, 2, 3), float("-inf"))
    merged, lse = merge_by_lse(out, no_keys, torch.zeros_like(out), no_keys)
    assert torch.all(merged == 0) and torch.all(torch.isneginf(lse))


def test_sinks_join_the_softmax_denominator_with_their_gradient():
    """gpt-oss: softmax over [scores, sink] with the sink's column dropped, as its eager attention computes it."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    k, v = torch.randn(2, 10, 8, dtype=torch.float64), torch.randn(2, 10, 8, dtype=torch.float64)
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    q_positions, positions = torch.arange(7, 10), torch.arange(10)
    out, lse = chunked_attention(q, k, v, q_positions, positions, 0.4, CAUSAL, 3)
    got = add_sinks(out, lse, sinks)
    scores = torch.matmul(q, k.repeat_interleave(2, 0)[None].transpose(-1, -2)) * 0.4
    scores = scores.masked_fill(positions[None, :] > q_positions[:, None], float("-inf"))
    combined = torch.cat([scores, sinks[None, :, None, None].expand(1, 4, 3, 1)], dim=-1)
    want = torch.matmul(torch.softmax(combined, -1)[..., :-1], v.repeat_interleave(2, 0)[None])
    assert torch.allclose(got, want, atol=1e-12)
    got.sum().backward()
    want_grad = torch.autograd.grad(want.sum(), sinks)[0]
    assert torch.allclose(sinks.grad, want_grad, atol=1e-12)


@pytest.mark.parametrize("visibility", ["causal", "window"])
def test_fused_cpu_kernel_agrees_with_the_plain_torch_chunks(visibility):
    """The fused flash path (all keys visible, or a square causal block) gives the plain-torch chunks' result."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 6, 8)
    k, v = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    positions = torch.arange(6)
    fused = chunked_attention(q, k, v, positions, positions, 0.3, VISIBILITIES[visibility], 64)
    plain = chunked_attention(
        q.double(), k.double(), v.double(), positions, positions, 0.3, VISIBILITIES[visibility], 64
    )
    assert torch.allclose(fused[0].double(), plain[0], atol=1e-5) and torch.allclose(
        fused[1].double(), plain[1], atol=1e-5
    )


def test_gradients_reach_the_prefix_leaves():
    q = torch.randn(1, 2, 2, 4, requires_grad=True)
    k = torch.randn(1, 6, 4, requires_grad=True)
    v = torch.randn(1, 6, 4, requires_grad=True)
    out, lse = chunked_attention(q, k, v, torch.tensor([6, 7]), torch.arange(6), 0.5, CAUSAL, 4)
    (out.sum() + lse.sum()).backward()
    assert k.grad.shape == k.shape and v.grad.abs().sum() > 0
