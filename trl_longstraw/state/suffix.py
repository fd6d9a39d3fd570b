"""The decoded tokens of a group's rows during a rollout: one row's worth of state per row, beside the prompt's.

A rollout decodes a group's completions together against one read-only [`PromptState`]. What each row adds is its
own: the K/V (or MLA latents, DSA indexer keys) of the tokens it has decoded so far, and its recurrent layers'
current conv / recurrent states. [`Suffix`] holds those for all rows of one group, per layer state kind, and never
a copy of the prompt's pages: attention reads the prompt's pages as a block shared by every row and the suffix as
one block per row, merged by log-sum-exp.

Per-token entries grow with the rows' decoded length, by at least a page of `SUFFIX_PAGE_TOKENS` and at least half
what they hold, up to `capacity` (the longest possible completion): a row that stops early never holds the
capacity's worth, each entry is copied a bounded number of times in all (at most twice on average, so a long
rollout's copying is linear in its length, not quadratic), and a decode step writes in place but for those growths;
a sliding-window layer keeps only its last `window - 1` entries (a window-sized copy per step, as transformers'
sliding-window cache layer); recurrent states are replaced each step (they are the rows' own). Decode memory for a
group is therefore one prompt state plus at most `rows * (1.5 * decoded + SUFFIX_PAGE_TOKENS) * (bytes per token of
every full-length kind)` plus `rows * (fixed bytes of every windowed and recurrent kind)`: the state accounting's
`bytes_per_token` and `fixed`.
"""

from __future__ import annotations

import torch

SUFFIX_PAGE_TOKENS = 256  # the least a suffix's per-token entries grow by


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
        self._entries: dict[tuple[object, str], torch.Tensor] = {}
        self._windows: dict[tuple[object, str], torch.Tensor] = {}
        self._states: dict[tuple[object, str], torch.Tensor] = {}

    def positions(self, count: int, new_tokens: int) -> torch.Tensor:
        """Absolute positions of the last `count` entries once a forward of `new_tokens` has extended them (on the
        host, as the attention reads positions)."""
        end = self.first_position + self.length + new_tokens
        return torch.arange(end - count, end)

    @torch.no_grad()
    def extend(
        self, owner: object, name: str, values: torch.Tensor, dim: int, window: int | None = None
    ) -> torch.Tensor:
        """Write `values` (this forward's entries, `T` along `dim`) after the stored ones; return the entries this
        forward reads: all of them (a view), or with a sliding `window` the last `window - 1` stored ones and the new
        ones (only `window - 1` are kept, as transformers' sliding-window cache layer does).

        `owner` and `name` identify the entry set (a layer state and, e.g., "key"); its layout is the caller's.
        """
        key = (owner, name)
        if window is not None:
            previous = self._windows.get(key)
            joined = values if previous is None else torch.cat([previous, values], dim=dim)
            keep = min(window - 1, joined.shape[dim])
            self._windows[key] = joined.narrow(dim, joined.shape[dim] - keep, keep).clone()
            return joined
        end = self.length + values.shape[dim]
        if end > self.capacity:
            raise ValueError(f"A rollout decoded {end} tokens per row, more than its capacity of {self.capacity}.")
        buffer = self._entries.get(key)
        if buffer is None or buffer.shape[dim] < end:
            held = 0 if buffer is None else buffer.shape[dim]
            wanted = max(end, held + held // 2)
            shape = list(values.shape)
            shape[dim] = min(self.capacity, -(-wanted // SUFFIX_PAGE_TOKENS) * SUFFIX_PAGE_TOKENS)
            grown = values.new_empty(shape)
            if buffer is not None:
                grown.narrow(dim, 0, self.length).copy_(buffer.narrow(dim, 0, self.length))
            buffer = self._entries[key] = grown
        buffer.narrow(dim, self.length, values.shape[dim]).copy_(values)
        return buffer.narrow(dim, 0, end)

    def state(self, owner: object, name: str) -> torch.Tensor | None:
        """A recurrent layer's current state for every row, or None before its first decoded token."""
        return self._states.get((owner, name))

    def set_state(self, owner: object, name: str, value: torch.Tensor) -> None:
        self._states[(owner, name)] = value.detach()

    def advance(self, count: int) -> None:
        self.length += count

    def nbytes(self) -> int:
        tensors = [*self._entries.values(), *self._windows.values(), *self._states.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
