"""Where a group's members are replayed from: the segments of a long member, and the prefix tree of what members share.

A member's replay feeds `[last prompt token, completion...]`: `length + 1` tokens, token `t` predicting completion
token `t` (the last one predicting nothing). Both structures here are spans of those token indices, found from the
token ids alone.

- `segments`: a span cut into pieces of `replay_segment_size` tokens, each forwarded (and back-propagated) on its
  own, the later ones reading the earlier ones' state (`LongStrawEngine.replay_member`).
- `prefix_tree`: members that predict the same tokens over a span share it (the same first turns of an agent
  episode, tree-shaped rollouts, a completion prefix given in the data): each shared span is run once for all the
  members below it, its gradient the sum of theirs (`LongStrawEngine.replay_group`).

A forward always takes at least two tokens: a linear-attention layer fed one token takes its single-token decode
kernel, which is not differentiable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

IGNORED = -100  # the label of a token that predicts nothing (TRL's and transformers' ignore index)


def segments(first: int, end: int, size: int | None) -> list[tuple[int, int]]:
    """`[start, end)` pieces of tokens `first .. end - 1`, `size` tokens each, the last one longer where a piece of a
    single token would remain; the whole span when `size` is None or the span fits."""
    if size is None or end - first <= size:
        return [(first, end)]
    starts = list(range(first, end, size))
    if end - starts[-1] < 2:
        starts.pop()
    return list(zip(starts, starts[1:] + [end], strict=True))


@dataclass
class PrefixNode:
    """Tokens `start .. end - 1` that `members` (indices into the group) feed and predict alike, run once for them.

    `children` are the spans shared further by some of them; the others (`leaves`) go on alone from `end`. Tokens
    before `start` are shared with the node above (or are the members' first tokens, for a root)."""

    start: int
    end: int
    members: list[int]
    children: list[PrefixNode] = field(default_factory=list)

    @property
    def leaves(self) -> list[int]:
        below = {member for child in self.children for member in child.members}
        return [member for member in self.members if member not in below]


def prefix_tree(labels: list[list[int]], min_tokens: int, own_tokens: int = 2) -> list[PrefixNode]:
    """The spans of at least `min_tokens` tokens that two or more members predict alike, as trees: `labels[i]` is
    member `i`'s label per replayed token (its completion, then `IGNORED`). A span stops `own_tokens` (at least two)
    tokens before its shortest member's end, so that every member still feeds that many tokens of its own (under
    context parallelism, two per rank)."""
    own_tokens = max(own_tokens, 2)
    return _shared(list(range(len(labels))), 0, labels, max(min_tokens, 2), own_tokens)


def _shared(
    members: list[int], start: int, labels: list[list[int]], min_tokens: int, own_tokens: int
) -> list[PrefixNode]:
    """The nodes of `members`, which predict alike before `start` (or start there)."""
    if len(members) < 2:
        return []
    shortest = min(len(labels[member]) for member in members)
    agreed = start
    while agreed < shortest and len({labels[member][agreed] for member in members}) == 1:
        agreed += 1
    end = min(agreed, shortest - own_tokens)
    if end - start >= min_tokens:
        children = [
            node
            for group in _split(members, end, labels)
            for node in _shared(group, end, labels, min_tokens, own_tokens)
        ]
        return [PrefixNode(start, end, members, children)]
    if agreed >= shortest:  # alike to the end of the shortest member, and too short to share
        return []
    # they part at `agreed`: each group of those that go on alike may still share a long enough span from `start`
    return [
        node
        for group in _split(members, agreed, labels)
        for node in _shared(group, start, labels, min_tokens, own_tokens)
    ]


def _split(members: list[int], at: int, labels: list[list[int]]) -> list[list[int]]:
    """`members` grouped by their label at token `at` (in first appearance order); a member that ends before `at`
    alone."""
    groups: dict[object, list[int]] = {}
    for member in members:
        key = labels[member][at] if at < len(labels[member]) else ("ended", member)
        groups.setdefault(key, []).append(member)
    return list(groups.values())
