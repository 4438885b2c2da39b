"""train.objective grpo (fineflow/objectives/grpo.py, rollouts.py): the loss and its normalisations against their
formulas in plain floats, the group advantages, the prompts read back from packed SFT rows, and the real train stage
on the tiny project: rollouts seeded per group (the same completions after a resume), the step log's rollout figures
and the ledger's rollout and reward spans."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import (
    finish_train,
    kill_when,
    last_logged_step,
    ranks_overrides,
    start_train,
    train_env,
    train_project,
)
from tests.test_preference_train import run_stage, steps_of

# three completions (rows) of 2, 3 and 1 tokens in a 4-wide batch
LOGPS = [[-0.5, -1.25], [-2.0, -0.75, -0.1], [-3.0]]
REFS = [[-0.6, -1.0], [-2.5, -0.5, -0.2], [-2.0]]
ADVANTAGES = [0.8, -1.1, 0.3]


def _batch():
    import torch

    at = torch.zeros((3, 4), dtype=torch.bool)
    for r, values in enumerate(LOGPS):
        at[r, 1 : 1 + len(values)] = True
    flat = lambda rows: torch.tensor([v for row in rows for v in row], dtype=torch.float64)  # noqa: E731
    advantages = torch.tensor([a for a, row in zip(ADVANTAGES, LOGPS) for _ in row], dtype=torch.float64)
    return flat(LOGPS), advantages, flat(REFS), at


def _settings(**values):
    from fineflow.objectives.grpo import GRPOParams

    return GRPOParams(**values)


@pytest.mark.parametrize("normalization", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_policy_loss_is_the_clipped_objective_with_the_kl_term_under_each_normalisation(normalization, beta):
    """At ratio 1 (one optimizer step per generation batch) the clipped term is -A per token; the k3 KL estimate
    exp(ref - logp) - (ref - logp) - 1 weighs in with beta; grpo sums each completion's token mean, dapo every
    token, dr_grpo each completion's token sum over max_completion_tokens. Its gradient is -A per token's logp."""
    import torch

    from fineflow.objectives.grpo import policy_loss

    logps, advantages, refs, at = _batch()
    logps.requires_grad_(True)
    settings = _settings(beta=beta, normalization=normalization, max_completion_tokens=8)
    got = policy_loss(logps, advantages, refs, at, settings)
    per_completion = []
    for values, ref_values, a in zip(LOGPS, REFS, ADVANTAGES):
        terms = [-a + beta * (math.exp(r - v) - (r - v) - 1) for v, r in zip(values, ref_values)]
        per_completion.append(terms)
    if normalization == "grpo":
        expected, count = sum(sum(t) / len(t) for t in per_completion), 3
    elif normalization == "dapo":
        expected, count = sum(sum(t) for t in per_completion), 6
    else:
        expected, count = sum(sum(t) for t in per_completion) / 8, 3
    assert float(got.loss_sum) == pytest.approx(expected, abs=1e-12) and got.count == count
    got.loss_sum.backward()
    if beta == 0.0 and normalization == "dapo":
        assert logps.grad.tolist() == pytest.approx([-a for a, row in zip(ADVANTAGES, LOGPS) for _ in row])
    assert torch.isfinite(logps.grad).all()


def test_the_ratio_is_clipped_on_the_side_the_advantage_pushes_it():
    """Against a sampling policy whose log-probs are ln 1.5 below (ratio 1.5, past 1 + eps = 1.2): a positive
    advantage takes the clipped 1.2 A (no gradient), a negative one the unclipped 1.5 A (gradient -A * ratio);
    epsilon_high widens only the upper side (DAPO's clip-higher)."""
    import torch

    from fineflow.objectives.grpo import policy_loss

    at = torch.ones((1, 2), dtype=torch.bool)
    logps = torch.tensor([-1.0, -1.0], dtype=torch.float64, requires_grad=True)
    old = logps.detach() - math.log(1.5)
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    got = policy_loss(logps, advantages, None, at, _settings(epsilon=0.2, normalization="dapo"), old)
    assert float(got.loss_sum) == pytest.approx(-1.2 + 1.5)
    got.loss_sum.backward()
    assert logps.grad.tolist() == pytest.approx([0.0, 1.5])
    higher = policy_loss(
        logps, advantages, None, at, _settings(epsilon=0.2, epsilon_high=0.6, normalization="dapo"), old
    )
    assert float(higher.loss_sum) == pytest.approx(-1.5 + 1.5)  # 1.5 < 1 + 0.6: unclipped both sides


def test_group_advantages_are_the_rewards_less_the_group_mean_over_its_std_or_unscaled_for_dr_grpo():
    import torch

    from fineflow.objectives.grpo import group_advantages

    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    std = math.sqrt(sum((r - 0.5) ** 2 for r in (1, 0, 0, 1)) / 3)
    grpo = group_advantages(rewards, "grpo")
    scale = std + 1e-4
    assert grpo[0].tolist() == pytest.approx([0.5 / scale, -0.5 / scale, -0.5 / scale, 0.5 / scale])
    assert grpo[1].tolist() == [0.0] * 4  # a flat group: no signal
    assert group_advantages(rewards, "dr_grpo")[0].tolist() == [0.5, -0.5, -0.5, 0.5]


def test_the_prompts_of_a_packed_row_are_each_examples_tokens_before_its_answer(built):
    """Every example of the built SFT shard's rows comes back as its prompt and its answer (+ EOS), and the prompt
    renders the row's instruction: what the rollouts generate from and the rewards check against."""
    from transformers import AutoTokenizer

    from fineflow.tokenize.shards import PackedShard
    from fineflow.train.rollouts import prompts_of

    shard = PackedShard(built / "data/shards/train")
    tokenizer = AutoTokenizer.from_pretrained(built / "models/base")
    rows = [json.loads(line) for line in (built / "data/validated/train.jsonl").read_text().splitlines()]
    outputs = {row["output"] for row in rows}
    found = []
    for i in range(len(shard)):
        arrays = shard.row(i)
        found += prompts_of(arrays["input_ids"], arrays["labels"], arrays["position_ids"], i)
    assert len(found) == shard.meta["examples"] > len(shard)  # every example, several to some packed rows
    for prompt in found:
        answer = tokenizer.decode(prompt.answer_ids, skip_special_tokens=True).strip()
        assert answer in outputs, answer
        assert prompt.answer_ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(prompt.prompt_ids).startswith("### Instruction:")
        assert tokenizer.decode(prompt.prompt_ids).rstrip().endswith("### Response:")
    assert len({(p.row, p.example) for p in found}) == len(found)


GRPO = {
    "train.objective": "grpo",
    "train.steps": 4,
    "train.micro_batch_size": 1,
    "train.grad_accum": 2,
    "train.grpo.group_size": 4,
    "train.grpo.max_completion_tokens": 12,
    "train.lr": 0.005,
    "checkpoint.every_steps": 2,
    # a reward the base model's samples earn sometimes: groups with and without a digit, so advantages are not 0
    "train.grpo.rewards": [{"name": "format", "weight": 1.0, "pattern": "[0-9]", "mode": "search"}],
}


def with_tests_importable(env: dict) -> dict:
    """The stage's environment with the repository on PYTHONPATH, so a user reward named tests.reward_functions:...
    imports (a user's own reward module is on their PYTHONPATH the same way)."""
    from tests.conftest import ROOT

    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)}


def TRAIN_OVERRIDES_GRPO() -> dict:  # noqa: N802 - the params grpo_project writes
    from tests.conftest import TRAIN_OVERRIDES

    return {**TRAIN_OVERRIDES, **GRPO}


def grpo_project(built: Path, path: Path, overrides: dict | None = None) -> Path:
    """The tiny project's SFT shards and base, params for grpo; the fingerprint and reference_logps stages run
    (the start: the base, no champion)."""
    project = train_project(built, path, {**GRPO, **(overrides or {})})
    run_stage(project, "fingerprint")
    run_stage(project, "reference_logps")
    return project


@pytest.mark.slow
def test_the_train_stage_trains_grpo_from_its_rollouts_and_logs_where_the_step_went(built, tmp_path):
    """The real train stage with train.objective grpo: each step logs its reward mean, the share of groups
    without signal, the completions' length and reward errors, and its rollout and reward spans, which the
    report's loop totals carry for the goodput ledger; the candidate adapter is saved."""
    project = grpo_project(built, tmp_path / "p")
    finish_train(project, 1, train_env(1))
    steps = steps_of(project)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for record in steps:
        assert 0.0 <= record["reward_mean"] <= 1.0 and 0.0 <= record["zero_advantage_share"] <= 1.0, record
        assert 0 < record["completion_tokens_mean"] <= 12 and record["reward_errors"] == 0, record
        assert record["rollout_s"] > 0 and record["reward_s"] > 0, record
    report = json.loads((project / "reports/train.json").read_text())
    assert report["loop_totals"]["rollout_s"] > 0 and report["loop_totals"]["reward_s"] > 0, report["loop_totals"]
    assert any(0 < s["zero_advantage_share"] < 1 for s in steps) and any(s["grad_norm"] > 0 for s in steps), steps
    assert (project / "models/candidate/adapter_model.safetensors").is_file()


def _adapter(project: Path) -> dict:
    return load_file(project / "models/candidate/adapter_model.safetensors")


ROLLOUT_KEYS = ("step", "rows", "loss", "grad_norm", "reward_mean", "zero_advantage_share", "completion_tokens_mean")


@pytest.mark.nightly  # two kills and three trainings (~40 s); per PR: the seeded groups and the train stage
@pytest.mark.slow
def test_grpo_sigkilled_mid_run_then_resumed_generates_the_same_completions_and_the_same_adapter(built, tmp_path):
    """SIGKILL during a rollout (the step after a checkpoint) and once more later, then a run to the end: every
    step's rows, reward mean, completion lengths, loss and gradient norm are an uninterrupted run's (the groups'
    seeds are the step's and the example's, the sampler and the weights restored), and so are the adapter's
    tensors."""
    reference = grpo_project(built, tmp_path / "reference", {"train.steps": 6})
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    env = train_env(1)
    finish_train(reference, 1, env)
    kills = sum(
        kill_when(lambda port: start_train(resumed, 1, env), resumed, lambda p, n=n: last_logged_step(p) >= n)
        for n in (3, 5)
    )
    output = finish_train(resumed, 1, env)
    assert kills == 2 and "resuming from" in output, (kills, output[-2000:])
    assert [[s.get(k) for k in ROLLOUT_KEYS] for s in steps_of(resumed)] == [
        [s.get(k) for k in ROLLOUT_KEYS] for s in steps_of(reference)
    ]
    a, b = _adapter(resumed), _adapter(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.nightly  # a 2-rank accelerate launch beside a 1-process run (~30 s); per PR: SFT's 2 ranks vs 1
@pytest.mark.slow
def test_grpo_on_two_ddp_ranks_matches_one_process_with_the_same_global_batch(built, tmp_path):
    """The same global batch on 1 process and on 2 accelerate ranks: each group's seed is its example's, so the
    ranks sample the completions one process samples; every step's reward mean, zero-advantage share, loss and
    gradient norm agree (the gradient all-reduce sums in another order)."""
    one = grpo_project(
        built, tmp_path / "one", {**ranks_overrides(1), "train.micro_batch_size": 2, "train.grad_accum": 1}
    )
    two = tmp_path / "two"
    shutil.copytree(one, two)
    from tests.conftest import write_params

    write_params(
        two / "params.yaml",
        {**TRAIN_OVERRIDES_GRPO(), **ranks_overrides(2), "train.micro_batch_size": 1, "train.grad_accum": 1},
    )
    finish_train(one, 1, train_env(1))
    finish_train(two, 2, train_env(2))
    one_steps, two_steps = steps_of(one), steps_of(two)
    assert len(one_steps) == len(two_steps) == 4
    for key in ("reward_mean", "zero_advantage_share", "completion_tokens_mean"):
        assert [s[key] for s in two_steps] == [s[key] for s in one_steps], key
    for key in ("loss", "grad_norm"):
        assert [s[key] for s in two_steps] == pytest.approx([s[key] for s in one_steps], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_bad_rewards_are_named_all_at_once_before_the_model_loads(built, tmp_path):
    """train.grpo.rewards with an unknown reward, a format reward without its pattern and a user function that
    reads a row field the rollouts do not hand over: the train stage exits 2 naming each entry's key, no
    traceback, before any step."""
    project = grpo_project(built, tmp_path / "p")
    from tests.conftest import write_params

    bad = [{"name": "nope"}, {"name": "format"}]
    write_params(project / "params.yaml", {**TRAIN_OVERRIDES_GRPO(), "train.grpo.rewards": bad})
    proc = start_train(project, 1, train_env(1))
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert "train.grpo.rewards[0].name" in output and "train.grpo.rewards[1].pattern" in output, output[-3000:]
    assert not (project / "reports/train_steps.jsonl").exists()
    beyond = [{"name": "user", "function": "tests.reward_functions:contains_answer", "needs": ["tests"]}]
    write_params(project / "params.yaml", {**TRAIN_OVERRIDES_GRPO(), "train.grpo.rewards": beyond})
    proc = start_train(project, 1, with_tests_importable(train_env(1)))
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert "reward user reads the row's tests" in output, output[-3000:]


# ---- issue 47's acceptance: SFT, then GRPO from the SFT champion, through `dvc repro` ----------------------------

from tests.test_preference_pipeline import _default_params, _report, _repro, sft_champion  # noqa: E402, F401

# exact match as the reward (pass@1 of the held-out prompts is fineflow_synth/exact_match, the gate's metric)
FROM_SFT = {
    "train.objective": "grpo",
    "train.steps": 150,
    "train.lr": 5.0e-4,
    "train.grpo.group_size": 4,
    "train.grpo.max_completion_tokens": 24,
    "checkpoint.every_steps": 50,
}


@pytest.mark.nightly  # the embedded default's SFT run (~4-8 min), then GRPO from its champion
@pytest.mark.slow
def test_sft_then_grpo_raises_held_out_pass_at_1_over_the_sft_champion_and_is_promoted(sft_champion, tmp_path):  # noqa: F811
    """The embedded default trained with SFT and promoted; then train.objective grpo from that champion (its
    adapter, train.preference.reference champion) with exact match as the reward: the held-out exact match
    (greedy pass@1 of the eval prompts) rises significantly over the champion's by the gate's paired bootstrap,
    and the gate promotes it."""
    project = tmp_path / "project"
    shutil.copytree(sft_champion, project, symlinks=True)
    sft_id = json.loads((project / "models/registry/champion.json").read_text())["id"]
    _default_params(project, FROM_SFT)
    ran, wall_s = _repro(project)
    assert {"reference_logps", "train", "evaluate", "promote"} <= set(ran), ran
    assert json.loads((project / "models/reference_logps/reference.json").read_text())["champion"] == sft_id
    scores = json.loads((project / "eval/scores.json").read_text())
    figures = {m: scores[m]["metrics"] for m in ("base", "champion", "candidate")}
    promote, train = _report(project, "promote"), _report(project, "train")
    record = {"wall_s": wall_s, "scores": figures, "promote": promote, "train": train}
    (tmp_path.parent / "sft_then_grpo.json").write_text(json.dumps(record, indent=1, default=str))
    assert scores["champion"]["id"] == sft_id
    assert promote["decision"] == "promoted", promote


# ---- the doctor's RL findings -----------------------------------------------------------------------------------


def _rl_ledger(rollout_s: float, sums: dict):
    from tests.test_goodput import _ledger, _train

    train = _train(loop_s=100.0, compute_s=100.0 - rollout_s, rollout_s=rollout_s) | {
        "objective": "grpo",
        "rollouts": sums,
        "precision": "no",
        "device": {"type": "cpu", "name": "cpu", "bf16_capable": False},
    }
    return _ledger({"compute": 100.0 - rollout_s, "rollout": rollout_s}, train)


def _found(ledger) -> dict:
    from fineflow.goodput import doctor

    return {f["cause"]: f for f in doctor.diagnose(ledger)}


SIGNAL = {"groups": 100.0, "flat_groups": 10.0, "flat_solved": 5.0, "reward_errors": 0.0}


def test_the_doctor_names_rollouts_that_dominate_the_loop_and_what_to_shorten():
    found = _found(_rl_ledger(85.0, SIGNAL))
    assert found["rollout"]["severity"] == "severe" and "85%" in found["rollout"]["evidence"]
    assert found["rollout"]["fix"]["param"] == "train.grpo.max_completion_tokens"
    assert "rollout" not in _found(_rl_ledger(40.0, SIGNAL))


@pytest.mark.parametrize(
    ("solved", "reading", "param"),
    [(80.0, "too easy", "train.grpo.temperature"), (5.0, "too hard", "train.grpo.group_size")],
)
def test_the_doctor_says_whether_groups_without_signal_were_all_right_or_all_wrong(solved, reading, param):
    found = _found(_rl_ledger(40.0, {**SIGNAL, "flat_groups": 90.0, "flat_solved": solved}))
    assert found["no_signal"]["severity"] == "severe" and reading in found["no_signal"]["evidence"]
    assert found["no_signal"]["fix"]["param"] == param
    assert "no_signal" not in _found(_rl_ledger(40.0, SIGNAL))


def test_the_doctor_names_failing_rewards():
    found = _found(_rl_ledger(40.0, {**SIGNAL, "reward_errors": 30.0}))
    assert (
        found["reward_errors"]["severity"] == "severe"
        and found["reward_errors"]["fix"]["param"] == "train.grpo.rewards"
    )
    assert _found(_rl_ledger(40.0, {**SIGNAL, "reward_errors": 2.0}))["reward_errors"]["severity"] == "warn"
    assert "reward_errors" not in _found(_rl_ledger(40.0, SIGNAL))


@pytest.mark.nightly  # a train and a goodput stage (~20 s); per PR: the doctor's findings on built ledgers
@pytest.mark.slow
def test_induced_through_the_train_stage_a_raising_reward_and_a_task_too_hard_are_what_the_doctor_names(
    built, tmp_path
):
    """The real train and goodput stages: the base model never produces a row's exact answer (every group scores
    0: too hard) and a user reward raises on every batch (each counted, the run goes on): the ledger's doctor names
    both, and the ledger adds up with the rollout and reward buckets."""
    from fineflow.goodput import doctor
    from tests.conftest import venv_env
    from tests.test_goodput import assert_adds_up, train_then_ledger

    rewards = [{"name": "exact_match"}, {"name": "user", "function": "tests.reward_functions:raises", "weight": 0.5}]
    project = grpo_project(built, tmp_path / "p", {"train.grpo.rewards": rewards})
    ledger = train_then_ledger(project, with_tests_importable(venv_env()), 1)
    assert_adds_up(ledger)
    assert ledger["buckets"]["rollout"] > 0 and ledger["buckets"]["reward"] > 0
    found = {f["cause"]: f for f in doctor.diagnose(ledger)}
    assert "too hard" in found["no_signal"]["evidence"] and found["no_signal"]["severity"] == "severe", found
    assert found["reward_errors"]["severity"] == "severe", found
    steps = steps_of(project)
    assert all(s["reward_errors"] >= 1 for s in steps), steps
