"""GatedDeltaNet (linear attention) layers of Qwen3.5/3.6 and Qwen3-Next: conv state + fp32 recurrent state.

The state is `[v_heads, k_dim, v_dim]` (kept in fp32, as transformers' torch fallback and fla's kernels compute it)
plus the conv's last `kernel - 1` inputs over `2 * key_dim + value_dim` channels: a few MiB per layer whatever the
prompt length. Capture, reads and out-of-place continuation are [`ConvRecurrentState`]'s.

State passing (context parallelism). The gated delta rule is linear in its starting state: from a state `S`, a
chunk's outputs are those from the zero state plus the contribution of `S` (the same recurrence, values zeroed,
started from `S`), and so is its final state. So a capture chunk whose starting state another rank is still computing
runs the rule from the zero state first, and adds the starting state's contribution once it arrives
(`DeferredStartRule`): the ranks of a capture step run a GatedDeltaNet layer at once, each waiting only for the
previous chunk's state to be corrected, a pass of the rule's sequential scan, instead of for the whole layer. The
mixer's call of its chunked rule is reached through the kernel function transformers attaches to each GatedDeltaNet
(`use_kernelized_func`, the `kernels` package: `mixer._kernel_funcs`, which `kernels.kernelize` replaces the same way).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .recurrent import FP32_BYTES, ConvRecurrentState, chunk_kernel_bytes
from .registry import LayerAccount, find_child

GATED_DELTANET_CHUNK = 64  # the chunk of transformers' torch_chunk_gated_delta_rule and of fla's chunked kernel
CHUNK_RULE_KERNEL = "chunk_gated_delta_rule"  # the kernel function's name in the mixer's `_kernel_funcs`


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # fla's, and transformers' torch fallback's


def torch_rule_with_deferred_start(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    start: Callable[[], torch.Tensor],
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule (the algorithm of transformers' `torch_chunk_gated_delta_rule`: a UT transform
    within each 64-token block, then a scan over the blocks) from a starting state that `start()` gives once the
    zero-state scan is done: the within-block transform is computed once, the scan runs from zero and again, values
    zeroed, from the starting state. Returns the outputs `[batch, tokens, v_heads, v_dim]` and the final state."""
    dtype, tokens, block = query.dtype, query.shape[1], GATED_DELTANET_CHUNK
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

    def scan(state: torch.Tensor, with_values: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(new_values)
        for i in range(new_values.shape[2]):
            read = k_cumdecay[:, :, i] @ state
            update = new_values[:, :, i] - read if with_values else -read
            out[:, :, i] = query[:, :, i] @ state + intra[:, :, i] @ update
            state = state * block_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ update
        return out, state

    zero = new_values.new_zeros(*new_values.shape[:2], key.shape[-1], new_values.shape[-1])
    out, final = scan(zero, with_values=True)
    correction, carried = scan(start().to(new_values), with_values=False)
    out = (out + correction).flatten(2, 3)[:, :, :tokens]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), final + carried


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


class DeferredStartRule:
    """A GatedDeltaNet's chunked-rule kernel function that, given a pending starting state (`pending`, taken by its
    next call), runs the rule with it deferred, and otherwise the model's own kernel untouched."""

    def __init__(self, kernel: Callable):
        self.kernel = kernel
        self.pending: Callable[[], torch.Tensor] | None = None
        self.deferred_runs = 0  # calls that ran with a deferred starting state

        def forward(module, *args, **kwargs):  # the kernel function's forward, bound to it
            return self(*args, **kwargs)

        self.forward = forward

    def __call__(self, query, key, value, g=None, beta=None, initial_state=None, output_final_state=False, **kwargs):
        start, self.pending = self.pending, None
        if start is None:
            return self.kernel(
                query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                **kwargs,
            )  # fmt: skip
        if initial_state is not None:
            raise RuntimeError("A deferred starting state met a starting state given to the rule.")
        self.deferred_runs += 1
        if query.device.type == "cpu":  # transformers' torch fallback: share the within-block transform
            return torch_rule_with_deferred_start(
                query, key, value, g, beta, start, kwargs.get("use_qk_l2norm_in_kernel", False)
            )
        return kernel_rule_with_deferred_start(self.kernel, query, key, value, g, beta, start, **kwargs)


_DEFERRED_START_RULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mixer -> its DeferredStartRule


def deferred_start_rule(mixer) -> DeferredStartRule | None:
    """The mixer's `DeferredStartRule`, in place of its chunked-rule kernel function's forward (put there on first use,
    and again over a forward that replaced it since, such as `kernels.kernelize`'s); None where the mixer has no such
    kernel function (a model without transformers' kernel hooks)."""
    kernel = getattr(mixer, "_kernel_funcs", {}).get(CHUNK_RULE_KERNEL)
    if kernel is None:
        return None
    rule = _DEFERRED_START_RULES.get(mixer)
    if rule is not None and getattr(kernel.forward, "__func__", None) is rule.forward:
        return rule
    rule = DeferredStartRule(kernel.forward)
    kernel.forward = types.MethodType(rule.forward, kernel)  # a bound forward, as `kernels.kernelize` sets one
    _DEFERRED_START_RULES[mixer] = rule
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
        rule = deferred_start_rule(self.mixer)
        if rule is None:
            return False
        rule.pending = start
        return True

    @classmethod
    def replay_saved_bytes(cls, mixer):
        return chunk_kernel_bytes(mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim, GATED_DELTANET_CHUNK)
