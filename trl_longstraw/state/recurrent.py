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
        if index < 0:  # the first chunk: a zero state, or where the state this one continues ends
            return None if self.parent is None else self.parent.final_state(slot)
        return self.prompt.placement.stage(states[index], self.device)

    def final_state(self, slot: int) -> torch.Tensor | None:
        """The `slot` state (0: conv, 1: recurrent) after every captured token, where a continuation starts."""
        states = self.chunk_states()[slot]
        if states:
            return self.prompt.placement.stage(states[-1], self.device)
        return None if self.parent is None else self.parent.final_state(slot)

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
