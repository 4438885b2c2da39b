"""Each objective's loss on one fixed batch: fineflow's, through the registry (fineflow.objectives.OBJECTIVES[name]
.pair_loss), against TRL 1.16's own trainer code on the same token log-probs, within 1e-5 (issue 46; the paper
formulas written out by hand are tests/test_objectives.py's half). TRL is the `bench` extra, never a dependency:

    .venv/bin/python -m pip install -e '.[bench]'      # trl==1.16.0 into the project's venv, or, leaving it alone:
    .venv/bin/python -m pip install --target .trl-site --no-deps trl==1.16.0   # TRL's own requirements are fineflow's
    PYTHONPATH=.trl-site .venv/bin/python bench/objective_losses_trl.py [--dtype float64|float32|both]

It prints one table per dtype and exits 1 when a judged row differs by more than 1e-5 (2 when TRL is missing).
No model runs: the batch is seeded per-token log-probs (make_batch: 7 pairs, prompts of 1-8 tokens, answers of 1-12,
chosen and rejected unequal, margins of both signs, one pair whose chosen answer and one whose rejected answer is
confident: mean log-prob above -ln 2, TRL's other log1mexp branch). Both sides get the same values in the dtype:

fineflow  the per-token log-probs packed two pairs to a row the way the tokenize stage packs them (pair_slots 2k/2k+1,
          one row holding a single pair) and summed by fineflow.objectives.pair_logps.pair_scores (float64), then
          OBJECTIVES[name].pair_loss(policy, reference, train) (the train section) and OBJECTIVES[name].rewards(...).
TRL       each trainer's loss code itself, on a bare trainer (object.__new__ and the attributes that code reads:
          _bare below) and a stand-in model that returns the batch's log-probs instead of running a network
          (a causal LM's outputs, masked as TRL masks them): chosen then rejected sequences of prompt + answer,
          right-padded, all token ids 0.
          dpo    trl.DPOTrainer.compute_ref_log_probs (the precompute_ref_log_probs path: fineflow's
                 reference_logps stage precomputes too), then DPOTrainer._compute_loss, loss_type ["sigmoid"],
                 f_divergence_type reverse_kl, no ld_alpha, no WPO weighting. The stand-in is TRL's fused LM head:
                 FusedCausalLMOutput.log_probs, zero where the label is -100.
          simpo  trl.experimental.cpo.CPOTrainer.get_batch_loss_metrics, loss_type "simpo", cpo_alpha 0.0 (CPOConfig's
                 default 1.0 adds the chosen NLL: CPO-SimPO, not the paper's SimPO), label_smoothing 0, alpha 0
                 (no AlphaPO). The stand-in returns logits over a 2-token vocabulary, [log p, log(1 - p)] at each
                 position, so TRL's own log-softmax recovers log p (exact to rounding in float64).
          orpo   trl.experimental.orpo.ORPOTrainer.get_batch_loss_metrics (beta = ORPO's lambda), the same logits.
          kto    trl.KTOTrainer._compute_loss (precomputed reference, calculate_KL), through trl_kto_loss below.
          rm     trl.RewardTrainer.compute_loss (Bradley-Terry) on scalar rewards, with TRL's optional margin column
                 and center_rewards_coefficient.

Reduction: fineflow's pair_loss returns the batch's SUM over pairs (BatchLoss.loss_sum; the train loop divides by the
global batch's pair count); TRL's trainers return the batch MEAN. The table compares per-pair means:
loss_sum / count against TRL's loss. Rewards: the batch mean of each side's chosen and rejected rewards (fineflow:
OBJECTIVES[name].rewards; TRL: its logged rewards/chosen, rewards/rejected), the mean margin (fineflow:
BatchLoss.rewards[1] / count) and the share of pairs ranked right (BatchLoss.rewards[0] / count; TRL:
rewards/accuracies). Every figure is judged at 1e-5.

ORPO's two halves are compared apart, because their NLL halves differ by convention, not by a bug: ORPOTrainer's NLL
term is a token mean of the chosen SEQUENCES' cross-entropy, the prompt tokens included (labels = input_ids where
attention_mask is 1: "orpo chosen nll loss is computed over the full prompt and response"), over the batch's chosen
tokens; fineflow's is the mean over pairs of each chosen ANSWER's mean token NLL (fineflow/objectives/orpo.py). The
odds-ratio term (lambda * -logsigmoid(log odds ratio), TRL's odds_ratio_loss) is judged on the general batch; the NLL
term is printed, not judged, with TRL's convention recomputed from the batch to show the difference is that and only
that; the whole loss is judged on a batch where the conventions coincide (one-token prompts, so no prompt token is
ever predicted, and chosen answers of one length; the latter alone is not enough, whatever
fineflow/objectives/orpo.py's docstring says, since TRL's term also counts the prompts). fineflow's side of each half
comes from the registry alone: pair_loss is linear in orpo_lambda, so with L(lam) = NLL + lam*OR, lam*OR = L(2*lam) -
L(lam) and NLL = 2 L(lam) - L(2*lam).

KTO: fineflow's OBJECTIVES["kto"].feedback_loss on the batch unpaired (each pair's chosen answer a desirable row,
its rejected one an undesirable row, each row's KL sample one of the batch's KL completions) against TRL's. TRL 1.16
has no KTOTrainer.kto_loss method any more (the loss is inline in KTOTrainer._compute_loss); trl_kto_loss keeps the
old kto_loss's arguments (policy chosen / rejected / KL log-probs, then the reference's) and runs the trainer's code
on them. TRL's loss is the mean over all the batch's examples (desirable and undesirable together) of weight * (1 -
sigmoid(beta * (logratio - KL))) for desirable and weight * (1 - sigmoid(beta * (KL - logratio))) for undesirable
ones, KL = clamp(mean(policy_KL - ref_KL), 0), detached; fineflow's is its sum over rows, divided here by the row
count. Only the loss is compared (fineflow's step reward statistics are not TRL's logged means).

Reward model: the rewards are the batch's seeded scalars (a head's one output per side, as both trainers pool it).
fineflow's side is the reward_model objective's Bradley-Terry loss on them (fineflow.objectives.reward_model.
bradley_terry: -logsigmoid(r_chosen - r_rejected) summed, divided here by the pair count), against
RewardTrainer.compute_loss; its margin and ranked-right share are TRL's logged ones. TRL's optional extras, a margin
column and center_rewards_coefficient, have no fineflow counterpart: that row holds TRL against this script's formula,
mean(-logsigmoid(r_chosen - r_rejected - margin)) + c * mean((r_chosen + r_rejected)^2), labelled as such.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOLERANCE = 1e-5
SEED = 46
PAIRS_PER_ROW = 2  # fineflow's packed rows: two pairs to a row (the last row of an odd batch holds one)


# ---------------------------------------------------------------------------------------------- the fixed batch


@dataclass(frozen=True)
class Batch:
    """Per pair: the policy's log-prob of each prompt token after the first (token 0 is never predicted) and of each
    answer token, the reference's of each answer token; per example, the KTO KL completions' sequence log-probs;
    per pair, the reward model rows' scalar rewards and margin."""

    prompt: tuple[tuple[float, ...], ...]
    chosen: tuple[tuple[float, ...], ...]
    rejected: tuple[tuple[float, ...], ...]
    ref_chosen: tuple[tuple[float, ...], ...]
    ref_rejected: tuple[tuple[float, ...], ...]
    kl: tuple[float, ...] = ()  # 2 x pairs: the policy's log-prob of each example's mismatched (KL) completion
    ref_kl: tuple[float, ...] = ()
    reward_chosen: tuple[float, ...] = ()
    reward_rejected: tuple[float, ...] = ()
    reward_margin: tuple[float, ...] = ()

    @property
    def pairs(self) -> int:
        return len(self.chosen)

    def describe(self) -> str:
        lengths = lambda answers: "/".join(str(len(a)) for a in answers)  # noqa: E731
        return (
            f"{self.pairs} pairs; prompt tokens {'/'.join(str(len(p) + 1) for p in self.prompt)}, "
            f"chosen {lengths(self.chosen)}, rejected {lengths(self.rejected)}"
        )


def make_batch(seed: int = SEED, pairs: int = 7, prompt_lens=None, chosen_lens=None) -> Batch:
    """A seeded batch (Python's random: the same values on every platform and torch version)."""
    rng = random.Random(seed)
    draw = lambda n, low, high: tuple(-rng.uniform(low, high) for _ in range(n))  # noqa: E731
    prompt, chosen, rejected, ref_chosen, ref_rejected = [], [], [], [], []
    for k in range(pairs):
        p = prompt_lens[k] if prompt_lens else rng.randint(1, 8)
        lc = chosen_lens[k] if chosen_lens else rng.randint(1, 12)
        lr = rng.randint(1, 12)
        prompt.append(draw(p - 1, 0.01, 3.0))
        chosen.append(draw(lc, 0.005, 0.2) if k == 2 else draw(lc, 0.02, 2.2))  # pair 2: a confident chosen answer
        rejected.append(draw(lr, 0.005, 0.2) if k == 4 else draw(lr, 0.02, 2.6))  # pair 4: a confident rejected one
        noisy = lambda answer: tuple(min(-1e-3, x + rng.gauss(0.0, 0.35)) for x in answer)  # noqa: E731
        ref_chosen.append(noisy(chosen[-1]))
        ref_rejected.append(noisy(rejected[-1]))
    kl = tuple(-rng.uniform(4.0, 25.0) for _ in range(2 * pairs))
    ref_kl = tuple(x - rng.gauss(0.4, 1.0) for x in kl)
    return Batch(
        tuple(prompt),
        tuple(chosen),
        tuple(rejected),
        tuple(ref_chosen),
        tuple(ref_rejected),
        kl,
        ref_kl,
        reward_chosen=tuple(rng.gauss(0.3, 1.5) for _ in range(pairs)),
        reward_rejected=tuple(rng.gauss(-0.3, 1.5) for _ in range(pairs)),
        reward_margin=tuple(rng.uniform(0.0, 1.0) for _ in range(pairs)),
    )


# one-token prompts and chosen answers of one length: where ORPOTrainer's NLL convention and fineflow's coincide
BATCHES = {
    "pairs": make_batch(),
    "orpo-aligned": make_batch(SEED + 1, pairs=5, prompt_lens=[1] * 5, chosen_lens=[6] * 5),
}


def fineflow_scores(batch: Batch, dtype):
    """(policy, reference) PairScores of the batch, packed into rows as the tokenize stage packs pairs (prompt+chosen,
    prompt+rejected, the next pair's, ...; pair_slots 2j / 2j+1; only answer tokens trained) and summed by
    fineflow's pair_scores."""
    import torch

    from fineflow.objectives.pair_logps import pair_scores

    rows = [range(start, min(start + PAIRS_PER_ROW, batch.pairs)) for start in range(0, batch.pairs, PAIRS_PER_ROW)]
    sequences = lambda k: ((batch.chosen[k], batch.ref_chosen[k]), (batch.rejected[k], batch.ref_rejected[k]))  # noqa: E731
    width = max(
        sum(2 * (len(batch.prompt[k]) + 1) + len(batch.chosen[k]) + len(batch.rejected[k]) for k in row) for row in rows
    )
    pair_slots = torch.full((len(rows), width), -1, dtype=torch.long)
    at = torch.zeros((len(rows), width), dtype=torch.bool)
    policy, reference = [], []
    for r, row in enumerate(rows):
        position = 0
        for j, k in enumerate(row):
            for side, (answer, ref_answer) in enumerate(sequences(k)):
                start = position + len(batch.prompt[k]) + 1  # the answer's first token
                pair_slots[r, position : start + len(answer)] = 2 * j + side
                at[r, start : start + len(answer)] = True
                policy.extend(answer)  # row-major order of `at`'s trained tokens
                reference.extend(ref_answer)
                position = start + len(answer)
    as_tokens = lambda values: torch.tensor(values, dtype=torch.float64).to(dtype)  # noqa: E731
    return pair_scores(as_tokens(policy), pair_slots, at), pair_scores(as_tokens(reference), pair_slots, at)


def trl_sequences(batch: Batch, dtype) -> SimpleNamespace:
    """TRL's layout of the batch: the chosen sequences then the rejected ones, prompt + answer, right-padded to one
    width, token ids 0; policy / reference [n, t - 1] = the log-prob of sequence n's token t (0 where none)."""
    import torch

    sequences = [(batch.prompt[k], batch.chosen[k], batch.ref_chosen[k]) for k in range(batch.pairs)]
    sequences += [(batch.prompt[k], batch.rejected[k], batch.ref_rejected[k]) for k in range(batch.pairs)]
    width = max(1 + len(prompt) + len(answer) for prompt, answer, _ in sequences)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    completion = torch.zeros_like(attention)
    policy = torch.zeros((len(sequences), width - 1), dtype=torch.float64)
    reference = torch.zeros_like(policy)
    for n, (prompt, answer, ref_answer) in enumerate(sequences):
        start = 1 + len(prompt)
        attention[n, : start + len(answer)] = 1
        completion[n, start : start + len(answer)] = 1
        policy[n, : start - 1] = torch.tensor(prompt, dtype=torch.float64)
        policy[n, start - 1 : start - 1 + len(answer)] = torch.tensor(answer, dtype=torch.float64)
        reference[n, start - 1 : start - 1 + len(answer)] = torch.tensor(ref_answer, dtype=torch.float64)
    return SimpleNamespace(
        input_ids=torch.zeros_like(attention),
        attention_mask=attention,
        completion_mask=completion,
        policy=policy.to(dtype),
        reference=reference.to(dtype),
        pairs=batch.pairs,
    )


def kto_inputs(batch: Batch) -> tuple[list[float], ...]:
    """The batch as KTO's unpaired examples, in kto_loss's argument order: the policy's sequence log-prob of each
    chosen answer (desirable), each rejected one (undesirable), each example's KL completion, then the reference's."""
    total = lambda answers: [math.fsum(a) for a in answers]  # noqa: E731
    return (
        total(batch.chosen),
        total(batch.rejected),
        list(batch.kl),
        total(batch.ref_chosen),
        total(batch.ref_rejected),
        list(batch.ref_kl),
    )


# ---------------------------------------------------------------------------------------------- the two sides


@dataclass
class Side:
    """One side's figures for a batch: the per-example mean loss and batch means of its reward statistics."""

    loss: float
    chosen_reward: float | None = None
    rejected_reward: float | None = None
    margin: float | None = None
    accuracy: float | None = None  # share of pairs ranked right (chosen reward above rejected)


# the bench's setting names (TRL's arguments) -> fineflow's train section: train.preference, train.<objective>
TRAIN_SETTINGS = {
    "beta": ("preference", "beta"),
    "simpo_gamma": ("simpo", "gamma"),
    "orpo_lambda": ("orpo", "odds_ratio_weight"),
    "desirable_weight": ("kto", "desirable_weight"),
    "undesirable_weight": ("kto", "undesirable_weight"),
}


def train_section(settings: dict):
    """fineflow's train section (TrainParams) with the bench's settings where params.yaml would put them."""
    from fineflow.core.train_config import TrainParams

    sections: dict = {}
    for name, value in settings.items():
        section, key = TRAIN_SETTINGS[name]
        sections.setdefault(section, {})[key] = value
    return TrainParams(**sections)


def fineflow_pair(name: str) -> Callable:
    """fineflow's side of a pair objective: OBJECTIVES[name] on the packed batch's PairScores."""

    def run(batch: Batch, settings: dict, dtype) -> Side:
        from fineflow.objectives import OBJECTIVES

        objective, prefs = OBJECTIVES[name], train_section(settings)
        policy, reference = fineflow_scores(batch, dtype)
        reference = reference if objective.needs_reference else None
        got = objective.pair_loss(policy, reference, prefs)
        chosen, rejected = objective.rewards(policy, reference, prefs)
        right, margin_sum = got.rewards
        return Side(
            float(got.loss_sum) / got.count, float(chosen.mean()), float(rejected.mean()), margin_sum / got.count,
            right / got.count,
        )  # fmt: skip

    return run


def fineflow_kto(batch: Batch, settings: dict, dtype) -> Side:
    """fineflow's KTO (OBJECTIVES["kto"].feedback_loss) on kto_inputs' examples: each pair's chosen answer a
    desirable row, its rejected one an undesirable row, each row's KL sample one of batch.kl (the estimate is their
    mean, so which row holds which does not matter). The loss is the per-row mean (fineflow's sum / count)."""
    import torch

    from fineflow.objectives import OBJECTIVES
    from fineflow.objectives.pair_logps import PairScores

    chosen, rejected, kl, ref_chosen, ref_rejected, ref_kl = kto_inputs(batch)
    as_tensor = lambda values: torch.tensor(values, dtype=dtype)  # noqa: E731
    lengths = as_tensor([1.0] * len(kl))  # unused by KTO: sequence log-probs, not means

    def scores(answers, samples):
        return PairScores(as_tensor(answers), as_tensor(samples), lengths, lengths)

    prefs = train_section(settings)
    desirable = torch.tensor([True] * len(chosen) + [False] * len(rejected))
    got = OBJECTIVES["kto"].feedback_loss(
        scores(chosen + rejected, kl), scores(ref_chosen + ref_rejected, ref_kl), desirable, prefs
    )
    return Side(float(got.loss_sum) / got.count)  # its reward statistics are not TRL's: the loss alone is compared


def fineflow_orpo_halves(batch: Batch, settings: dict, dtype) -> tuple[float, float]:
    """(NLL term, lambda * odds-ratio term), per-pair means, from the registry's ORPO alone: pair_loss is
    NLL + lambda * OR, so two lambdas give both halves."""
    from fineflow.objectives import OBJECTIVES

    policy, _ = fineflow_scores(batch, dtype)
    once = OBJECTIVES["orpo"].pair_loss(policy, None, train_section(settings))
    doubled = {**settings, "orpo_lambda": 2 * settings["orpo_lambda"]}
    twice = OBJECTIVES["orpo"].pair_loss(policy, None, train_section(doubled))
    one, two = float(once.loss_sum) / once.count, float(twice.loss_sum) / twice.count
    return 2 * one - two, two - one


class _OneProcess:
    """accelerate.Accelerator as TRL's loss code uses it, on one process: gathers are the tensor itself."""

    @property
    def device(self):
        import torch

        return torch.device("cpu")

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather

    def autocast(self):
        return contextlib.nullcontext()

    def unwrap_model(self, model):
        return model


def _bare(trainer_class, **attributes):
    """A trainer without __init__ (no model, dataset or Accelerator): the attributes its loss code reads."""
    trainer = object.__new__(trainer_class)
    trainer.accelerator = _OneProcess()
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens, trainer._tp_size = 0, 1
    trainer.args = SimpleNamespace(gradient_checkpointing_kwargs=None, center_rewards_coefficient=None)
    for key, value in attributes.items():
        setattr(trainer, key, value)
    return trainer


class _FusedHeadModel:
    """A causal LM with TRL's fused LM head (trl.trainer.utils.add_fused_lm_head), called with fused_lm_head=True:
    per position t - 1 the fixed log-prob of token t, zero where the label is -100, as that head returns it."""

    training, is_gradient_checkpointing = True, False

    def __init__(self, log_probs):
        self.log_probs = log_probs

    def __call__(self, input_ids=None, labels=None, fused_lm_head=False, **kwargs):
        import torch
        from trl.trainer.utils import FusedCausalLMOutput

        assert fused_lm_head and labels is not None and input_ids.shape[1] - 1 == self.log_probs.shape[1]
        mask = labels[:, 1:] != -100
        zero = torch.zeros_like(self.log_probs)
        return FusedCausalLMOutput(
            log_probs=self.log_probs.masked_fill(~mask, 0),
            entropy=zero,
            mean_logits=zero,
            is_top1=torch.zeros_like(mask),
        )


class _LogitsModel:
    """A causal LM returning logits over a 2-token vocabulary: at position t - 1, [log p, log(1 - p)] with p the
    fixed probability of token t (id 0), so a log-softmax gives back log p; zeros where no real token follows."""

    training, is_gradient_checkpointing = True, False

    def __init__(self, log_probs, attention_mask):
        import torch

        lp = log_probs.double()
        follows = attention_mask[:, 1:].bool()
        logits = torch.zeros((*attention_mask.shape, 2), dtype=torch.float64)
        logits[:, :-1, 0] = torch.where(follows, lp, 0.0)
        logits[:, :-1, 1] = torch.where(follows, torch.log(-torch.expm1(lp.clamp(max=-1e-12))), 0.0)
        self.logits = logits.to(log_probs.dtype)

    def __call__(self, input_ids, attention_mask=None, use_cache=False, **kwargs):
        assert input_ids.shape == self.logits.shape[:2]
        return SimpleNamespace(logits=self.logits)


def _trl_pair_inputs(seq: SimpleNamespace) -> dict:
    """CPOTrainer's / ORPOTrainer's batch: chosen_* and rejected_* input ids, attention masks, labels (-100 on
    prompt and padding)."""
    labels = seq.input_ids.masked_fill(seq.completion_mask == 0, -100)
    inputs = {}
    for name, rows in (("chosen", slice(0, seq.pairs)), ("rejected", slice(seq.pairs, None))):
        inputs[f"{name}_input_ids"] = seq.input_ids[rows]
        inputs[f"{name}_attention_mask"] = seq.attention_mask[rows]
        inputs[f"{name}_labels"] = labels[rows]
    return inputs


def trl_dpo(batch: Batch, settings: dict, dtype) -> Side:
    from trl import DPOTrainer

    seq = trl_sequences(batch, dtype)
    trainer = _bare(
        DPOTrainer,
        beta=settings["beta"],
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        f_divergence_type="reverse_kl",
        ld_alpha=None,
        use_weighting=False,
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        model=_FusedHeadModel(seq.policy),
        ref_model=_FusedHeadModel(seq.reference),
    )
    inputs = {"input_ids": seq.input_ids, "attention_mask": seq.attention_mask, "completion_mask": seq.completion_mask}
    ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.ref_model, inputs)
    inputs.update(ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected)
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    logged = trainer._metrics["train"]
    return Side(
        float(loss), logged["rewards/chosen"][-1], logged["rewards/rejected"][-1], logged["rewards/margins"][-1],
        logged["rewards/accuracies"][-1],
    )  # fmt: skip


def trl_simpo(batch: Batch, settings: dict, dtype) -> Side:
    from trl.experimental.cpo import CPOTrainer

    seq = trl_sequences(batch, dtype)
    trainer = _bare(
        CPOTrainer,
        beta=settings["beta"],
        loss_type="simpo",
        simpo_gamma=settings["simpo_gamma"],
        cpo_alpha=0.0,  # CPOConfig's default 1.0 adds the chosen NLL (CPO-SimPO); SimPO's paper has none
        label_smoothing=0.0,
        alpha=0.0,
        is_encoder_decoder=False,
        pad_token_id=0,
        aux_loss_enabled=False,
    )
    loss, logged = trainer.get_batch_loss_metrics(_LogitsModel(seq.policy, seq.attention_mask), _trl_pair_inputs(seq))
    return Side(
        float(loss), logged["rewards/chosen"], logged["rewards/rejected"], logged["rewards/margins"],
        logged["rewards/accuracies"],
    )  # fmt: skip


def trl_orpo_run(batch: Batch, settings: dict, dtype) -> tuple[Side, float]:
    """(ORPOTrainer's loss and rewards, its NLL term)."""
    from trl.experimental.orpo import ORPOTrainer

    seq = trl_sequences(batch, dtype)
    trainer = _bare(
        ORPOTrainer, beta=settings["orpo_lambda"], is_encoder_decoder=False, padding_value=0, aux_loss_enabled=False
    )
    loss, logged = trainer.get_batch_loss_metrics(_LogitsModel(seq.policy, seq.attention_mask), _trl_pair_inputs(seq))
    side = Side(
        float(loss), logged["rewards/chosen"], logged["rewards/rejected"], logged["rewards/margins"],
        logged["rewards/accuracies"],
    )  # fmt: skip
    return side, logged["nll_loss"]


def trl_orpo(batch: Batch, settings: dict, dtype) -> Side:
    return trl_orpo_run(batch, settings, dtype)[0]


def trl_orpo_odds_ratio(batch: Batch, settings: dict, dtype) -> Side:
    side, nll = trl_orpo_run(batch, settings, dtype)
    side.loss -= nll  # loss = nll_loss - mean(lambda * logsigmoid(log odds ratio))
    return side


def trl_orpo_nll(batch: Batch, settings: dict, dtype) -> Side:
    return Side(trl_orpo_run(batch, settings, dtype)[1])


def fineflow_orpo_odds_ratio(batch: Batch, settings: dict, dtype) -> Side:
    whole = fineflow_pair("orpo")(batch, settings, dtype)
    whole.loss = fineflow_orpo_halves(batch, settings, dtype)[1]
    return whole


def fineflow_orpo_nll(batch: Batch, settings: dict, dtype) -> Side:
    return Side(fineflow_orpo_halves(batch, settings, dtype)[0])


def orpo_nll_conventions(batch: Batch) -> dict[str, float]:
    """ORPO's NLL term under each convention, written out from the batch: TRL's (-mean over every predicted token of
    the chosen sequences: the prompt tokens after the first and the answer), the same over the answer tokens only,
    and fineflow's (-mean over pairs of each chosen answer's mean token log-prob)."""
    with_prompt = [x for k in range(batch.pairs) for x in (*batch.prompt[k], *batch.chosen[k])]
    answers = [x for answer in batch.chosen for x in answer]
    return {
        "TRL: chosen prompt + answer tokens, token mean": -math.fsum(with_prompt) / len(with_prompt),
        "chosen answer tokens only, token mean": -math.fsum(answers) / len(answers),
        "fineflow: pair mean of each chosen answer's token mean": -math.fsum(
            math.fsum(a) / len(a) for a in batch.chosen
        )
        / batch.pairs,
    }


def trl_kto_loss(
    policy_chosen_logps,
    policy_rejected_logps,
    policy_KL_logps,  # noqa: N803 (TRL's names)
    reference_chosen_logps,
    reference_rejected_logps,
    reference_KL_logps,  # noqa: N803
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    dtype=None,
) -> tuple[Side, float]:
    """(TRL 1.16's KTO loss and rewards, its KL estimate) for sequence log-probs given in the order of earlier TRL
    releases' KTOTrainer.kto_loss (1.16 computes the loss inline in KTOTrainer._compute_loss, which runs here on
    them): the desirable examples, then the undesirable ones, each a one-token completion carrying its sequence
    log-prob; the KL batch one mismatched completion per example, its log-prob likewise."""
    import torch
    from trl import KTOTrainer

    dtype = dtype or torch.float64
    main = [*policy_chosen_logps, *policy_rejected_logps]
    examples = len(main)
    if len(policy_KL_logps) != examples or len(reference_KL_logps) != examples:
        raise ValueError("one KL completion per example: len(policy_KL_logps) = desirable + undesirable")
    table = torch.tensor([0.0, *main, *policy_KL_logps], dtype=torch.float64).to(dtype)  # token id -> its log-prob

    class OneTokenCompletions(_FusedHeadModel):  # token 1 of each sequence names its example (id) and log-prob
        def __call__(self, input_ids=None, labels=None, fused_lm_head=False, **kwargs):
            self.log_probs = table[input_ids[:, 1]].unsqueeze(1)
            return super().__call__(input_ids=input_ids, labels=labels, fused_lm_head=fused_lm_head)

    ids = torch.arange(1, examples + 1)
    two_tokens = lambda token: torch.stack([torch.zeros_like(token), token], dim=1)  # noqa: E731
    completion_mask = torch.tensor([[0, 1]] * examples)
    inputs = {
        "input_ids": two_tokens(ids),
        "attention_mask": torch.ones_like(completion_mask),
        "completion_mask": completion_mask,
        "KL_input_ids": two_tokens(ids + examples),
        "KL_attention_mask": torch.ones_like(completion_mask),
        "KL_completion_mask": completion_mask,
        "label": torch.tensor([True] * len(policy_chosen_logps) + [False] * len(policy_rejected_logps)),
        "ref_logps": torch.tensor([*reference_chosen_logps, *reference_rejected_logps], dtype=torch.float64).to(dtype),
        "ref_KL_logps": torch.tensor(list(reference_KL_logps), dtype=torch.float64).to(dtype),
    }
    model = OneTokenCompletions(table[:1])
    trainer = _bare(
        KTOTrainer,
        beta=beta,
        loss_type="kto",
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        calculate_KL=True,
        precompute_ref_logps=True,
        aux_loss_enabled=False,
        model=model,
        ref_model=None,
    )
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    logged = trainer._metrics["train"]
    side = Side(
        float(loss), logged["rewards/chosen"][-1], logged["rewards/rejected"][-1], logged["rewards/margins"][-1]
    )
    return side, logged["kl"][-1]


def trl_kto(batch: Batch, settings: dict, dtype) -> Side:
    return trl_kto_loss(*kto_inputs(batch), **settings, dtype=dtype)[0]


def kto_formula(
    policy_chosen_logps,
    policy_rejected_logps,
    policy_KL_logps,  # noqa: N803
    reference_chosen_logps,
    reference_rejected_logps,
    reference_KL_logps,  # noqa: N803
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> float:
    """The KTO loss the module docstring states, in plain floats: a check of trl_kto_loss's plumbing (not a fineflow
    side: fineflow's is fineflow_kto)."""
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    kl = max(0.0, math.fsum(p - r for p, r in zip(policy_KL_logps, reference_KL_logps)) / len(policy_KL_logps))
    losses = [
        desirable_weight * (1 - sigmoid(beta * ((p - r) - kl)))
        for p, r in zip(policy_chosen_logps, reference_chosen_logps)
    ]
    losses += [
        undesirable_weight * (1 - sigmoid(beta * (kl - (p - r))))
        for p, r in zip(policy_rejected_logps, reference_rejected_logps)
    ]
    return math.fsum(losses) / len(losses)


def _reward_tensors(batch: Batch, dtype):
    import torch

    as_tensor = lambda values: torch.tensor(values, dtype=torch.float64).to(dtype)  # noqa: E731
    return as_tensor(batch.reward_chosen), as_tensor(batch.reward_rejected), as_tensor(batch.reward_margin)


def trl_reward_model(batch: Batch, settings: dict, dtype) -> Side:
    """trl.RewardTrainer.compute_loss on the scalar rewards (a sequence-classification head's one logit each)."""
    import torch
    from trl import RewardTrainer

    chosen, rejected, margin = _reward_tensors(batch, dtype)
    rewards = torch.cat([chosen, rejected]).unsqueeze(-1)

    class Head(_FusedHeadModel):
        def __call__(self, **inputs):
            return SimpleNamespace(logits=rewards)

    trainer = _bare(RewardTrainer, model=Head(rewards))
    trainer.args.center_rewards_coefficient = settings.get("center_rewards_coefficient")
    inputs = {"input_ids": torch.zeros((2 * batch.pairs, 1), dtype=torch.long)}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if settings.get("margin"):
        inputs["margin"] = margin
    loss = trainer.compute_loss(trainer.model, inputs)
    logged = trainer._metrics["train"]
    return Side(float(loss), margin=logged["margin"][-1], accuracy=logged["accuracy"][-1])


def fineflow_reward_model(batch: Batch, settings: dict, dtype) -> Side:
    """fineflow's reward model loss (the reward_model objective's bradley_terry) on the batch's scalar rewards."""
    from fineflow.objectives.reward_model import bradley_terry

    chosen, rejected, _ = _reward_tensors(batch, dtype)
    got = bradley_terry(chosen, rejected)
    right, margin_sum = got.rewards
    return Side(float(got.loss_sum) / got.count, margin=margin_sum / got.count, accuracy=right / got.count)


def bradley_terry_formula(batch: Batch, settings: dict, dtype) -> Side:
    """TRL's reward loss with its optional extras, written here (fineflow has neither extra): Bradley-Terry,
    -logsigmoid(r_chosen - r_rejected - margin), mean over pairs, + c * mean((r_chosen + r_rejected)^2)."""
    import torch.nn.functional as F

    chosen, rejected, margin = _reward_tensors(batch, dtype)
    difference = chosen - rejected - (margin if settings.get("margin") else 0.0)
    loss = -F.logsigmoid(difference).mean()
    if settings.get("center_rewards_coefficient") is not None:
        loss = loss + settings["center_rewards_coefficient"] * ((chosen + rejected) ** 2).mean()
    return Side(
        float(loss), margin=float((chosen - rejected).mean()), accuracy=float((chosen > rejected).double().mean())
    )


# ---------------------------------------------------------------------------------------------- the comparisons


@dataclass(frozen=True)
class Comparison:
    """One row: an objective's loss on one fixed batch, TRL's side against fineflow's. fineflow None: no fineflow
    objective yet (the row shows TRL's figure and is never judged); judged False: a difference of convention,
    printed with its reason, not judged."""

    name: str
    batch: str  # a key of BATCHES
    settings: dict
    trl: Callable  # (batch, settings, dtype) -> Side
    fineflow: Callable | None  # (batch, settings, dtype) -> Side
    judged: bool = True
    note: str = ""
    fineflow_is_formula: bool = False  # the fineflow column is this script's formula, not fineflow code


COMPARISONS: tuple[Comparison, ...] = (
    Comparison("dpo", "pairs", {"beta": 0.1}, trl_dpo, fineflow_pair("dpo")),
    Comparison("simpo", "pairs", {"beta": 2.0, "simpo_gamma": 0.5}, trl_simpo, fineflow_pair("simpo")),
    Comparison(
        "orpo: lambda x odds-ratio term", "pairs", {"orpo_lambda": 0.25}, trl_orpo_odds_ratio, fineflow_orpo_odds_ratio
    ),
    Comparison(
        "orpo: NLL term",
        "pairs",
        {"orpo_lambda": 0.25},
        trl_orpo_nll,
        fineflow_orpo_nll,
        judged=False,
        note="TRL: token mean over the chosen sequences' prompt and answer tokens; fineflow: pair mean of each "
        "chosen answer's mean token NLL",
    ),
    Comparison(
        "orpo (1-token prompts, chosen of one length)",
        "orpo-aligned",
        {"orpo_lambda": 0.25},
        trl_orpo,
        fineflow_pair("orpo"),
    ),  # fmt: skip
    Comparison(
        "kto",
        "pairs",
        {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.5},
        trl_kto,
        fineflow_kto,
    ),
    Comparison(
        "rm: Bradley-Terry",
        "pairs",
        {},
        trl_reward_model,
        fineflow_reward_model,
    ),
    Comparison(
        "rm: TRL's margin + center 0.01",
        "pairs",
        {"margin": True, "center_rewards_coefficient": 0.01},
        trl_reward_model,
        bradley_terry_formula,
        fineflow_is_formula=True,
        note="TRL's optional extras, which fineflow's reward model has not: the fineflow column is this script's "
        "formula",
    ),
)

FIGURES = ("loss", "chosen_reward", "rejected_reward", "margin", "accuracy")


@dataclass
class Row:
    comparison: Comparison
    fineflow: Side | None = None
    trl: Side | None = None
    error: str | None = None
    differences: dict = field(default_factory=dict)  # figure -> |fineflow - TRL|, for figures both sides give

    def __post_init__(self):
        if self.fineflow is not None and self.trl is not None:
            for figure in FIGURES:
                ours, theirs = getattr(self.fineflow, figure), getattr(self.trl, figure)
                if ours is not None and theirs is not None:
                    self.differences[figure] = abs(ours - theirs)

    @property
    def compared(self) -> bool:
        return self.error is None and self.fineflow is not None and self.trl is not None

    @property
    def within(self) -> bool:
        return self.compared and all(d <= TOLERANCE for d in self.differences.values())

    @property
    def failed(self) -> bool:
        """A judged row that errs or differs beyond the tolerance (a row with no fineflow side never fails)."""
        if self.error is not None:
            return True
        return self.comparison.judged and self.compared and not self.within

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return f"ERROR: {self.error}"
        if self.comparison.fineflow is None:
            return "not compared"
        if not self.comparison.judged:
            return f"{'yes' if self.within else 'no'} (not judged: convention)"
        return "yes" if self.within else "NO"


def run_comparison(comparison: Comparison, dtype) -> Row:
    batch = BATCHES[comparison.batch]
    try:
        trl = comparison.trl(batch, comparison.settings, dtype)
        ours = comparison.fineflow(batch, comparison.settings, dtype) if comparison.fineflow else None
    except Exception as error:  # a side that cannot run is a failed row, reported, not a crash of the table
        return Row(comparison, error=f"{type(error).__name__}: {error}")
    return Row(comparison, ours, trl)


def _number(value: float | None, digits: int = 10) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _difference(row: Row, figure: str) -> str:
    return f"{row.differences[figure]:.1e}" if figure in row.differences else "-"


def render(rows: list[Row]) -> str:
    """The table: objective | fineflow loss | TRL loss | |diff| | reward |diff|s | ranked right | within 1e-5."""
    header = (
        f"{'objective':<46} {'fineflow loss':>14} {'TRL loss':>14} {'|diff|':>8} "
        f"{'|d chosen r|':>12} {'|d rejected r|':>14} {'|d margin|':>10} {'right ff/TRL':>13}  within {TOLERANCE:g}"
    )
    lines = [header]
    for row in rows:
        ours, theirs = row.fineflow, row.trl
        right = "-"
        if ours is not None and theirs is not None and ours.accuracy is not None and theirs.accuracy is not None:
            right = f"{ours.accuracy:.3f}/{theirs.accuracy:.3f}"
        lines.append(
            f"{row.comparison.name:<46} {_number(ours and ours.loss):>14} {_number(theirs and theirs.loss):>14} "
            f"{_difference(row, 'loss'):>8} {_difference(row, 'chosen_reward'):>12} "
            f"{_difference(row, 'rejected_reward'):>14} {_difference(row, 'margin'):>10} {right:>13}  {row.verdict}"
        )
    notes = [f"  {row.comparison.name}: {row.comparison.note}" for row in rows if row.comparison.note]
    return "\n".join(lines + (["notes:", *notes] if notes else []))


def print_checks(rows: list[Row], dtype) -> bool:
    """The lines under a table: ORPO's NLL term under each convention, and TRL's KTO side against the formula
    the docstring states. True when that KTO check fails (the harness, not fineflow, would be wrong)."""
    failed = False
    trl_nll = next((row.trl.loss for row in rows if row.comparison.name == "orpo: NLL term" and row.trl), None)
    if trl_nll is not None:
        print(f"  orpo: the NLL term recomputed from batch 'pairs' (TRL's figure {trl_nll:.10f}):")
        for convention, value in orpo_nll_conventions(BATCHES["pairs"]).items():
            print(f"    {convention:<58} {value:.10f}")
    kto = next((row for row in rows if row.comparison.name == "kto" and row.trl), None)
    if kto is not None:
        inputs = kto_inputs(BATCHES[kto.comparison.batch])
        side, kl = trl_kto_loss(*inputs, **kto.comparison.settings, dtype=dtype)
        by_hand = kto_formula(*inputs, **kto.comparison.settings)
        failed = abs(side.loss - by_hand) > TOLERANCE
        print(
            f"  kto: TRL's batch KL estimate {kl:.6f}; TRL's loss {side.loss:.10f} against the docstring's formula "
            f"(this script's, not fineflow's) {by_hand:.10f}: |diff| {abs(side.loss - by_hand):.1e}"
            + (" (beyond the tolerance: trl_kto_loss is wrong)" if failed else "")
        )
    return failed


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float64", "float32", "both"), default="both")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # CPO and ORPO live in trl.experimental in 1.16
    try:
        import trl
    except ImportError:
        print(
            "bench/objective_losses_trl.py: trl is not importable; install the bench extra (trl==1.16.0): see the "
            "module docstring",
            file=sys.stderr,
        )
        return 2
    import torch

    print(
        f"trl {trl.__version__}, torch {torch.__version__}; tolerance {TOLERANCE:g}; per-pair means "
        "(fineflow loss_sum / count, TRL's batch mean)"
    )
    for name, batch in BATCHES.items():
        print(f"batch {name!r}: {batch.describe()}")
    failed = False
    for dtype_name in ("float64", "float32") if args.dtype == "both" else (args.dtype,):
        dtype = getattr(torch, dtype_name)
        rows = [run_comparison(comparison, dtype) for comparison in COMPARISONS]
        print(f"\nlog-probs in {dtype_name} (fineflow sums them in float64, as pair_sums does)")
        print(render(rows))
        failed |= print_checks(rows, dtype)
        failed |= any(row.failed for row in rows)
    print(
        "\nFAILED: a judged row differs by more than the tolerance or did not run"
        if failed
        else "\nall judged rows within"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
