"""Prompt groups: which rows of a batch share a prompt, and the one prompt state kept between its uses.

TRL shuffles a generation batch's rows and spreads a group over micro-steps; the trainer captures each distinct
prompt of a micro-batch (`group_rows_by_prompt`) and keeps at most one state alive between uses
(`KeptPromptState`), reused only while it is that prompt's and the weights have not moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PromptGroup:
    """The rows of a batch that share one prompt (a GRPO group, or the part of it in this micro-batch)."""

    index: int  # order of first appearance in the batch
    rows: list[int]  # row indices, ascending
    prompt_ids: torch.Tensor  # [P] real prompt tokens (left padding removed)
    first_position: int  # position of prompt_ids[0], as the padded full-sequence forward numbers it
    completion_lengths: list[int]  # real completion tokens per row

    def same_prompt(self, prompt_ids: torch.Tensor, first_position: int) -> bool:
        return first_position == self.first_position and torch.equal(
            prompt_ids.to(self.prompt_ids.device), self.prompt_ids
        )


def group_rows_by_prompt(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    max_positions: int | None,
    positions_follow_mask: bool = False,
) -> list[PromptGroup]:
    """Group a batch's rows by identical `(prompt_ids, prompt_mask)`, wherever they sit; raise on bad layouts.

    TRL shuffles rows across the whole generation batch and lets a group span micro-steps, so a micro-batch holds any
    number of rows of any number of groups, in any order. Rows with the same prompt need one capture, whichever group
    they were sampled in. A group's first real token sits where the model's own forward puts it: at its index in the
    padded row, or at 0 for a model that numbers positions from the attention mask (`positions_follow_mask`).
    """
    total_length = prompt_ids.shape[1] + completion_mask.shape[1]
    if max_positions is not None and total_length > max_positions:
        raise ValueError(
            f"Prompt ({prompt_ids.shape[1]} tokens, padded) plus completion ({completion_mask.shape[1]} tokens) "
            f"spans {total_length} positions, more than the model's max_position_embeddings={max_positions}. "
            "Truncate the prompts, lower max_completion_length, or use a model configured for longer context."
        )
    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    inverse = inverse.tolist()
    rows_of: dict[int, list[int]] = {}
    for row, key in enumerate(inverse):
        rows_of.setdefault(key, []).append(row)
    lengths = completion_mask.sum(1).tolist()
    groups = []
    for index, rows in enumerate(sorted(rows_of.values(), key=lambda rows: rows[0])):
        real = prompt_mask[rows[0]].bool()
        num_real = int(real.sum())
        padding = prompt_ids.shape[1] - num_real
        if num_real == 0 or not bool(real[padding:].all()):
            raise ValueError(
                f"Row {rows[0]}: prompt_mask must be left-padded and non-empty (got {prompt_mask[rows[0]].tolist()})."
            )
        groups.append(
            PromptGroup(
                index,
                rows,
                prompt_ids[rows[0], padding:].clone(),  # not a view: a kept group must not pin the batch
                0 if positions_follow_mask else padding,
                [int(lengths[r]) for r in rows],
            )
        )
    return groups


class KeptPromptState:
    """The one prompt state kept between uses: the last group scored or replayed (or rolled out), while the weights
    stay put. Its one owner is the trainer; every other holder gets the state by `get`, which hands it over.

    `get` releases the slot whether or not the state matches, so at most one state is alive besides the caller's
    (a capture that follows a miss does not find the old state still held).
    """

    def __init__(self):
        self._group: PromptGroup | None = None
        self._state: Any = None

    @property
    def group(self) -> PromptGroup | None:
        """The group whose state is kept, or None."""
        return self._group

    def get(self, group: PromptGroup, weights_version: int) -> Any:
        """The kept state if it is `group`'s prompt and was captured under `weights_version`, else None; the slot is
        empty afterwards either way."""
        kept, state = self._group, self._state
        self.invalidate()
        if (
            kept is not None
            and kept.same_prompt(group.prompt_ids, group.first_position)
            and state.weights_version == weights_version
        ):
            return state
        return None

    def keep(self, group: PromptGroup, state: Any) -> None:
        """Keep `state` (captured for `group`'s prompt), replacing whatever was kept."""
        self._group, self._state = group, state

    def invalidate(self) -> None:
        """Release the kept state: generation needs the memory, or the weights moved."""
        self._group = self._state = None
