"""Needle-in-a-haystack retrieval: a synthetic long-context task and its rewards, built in code (no download).

Every prompt is a haystack of random lowercase words with one needle ("the secret key is 4821. ") planted at a random
word boundary, followed by the question. The content of every prompt has exactly `prompt_chars` characters of printable
ASCII, so with the embedded character-level tokenizer all prompts tokenize to the same length: a generation batch needs
no padding, and the prompt length the run measures is the one that was asked for.
"""

from __future__ import annotations

import random
import string
from typing import Any

from datasets import Dataset

QUESTION = "What is the secret key?"
ANSWER_DIGITS = 4  # a fixed width keeps the needle, hence the prompt, the same length in every sample
NEEDLE_TEMPLATE = "the secret key is {answer}. "
MIN_WORD, MAX_WORD = 2, 8


def _filler(rng: random.Random, num_chars: int) -> str:
    """`num_chars` characters of space-terminated random lowercase words.

    The last word absorbs whatever is left over after the last whole word fits, so the length is exact and the text
    never holds two spaces in a row.
    """
    words: list[str] = []
    length = 0
    while True:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(MIN_WORD, MAX_WORD)))
        if length + len(word) + 1 > num_chars:
            break
        words.append(word)
        length += len(word) + 1
    words[-1] += "".join(rng.choices(string.ascii_lowercase, k=num_chars - length))
    return "".join(word + " " for word in words)


def haystack_with_needle(rng: random.Random, num_chars: int) -> tuple[str, str]:
    """`num_chars` characters of random words with a needle planted at a random word boundary, and its answer."""
    answer = "".join(rng.choices(string.digits, k=ANSWER_DIGITS))
    needle = NEEDLE_TEMPLATE.format(answer=answer)
    haystack = _filler(rng, num_chars - len(needle))
    word_starts = [0] + [i + 1 for i, char in enumerate(haystack[:-1]) if char == " "]
    depth = rng.choice(word_starts)
    return haystack[:depth] + needle + haystack[depth:], answer


def _needle_sample(rng: random.Random, prompt_chars: int) -> dict[str, Any]:
    haystack, answer = haystack_with_needle(rng, prompt_chars - len(QUESTION))
    return {"prompt": [{"role": "user", "content": haystack + QUESTION}], "answer": answer}


def build_needle_dataset(num_prompts: int, prompt_chars: int, seed: int = 0) -> Dataset:
    """`num_prompts` needle prompts whose user message is exactly `prompt_chars` characters, deterministic in `seed`.

    Columns: `prompt` (conversational, one user turn) and `answer` (the needle's digits, read by `needle_reward`).
    """
    minimum = len(NEEDLE_TEMPLATE.format(answer="0" * ANSWER_DIGITS)) + len(QUESTION) + MAX_WORD + 1
    if prompt_chars < minimum:
        raise ValueError(
            f"prompt_chars={prompt_chars} is too short for a needle, a question and a haystack word: "
            f"use at least {minimum}."
        )
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be positive.")
    rng = random.Random(seed)
    samples = [_needle_sample(rng, prompt_chars) for _ in range(num_prompts)]
    return Dataset.from_list(samples)


def _completion_text(completion: str | list[dict[str, str]]) -> str:
    """The text of a standard (str) or conversational (list of messages) completion."""
    if isinstance(completion, str):
        return completion
    return "".join(message["content"] for message in completion)


def needle_reward(completions: list[str | list[dict[str, str]]], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the answer appears anywhere in the completion, else the fraction of the answer's leading characters
    that the completion starts with (after leading whitespace).

    The partial credit gives a group of mostly wrong completions distinct rewards, so GRPO's group-normalised advantage
    is non-zero early in training, when exact hits are rare.
    """
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = _completion_text(completion)
        if expected in text:
            rewards.append(1.0)
            continue
        text = text.lstrip()
        matched = 0
        while matched < min(len(text), len(expected)) and text[matched] == expected[matched]:
            matched += 1
        rewards.append(matched / len(expected))
    return rewards


def digits_only_reward(completions: list[str | list[dict[str, str]]], **kwargs: Any) -> list[float]:
    """The fraction of the completion's non-whitespace characters that are digits (0.0 for an empty completion).

    A format reward: the answer is a bare number. Unlike `needle_reward`, it varies between the completions of an
    untrained model, so the groups of early steps already carry an advantage, and the replay has a gradient to push.
    A correct bare answer still scores highest on the sum, so the format term cannot outbid the task.
    """
    rewards = []
    for completion in completions:
        characters = "".join(_completion_text(completion).split())
        rewards.append(sum(char.isdigit() for char in characters) / len(characters) if characters else 0.0)
    return rewards
