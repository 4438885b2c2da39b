"""The promotion gate: the statistics and the decision, on numbers only (no files).

A candidate becomes champion only if its primary metric beats the reference (the current champion, or
the base model when there is none) by ``promote.min_delta``, a seeded paired bootstrap over the
per-sample scores puts the lower end of the delta's confidence interval above 0 (so a lucky run on a
small eval set is not promoted), and no other metric regresses by more than ``promote.max_regression`` (a
score, higher is better; ``NOT_REGRESSION_GUARDED`` names the reported measures that are not scores of that kind).
It is refused outright, with the reason, when an evaluation is missing or failed, the eval data differs
from the champion's, or the candidate's lineage manifest is missing or incomplete.

``promotion_decision`` is the whole gate on an evaluate stage's scores; ``decide`` the comparison of two
sets of metrics it ends with. Both read their settings from one ``GatePolicy``, built once from the params
(``GatePolicy.from_params``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from fineflow.core.config import Params

# Reported and bootstrapped, but no veto as another metric: the preference task's reward margin is a log-prob
# difference times train.preference.beta, unbounded and on no scale promote.max_regression (a share of docs) speaks
# for; a candidate that ranks more pairs right with smaller margins is better, not a regression. It still decides
# as promote.primary_metric. (The task: fineflow.evaluate.pair_ranking, not imported here: the gate reads numbers.)
NOT_REGRESSION_GUARDED = frozenset({"fineflow_preference/reward_margin"})


@dataclass(frozen=True, kw_only=True)
class GatePolicy:
    """The gate's settings, the promote params it reads (and the run's seed), built once: ``from_params``.

    Keyword-only, since most fields are numbers and a position would silently swap two of them. Change one with
    ``dataclasses.replace(policy, max_regression=0.0)``."""

    primary_metric: str
    """The metric that decides, ``<task>/<metric>`` (promote.primary_metric)."""
    min_delta: float
    """How much the candidate must beat the reference by on the primary metric (promote.min_delta)."""
    max_regression: float
    """How far any other guarded metric may drop versus the reference (promote.max_regression)."""
    bootstrap_samples: int
    """Paired bootstrap resamples of the per-sample scores (promote.bootstrap_samples)."""
    confidence: float
    """Two-sided level of the delta's CI, which must exclude 0 (promote.confidence)."""
    seed: int
    """The bootstrap's seed (the run's seed)."""
    on_eval_change: Literal["compare_on_current", "refuse"] = "refuse"
    """Eval data changed since the champion: re-score the champion on the current data, or refuse
    (promote.on_eval_change; a library caller that says nothing is refused)."""
    on_base_change: Literal["compare_to_base", "refuse"] = "refuse"
    """The base model changed since the champion: judge against the candidate's own base, or refuse
    (promote.on_base_change; a library caller that says nothing is refused)."""

    @classmethod
    def from_params(cls, params: Params) -> GatePolicy:
        """The policy of params.promote, seeded by params.seed."""
        cfg = params.promote
        return cls(
            primary_metric=cfg.primary_metric,
            min_delta=cfg.min_delta,
            max_regression=cfg.max_regression,
            bootstrap_samples=cfg.bootstrap_samples,
            confidence=cfg.confidence,
            seed=params.seed,
            on_eval_change=cfg.on_eval_change,
            on_base_change=cfg.on_base_change,
        )


@dataclass(frozen=True)
class Bootstrap:
    """Paired bootstrap of mean(candidate - reference) over per-sample scores."""

    delta: float
    ci_low: float
    ci_high: float
    p_value: float  # one-sided: share of bootstrap deltas <= 0
    n: int
    confidence: float
    samples: int
    seed: int

    def describe(self) -> str:
        return (
            f"{self.delta:+.4f}, {self.confidence:.0%} CI [{self.ci_low:+.4f}, {self.ci_high:+.4f}], "
            f"p={self.p_value:.3f}, n={self.n}"
        )


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The gate's verdict and its evidence; keyword-only, since several fields share a type and a position
    would silently swap the candidate's and the reference's values."""

    promote: bool
    reason: str
    primary: str
    candidate: float | None
    reference: float | None
    reference_name: str
    regressions: dict
    stats: dict | None = None  # the Bootstrap as a dict, when it was computed
    # what changed since the champion and how the policy handled it: "eval_change" / "base_change" ({"from",
    # "to", "policy"}), "vs_old_champion" (the old champion's merged model on the same docs, side by side)
    context: dict = field(default_factory=dict)


def refusal(
    reason: str,
    primary: str,
    reference_name: str = "reference",
    candidate: float | None = None,
    reference: float | None = None,
    context: dict | None = None,
) -> Decision:
    """A refusal for want of evidence: no regressions measured, no bootstrap run."""
    return Decision(
        promote=False,
        reason=reason,
        primary=primary,
        candidate=candidate,
        reference=reference,
        reference_name=reference_name,
        regressions={},
        stats=None,
        context=context or {},
    )


def decision_record(decision: Decision) -> dict:
    """The decision as the promotion log stores it."""
    return asdict(decision)


def flatten(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    """{task: {metric: v}} -> {"task/metric": v}."""
    return {f"{task}/{name}": value for task, values in metrics.items() for name, value in values.items()}


def paired_bootstrap(
    candidate: Sequence[float], reference: Sequence[float], samples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> Bootstrap:
    """Resample the paired differences with replacement ``samples`` times (numpy, seeded): mean delta,
    percentile CI and the one-sided p-value. Memory stays bounded for long eval sets (chunks of rows)."""
    import numpy as np

    diffs = np.asarray(candidate, dtype=np.float64) - np.asarray(reference, dtype=np.float64)
    n = int(diffs.size)
    if n == 0:
        raise ValueError("no paired samples")
    rng = np.random.default_rng(seed)
    means = np.empty(samples, dtype=np.float64)
    chunk = max(1, (1 << 22) // n)
    for start in range(0, samples, chunk):
        k = min(chunk, samples - start)
        means[start : start + k] = diffs[rng.integers(0, n, size=(k, n))].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return Bootstrap(
        delta=round(float(diffs.mean()), 6),
        ci_low=round(float(low), 6),
        ci_high=round(float(high), 6),
        p_value=round(float((means <= 0).mean()), 6),
        n=n,
        confidence=confidence,
        samples=samples,
        seed=seed,
    )


def bootstrap_per_metric(candidate: dict, reference: dict, policy: GatePolicy) -> dict:
    """Paired bootstrap of every task/metric both evaluation entries have per-sample scores for, on exactly the
    same docs, with the policy's samples, confidence and seed: {"task/metric": {delta, ci_low, ci_high, p_value, n,
    confidence}} (the model card's table)."""
    out = {}
    for task, metrics in (candidate.get("metrics") or {}).items():
        cand_rows = {r["doc_id"]: r for r in (candidate.get("samples") or {}).get(task) or []}
        ref_rows = {r["doc_id"]: r for r in (reference.get("samples") or {}).get(task) or []}
        docs = sorted(set(cand_rows) & set(ref_rows))
        for metric in metrics:
            pairs = [
                (cand_rows[d][metric], ref_rows[d][metric])
                for d in docs
                if isinstance(cand_rows[d].get(metric), (int, float))
                and isinstance(ref_rows[d].get(metric), (int, float))
            ]
            if pairs and len(pairs) == len(cand_rows) == len(ref_rows):
                b = paired_bootstrap(
                    [c for c, _ in pairs],
                    [r for _, r in pairs],
                    policy.bootstrap_samples,
                    policy.confidence,
                    policy.seed,
                )
                out[f"{task}/{metric}"] = {
                    "delta": b.delta,
                    "ci_low": b.ci_low,
                    "ci_high": b.ci_high,
                    "p_value": b.p_value,
                    "n": b.n,
                    "confidence": policy.confidence,
                }
    return out


def decide(
    candidate: dict[str, float],
    reference: dict[str, float],
    reference_name: str,
    policy: GatePolicy,
    stats: Bootstrap | None = None,
) -> Decision:
    """The gate on numbers, by the policy's primary metric, min_delta and max_regression. Metrics are flat
    {"task/metric": value}, higher is better. With stats (the paired bootstrap of the primary metric) the delta is
    the paired mean and its CI must exclude 0."""
    primary, min_delta, max_regression = policy.primary_metric, policy.min_delta, policy.max_regression
    cand, ref = candidate.get(primary), reference.get(primary)
    st = asdict(stats) if stats else None

    def verdict(promote: bool, reason: str, regressions: dict | None = None) -> Decision:
        return Decision(
            promote=promote,
            reason=reason,
            primary=primary,
            candidate=cand,
            reference=ref,
            reference_name=reference_name,
            regressions=regressions or {},
            stats=st,
        )

    if cand is None:
        return verdict(False, f"the candidate has no value for the primary metric {primary}")
    if ref is None:
        return verdict(False, f"the {reference_name} has no value for the primary metric {primary}")
    regressions = {
        key: round(reference[key] - value, 6)
        for key, value in candidate.items()
        if key != primary
        and key not in NOT_REGRESSION_GUARDED
        and key in reference
        and reference[key] - value > max_regression
    }
    if regressions:
        return verdict(
            False,
            f"regressed beyond promote.max_regression={max_regression} on {sorted(regressions)} "
            f"versus the {reference_name}: " + ", ".join(f"{k} -{v:.4f}" for k, v in sorted(regressions.items())),
            regressions,
        )
    delta = stats.delta if stats else cand - ref
    evidence = f" ({stats.describe()})" if stats else ""
    if delta < min_delta:
        return verdict(
            False,
            f"{primary} {cand:.4f} does not beat the {reference_name}'s {ref:.4f} by "
            f"promote.min_delta={min_delta}: delta {delta:+.4f}{evidence}",
        )
    if stats and stats.ci_low <= 0:
        return verdict(
            False,
            f"{primary} delta {delta:+.4f} over the {reference_name} is within noise: the "
            f"{stats.confidence:.0%} CI [{stats.ci_low:+.4f}, {stats.ci_high:+.4f}] includes 0 "
            f"(p={stats.p_value:.3f}, n={stats.n})",
        )
    return verdict(
        True,
        f"{primary} {cand:.4f} beats the {reference_name}'s {ref:.4f} by {delta:+.4f} "
        f"(>= {min_delta}){evidence} with no regression",
    )


def per_sample(entry: dict, primary: str) -> dict | None:
    """{doc_id: score} of the primary metric from an evaluation entry's samples, or None."""
    task, _, metric = primary.partition("/")
    rows = (entry.get("samples") or {}).get(task)
    if not rows:
        return None
    scores = {r["doc_id"]: float(r[metric]) for r in rows if isinstance(r.get(metric), (int, float)) and "doc_id" in r}
    return scores or None


def promotion_decision(
    scores: dict,
    champion: dict | None,
    lineage_missing: list[str] | None,
    policy: GatePolicy,
    eval_data_sha256: str | None,
) -> Decision:
    """The whole gate. scores is eval/scores.json; champion the current champion's record ({"id",
    "metrics" flat, "samples", "eval_data_sha256", "base_digest"}) or None; lineage_missing the REQUIRED lineage
    fields that are absent (None: no manifest at all); eval_data_sha256 the eval data these scores were computed
    on. Never promotes on missing or doubtful evidence.

    policy.on_eval_change / policy.on_base_change: what happens when the eval data or the base model are not
    the champion's any more; the decision's context says what changed and what the policy did."""
    candidate = scores.get("candidate")
    problem = _candidate_problem(candidate, lineage_missing)
    if problem:
        return refusal(problem, policy.primary_metric)
    if champion is None:
        reference_name, context = "base model", {}
        reference, problem = _base_as_reference(scores)
    elif _base_changed(scores, champion):
        eval_change = _eval_change(champion, eval_data_sha256, policy.on_eval_change)
        return _judge_on_a_new_base(scores, champion, policy, eval_change)
    else:
        reference_name = f"champion {champion['id']}"
        reference, problem, context = _champion_as_reference(
            scores, champion, reference_name, eval_data_sha256, policy.on_eval_change
        )
    if problem:
        return refusal(problem, policy.primary_metric, reference_name, context=context)
    decision = _compare(candidate, reference, reference_name, policy)
    return replace(decision, context=context)


def _base_changed(scores: dict, champion: dict) -> bool:
    """Both bases are known by content and differ (a library caller that gave evaluate no base digest records
    none: then the bases are taken to be the same)."""
    now, then = scores.get("base_digest"), champion.get("base_digest")
    return bool(now and then and now != then)


def _judge_on_a_new_base(scores: dict, champion: dict, policy: GatePolicy, eval_change: dict) -> Decision:
    """The candidate is on another base than the champion: refused (policy.on_base_change refuse), or judged
    against its own base, with the old champion's merged model on the same docs reported side by side
    (compare_to_base).
    eval_change: the eval set's change in the same run ({} or {"eval_change": ...}), recorded beside the base's
    (the candidate is not compared with the champion's recorded metrics then, so it decides nothing)."""
    cid = champion["id"]
    change = {"from": champion["base_digest"], "to": scores["base_digest"], "policy": policy.on_base_change}
    switch = (
        f"the base model changed: champion {cid} was trained on base {change['from']}, this candidate on {change['to']}"
    )
    if policy.on_base_change == "refuse":
        return refusal(
            f"{switch}; promote.on_base_change is refuse (set it to compare_to_base to judge the candidate against "
            "its own base, the old champion's merged model side by side)",
            policy.primary_metric,
            f"champion {cid}",
            context={"base_change": change, **eval_change},
        )
    reference, problem = _base_as_reference(scores)
    context = {"base_change": change, **eval_change, "vs_old_champion": _side_by_side(scores, champion, policy)}
    if problem:
        return refusal(f"{switch}; {problem}", policy.primary_metric, "base model", context=context)
    decision = _compare(scores["candidate"], reference, "base model", policy)
    reason = f"{decision.reason} ({switch}; promote.on_base_change: compare_to_base)"
    return replace(decision, reason=reason, context=context)


def _side_by_side(scores: dict, champion: dict, policy: GatePolicy) -> dict:
    """The old champion as the evaluate stage could score it on this run's docs (its merged model, which needs
    no base of ours): its metrics and the candidate's paired delta per metric; or why it could not be."""
    evaluated = scores.get("champion")
    if not evaluated or evaluated.get("status", "ok") != "ok":
        why = (evaluated or {}).get("error", "not evaluated in this run")
        return {"champion": champion["id"], "status": "not compared", "why": why}
    return {
        "champion": champion["id"],
        "evaluated_as": evaluated.get("evaluated_as", "adapter"),
        "metrics": flatten(evaluated.get("metrics") or {}),
        "candidate_vs_champion": bootstrap_per_metric(scores["candidate"], evaluated, policy),
    }


def _candidate_problem(candidate: dict | None, lineage_missing: list[str] | None) -> str | None:
    """Why the candidate's own evidence (its evaluation, its lineage) cannot be judged, or None."""
    if candidate and candidate.get("status", "ok") != "ok":
        return f"the candidate's evaluation failed: {candidate.get('error', 'no error given')}"
    if not candidate or not candidate.get("metrics"):
        return "no candidate evaluation in the scores: run the evaluate stage"
    if lineage_missing is None:
        return "the candidate has no lineage manifest"
    if lineage_missing:
        return f"the candidate's lineage is incomplete: missing {', '.join(lineage_missing)}"
    return None


def _base_as_reference(scores: dict) -> tuple[dict | None, str | None]:
    """With no champion yet the base model's evaluation is the reference: (entry, None) or (None, why not)."""
    reference = scores.get("base")
    if reference and reference.get("status", "ok") != "ok":
        return None, f"the base model's evaluation failed: {reference.get('error', 'no error given')}"
    if not reference or not reference.get("metrics"):
        return None, "no base model evaluation in the scores (needed when there is no champion)"
    return reference, None


def _champion_as_reference(
    scores: dict, champion: dict, reference_name: str, eval_data_sha256: str | None, on_eval_change: str
) -> tuple[dict | None, str | None, dict]:
    """The champion's evaluation in these scores, else its metrics recorded at promotion, provided both were
    computed on the same eval data as the candidate's: (entry, None, context) or (None, why not, context).
    Changed eval data: with on_eval_change compare_on_current, the champion's evaluation in this run (on the
    current data) is the reference; with refuse, or when the champion was not re-scored, it is refused."""
    recorded = champion.get("eval_data_sha256")
    evaluated = scores.get("champion")
    context = _eval_change(champion, eval_data_sha256, on_eval_change)
    problem = _eval_data_problem(recorded, eval_data_sha256, evaluated is not None, reference_name, on_eval_change)
    if problem is None and evaluated is not None:
        problem = _evaluation_problem(evaluated, champion["id"], reference_name)
    if problem:
        return None, problem, context
    if evaluated is not None:
        return evaluated, None, context
    return {"metrics": None, "flat": champion.get("metrics") or {}, "samples": champion.get("samples")}, None, context


def _eval_change(champion: dict, eval_data_sha256: str | None, on_eval_change: str) -> dict:
    """{"eval_change": {"from", "to", "policy"}} when the eval data is not the champion's any more, else {}."""
    recorded = champion.get("eval_data_sha256")
    if recorded and eval_data_sha256 and recorded != eval_data_sha256:
        return {"eval_change": {"from": recorded, "to": eval_data_sha256, "policy": on_eval_change}}
    return {}


def _eval_data_problem(
    recorded: str | None, current: str | None, rescored: bool, reference_name: str, on_eval_change: str
) -> str | None:
    """Why the champion's scores cannot be compared for want of eval data in common (recorded: the eval data
    hash at its promotion; current: this run's; rescored: the champion was evaluated in this run), or None."""
    if not recorded:
        if rescored:
            return None
        return (
            f"the {reference_name} has no recorded eval data hash and was not re-evaluated in this run, so its "
            "metrics cannot be compared"
        )
    if not current:
        return (
            "the scores do not say which eval data they were computed on (no eval_data_sha256), so they cannot be "
            f"compared with the {reference_name}'s"
        )
    if recorded == current:
        return None
    changed = (
        f"the eval data changed since the {reference_name} was promoted: sha256 {recorded[:12]} then, "
        f"{current[:12]} now"
    )
    if on_eval_change == "refuse":
        return (
            f"{changed}; promote.on_eval_change is refuse (set it to compare_on_current to judge the candidate "
            "against the champion re-scored on the current eval data, or restore the champion's eval data)"
        )
    return None if rescored else f"{changed}, and the {reference_name} was not re-scored on it in this run"


def _evaluation_problem(evaluated: dict, cid: str, reference_name: str) -> str | None:
    """Why the champion's evaluation in this run cannot be the reference (it failed, or scored another model)."""
    if evaluated.get("status", "ok") != "ok":
        return f"the {reference_name}'s evaluation failed: {evaluated.get('error', 'no error given')}"
    if evaluated.get("id") and evaluated["id"] != cid:
        return (
            f"the scores evaluated champion {evaluated['id']} but the registry's champion is {cid}: re-run the "
            "evaluate stage"
        )
    return None


def _compare(candidate: dict, reference: dict, reference_name: str, policy: GatePolicy) -> Decision:
    """decide() on the two entries' metrics, with the paired bootstrap of the primary metric over the docs
    both were scored on; refused when the per-sample scores that bootstrap needs are missing or unpaired."""
    primary = policy.primary_metric
    cand_flat = flatten(candidate["metrics"])
    ref_flat = reference.get("flat") if reference.get("metrics") is None else flatten(reference["metrics"])
    cand_samples, ref_samples = per_sample(candidate, primary), per_sample(reference, primary)
    if cand_flat.get(primary) is None or ref_flat.get(primary) is None:
        return decide(cand_flat, ref_flat, reference_name, policy)
    values = dict(
        primary=primary,
        reference_name=reference_name,
        candidate=cand_flat.get(primary),
        reference=ref_flat.get(primary),
    )
    if cand_samples is None or ref_samples is None:
        who = "candidate" if cand_samples is None else reference_name
        return refusal(
            f"no per-sample {primary} scores for the {who}: the gate needs them for the paired bootstrap", **values
        )
    if set(cand_samples) != set(ref_samples):
        return refusal(
            f"the candidate's and the {reference_name}'s per-sample scores cover different docs "
            f"({len(cand_samples)} vs {len(ref_samples)}): not comparable",
            **values,
        )
    docs = sorted(cand_samples)
    stats = paired_bootstrap(
        [cand_samples[d] for d in docs],
        [ref_samples[d] for d in docs],
        policy.bootstrap_samples,
        policy.confidence,
        policy.seed,
    )
    return decide(cand_flat, ref_flat, reference_name, policy, stats)
