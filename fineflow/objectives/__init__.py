"""train.objective: one module per objective, each a subclass of ``Objective`` (interface.py) that the stages ask for
its rows, its loss, whether it needs a reference model and what evaluate reports for it; no stage names one.

interface.py     the interface: Objective, PairObjective (a reward per answer, -logsigmoid of the margin),
                 BatchLoss, the row schemas (EXAMPLES, PAIRS, FEEDBACK)
sft.py           SFT: next-token loss on the answers
dpo.py           DPO: pairs against a frozen reference (its log-probs from the reference_logps stage)
simpo.py         SimPO: pairs, reference-free, length-normalised, with a margin
orpo.py          ORPO: pairs, reference-free, the chosen answer's SFT loss plus an odds-ratio term
kto.py           KTO: unpaired answers labelled desirable/undesirable, against a reference, with a KL estimate
reward_model.py  a reward model: pairs, LoRA and a scalar head, Bradley-Terry loss (model_kind: not a generator)
grpo.py          GRPO (DAPO, Dr. GRPO): online RL, completions sampled per prompt and scored by rewards
rollouts.py      an online objective's rollout phase: generation, rewards, advantages, the step's micro-batches
token_loss.py    the next-token loss, plain or chunked so the logits never exist whole (train.loss_chunk_tokens)
pair_params.py   train.preference: what the preference objectives share (beta, the model a run starts from)
pair_logps.py    each pair's chosen and rejected sequence log-probs under a model, from a packed pair batch

Imports nothing of fineflow but ``fineflow.errors`` and ``fineflow.param_section``: every package may ask it (params
validation included: each objective's own settings section, Objective.params, becomes train.<name>).
Adding one: a module with its subclass, and its line in OBJECTIVES below (docs/objectives.md).
"""

from __future__ import annotations

from fineflow.errors import ConfigError
from fineflow.objectives.dpo import DPO
from fineflow.objectives.grpo import GRPO
from fineflow.objectives.interface import EXAMPLES, FEEDBACK, PAIRS, PREFERENCE_TASK, BatchLoss, Objective
from fineflow.objectives.kto import KTO
from fineflow.objectives.orpo import ORPO
from fineflow.objectives.reward_model import RewardModel
from fineflow.objectives.sft import SFT
from fineflow.objectives.simpo import SimPO

OBJECTIVES: dict[str, Objective] = {
    objective.name: objective for objective in (SFT(), DPO(), SimPO(), ORPO(), KTO(), RewardModel(), GRPO())
}
NAMES = tuple(OBJECTIVES)


def objective_for(name: str) -> Objective:
    """The objective train.objective names (params validation refuses any other name before a stage runs)."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ConfigError(f"train.objective: {name!r} is not one of {', '.join(NAMES)}") from None


def described() -> str:
    """train.objective's description in the params reference: each objective and what it trains."""
    return "; ".join(f"{objective.name}: {objective.summary}" for objective in OBJECTIVES.values())


__all__ = [
    "EXAMPLES",
    "FEEDBACK",
    "NAMES",
    "OBJECTIVES",
    "PAIRS",
    "PREFERENCE_TASK",
    "BatchLoss",
    "Objective",
    "objective_for",
]
