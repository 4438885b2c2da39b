"""KTO (Ethayarajh et al. 2024): unpaired feedback, each answer labelled desirable or undesirable, against a frozen
reference model.

    r(y)  = log pi(y|x) - log ref(y|x)                                  the answer's log-ratio
    z     = max(0, mean over the batch of (log pi(y'|x) - log ref(y'|x)))  the KL estimate, no gradient
            (over the rows whose KL sample kept a trained token: tokenize.seq_len may leave a long row's sample
            only its prompt)
    loss  = w_D * (1 - sigmoid(beta * (r - z)))   for a desirable answer
            w_U * (1 - sigmoid(beta * (z - r)))   for an undesirable one

per row, summed over the batch's rows (the loop divides by the global batch's row count: TRL's mean). y' is the
row's KL sample: its prompt with another row's answer (the tokenize stage packs it beside the row, the way TRL
builds its KL dataset by shifting answers), so z estimates KL(pi || ref) on prompts and answers that do not belong
together. z is the micro-batch's estimate gathered across ranks, as TRL computes it: N ranks of m/N rows a
micro-batch then equal one process of m rows. beta is train.preference.beta, w_D and w_U
train.kto.desirable_weight and undesirable_weight (KTOParams, its own section; the paper keeps
w_D * n_D / (w_U * n_U) in [1, 4/3] when the labels are imbalanced: the validate stage reports the counts).

The shards are pair shards (fineflow.tokenize.pairs.pack_feedback): slot 2k is the k-th row's answer, 2k+1 its KL
sample, and ``desirable`` is 1 on a desirable row's tokens. Held out, KTO is judged as the pair objectives are, on
the pairs its eval rows make (a desirable and an undesirable answer to one prompt: fineflow.evaluate.pair_ranking).
"""

from __future__ import annotations

from pydantic import Field

from fineflow.errors import DataError
from fineflow.objectives.interface import FEEDBACK, PREFERENCE_TASK, BatchLoss, Objective
from fineflow.param_section import Section

DESIRABLE = "desirable"  # the batch's per-token label array: 1 on a desirable row's tokens, 0 elsewhere


class KTOParams(Section):
    """train.kto: KTO's own settings (its beta is train.preference.beta, its reference train.preference.reference)."""

    desirable_weight: float = Field(
        1.0, gt=0, description="the weight of a desirable answer's loss (raise it when desirable rows are rarer)"
    )
    undesirable_weight: float = Field(1.0, gt=0, description="the weight of an undesirable answer's loss")


class KTO(Objective):
    name = "kto"
    summary = "unpaired answers labelled desirable or undesirable, against a reference model"
    rows = FEEDBACK
    anchored = True
    needs_reference = True
    params = KTOParams
    eval_task = PREFERENCE_TASK

    def loss(self, model, batch: dict, cfg=None, **forward_kwargs) -> BatchLoss:
        from fineflow.errors import FineflowError
        from fineflow.objectives.pair_logps import pair_scores, token_logps, trained_positions

        if "ref_logps" not in batch:
            raise FineflowError("train.objective kto needs the reference log-probs: run the reference_logps stage")
        _, at = trained_positions(batch["labels"])
        slots = batch["pair_slots"]
        policy = pair_scores(token_logps(model, batch, **forward_kwargs), slots, at)
        reference = pair_scores(batch["ref_logps"][at], slots, at)
        desirable = pair_scores(batch[DESIRABLE][at].double(), slots, at).chosen > 0
        return self.feedback_loss(policy, reference, desirable, cfg)

    def feedback_loss(self, policy, reference, desirable, cfg) -> BatchLoss:
        """The summed loss of scored rows: ``policy``/``reference`` PairScores whose chosen is each row's answer and
        rejected its KL sample, ``desirable`` a bool tensor per row. Rewards: (rows whose reward r - z has their
        label's sign, summed signed reward)."""
        import torch

        kl = _kl_estimate(policy, reference)
        logratio = policy.chosen - reference.chosen
        beta, weights = cfg.preference.beta, cfg.kto
        # in the log-ratios' dtype (float64) from the start: a float32 weight would round 1.33 before it multiplies
        ones = torch.ones_like(logratio)
        sign = torch.where(desirable, ones, -ones)
        weight = torch.where(desirable, ones * weights.desirable_weight, ones * weights.undesirable_weight)
        losses = weight * (1 - torch.sigmoid(beta * sign * (logratio - kl)))
        signed_reward = (beta * sign * (logratio - kl)).detach()
        right = float((signed_reward > 0).sum())
        return BatchLoss(losses.sum(), int(losses.numel()), (right, float(signed_reward.sum())))

    def check_kept_rows(self, kept: dict, cfg) -> dict:
        """Both labels in each split (KTO learns from the contrast; evaluate ranks a prompt's desirable answer
        against its undesirable one), and the labels' balance as the paper weighs it."""
        counts = {split: label_counts(path) for split, path in kept.items()}
        for split, (desirable, undesirable) in counts.items():
            if not desirable or not undesirable:
                missing = "desirable (label true)" if not desirable else "undesirable (label false)"
                raise DataError(
                    f"{kept[split]}: no {missing} row was kept of {desirable + undesirable} {split} rows: "
                    "train.objective kto needs both labels in each split; add such rows to the source, or see the "
                    "quarantine for the ones refused"
                )
        desirable, undesirable = counts["train"]
        ratio = cfg.kto.desirable_weight * desirable / (cfg.kto.undesirable_weight * undesirable)
        return {
            "labels": {split: {"desirable": d, "undesirable": u} for split, (d, u) in counts.items()},
            # the paper's advice: keep weight_D * n_D / (weight_U * n_U) in [1, 4/3] (set the weights to get there)
            "kto_weighted_label_ratio": round(ratio, 4),
        }


def _kl_estimate(policy, reference):
    """z: the mean log-ratio of the KL samples that kept a trained token (a row too long for its sample keeps only
    the prompt), over this micro-batch on every rank (TRL gathers it across processes the same way: N ranks of m/N
    rows then see the z of one process's m rows), clamped at 0, without gradient. Every rank computes each
    micro-batch's loss, in training and in evaluation (fineflow.train.loop), so the all-reduce always has its peers."""
    import torch
    import torch.distributed as dist

    sampled = policy.rejected_len > 0
    totals = torch.stack(
        [(policy.rejected - reference.rejected)[sampled].sum(), sampled.sum().to(policy.rejected.dtype)]
    )
    totals = totals.detach()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).clamp(min=0)


def label_counts(path) -> tuple[int, int]:
    """(desirable, undesirable) rows of a validated feedback rows file (the gate kept only boolean labels)."""
    import json

    desirable = undesirable = 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                if json.loads(line).get("label") is True:
                    desirable += 1
                else:
                    undesirable += 1
    return desirable, undesirable
