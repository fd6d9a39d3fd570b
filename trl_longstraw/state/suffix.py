"""The decoded tokens of a group's rows during a rollout: one row's worth of state per row, beside the prompt's.

A rollout decodes a group's completions together against one read-only [`PromptState`]. What each row adds is its
own: the K/V (or MLA latents, DSA indexer keys) of the tokens it has decoded so far, and its recurrent layers'
current conv / recurrent states. [`Suffix`] holds those for all rows of one group, per layer state kind, and never
a copy of the prompt's pages: attention reads the prompt's pages as a block shared by every row and the suffix as
one block per row, merged by log-sum-exp.

Per-token entries are kept in pages of `SUFFIX_PAGE_TOKENS` tokens (fewer where the capacity, the longest possible
completion, is smaller), allocated as the rows reach them: a decode step writes its tokens into the last page and,
when that is full, a new one; nothing is ever copied or reallocated, so a step adds at most its own tokens' pages
(one page, for a step of one token) and a rollout of any length copies nothing. Attention reads the pages as one
block each (`StateAccess.own_entries`); a DSA indexer scores the last page and its own keys as the model does and the
earlier pages block by block, as it visits the prompt's (`state/dsa.py`). A sliding-window layer keeps only its last
`window - 1` entries (a window-sized copy per step, as transformers' sliding-window cache layer); recurrent states are
replaced each step (they are the rows' own). Decode memory for a group is therefore one prompt state plus at most
`rows * (decoded + SUFFIX_PAGE_TOKENS) * (bytes per token of every full-length kind)` plus `rows * (fixed bytes of
every windowed and recurrent kind)`: the state accounting's `bytes_per_token` and `fixed`.
"""

from __future__ import annotations

import torch

SUFFIX_PAGE_TOKENS = 256  # the tokens of a page of a suffix's per-token entries


class Suffix:
    """The per-row state of `rows` decoded sequences continuing one prompt, for up to `capacity` tokens each.

    `length` tokens (per row, all rows in lockstep) are stored; a forward of `T` more tokens extends every kind's
    entries with `extend` and the caller then calls `advance(T)`.
    """

    def __init__(self, rows: int, capacity: int, first_position: int):
        self.rows = rows
        self.capacity = capacity
        self.first_position = first_position  # absolute position of the first decoded token (entry 0)
        self.length = 0
        self._pages: dict[tuple[object, str], list[torch.Tensor]] = {}
        self._windows: dict[tuple[object, str], torch.Tensor] = {}
        self._states: dict[tuple[object, str], torch.Tensor] = {}

    @property
    def page_tokens(self) -> int:
        return min(SUFFIX_PAGE_TOKENS, self.capacity)

    @property
    def last_page_length(self) -> int:
        """The stored entries in the last page (0 when the stored ones fill whole pages): the rows' earlier entries a
        forward's own keys begin with (`extend_last_page`)."""
        return self.length % self.page_tokens

    def positions(self, count: int, new_tokens: int) -> torch.Tensor:
        """Absolute positions of the last `count` entries once a forward of `new_tokens` has extended them (on the
        host, as the attention reads positions)."""
        end = self.first_position + self.length + new_tokens
        return torch.arange(end - count, end)

    @torch.no_grad()
    def extend(
        self, owner: object, name: str, values: torch.Tensor, dim: int, window: int | None = None
    ) -> list[torch.Tensor]:
        """Write `values` (this forward's entries, `T` along `dim`) after the stored ones; return the entries this
        forward reads, as blocks along `dim` ending with these: every page (views, nothing copied), or with a sliding
        `window` one block of the last `window - 1` stored entries and the new ones (only `window - 1` are kept, as
        transformers' sliding-window cache layer does).

        `owner` and `name` identify the entry set (a layer state and, e.g., "key"); its layout is the caller's.
        """
        key = (owner, name)
        if window is not None:
            previous = self._windows.get(key)
            joined = values if previous is None else torch.cat([previous, values], dim=dim)
            keep = min(window - 1, joined.shape[dim])
            self._windows[key] = joined.narrow(dim, joined.shape[dim] - keep, keep).clone()
            return [joined]
        end = self.length + values.shape[dim]
        if end > self.capacity:
            raise ValueError(f"A rollout decoded {end} tokens per row, more than its capacity of {self.capacity}.")
        pages, size = self._pages.setdefault(key, []), self.page_tokens
        written = 0
        while written < values.shape[dim]:
            page, offset = divmod(self.length + written, size)
            if page == len(pages):
                shape = list(values.shape)
                shape[dim] = min(size, self.capacity - page * size)
                pages.append(values.new_empty(shape))
            count = min(values.shape[dim] - written, pages[page].shape[dim] - offset)
            pages[page].narrow(dim, offset, count).copy_(values.narrow(dim, written, count))
            written += count
        full, partial = divmod(end, size)
        return pages[:full] + ([pages[full].narrow(dim, 0, partial)] if partial else [])

    @torch.no_grad()
    def extend_last_page(self, owner: object, name: str, values: torch.Tensor, dim: int) -> torch.Tensor:
        """`extend`, returning the stored entries of the last page followed by `values` as one tensor (at most a page
        and this forward's tokens): what a DSA indexer scores as the forward's own keys."""
        earlier = self.last_page_length
        before = None
        if earlier:
            before = self._pages[(owner, name)][-1].narrow(dim, 0, earlier)  # entries this write leaves alone
        self.extend(owner, name, values, dim)
        return values if before is None else torch.cat([before, values], dim=dim)

    def earlier_pages(self, owner: object, name: str) -> list[torch.Tensor]:
        """The whole pages stored before the last one a forward's own keys begin with (`extend_last_page`), each
        `page_tokens` along the entry dimension, in order."""
        return self._pages.get((owner, name), [])[: self.length // self.page_tokens]

    def state(self, owner: object, name: str) -> torch.Tensor | None:
        """A recurrent layer's current state for every row, or None before its first decoded token."""
        return self._states.get((owner, name))

    def set_state(self, owner: object, name: str, value: torch.Tensor) -> None:
        self._states[(owner, name)] = value.detach()

    def advance(self, count: int) -> None:
        self.length += count

    def nbytes(self) -> int:
        pages = [page for entries in self._pages.values() for page in entries]
        tensors = [*pages, *self._windows.values(), *self._states.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
