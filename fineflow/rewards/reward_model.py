"""The champion reward model's score of each completion: the registry's champion of the reward kind (trained by the
objective of that name, promoted by the gate) run on the row's prompt with the completion as its answer.

    reward = r(prompt, completion)    the champion's scalar head on its base (fineflow.registry.reward_champion)

The prompt is the row's: ``instruction`` and ``input``, or ``messages`` (the completion replaces a final assistant
message, or answers the conversation). Rendered and cut as ``fineflow reward score`` renders them: the
champion's tokenizer and chat template, its training run's tokenize.seq_len. The model loads on the first score,
not when the set is built, and stays loaded for the next batches (``close`` lets it go); a registry with no reward
champion is then a FineflowError saying how to train one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fineflow.param_section import Section
from fineflow.rewards.interface import MESSAGES, Reward


class RewardModelSettings(Section):
    registry: str = Field("models/registry", min_length=1, description="the registry whose reward champion scores")
    base_dir: str | None = Field(None, description="the base to load the champion on (None: the one it names)")
    batch_size: int = Field(8, ge=1, description="completions scored together")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: this process's GPU when it has one")


class ChampionReward(Reward):
    name = "reward_model"
    summary = "the registry's champion reward model's score of the prompt and the completion"
    settings_model = RewardModelSettings

    def __init__(self, settings=None):
        super().__init__(settings)
        self._scorer = None

    @property
    def needs(self) -> tuple[str, ...]:
        return (f"instruction|{MESSAGES}",)

    def score(self, completions: list[str], rows: list[dict]) -> list[float]:
        if not completions:
            return []
        scored = [answered(row, completion) for row, completion in zip(rows, completions)]
        rewards = self.scorer().score(scored, self.settings.batch_size, where=f"reward {self.name}")
        return [float(r) for r in rewards]

    def scorer(self):
        """The champion, loaded on the first call (fineflow.registry.reward_champion.ChampionScorer)."""
        if self._scorer is None:
            from pathlib import Path

            from fineflow.registry.reward_champion import ChampionScorer

            self._scorer = ChampionScorer.load(Path(self.settings.registry), self.settings.base_dir, self._device())
        return self._scorer

    def _device(self) -> str:
        if self.settings.device != "auto":
            return self.settings.device
        import torch

        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"

    def close(self) -> None:
        self._scorer = None


def answered(row: dict, completion: str) -> dict:
    """The row's prompt with the completion as its answer, in the row's own form (SFT fields, or messages)."""
    if MESSAGES in row:
        messages = list(row[MESSAGES])
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        return {MESSAGES: [*messages, {"role": "assistant", "content": completion}]}
    return {"instruction": row["instruction"], "input": row.get("input") or "", "output": completion}
