"""A multi-turn tool task with long tool outputs, built in code (no download): the answer is in a report that the
model reads with a tool.

Every prompt asks for the secret key of one of `count` named reports and offers one tool, `read_report(name)`
(`ReportTask.read_report`), which returns that report: `report_chars` characters of random words with the key
planted at a random word boundary (the needle task's haystack, `needle_task.haystack_with_needle`). Each call adds a tool output of `report_chars`
tokens under the embedded character-level tokenizer to the member's completion: masked from the loss by TRL's
`tool_mask`, yet run through the model by the scoring and the replay, as stock runs it. That is what
`replay_segment_size` is for (docs/long-completions.md): a completion of several such turns is longer than its prompt.

Rewards: `report_key_reward` (1 where the last assistant turn names the key of the report its prompt asked for), what
a model that reads learns; `tool_use_reward` (1 where the completion called a tool), what the embedded tiny model
learns (it calls `read_report` at the start of a turn, about half the time untrained).
"""

from __future__ import annotations

import random
from typing import Any

from datasets import Dataset
from needle_task import ANSWER_DIGITS, MAX_WORD, NEEDLE_TEMPLATE, haystack_with_needle  # sibling module of this script

QUESTION = "What is the secret key in report {name}? Read it with the read_report tool, then answer with the key."
MIN_REPORT_CHARS = len(NEEDLE_TEMPLATE.format(answer="0" * ANSWER_DIGITS)) + MAX_WORD + 1
# The embedded tool-calling model's one call (one token of its tokenizer): it always reads the first report, opening a
# call at the start of an assistant turn with probability about one half (trl_longstraw.embedded.build_tool_calling_model)
EMBEDDED_TOOL_CALL = '\n{"name": "read_report", "arguments": {"name": "r0"}}\n'
EMBEDDED_CALL_LOGIT = 7.5


def report_name(index: int) -> str:
    return f"r{index}"


class ReportTask:
    """`count` reports of `report_chars` characters each, a prompt per report asking for its key, and the tool that
    reads them. Built from `seed` alone, so every rank builds the same reports."""

    def __init__(self, count: int, report_chars: int, seed: int = 0):
        if report_chars < MIN_REPORT_CHARS:
            raise ValueError(
                f"report_chars={report_chars} is too short for a key and a word: use at least {MIN_REPORT_CHARS}."
            )
        if count < 1:
            raise ValueError(f"num_prompts={count} must be positive.")
        rng = random.Random(seed)
        reports = [haystack_with_needle(rng, report_chars) for _ in range(count)]
        self.reports = {report_name(index): text for index, (text, _) in enumerate(reports)}
        self.answers = [answer for _, answer in reports]

    def read_report(self, name: str) -> str:
        """Read a report.

        Args:
            name: The report's name, as the question gives it.
        """
        return self.reports.get(name, f"There is no report named {name!r}.")

    def dataset(self) -> Dataset:
        """A conversational `prompt` per report, and its `answer`."""
        prompts = [
            [{"role": "user", "content": QUESTION.format(name=report_name(index))}]
            for index in range(len(self.answers))
        ]
        return Dataset.from_dict({"prompt": prompts, "answer": self.answers})


def _messages(completion: Any) -> list[dict]:
    return completion if isinstance(completion, list) else [{"role": "assistant", "content": str(completion)}]


def tool_use_reward(completions: list[Any], **kwargs) -> list[float]:
    """1.0 where the completion called a tool (an assistant turn with tool calls, or a tool's answer in it)."""
    return [
        float(any(message.get("tool_calls") or message.get("role") == "tool" for message in _messages(completion)))
        for completion in completions
    ]


def report_key_reward(completions: list[Any], answer: list[str], **kwargs) -> list[float]:
    """1.0 where the completion's last assistant turn names the key."""
    rewards = []
    for completion, key in zip(completions, answer, strict=True):
        said = [message for message in _messages(completion) if message.get("role") == "assistant"]
        rewards.append(float(bool(said) and key in str(said[-1].get("content") or "")))
    return rewards
