"""GatedDeltaNet (linear attention) layers of Qwen3.5/3.6 and Qwen3-Next: conv state + fp32 recurrent state.

The state is `[v_heads, k_dim, v_dim]` (kept in fp32, as transformers' torch fallback and fla's kernels compute it)
plus the conv's last `kernel - 1` inputs over `2 * key_dim + value_dim` channels: a few MiB per layer whatever the
prompt length. Capture, reads and out-of-place continuation are [`ConvRecurrentState`]'s.

State passing (context parallelism, `ops/gated_delta_rule.py`): a capture chunk whose starting state another rank is
still computing runs the rule from the zero state and adds the starting state's contribution once it arrives; an
exact-mode recompute chunk takes its final state's gradient late. The mixer's call of its chunked rule is reached
through the kernel function transformers attaches to each GatedDeltaNet (`use_kernelized_func`, the `kernels`
package: `mixer._kernel_funcs`, which `kernels.kernelize` replaces the same way): `StatePassingRule` stands in for
its forward and hands the call it is given (`StatePassing`) to the rule's next call.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable

from ..ops.gated_delta_rule import (
    GATED_DELTANET_CHUNK,
    StatePassing,
    kernel_rule_with_deferred_start,
    kernel_rule_with_state_gradient_hand_off,
    torch_rule_with_deferred_start,
    torch_rule_with_state_gradient_hand_off,
)
from .recurrent import FP32_BYTES, ConvRecurrentState, chunk_kernel_bytes
from .registry import LayerAccount, find_child

CHUNK_RULE_KERNEL = "chunk_gated_delta_rule"  # the kernel function's name in the mixer's `_kernel_funcs`


class StatePassingRule:
    """A GatedDeltaNet's chunked-rule kernel function for state passing under context parallelism: the rule's next
    call takes the `StatePassing` it was handed (`expect`); other calls run the model's own kernel untouched."""

    def __init__(self, kernel: Callable):
        self.kernel = kernel
        self.expected: StatePassing | None = None
        self.deferred_runs = 0  # calls that ran with a deferred starting state
        self.hand_off_runs = 0  # calls whose backward hands state gradients across ranks

        def forward(module, *args, **kwargs):  # the kernel function's forward, bound to it
            return self(*args, **kwargs)

        self.forward = forward

    def expect(self, passing: StatePassing) -> None:
        """Hand `passing` to the rule's next call. One at a time: a call handed over and never taken would otherwise
        be taken by a later, unrelated call."""
        if self.expected is not None:
            raise RuntimeError(
                "A GatedDeltaNet rule was handed a state passing while an earlier one was still pending: the mixer "
                "did not run its chunked rule for it."
            )
        self.expected = passing

    def withdraw(self) -> StatePassing | None:
        """The state passing handed over and not taken (the mixer ran no chunked rule), withdrawn."""
        passing, self.expected = self.expected, None
        return passing

    def __call__(self, query, key, value, g=None, beta=None, initial_state=None, output_final_state=False, **kwargs):
        passing, self.expected = self.expected, None
        if passing is None:
            return self.kernel(
                query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                **kwargs,
            )  # fmt: skip
        on_cpu = query.device.type == "cpu"  # transformers' torch fallback: share the within-block transform
        l2norm = kwargs.get("use_qk_l2norm_in_kernel", False)
        if passing.hand_off is not None:
            if not output_final_state:
                raise RuntimeError("A state-gradient hand-off met a rule call without a final state.")
            passing.taken = True
            self.hand_off_runs += 1
            if on_cpu:
                return torch_rule_with_state_gradient_hand_off(
                    query, key, value, g, beta, initial_state, passing.hand_off, l2norm
                )
            return kernel_rule_with_state_gradient_hand_off(
                self.kernel, query, key, value, g, beta, initial_state, passing.hand_off, **kwargs
            )
        if initial_state is not None:
            raise RuntimeError("A deferred starting state met a starting state given to the rule.")
        passing.taken = True
        self.deferred_runs += 1
        if on_cpu:
            return torch_rule_with_deferred_start(query, key, value, g, beta, passing.start, l2norm)
        return kernel_rule_with_deferred_start(self.kernel, query, key, value, g, beta, passing.start, **kwargs)


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

    def pass_state(self, passing: StatePassing) -> bool:
        """Hand `passing` to this forward's chunked rule (state passing, `ops/gated_delta_rule.py`); False where the
        mixer's rule cannot take it."""
        rule = state_passing_rule(self.mixer)
        if rule is None:
            return False
        rule.expect(passing)
        return True

    def withdraw_state_passing(self) -> None:
        rule = state_passing_rule(self.mixer)
        if rule is not None:
            rule.withdraw()

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
