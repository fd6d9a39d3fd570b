"""Where a prompt state lives, and the one buffer every per-token state kind appends to.

Placement is decided once per state (`prompt_state_device`), not per kind: every kind allocates, stores and stages
through [`Placement`]. On a CUDA model with host-resident state, buffers are pinned so that staging a chunk onto the
GPU is an asynchronous copy. [`Pages`] is the append buffer of K/V pages, MLA latents and DSA indexer keys: either
preallocated to the prompt's length and written at `length` (no copy when it grows), or rolling (only the entries a
later token can still read: a sliding window, the current attention chunk).

Finiteness is checked as the state is written, chunk by chunk, into a device flag that is read once per capture, so
a NaN in a 100 GiB state is found without scanning it again and without a device sync per chunk.
"""

from __future__ import annotations

import torch


class Placement:
    """The device of one prompt state, and the running finiteness flag of everything written to it."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._finite: torch.Tensor | None = None

    def allocate(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        pin = self.device.type == "cpu" and like.device.type == "cuda"
        return torch.empty(shape, dtype=like.dtype, device=self.device, pin_memory=pin)

    def store(self, tensor: torch.Tensor) -> torch.Tensor:
        """A detached copy of `tensor` on the state's device (a snapshot no later write can alias)."""
        self.check(tensor)
        return tensor.detach().to(self.device, copy=True)

    @staticmethod
    def stage(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`tensor` on the compute device (asynchronous from pinned host memory)."""
        return tensor.to(device, non_blocking=True)

    def check(self, written: torch.Tensor) -> None:
        finite = torch.isfinite(written).all()
        self._finite = finite if self._finite is None else self._finite & finite

    def all_finite(self) -> bool:
        return self._finite is None or bool(self._finite)


class Pages:
    """`[heads, tokens, dim]` entries of one layer, appended along the token dimension during capture.

    `capacity` given: preallocated, written in place. `capacity=None`: rolling; `append` then keeps only the entries
    from `keep_from` (an index into the entries after the append) on, as a compact copy.
    """

    def __init__(self, placement: Placement, capacity: int | None):
        self.placement = placement
        self.capacity = capacity
        self.data: torch.Tensor | None = None
        self.length = 0

    def append(self, values: torch.Tensor, keep_from: int = 0) -> int:
        """Write `values [heads, tokens, dim]` after the current entries; returns how many old entries were dropped."""
        self.placement.check(values)
        values = values.detach().to(self.placement.device)
        if self.capacity is not None:
            if self.data is None:
                self.data = self.placement.allocate(values, (values.shape[0], self.capacity, values.shape[-1]))
            end = self.length + values.shape[1]
            self.data[:, self.length : end] = values
            self.length = end
            return 0
        joined = values if self.data is None else torch.cat([self.data, values], dim=1)
        self.data = joined[:, keep_from:].clone()
        self.length = self.data.shape[1]
        return keep_from

    def read(self, limit: int | None = None) -> torch.Tensor | None:
        """The first `limit` entries (all by default), still on the state's device."""
        if self.data is None:
            return None
        return self.data[:, : self.length if limit is None else limit]

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.data is None else [self.data]
