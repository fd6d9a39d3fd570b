"""Durable prompt state of a GatedDeltaNet (linear attention) layer: its conv and recurrent states.

Both have a size independent of the prompt length: the causal conv needs the last `kernel - 1` inputs
(`[conv_dim, kernel - 1]`), the delta rule its recurrent state (`[v_heads, k_dim, v_dim]`, fp32). transformers'
`LinearAttentionLayer` updates them in place with `copy_`, which would both corrupt a snapshot shared by replays and
break autograd; here every read returns the snapshot and every continuation is computed out of place from it.

With the exact prompt gradient the state at every capture-chunk boundary is kept (a few KiB-MiB each): the reverse
recompute of chunk c starts from boundary c - 1 and back-propagates into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LinearAttentionState:
    """Conv and recurrent state of one GatedDeltaNet layer after the captured prompt (and, exact mode, per chunk)."""

    differentiable = True

    def __init__(self, device: torch.device, keep_boundaries: bool):
        self.device = device
        self.keep_boundaries = keep_boundaries
        self.conv: list[torch.Tensor] = []  # [1, conv_dim, kernel - 1] after each capture chunk (or only the last)
        self.recurrent: list[torch.Tensor] = []  # [1, v_heads, k_dim, v_dim] likewise

    def tensors(self) -> list[torch.Tensor]:
        return self.conv + self.recurrent

    def _before(self, states: list[torch.Tensor], access) -> torch.Tensor | None:
        if access.mode == "capture":
            return states[-1] if states else None
        index = len(states) - 1 if access.mode == "read" else access.chunk_index - 1
        if index < 0:
            return None
        return states[index].to(access.query_positions.device, non_blocking=True)

    def conv_state(self, access) -> torch.Tensor | None:
        return self._before(self.conv, access)

    def recurrent_state(self, access, batch_size: int) -> torch.Tensor | None:
        state = self._before(self.recurrent, access)
        return None if state is None else state.expand(batch_size, *state.shape[1:])

    def continue_conv(self, access, inputs: torch.Tensor, kernel_size: int) -> torch.Tensor:
        """`inputs [batch, conv_dim, T]` preceded by the conv state (out of place); records the new state."""
        previous = self._before(self.conv, access)
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
        if access.mode == "recompute":
            access.recorded.setdefault(self, [None, None])[slot] = value
            return
        value = value.detach().to(self.device).clone()
        if self.keep_boundaries or not states:
            states.append(value)
        else:
            states[-1] = value

    def recompute_pairs(
        self, recorded, chunk_index: int, start: int, end: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(recomputed end-of-chunk state, its accumulated gradient) for the exact prompt backward."""
        pairs = []
        for recomputed, leaf in zip(recorded, (self.conv[chunk_index], self.recurrent[chunk_index]), strict=True):
            if recomputed is not None and leaf.grad is not None:
                pairs.append((recomputed, leaf.grad.to(recomputed.device, recomputed.dtype, copy=True)))
        return pairs
