"""User reward functions for tests/test_rewards.py, imported by path (``tests.reward_functions:NAME``) in the user
reward's worker process: one that works, and one for each way a function can fail."""

from __future__ import annotations

import os
import time


def contains_answer(completions: list[str], rows: list[dict]) -> list[float]:
    """1 when the row's ``answer`` column appears in the completion."""
    return [float(str(row["answer"]) in completion) for completion, row in zip(completions, rows)]


def threads(completions: list[str], rows: list[dict]) -> list[float]:
    """The worker's OMP_NUM_THREADS, for every completion (what the thread plan set)."""
    return [float(os.environ["OMP_NUM_THREADS"])] * len(completions)


def hangs(completions: list[str], rows: list[dict]) -> list[float]:
    time.sleep(60)
    return [1.0] * len(completions)


def raises(completions: list[str], rows: list[dict]) -> list[float]:
    raise ValueError("the test suite did not compile")


def one_short(completions: list[str], rows: list[dict]) -> list[float]:
    return [1.0] * (len(completions) - 1)


def not_numbers(completions: list[str], rows: list[dict]) -> list:
    return ["yes"] * len(completions)


def exits(completions: list[str], rows: list[dict]) -> list[float]:
    os._exit(3)


NOT_A_FUNCTION = 42
