"""GRPO (Shao et al. 2024) and its loss normalisations (DAPO: Yu et al. 2025; Dr. GRPO: Liu et al. 2025): online RL
with verifiable rewards. The training rows are prompts with what the rewards check (an SFT row: its ``output`` is the
reference answer); each optimizer step generates its own batch.

For each prompt the loop drew (the packed SFT shard's examples of the step's rows: prompt tokens and the reference
answer), the policy samples a group of G = train.grpo.group_size completions; the rewards (fineflow.rewards, weighted
by train.grpo.rewards) score each one; the group-relative advantage of completion i is

    A_i = (r_i - mean(r)) / (std(r) + 1e-4)        grpo, dapo        (std: the group's, unbiased, as TRL's)
    A_i =  r_i - mean(r)                           dr_grpo           (no scaling by the group's spread)

and every completion token t is trained with the clipped policy-gradient loss, plus beta times the k3 estimate of
the KL to the reference model (beta = train.grpo.beta; 0: no reference forward runs):

    ratio_t = pi(y_t) / pi_old(y_t)   (1 in value: one optimizer step per generation batch, so pi_old = pi detached)
    k3_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1
    l_t     = -min(ratio_t A, clip(ratio_t, 1 - eps, 1 + eps_high) A) + beta k3_t

summed as train.grpo.normalization says (the loop divides by the global batch's count of what the sum is over):
grpo: each completion's token mean, over completions; dapo: every token, over the global batch's completion tokens;
dr_grpo: each completion's token sum / max_completion_tokens, over completions. That is TRL 1.16's GRPOTrainer's
loss_type grpo, dapo and dr_grpo.

Sampling is seeded per group by (seed, step, the example's shard row and place in it), never by rank or batch, so a
resumed run generates the same completions and 2 ranks generate what 1 process does. The reference is the model the
run starts from (train.preference.reference: the champion's adapter on the base, or the base): the base with the
adapter switched off when the run starts from the base, else a frozen copy of the start. The held-out loss the
loop reports (train.eval_every) is the SFT loss of the eval rows' answers: the guard against forgetting them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fineflow.errors import FineflowError
from fineflow.objectives.interface import EXAMPLES, BatchLoss, Objective
from fineflow.reward_spec import RewardsParams

NORMALIZATIONS = ("grpo", "dapo", "dr_grpo")
# the step's rollout sums, reduced over ranks in this order (Objective.rollout_stats)


class GRPOParams(RewardsParams):
    """train.grpo: GRPO's own settings, its rewards among them (its start and reference: train.preference.reference)."""

    group_size: int = Field(
        4, ge=2, description="completions sampled per prompt (G): the group their advantage is relative to"
    )
    max_completion_tokens: int = Field(32, gt=0, description="the most tokens a completion may have (it stops at EOS)")
    temperature: float = Field(1.0, gt=0, description="the sampling temperature of the rollouts")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of the rollouts (1: the whole distribution)")
    beta: float = Field(0.0, ge=0, description="the KL penalty's weight against the reference (0: no reference runs)")
    epsilon: float = Field(0.2, gt=0, lt=1, description="the clip range below and above 1 of the probability ratio")
    epsilon_high: float | None = Field(
        None, gt=0, description="the clip range above 1 (DAPO's clip-higher, e.g. 0.28); unset: epsilon"
    )
    normalization: Literal["grpo", "dapo", "dr_grpo"] = Field(
        "grpo",
        description="grpo: each completion's token mean, then the mean over completions; dapo: the mean over all "
        "completion tokens of the batch; dr_grpo: token sums over max_completion_tokens, advantages not scaled by "
        "the group's std",
    )


class GRPO(Objective):
    name = "grpo"
    summary = "online RL: completions sampled per prompt, scored by rewards, group-relative clipped policy gradient"
    rows = EXAMPLES  # a prompt and its reference answer (output), what the rewards check
    anchored = True  # starts from train.preference.reference's model, its KL reference too
    online = True
    params = GRPOParams

    def check_run(self, cfg, profile) -> None:
        refuse_unsupported(cfg, profile.sharding)

    def online_settings(self, cfg) -> GRPOParams:
        return cfg.grpo

    def advantages(self, rewards, cfg):
        return group_advantages(rewards, cfg.grpo.normalization)

    def loss_targets(self, completions: int, completion_tokens: int, cfg) -> int:
        """What the loss is a sum over: completion tokens (dapo), else completions."""
        return completion_tokens if cfg.grpo.normalization == "dapo" else completions

    def loss(self, model, batch: dict, cfg=None, **forward_kwargs) -> BatchLoss:
        if "advantages" not in batch:  # the loop's held-out loss on the eval shard: SFT's, the guard
            from fineflow.objectives.sft import SFT

            return SFT().loss(model, batch, cfg, **forward_kwargs)
        from fineflow.objectives.pair_logps import token_logps, trained_positions

        _, at = trained_positions(batch["labels"])
        logps = token_logps(model, batch, **forward_kwargs)
        reference = batch["ref_logps"][at] if "ref_logps" in batch else None
        old = batch["old_logps"][at] if "old_logps" in batch else None
        return policy_loss(logps, batch["advantages"][at], reference, at, cfg.grpo, old)


def policy_loss(logps, advantages, reference, at, settings: GRPOParams, old=None) -> BatchLoss:
    """The batch's summed clipped policy-gradient loss (and KL penalty) under settings.normalization. logps,
    advantages, reference (or None) and old, the log-probs of the policy that sampled the completions (None: this
    very policy, detached: ratio 1 in value): one value per completion token, the True cells of ``at`` (rows x
    seq, one completion per row) in row-major order."""
    import torch

    ratio = torch.exp(logps - (logps.detach() if old is None else old))
    high = settings.epsilon_high if settings.epsilon_high is not None else settings.epsilon
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if settings.beta > 0 and reference is not None:
        delta = reference - logps
        per_token = per_token + settings.beta * (torch.exp(delta) - delta - 1)
    if settings.normalization == "dapo":
        return BatchLoss(per_token.sum(), int(per_token.numel()))
    rows = at.shape[0]
    full = torch.zeros(at.shape, dtype=per_token.dtype, device=per_token.device)
    full[at] = per_token
    sums = full.sum(dim=1)
    if settings.normalization == "dr_grpo":
        return BatchLoss(sums.sum() / settings.max_completion_tokens, rows)
    lengths = at.sum(dim=1).clamp(min=1).to(per_token.dtype)
    return BatchLoss((sums / lengths).sum(), rows)


def group_advantages(rewards, normalization: str):
    """Each completion's advantage within its group: rewards (groups x G) less the group's mean, over the group's
    unbiased std + 1e-4 (grpo, dapo) or unscaled (dr_grpo)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if normalization == "dr_grpo":
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + 1e-4)


def refuse_unsupported(cfg, sharding: str) -> None:
    """What GRPO does not run with yet, refused before the model loads."""
    if sharding != "none":
        raise FineflowError(
            f"train.objective grpo generates its rollouts with the unsharded model: the accelerate profile's "
            f"sharding {sharding} is not supported for it; use a DDP or single-process profile"
        )
    if cfg.method == "full" and cfg.grpo.beta > 0:
        raise FineflowError(
            "train.objective grpo with train.method full and train.grpo.beta > 0 would hold a second full copy "
            "of the model as the reference: set train.grpo.beta: 0, or train.method lora"
        )
