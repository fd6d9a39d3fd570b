"""The shared mechanics of recurrent token mixers (GatedDeltaNet, Mamba2): a conv state and a recurrent state.

Both have a size independent of the prompt length: the causal conv needs the last `kernel - 1` inputs
(`[conv_dim, kernel - 1]`), the recurrence its state. transformers' cache layers update them in place (`copy_`),
which would both corrupt a snapshot shared by replays and break autograd; here every read returns the snapshot and
every continuation is computed out of place from it, through the Cache API these mixers already call
(`get/update_conv_state`, `get/update_recurrent_state`).

A rollout decodes from the prompt's final states: each row continues its own copy, kept in the rollout's `Suffix`.

With the exact prompt gradient the state at every capture-chunk boundary is kept (a few KiB-MiB each): the reverse
recompute of chunk c starts from boundary c - 1 and back-propagates into it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .registry import LayerState

FP32_BYTES = 4
# What the chunked kernels (transformers' torch fallbacks of GatedDeltaNet and Mamba2) save for backward in fp32, per
# token and head: about 8 x chunk + 12 x (key dim + value dim) + 2 x key dim x value dim / chunk elements (calibrated
# on the fallbacks; fla / mamba-ssm kernels recompute most of this and keep less).
CHUNK_KERNEL_TERMS = (8, 12, 2)


def chunk_kernel_bytes(heads: int, key_dim: int, value_dim: int, chunk: int) -> int:
    """fp32 bytes per replayed token a chunked recurrent kernel saves for backward (`CHUNK_KERNEL_TERMS`)."""
    per_chunk, per_dim, per_state = CHUNK_KERNEL_TERMS
    elements = heads * (
        per_chunk * chunk + per_dim * (key_dim + value_dim) + -(-per_state * key_dim * value_dim // chunk)
    )
    return elements * FP32_BYTES


@dataclass
class StateGradientHandOff:
    """An exact-mode recompute chunk's recurrent-state gradients across ranks (state passing backward): `receive(final)`
    gives the share of the final state's gradient the next chunk's rank computed (None: that chunk is here, or there
    is none), `send(grad)` takes the starting state's gradient for the previous chunk's rank (None: likewise). `taken`:
    whether the mixer's rule took it (a one-token chunk's mixer runs its recurrent rule instead)."""

    receive: Callable[[torch.Tensor], torch.Tensor] | None
    send: Callable[[torch.Tensor], None] | None
    taken: bool = False


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


SLOTS = ("conv", "recurrent")


class ConvRecurrentState(LayerState):
    """Conv and recurrent state of one recurrent layer after the captured prompt (and, exact mode, per chunk).

    Subclasses only recognise their mixer and account for it.
    """

    roles = frozenset({"conv", "recurrent"})

    def __init__(self, mixer, layer_idx, layer_type, prompt):
        super().__init__(mixer, layer_idx, layer_type, prompt)
        self.conv: list[torch.Tensor] = []  # [1, conv_dim, kernel - 1] after each capture chunk (or only the last)
        self.recurrent: list[torch.Tensor] = []  # [1, heads, ...] likewise

    def tensors(self) -> list[torch.Tensor]:
        return self.conv + self.recurrent

    def chunk_states(self) -> list[list[torch.Tensor]]:
        return [self.conv, self.recurrent]

    def _before(self, states: list[torch.Tensor], access, slot: int) -> torch.Tensor | None:
        if access.mode == "decode" and (current := access.suffix.state(self, SLOTS[slot])) is not None:
            return current  # the rows' own state after their decoded tokens
        index = access.chunk_index - 1 if access.mode == "recompute" else len(states) - 1
        if index < 0:
            return None
        return self.prompt.placement.stage(states[index], self.device)

    def conv_state(self, access) -> torch.Tensor | None:
        return self._before(self.conv, access, slot=0)

    def recurrent_state(self, access, batch_size: int) -> torch.Tensor | None:
        if access.mode == "decode" and (current := access.suffix.state(self, SLOTS[1])) is not None:
            return current
        state = self._before(self.recurrent, access, slot=1)
        if state is None:
            return None
        state = state.expand(batch_size, *state.shape[1:])
        if access.mode == "decode":
            # The rows' own copy from their first decoded token on: single-token kernels (Mamba2's state update)
            # write the state they are given in place, which must never be the prompt's snapshot.
            state = state.clone()
            access.suffix.set_state(self, SLOTS[1], state)
        return state

    def continue_conv(self, access, inputs: torch.Tensor, kernel_size: int) -> torch.Tensor:
        """`inputs [batch, conv_dim, T]` preceded by the conv state (out of place); records the new state."""
        previous = self._before(self.conv, access, slot=0)
        full = inputs if previous is None else torch.cat([previous.expand(inputs.shape[0], -1, -1), inputs], dim=-1)
        if access.mode != "read":
            tail = full[..., -(kernel_size - 1) :]
            if tail.shape[-1] < kernel_size - 1:  # a prompt shorter than the kernel: zeros are the conv's own padding
                tail = F.pad(tail, (kernel_size - 1 - tail.shape[-1], 0))
            self._record(self.conv, access, tail, slot=0)
        return full

    def finish_recurrent(self, access, state: torch.Tensor) -> None:
        if access.mode != "read":
            self._record(self.recurrent, access, state, slot=1)

    def _record(self, states: list[torch.Tensor], access, value: torch.Tensor, slot: int) -> None:
        if access.mode == "decode":
            access.suffix.set_state(self, SLOTS[slot], value)
            return
        if access.mode == "recompute":
            access.recorded.setdefault(self, [None, None])[slot] = value
            return
        self.keep_chunk_state(states, self.prompt.placement.store(value))

    def recompute_pairs(self, recorded, chunk_index, start, end):
        pairs = []
        for recomputed, leaf in zip(recorded, (self.conv[chunk_index], self.recurrent[chunk_index]), strict=True):
            if recomputed is not None and leaf.grad is not None:
                pairs.append((recomputed, leaf.grad.to(recomputed.device, recomputed.dtype, copy=True)))
        return pairs
