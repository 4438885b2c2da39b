"""The one interface every training objective implements, and that the stages ask instead of naming one.

An objective says:
- ``rows``: the row schema it trains on. EXAMPLES: an instruction (or messages) and its answer, the SFT row;
  PAIRS: a prompt with a chosen and a rejected answer; FEEDBACK: an SFT row plus a ``label`` (true: the answer is
  desirable, false: undesirable), unpaired. The data, validate and tokenize stages read, check and pack rows of
  that schema (fineflow.data.formats, fineflow.data.checks, fineflow.tokenize.pairs). PAIRS and FEEDBACK rows are
  packed as units of two sequences (a pair's two answers; a feedback row's answer and, for the KL estimate, its
  prompt with another row's answer): ``pair_shards``.
- ``anchored``: whether the run continues a model: train.preference.reference picks it (the champion's adapter, or
  a fresh adapter on the base), the policy starts from it and evaluate measures the candidate's preference rewards
  from it; ``needs_reference``: whether that model, frozen, also scores the training rows, so that the
  reference_logps stage computes its log-probs once (and the train stage reads them, fineflow.train.reference_model).
- ``loss``: a batch's summed loss, what it is a sum over (trained tokens, or pairs: the loop divides by the
  global batch's count of them, so 1 process and N ranks take the same step) and, for pairs, the reward
  statistics the step log shows.
- ``params``: its own settings, a params section (``train.<name>``: fineflow.param_section.Section, typed, unknown keys
  rejected, listed in the params reference); None when it has none. Settings the preference objectives share
  (beta, the reference) are ``train.preference`` (fineflow.objectives.pair_params).
- ``online``: it generates its training batches in the loop (online RL: fineflow.objectives.grpo): each step's
  sampled rows are prompts, which fineflow.train.rollouts samples completions for with ``online_settings``,
  scores with its rewards and turns into the step's micro-batches with its ``advantages`` and ``loss_targets``.
- ``eval_task``: the held-out task evaluate adds for it (None: only evaluate.tasks), whose metrics the gate
  can judge (promote.primary_metric).
- ``model_kind``: what the trained model is: a language model (LANGUAGE_MODEL), or a model that scores text (the
  reward model), which evaluate, promote, the registry and export treat as its kind says (``generates``), with
  the hooks that build, save, load and run it (``prepare_model``, ``save_extra``, ``load_trained``,
  ``score_examples``).

Adding an objective: one module in this package with a subclass, and its line in ``OBJECTIVES``
(fineflow/objectives/__init__.py). docs/objectives.md walks through one.
"""

from __future__ import annotations

from dataclasses import dataclass

EXAMPLES = "examples"  # an instruction (or messages) and its answer: what SFT trains on
PAIRS = "pairs"  # a prompt, a chosen and a rejected answer: what preference objectives train on
FEEDBACK = "feedback"  # an SFT row and a desirable/undesirable label, unpaired: what KTO trains on
ROW_SCHEMAS = (EXAMPLES, PAIRS, FEEDBACK)

PREFERENCE_TASK = "fineflow_preference"  # evaluate's held-out pair ranking (fineflow.evaluate.pair_ranking)

LANGUAGE_MODEL = "lm"  # Objective.model_kind of a model that generates: every objective's but the reward model's


@dataclass
class BatchLoss:
    loss_sum: object  # a torch scalar: the batch's summed loss (backward goes through it)
    count: int  # what loss_sum sums over: trained tokens (EXAMPLES) or pairs (PAIRS)
    rewards: tuple[float, float] | None = None  # pairs: (pairs ranked right, summed reward margin); else None


class Objective:
    """A training objective (train.objective). Subclasses set the class attributes and implement ``loss``."""

    name: str = ""
    summary: str = ""  # one line for the params reference (train.objective's description)
    rows: str = EXAMPLES
    anchored: bool = False  # starts from train.preference.reference's model (always, when needs_reference)
    needs_reference: bool = False
    params: type | None = None  # its own settings section, train.<name> (a fineflow.param_section.Section)
    online: bool = False  # generates each step's batch in the loop (fineflow.train.rollouts)
    eval_task: str | None = None

    def loss(self, model, batch: dict, cfg=None, **forward_kwargs) -> BatchLoss:
        """The batch's summed loss under this objective. cfg: the run's train section (TrainParams; None: the
        defaults), forward_kwargs: the attention layout (fineflow.train.attention.layout_kwargs)."""
        raise NotImplementedError

    def check_kept_rows(self, kept: dict, cfg) -> dict:
        """The checks of each split's kept rows as a whole, after the validate stage's row checks: ``kept`` maps
        train and eval to their rows file (JSONL), cfg is the train section. Returns what the validate report adds,
        or raises DataError naming the file and what to change. None by default."""
        return {}

    def check_run(self, cfg, profile) -> None:
        """Refuse, before any model loads, a run configuration it cannot train with (cfg: the train section,
        profile: the accelerate profile, fineflow.train.profile); nothing by default."""

    # ---- an online objective (online: True): the loop's rollouts make each step's batch (fineflow.train.rollouts) --

    def online_settings(self, cfg):
        """Its rollouts' settings: group_size, max_completion_tokens, temperature, top_p, beta (the reference's
        weight) and rewards (fineflow.reward_spec.RewardSpec list)."""
        raise NotImplementedError(f"train.objective {self.name} trains on its shards as they are: no rollouts")

    def advantages(self, rewards, cfg):
        """Each completion's advantage from its group's rewards (a groups x group_size tensor)."""
        raise NotImplementedError(f"train.objective {self.name} trains on its shards as they are: no rollouts")

    def loss_targets(self, completions: int, completion_tokens: int, cfg) -> int:
        """What its loss over a rank's completions is a sum over (the loop divides by the global count)."""
        raise NotImplementedError(f"train.objective {self.name} trains on its shards as they are: no rollouts")

    @property
    def trains_pairs(self) -> bool:
        """Its rows are preference pairs (prompt, chosen, rejected)."""
        return self.rows == PAIRS

    @property
    def pair_shards(self) -> bool:
        """Its shards pack units of two sequences with their pair slots (fineflow.train.pair_shards)."""
        return self.rows in (PAIRS, FEEDBACK)

    # ---- what the trained model is: a language model, unless the objective trains another kind of model ----------
    # (added with the reward model, fineflow.objectives.reward_model; a kind other than LANGUAGE_MODEL scores text)

    model_kind: str = LANGUAGE_MODEL
    """The kind of model it trains. LANGUAGE_MODEL generates: evaluate.tasks score it, promote merges it, export
    writes it as GGUF. Another kind scores text (``score_examples``): evaluate scores it on ``eval_task`` alone, it is
    neither merged nor exported, and the registry keeps a champion per kind (a candidate competes with its own kind's
    champion, or with chance when there is none: fineflow.registry.store)."""

    @property
    def generates(self) -> bool:
        """Whether the trained model is a language model (model_kind LANGUAGE_MODEL)."""
        return self.model_kind == LANGUAGE_MODEL

    def prepare_model(self, model, cfg=None):
        """The model to train, its adapters added: what the objective trains beside them (default: nothing more).
        cfg: the run's train section."""
        return model

    def save_extra(self, model, out_dir, state_dict: dict | None = None) -> None:
        """Beside the saved adapter in out_dir: what prepare_model added (default: nothing). state_dict: the
        trained model's, as the train stage gathered it (None: read the model's own tensors)."""

    def load_trained(self, model, model_dir):
        """A kind that scores text: the trained model in model_dir (its adapter and save_extra's files) on the
        loaded base ``model``, for scoring (``score_examples``)."""
        raise NotImplementedError(f"train.objective {self.name} trains a language model: it has no scores")

    def score_examples(self, model, encoded, batch_size: int, seq_len: int):
        """A kind that scores text: one float per example of ``encoded`` (fineflow.tokenize.template.EncodedBatch:
        prompt and answer as the tokenize stage renders them), each cut at its first seq_len tokens as packing
        cuts it; a numpy array."""
        raise NotImplementedError(f"train.objective {self.name} trains a language model: it has no scores")


class PairObjective(Objective):
    """A preference objective over packed pair shards: a reward per answer, and the loss -logsigmoid of the
    chosen reward's margin over the rejected one's (less ``offset``). Subclasses define ``rewards``."""

    rows = PAIRS
    eval_task = PREFERENCE_TASK
    anchored = True

    def rewards(self, policy, reference, cfg):
        """(chosen reward, rejected reward) per pair, from the policy's PairScores (and the reference's, when
        needs_reference) with cfg = the run's train section (train.preference, and train.<name> for its own)."""
        raise NotImplementedError

    def offset(self, cfg) -> float:
        """What the margin must exceed before the loss is small (SimPO's gamma); 0 by default."""
        return 0.0

    def loss(self, model, batch: dict, cfg=None, **forward_kwargs) -> BatchLoss:
        from fineflow.errors import FineflowError
        from fineflow.objectives.pair_logps import pair_scores, token_logps, trained_positions

        _, at = trained_positions(batch["labels"])
        policy = pair_scores(token_logps(model, batch, **forward_kwargs), batch["pair_slots"], at)
        reference = None
        if self.needs_reference:
            if "ref_logps" not in batch:
                raise FineflowError(
                    f"train.objective {self.name} needs the reference log-probs: run the reference_logps stage"
                )
            reference = pair_scores(batch["ref_logps"][at], batch["pair_slots"], at)
        return self.pair_loss(policy, reference, cfg)  # a pair objective always runs with the run's train section

    def pair_loss(self, policy, reference, cfg) -> BatchLoss:
        """The summed loss and reward statistics of scored pairs (the batch's, or a test's); cfg: the train section."""
        import torch.nn.functional as F

        chosen, rejected = self.rewards(policy, reference, cfg)
        margin = chosen - rejected
        offset = self.offset(cfg)
        logits = margin - offset if offset else margin
        loss_sum = -F.logsigmoid(logits).sum()
        return BatchLoss(loss_sum, int(margin.numel()), (float((margin > 0).sum()), float(margin.detach().sum())))
