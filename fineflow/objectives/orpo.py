"""ORPO (Hong et al. 2024): preference pairs, reference-free, the SFT loss on the chosen answer plus an odds-ratio
term that makes the chosen answer likelier than the rejected one.

    p(y)  = exp(log pi(y|x) / |y|)                       the answer's mean per-token probability
    odds  = p / (1 - p)
    loss  = -log pi(chosen|x) / |chosen|  -  lambda * logsigmoid(log odds(chosen) - log odds(rejected))

per pair, summed over the batch's pairs (the loop divides by the global batch's pair count: the NLL term is the
mean over pairs of each chosen answer's mean token loss, the paper's SFT term on the answer). TRL 1.16's ORPOTrainer
takes its NLL over the chosen sequences' prompt tokens too, as one token mean over the batch: the two agree only with
one-token prompts and chosen answers of one length (bench/objective_losses_trl.py compares the odds-ratio term
apart, and the whole loss on such a batch). lambda is train.orpo.odds_ratio_weight (ORPOParams, its own
section). The step log's rewards are TRL's: lambda times each answer's mean log-prob.
"""

from __future__ import annotations

from pydantic import Field

from fineflow.objectives.interface import BatchLoss, PairObjective
from fineflow.param_section import Section


class ORPOParams(Section):
    """train.orpo: ORPO's own settings."""

    odds_ratio_weight: float = Field(
        0.1, gt=0, description="lambda: the weight of the odds-ratio term beside the chosen answer's SFT loss"
    )


class ORPO(PairObjective):
    name = "orpo"
    summary = "preference pairs, reference-free: the chosen answer's SFT loss plus an odds-ratio term"
    params = ORPOParams

    def rewards(self, policy, reference, cfg):
        chosen, rejected = _mean_logps(policy)
        weight = cfg.orpo.odds_ratio_weight
        return weight * chosen, weight * rejected

    def pair_loss(self, policy, reference, cfg) -> BatchLoss:
        import torch
        import torch.nn.functional as F

        chosen, rejected = _mean_logps(policy)
        # log(p / (1 - p)) = log p - log(1 - exp(log p)); log p < 0 strictly for any real model's answer
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        loss_sum = (-chosen - cfg.orpo.odds_ratio_weight * F.logsigmoid(log_odds)).sum()
        margin = cfg.orpo.odds_ratio_weight * (chosen - rejected)
        return BatchLoss(loss_sum, int(margin.numel()), (float((margin > 0).sum()), float(margin.detach().sum())))


def _mean_logps(policy):
    """Each pair's chosen and rejected answer's mean per-token log-prob."""
    return policy.chosen / policy.chosen_len.clamp(min=1), policy.rejected / policy.rejected_len.clamp(min=1)
