"""GatedDeltaNet (linear attention) layers of Qwen3.5/3.6 and Qwen3-Next: conv state + fp32 recurrent state.

The state is `[v_heads, k_dim, v_dim]` (kept in fp32, as transformers' torch fallback and fla's kernels compute it)
plus the conv's last `kernel - 1` inputs over `2 * key_dim + value_dim` channels: a few MiB per layer whatever the
prompt length. Capture, reads and out-of-place continuation are [`ConvRecurrentState`]'s.

State passing (context parallelism). The gated delta rule is linear in its starting state: from a state `S`, a
chunk's outputs are those from the zero state plus the contribution of `S` (the same recurrence, values zeroed,
started from `S`), and so is its final state. So a capture chunk whose starting state another rank is still computing
runs the rule from the zero state first, and adds the starting state's contribution once it arrives (a pending start
of `StatePassingRule`): the ranks of a capture step run a GatedDeltaNet layer at once, each waiting only for the
previous chunk's state to be corrected, a pass of the rule's sequential scan, instead of for the whole layer. The
exact-mode recompute passes the state's gradient back the same way (a pending hand-off, `LateStateGradient`): a
chunk back-propagates its rule's scan with the gradients at hand, then the share of its final state's gradient the
next chunk's rank sends (the rule's gradients are linear in its output gradients), and sends its starting state's
gradient as soon as that is summed, before its own backward goes on below the rule. The mixer's call of its chunked
rule is reached through the kernel function transformers attaches to each GatedDeltaNet (`use_kernelized_func`, the
`kernels` package: `mixer._kernel_funcs`, which `kernels.kernelize` replaces the same way).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .recurrent import FP32_BYTES, ConvRecurrentState, LateStateGradient, StateGradientHandOff, chunk_kernel_bytes
from .registry import LayerAccount, find_child

GATED_DELTANET_CHUNK = 64  # the chunk of transformers' torch_chunk_gated_delta_rule and of fla's chunked kernel
CHUNK_RULE_KERNEL = "chunk_gated_delta_rule"  # the kernel function's name in the mixer's `_kernel_funcs`


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


class StatePassingRule:
    """A GatedDeltaNet's chunked-rule kernel function for state passing under context parallelism: given a pending
    starting state (`pending_start`, a capture chunk's), or a pending hand-off of state gradients (`pending_hand_off`,
    an exact-mode recompute chunk's), its next call takes it; other calls run the model's own kernel untouched."""

    def __init__(self, kernel: Callable):
        self.kernel = kernel
        self.pending_start: Callable[[], torch.Tensor] | None = None
        self.pending_hand_off: StateGradientHandOff | None = None
        self.deferred_runs = 0  # calls that ran with a deferred starting state
        self.hand_off_runs = 0  # calls whose backward hands state gradients across ranks

        def forward(module, *args, **kwargs):  # the kernel function's forward, bound to it
            return self(*args, **kwargs)

        self.forward = forward

    def __call__(self, query, key, value, g=None, beta=None, initial_state=None, output_final_state=False, **kwargs):
        start, self.pending_start = self.pending_start, None
        hand_off, self.pending_hand_off = self.pending_hand_off, None
        if start is None and hand_off is None:
            return self.kernel(
                query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                **kwargs,
            )  # fmt: skip
        on_cpu = query.device.type == "cpu"  # transformers' torch fallback: share the within-block transform
        l2norm = kwargs.get("use_qk_l2norm_in_kernel", False)
        if hand_off is not None:
            if start is not None or not output_final_state:
                raise RuntimeError("A state-gradient hand-off met a deferred starting state or no final state.")
            self.hand_off_runs += 1
            hand_off.taken = True
            if on_cpu:
                return torch_rule_with_state_gradient_hand_off(
                    query, key, value, g, beta, initial_state, hand_off, l2norm
                )
            return kernel_rule_with_state_gradient_hand_off(
                self.kernel, query, key, value, g, beta, initial_state, hand_off, **kwargs
            )
        if initial_state is not None:
            raise RuntimeError("A deferred starting state met a starting state given to the rule.")
        self.deferred_runs += 1
        if on_cpu:
            return torch_rule_with_deferred_start(query, key, value, g, beta, start, l2norm)
        return kernel_rule_with_deferred_start(self.kernel, query, key, value, g, beta, start, **kwargs)


_STATE_PASSING_RULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mixer -> its StatePassingRule


def state_passing_rule(mixer) -> StatePassingRule | None:
    """The mixer's `StatePassingRule`, in place of its chunked-rule kernel function's forward (put there on first use,
    and again over a forward that replaced it since, such as `kernels.kernelize`'s); None where the mixer has no such
    kernel function (a model without transformers' kernel hooks)."""
    kernel = getattr(mixer, "_kernel_funcs", {}).get(CHUNK_RULE_KERNEL)
    if kernel is None:
        return None
    rule = _STATE_PASSING_RULES.get(mixer)
    if rule is not None and getattr(kernel.forward, "__func__", None) is rule.forward:
        return rule
    rule = StatePassingRule(kernel.forward)
    kernel.forward = types.MethodType(rule.forward, kernel)  # a bound forward, as `kernels.kernelize` sets one
    _STATE_PASSING_RULES[mixer] = rule
    return rule


def is_gated_deltanet(module) -> bool:
    return all(hasattr(module, name) for name in ("A_log", "dt_bias", "conv1d", "head_k_dim", "head_v_dim"))


class LinearAttentionState(ConvRecurrentState):
    """Conv and recurrent state of one GatedDeltaNet layer."""

    name = "gated_deltanet"
    layer_types = ("linear_attention", "hybrid")
    sharded_layer_types = layer_types

    @classmethod
    def find_mixer(cls, layer, layer_type):
        return find_child(layer, is_gated_deltanet)

    @classmethod
    def account(cls, mixer, config, layer_type, dtype_bytes, exact, fp8_pages=False):
        recurrent = mixer.num_v_heads * mixer.head_k_dim * mixer.head_v_dim * FP32_BYTES
        conv = mixer.conv_dim * (mixer.conv_kernel_size - 1) * dtype_bytes
        return LayerAccount("gated_deltanet", fixed=recurrent + conv, per_chunk=exact)  # exact: one per chunk boundary

    def defer_start(self, start: Callable[[], torch.Tensor]) -> bool:
        """Run this capture forward's chunked rule with its starting state given later, by `start()` (state passing,
        module docstring); False where the mixer's rule cannot take it so."""
        rule = state_passing_rule(self.mixer)
        if rule is None:
            return False
        rule.pending_start = start
        return True

    def hand_off_state_gradients(self, hand_off: StateGradientHandOff | None) -> bool:
        """Run this recompute forward's chunked rule so that its backward hands the recurrent state's gradients
        across ranks itself (`LateStateGradient`, state passing backward); False where the mixer's rule cannot. None
        withdraws a hand-off the rule did not take."""
        rule = state_passing_rule(self.mixer)
        if rule is None:
            return False
        rule.pending_hand_off = hand_off
        return True

    @classmethod
    def replay_saved_bytes(cls, mixer, dtype_bytes, fused):
        """fla's chunked kernel (fused): what its forward keeps (L2-normalised q and k with their fp32 reciprocal
        norms, the fp32 cumulative gate, `A [heads, 64]`, v and beta) and its backward's workspace (`w`, `u`, `v_new`,
        `dv`, `dw`, per-value-head `dq` and `dk`, the chunk states `h` and `dh`, fp32 partial sums of `dg`), read off
        fla 0.6's code (the simulation's stand-ins allocate the same); about 1/4 of the torch fallback's at
        Qwen3.6-27B's widths."""
        heads, key_dim, value_dim = mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
        if not fused:
            return chunk_kernel_bytes(heads, key_dim, value_dim, GATED_DELTANET_CHUNK)
        k_heads, chunk = mixer.num_k_heads, GATED_DELTANET_CHUNK
        kept = dtype_bytes * (2 * k_heads * key_dim + heads * (chunk + value_dim + 1)) + FP32_BYTES * (
            2 * k_heads + heads
        )
        workspace = heads * (dtype_bytes * (4 * key_dim + 3 * value_dim) + FP32_BYTES * -(-key_dim // 128))
        states = -(-2 * dtype_bytes * heads * key_dim * value_dim // chunk)  # h and dh, one per chunk of 64 tokens
        return kept + workspace + states
