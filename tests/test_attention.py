"""The prefix-suffix attention: chunked online softmax, its recomputing backward, and the LSE merge."""

import pytest
import torch

from trl_longstraw import attention
from trl_longstraw.attention import ChunkedAttention, chunked_attention, merge_by_lse


def reference_attention(q, k, v, q_positions, k_positions, scaling, window):
    """Plain softmax attention with repeated kv heads, masked by absolute position."""
    groups = q.shape[1] // k.shape[0]
    keys, values = k.repeat_interleave(groups, 0)[None], v.repeat_interleave(groups, 0)[None]
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scaling
    visible = k_positions[None, :] <= q_positions[:, None]
    if window is not None:
        visible &= (q_positions[:, None] - k_positions[None, :]) < window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), values), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_attention_matches_softmax(window, chunk):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k, v = torch.randn(2, 13, 8, dtype=torch.float64), torch.randn(2, 13, 8, dtype=torch.float64)
    q_positions, k_positions = torch.arange(13, 19), torch.arange(13)
    out, lse = chunked_attention(q, k, v, q_positions, k_positions, 0.3, window, chunk)
    want_out, want_lse = reference_attention(q, k, v, q_positions, k_positions, 0.3, window)
    visible = torch.isfinite(want_lse)
    assert torch.allclose(out[visible], want_out[visible], atol=1e-12)
    assert torch.equal(visible, torch.isfinite(lse))
    assert torch.all(out[~visible] == 0)


@pytest.mark.parametrize("row_block", [1024, 3])  # 3: the backward tiles the query rows too
@pytest.mark.parametrize("window", [None, 4])
def test_chunked_attention_gradients_float64(window, row_block, monkeypatch):
    monkeypatch.setattr(attention, "BACKWARD_ROW_BLOCK", row_block)
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 9, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 9, 3, dtype=torch.float64, requires_grad=True)
    q_positions = torch.tensor([6, 7, 8, 9, 10])
    k_positions = torch.arange(9)
    fn = lambda q, k, v: ChunkedAttention.apply(q, k, v, q_positions, k_positions, 0.5, window, 2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_merge_by_lse_equals_attention_over_the_union():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    k, v = torch.randn(2, 20, 8, dtype=torch.float64), torch.randn(2, 20, 8, dtype=torch.float64)
    positions = torch.arange(20)
    q_positions = torch.arange(17, 20)
    whole, _ = reference_attention(q, k, v, q_positions, positions, 0.35, None)
    prefix = chunked_attention(q, k[:, :17], v[:, :17], q_positions, positions[:17], 0.35, None, 4)
    suffix = chunked_attention(q, k[:, 17:], v[:, 17:], q_positions, positions[17:], 0.35, None, 4)
    assert torch.allclose(merge_by_lse(prefix[0], prefix[1], *suffix), whole, atol=1e-12)


def test_gradients_reach_the_prefix_leaves():
    q = torch.randn(1, 2, 2, 4, requires_grad=True)
    k = torch.randn(1, 6, 4, requires_grad=True)
    v = torch.randn(1, 6, 4, requires_grad=True)
    out, lse = chunked_attention(q, k, v, torch.tensor([6, 7]), torch.arange(6), 0.5, None, 4)
    (out.sum() + lse.sum()).backward()
    assert k.grad.shape == k.shape and v.grad.abs().sum() > 0
