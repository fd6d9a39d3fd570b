"""Where a prompt state lives, and the one buffer every per-token state kind appends to.

Placement is decided once per state (`prompt_state_device`), not per kind: every kind allocates, stores and stages
through [`Placement`]. On a CUDA model with host-resident state, buffers are pinned so that staging a chunk onto the
GPU is an asynchronous copy (head by head: a chunk of `[heads, entries, dim]` pages is not contiguous). [`Pages`] is the append buffer of K/V pages, MLA latents and DSA indexer keys: either
preallocated to the prompt's length and written at `length` (no copy when it grows), or rolling (only the entries a
later token can still read: a sliding window, the current attention chunk).

Finiteness is checked as the state is written, chunk by chunk, into a device flag that is read once per capture, so
a NaN in a 100 GiB state is found without scanning it again and without a device sync per chunk.

fp8 pages (`prompt_state_dtype="float8_e4m3fn"`): entries are stored in `float8_e4m3fn` with one fp32 scale per
(page of `FP8_PAGE_TOKENS` tokens, head), `scale = amax / 448` (the format's largest finite value), and dequantised
chunk by chunk as attention reads them: a full-precision copy of the prefix never exists (only the last, partly
filled page is held in full precision during capture, so that a page filled by two capture chunks is quantised once,
from all its entries: the pages do not depend on `prefill_chunk_size`).
"""

from __future__ import annotations

import torch

from ..block_attention import stage

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
FP8_PAGE_TOKENS = 64
FP32_BYTES = 4


def page_bytes(heads: int, dim: int, dtype_bytes: int, fp8: bool) -> tuple[int, int]:
    """`(bytes per token, bytes per page of FP8_PAGE_TOKENS tokens)` of `[heads, tokens, dim]` pages: `dtype_bytes`
    per value, or fp8's one byte per value and one fp32 scale per (page, head)."""
    if fp8:
        return heads * dim, FP32_BYTES * heads
    return heads * dim * dtype_bytes, 0


def quantize_pages(values: torch.Tensor, page_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`values [heads, tokens, dim]` (tokens a multiple of `page_tokens`, or one partial last page) as fp8 entries and
    `[heads, pages]` fp32 scales, one per (page, head)."""
    heads, tokens, dim = values.shape
    pages = -(-tokens // page_tokens)
    padded = torch.nn.functional.pad(values.float(), (0, 0, 0, pages * page_tokens - tokens))
    amax = padded.view(heads, pages, page_tokens, dim).abs().amax(dim=(2, 3))
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    per_token = scales.repeat_interleave(page_tokens, dim=1)[:, :tokens, None]
    return (values.float() / per_token).to(FP8_DTYPE), scales


def dequantize_pages(
    entries: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, page_tokens: int, dtype: torch.dtype
) -> torch.Tensor:
    """fp8 `entries [heads, *index.shape, dim]` (the entries at token indices `index`: a chunk, or those a DSA top-k
    picked), in `dtype`, with their pages' scales `[heads, pages]`."""
    pages = index.to(scales.device) // page_tokens
    # host-resident scales: a fresh (pageable) tensor, copied without a device sync
    page_scales = scales[:, pages, None].to(entries.device, non_blocking=True)
    return (entries.to(torch.float32) * page_scales).to(dtype)


class Placement:
    """The device of one prompt state, and the running finiteness flag of everything written to it.

    `device=None`: each entry where it was computed, so a model split over devices (`device_map`) keeps each layer's
    state on that layer's device."""

    def __init__(self, device: torch.device | None):
        self.device = None if device is None else torch.device(device)
        self._finite: torch.Tensor | None = None

    def where(self, source: torch.device) -> torch.device:
        """The device of entries computed on `source`."""
        return source if self.device is None else self.device

    def allocate(self, dtype: torch.dtype, shape: tuple[int, ...], source: torch.device) -> torch.Tensor:
        """Room for `shape` entries of `dtype` written from `source`: pinned host memory when they come from (and go
        back to) a GPU, so that staging them is an asynchronous copy."""
        device = self.where(source)
        pin = device.type == "cpu" and source.type == "cuda"
        return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)

    def store(self, tensor: torch.Tensor) -> torch.Tensor:
        """A detached copy of `tensor` on the state's device (a snapshot no later write can alias)."""
        self.check(tensor)
        copy = self.allocate(tensor.dtype, tuple(tensor.shape), tensor.device)
        return copy.copy_(tensor.detach())

    @staticmethod
    def stage(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`tensor` on the compute device (asynchronous from pinned host memory, head by head: `attention.stage`)."""
        return stage(tensor, device)

    def check(self, written: torch.Tensor) -> None:
        finite = torch.isfinite(written).all()
        self._finite = finite if self._finite is None else self._finite & finite.to(self._finite.device)

    def all_finite(self) -> bool:
        return self._finite is None or bool(self._finite)


class Pages:
    """`[heads, tokens, dim]` entries of one layer, appended along the token dimension during capture.

    `capacity` given: preallocated, written in place. `capacity=None`: rolling; `append` then keeps only the entries
    from `keep_from` (an index into the entries after the append) on, as a compact copy. `fp8=True` (preallocated
    only): entries in `float8_e4m3fn` with per-(page, head) `scales` (module docstring).
    """

    def __init__(self, placement: Placement, capacity: int | None, fp8: bool = False):
        if fp8 and capacity is None:
            raise ValueError("fp8 pages are preallocated: a rolling window keeps its few entries in the model dtype")
        self.placement = placement
        self.capacity = capacity
        self.fp8 = fp8
        self.data: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None  # fp8: [heads, pages] fp32
        self._tail: torch.Tensor | None = None  # fp8: full-precision entries of the last, partly filled page
        self.length = 0

    def append(self, values: torch.Tensor, keep_from: int = 0) -> int:
        """Write `values [heads, tokens, dim]` after the current entries; returns how many old entries were dropped."""
        self.placement.check(values)
        source = values.device
        values = values.detach().to(self.placement.where(source))
        if self.fp8:
            self._append_fp8(values, source)
            return 0
        if self.capacity is not None:
            if self.data is None:
                shape = (values.shape[0], self.capacity, values.shape[-1])
                self.data = self.placement.allocate(values.dtype, shape, source)
            end = self.length + values.shape[1]
            self.data[:, self.length : end] = values
            self.length = end
            return 0
        joined = values if self.data is None else torch.cat([self.data, values], dim=1)
        kept = joined[:, keep_from:]
        self.data = self.placement.allocate(kept.dtype, tuple(kept.shape), source).copy_(kept)
        self.length = self.data.shape[1]
        return keep_from

    def _append_fp8(self, values: torch.Tensor, source: torch.device) -> None:
        heads, dim = values.shape[0], values.shape[-1]
        if self.data is None:
            self.data = self.placement.allocate(FP8_DTYPE, (heads, self.capacity, dim), source)
            pages = -(-self.capacity // FP8_PAGE_TOKENS)
            self.scales = self.placement.allocate(torch.float32, (heads, pages), source).fill_(1.0)
        # A partly filled page is quantised again with its new entries, from the full-precision values of that page
        # alone (`_tail`, under one page): the pages do not depend on how the capture was chunked.
        first = self.length // FP8_PAGE_TOKENS * FP8_PAGE_TOKENS
        if self._tail is not None:
            values = torch.cat([self._tail, values], dim=1)
        end = first + values.shape[1]
        entries, scales = quantize_pages(values, FP8_PAGE_TOKENS)
        self.data[:, first:end] = entries
        self.scales[:, first // FP8_PAGE_TOKENS : first // FP8_PAGE_TOKENS + scales.shape[1]] = scales
        partial = end % FP8_PAGE_TOKENS
        complete = end == self.capacity  # the whole prompt is written: its last page will not grow
        self._tail = values[:, values.shape[1] - partial :].clone() if partial and not complete else None
        self.length = end

    def dequantize(self, entries: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """fp8 pages: `entries` (those of `read()` at indices `index`, on any device) in `dtype`."""
        return dequantize_pages(entries, self.scales, index, FP8_PAGE_TOKENS, dtype)

    def read(self, limit: int | None = None) -> torch.Tensor | None:
        """The first `limit` entries (all by default), still on the state's device."""
        if self.data is None:
            return None
        return self.data[:, : self.length if limit is None else limit]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scales) if t is not None]

    def accumulate_grad(self, grad: torch.Tensor) -> None:
        """Add `grad [heads, entries, columns]` (the first entries and columns of the pages) to the pages' `.grad`,
        as autograd would for a leaf: a gradient computed outside the leaf's own graph (another rank's query)."""
        if self.data.grad is None:
            self.data.grad = torch.zeros_like(self.data)
        self.data.grad[:, : grad.shape[1], : grad.shape[-1]] += grad.to(self.data.grad.dtype)
