"""The gated delta rule (GatedDeltaNet's token mixer) as LongStraw runs it under context parallelism, beside its
naive reference.

The rule is linear in its starting state: from a state `S`, a chunk's outputs are those from the zero state plus the
contribution of `S` (the same recurrence, values zeroed, started from `S`), and so is its final state. So a capture
chunk whose starting state another rank is still computing runs the rule from the zero state first and adds the
starting state's contribution once it arrives (`torch_rule_with_deferred_start`, `kernel_rule_with_deferred_start`);
an exact-mode recompute chunk takes its final state's gradient late, from the next chunk's rank
(`LateStateGradient`, `..._with_state_gradient_hand_off`). What one call of the rule does is said by its
`StatePassing`, handed to it explicitly (fla passes its `cp_context` the same way) and checked to have been taken.

`torch_...` runs on transformers' torch path (the within-block transform computed once and shared), `kernel_...`
through the model's own chunked kernel (fla's on a GPU). `naive_gated_delta_rule` is the token-by-token recurrence
every chunked form is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GATED_DELTANET_CHUNK = 64  # the chunk of transformers' torch_chunk_gated_delta_rule and of fla's chunked kernel


@dataclass
class StateGradientHandOff:
    """An exact-mode recompute chunk's recurrent-state gradients across ranks (state passing backward): `receive(final)`
    gives the share of the final state's gradient the next chunk's rank computed (None: that chunk is here, or there
    is none), `send(grad)` takes the starting state's gradient for the previous chunk's rank (None: likewise)."""

    receive: Callable[[torch.Tensor], torch.Tensor] | None
    send: Callable[[torch.Tensor], None] | None


class LateStateGradient(torch.autograd.Function):
    """`rule(*inputs) -> (out, final)`, the last input its starting state (or None), whose backward takes a share of
    the final state's gradient late (`StateGradientHandOff`): it back-propagates the gradients at hand, then receives
    the share and back-propagates it through the final state alone (the rule's gradients are linear in its output
    gradients), and sends the starting state's whole gradient as soon as it is summed, before the backward goes on
    below the rule. The rule's graph is built in the forward, on detached inputs, and kept to the backward."""

    @staticmethod
    def forward(ctx, rule: Callable, hand_off: StateGradientHandOff, *inputs):
        leaves = [None if x is None else x.detach().requires_grad_(x.requires_grad) for x in inputs]
        with torch.enable_grad():
            out, final = rule(*leaves)
        ctx.rule_graph, ctx.hand_off = (leaves, out, final), hand_off
        return out.detach(), final.detach()

    @staticmethod
    def backward(ctx, d_out, d_final):
        (leaves, out, final), hand_off = ctx.rule_graph, ctx.hand_off
        del ctx.rule_graph
        wanted = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
        late = hand_off.receive is not None and final.requires_grad
        grads = torch.autograd.grad((out, final), wanted, (d_out, d_final), retain_graph=late, allow_unused=True)
        if late:
            shares = torch.autograd.grad(final, wanted, hand_off.receive(final), allow_unused=True)
            grads = [a if b is None else b if a is None else a + b for a, b in zip(grads, shares, strict=True)]
        by_leaf = {id(leaf): grad for leaf, grad in zip(wanted, grads, strict=True)}
        result = [None if leaf is None else by_leaf.get(id(leaf)) for leaf in leaves]
        if hand_off.send is not None and result[-1] is not None:
            hand_off.send(result[-1])
        return None, None, *result


@dataclass
class StatePassing:
    """What one call of a GatedDeltaNet's chunked rule does under context parallelism: start from a state given later
    (`start`, a capture chunk's: the previous chunk's rank is still computing it), or hand its state's gradients
    across ranks in its backward (`hand_off`, an exact-mode recompute chunk's). `taken`: whether the rule's call took
    it (its caller checks, so that a deferred starting state never goes missing)."""

    start: Callable[[], torch.Tensor] | None = None
    hand_off: StateGradientHandOff | None = None
    taken: bool = False

    def __post_init__(self):
        if (self.start is None) == (self.hand_off is None):
            raise ValueError("StatePassing takes a deferred start or a state-gradient hand-off, exactly one of them.")


def naive_gated_delta_rule(
    query, key, value, g, beta, initial_state=None, use_qk_l2norm_in_kernel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token, in fp32: `S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T
    k_t)^T`, `o_t = S_t^T q_t / sqrt(d_k)`. Inputs `[batch, tokens, heads, d]` (query and key heads each serving
    consecutive value heads), `g` and `beta` `[batch, tokens, value heads]`, a state `[batch, value heads, d_k, d_v]`.
    Returns the outputs `[batch, tokens, value heads, d_v]` in the query's dtype and the final state."""
    dtype, heads = query.dtype, value.shape[2]
    query, key = (x.repeat_interleave(heads // x.shape[2], dim=2).float() for x in (query, key))
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    value, g, beta = value.float(), g.float(), beta.float()
    state = key.new_zeros(key.shape[0], heads, key.shape[-1], value.shape[-1])
    state = state if initial_state is None else initial_state.float()
    outputs = []
    for t in range(query.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        read = (state * key[:, t, :, :, None]).sum(-2)  # S^T k: [batch, heads, d_v]
        state = state + key[:, t, :, :, None] * (beta[:, t, :, None] * (value[:, t] - read))[..., None, :]
        outputs.append((state * query[:, t, :, :, None]).sum(-2))
    return torch.stack(outputs, dim=1).to(dtype), state


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # fla's, and transformers' torch fallback's


def _blocked_rule(query, key, value, g, beta, use_qk_l2norm_in_kernel):
    """The chunked gated delta rule's within-block part (the algorithm of transformers'
    `torch_chunk_gated_delta_rule`: a UT transform within each 64-token block), the scan's inputs: the decayed queries
    and keys, the transformed values and key decays, the within-block attention and each block's decay."""
    tokens, block = query.shape[1], GATED_DELTANET_CHUNK
    heads, k_heads = value.shape[2], key.shape[2]
    if k_heads != heads:  # grouped values: each query/key head serves consecutive value heads
        query, key = (x.repeat_interleave(heads // k_heads, dim=2) for x in (query, key))
    query, key, value, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, g)
    )
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    pad = (block - tokens % block) % block
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    blocks = lambda x: x.reshape(x.shape[0], x.shape[1], -1, block, x.shape[-1])
    query, key, k_beta, v_beta = (blocks(x) for x in (query, key, key * beta[..., None], value * beta[..., None]))
    cum = g.reshape(g.shape[0], g.shape[1], -1, block).cumsum(dim=-1)
    upper = torch.ones(block, block, dtype=torch.bool, device=query.device).triu(1)
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    solve = lambda x: torch.linalg.solve_triangular(system, x, upper=False, unitriangular=True)
    new_values, k_cumdecay = solve(v_beta), solve(k_beta * cum.exp()[..., None])
    query = query * cum.exp()[..., None]
    key = key * (cum[..., -1:] - cum).exp()[..., None]
    block_decay = cum[..., -1].exp()[..., None, None]
    return query, key, new_values, k_cumdecay, intra, block_decay


def _scan(query, key, new_values, k_cumdecay, intra, block_decay, state, with_values: bool = True):
    """The scan over the blocks from `state` (`[batch, heads, k_dim, v_dim]`): the blocked outputs and the final
    state. Values zeroed (`with_values=False`): the starting state's share alone, the rule being linear in it."""
    out = torch.empty_like(new_values)
    for i in range(new_values.shape[2]):
        read = k_cumdecay[:, :, i] @ state
        update = new_values[:, :, i] - read if with_values else -read
        out[:, :, i] = query[:, :, i] @ state + intra[:, :, i] @ update
        state = state * block_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ update
    return out, state


def _unblocked(out: torch.Tensor, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocked outputs `[batch, heads, blocks, 64, v_dim]` as the rule returns them: `[batch, tokens, heads, v_dim]`."""
    return out.flatten(2, 3)[:, :, :tokens].transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


def torch_rule_with_deferred_start(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    start: Callable[[], torch.Tensor],
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule from a starting state that `start()` gives once the zero-state scan is done: the
    within-block transform is computed once, the scan runs from zero and again, values zeroed, from the starting
    state. Returns the outputs `[batch, tokens, v_heads, v_dim]` and the final state."""
    dtype, tokens = query.dtype, query.shape[1]
    blocked = _blocked_rule(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    new_values, key_blocks = blocked[2], blocked[1]
    zero = new_values.new_zeros(*new_values.shape[:2], key_blocks.shape[-1], new_values.shape[-1])
    out, final = _scan(*blocked, zero)
    correction, carried = _scan(*blocked, start().to(new_values), with_values=False)
    return _unblocked(out + correction, tokens, dtype), final + carried


def kernel_rule_with_deferred_start(
    rule: Callable, query, key, value, g, beta, start: Callable[[], torch.Tensor], **options
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same through the model's own chunked kernel (fla's on a GPU), called twice: from the zero state, then,
    values zeroed, from the starting state."""
    out, final = rule(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=True, **options)
    correction, carried = rule(
        query, key, torch.zeros_like(value), g=g, beta=beta, initial_state=start(), output_final_state=True, **options
    )
    return out + correction, final + carried


def torch_rule_with_state_gradient_hand_off(
    query, key, value, g, beta, initial_state, hand_off: StateGradientHandOff, use_qk_l2norm_in_kernel: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule from `initial_state` whose scan takes its final state's gradient late (`LateStateGradient`):
    the within-block transform's backward runs once, after the late share has joined the scan's gradients."""
    dtype, tokens = query.dtype, query.shape[1]
    blocked = _blocked_rule(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    new_values, key_blocks = blocked[2], blocked[1]
    if initial_state is None:
        initial_state = new_values.new_zeros(*new_values.shape[:2], key_blocks.shape[-1], new_values.shape[-1])
    out, final = LateStateGradient.apply(_scan, hand_off, *blocked, initial_state.to(new_values))
    return _unblocked(out, tokens, dtype), final


def kernel_rule_with_state_gradient_hand_off(
    rule: Callable, query, key, value, g, beta, initial_state, hand_off: StateGradientHandOff, **options
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same through the model's own chunked kernel (fla's on a GPU): its backward runs once with the gradients at
    hand and once more with the late share alone."""

    def run(query, key, value, g, beta, state):
        return rule(query, key, value, g=g, beta=beta, initial_state=state, output_final_state=True, **options)

    return LateStateGradient.apply(run, hand_off, query, key, value, g, beta, initial_state)
