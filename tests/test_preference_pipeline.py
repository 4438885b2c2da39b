"""Preference tuning through every stage of the real pipeline (`dvc repro`): the bundled task families as pairs,
the reference_logps stage, dpo training, the preference evaluation and the gate on it. The CI scenario runs the tiny
project; the nightly test trains the embedded default's SFT model first, promotes it, then aligns it with DPO."""

import json
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import ROOT, copy_project, venv_env, write_params

PREFERENCE = "fineflow_preference/preference_accuracy"


def _repro(project) -> tuple[list[str], float]:
    """`dvc repro` of the whole pipeline: the stages it ran, and its wall time."""
    started = time.monotonic()
    repro = [sys.executable, "-m", "dvc", "repro"]
    done = subprocess.run(repro, cwd=project, env=venv_env(), capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return re.findall(r"Running stage '(\w+)'", done.stdout), time.monotonic() - started


def _report(project, name: str) -> dict:
    return json.loads((project / f"reports/{name}.json").read_text())


def _metric(scores: dict, model: str) -> float:
    return scores[model]["metrics"]["fineflow_preference"]["preference_accuracy"]


TINY_DPO = {
    "train.objective": "dpo",
    "train.steps": 40,
    "train.lr": 0.01,
    "train.micro_batch_size": 4,
    "train.preference.beta": 0.5,
    "tokenize.seq_len": 256,  # a pair's row holds its prompt twice
    "data.n_eval": 48,
    "evaluate.limit": None,
    "checkpoint.every_steps": 1000,
    "promote.primary_metric": PREFERENCE,
}


@pytest.mark.nightly  # a whole dpo pipeline (~80 s); CI keeps dpo's kill/resume scenario and its stage tests
@pytest.mark.slow
def test_dpo_runs_every_stage_and_the_gate_judges_preference_accuracy_and_a_train_lr_edit_keeps_the_reference(
    tmp_path,
):
    """The tiny project with train.objective dpo from a fresh checkout: the bundled pairs are gated and packed,
    the reference_logps stage scores them with the base (no champion yet), dpo trains, evaluate scores base and
    candidate on fineflow_preference, and promote decides on preference accuracy with its bootstrap. A train.lr
    edit then re-runs train, evaluate and promote, never the reference."""
    project = copy_project(tmp_path / "project", TINY_DPO)
    ran, _ = _repro(project)
    assert {"data", "validate", "tokenize", "reference_logps", "train", "evaluate", "promote"} <= set(ran), ran
    reference = json.loads((project / "models/reference_logps/reference.json").read_text())
    assert reference["objective"] == "dpo" and (project / "models/reference_logps/train.logps.bin").is_file(), reference
    train = _report(project, "train")
    assert train["objective"] == "dpo" and 0.0 <= train["final_reward_accuracy"] <= 1.0, train
    scores = json.loads((project / "eval/scores.json").read_text())
    assert _metric(scores, "base") == 0.5  # the anchor: every reward of the base is 0, each pair a tie
    assert len(scores["candidate"]["samples"]["fineflow_preference"]) == 48
    assert "fineflow_synth" in scores["candidate"]["metrics"]  # the SFT guard: the chosen answers as targets
    promote = _report(project, "promote")
    # judged on preference accuracy with the paired bootstrap (the decision may also be a regression's refusal)
    assert promote["candidate_value"] == _metric(scores, "candidate") and promote["ci_low"] <= promote["ci_high"]
    write_params(project / "params.yaml", {**TINY_DPO, "train.lr": 0.005})
    ran, _ = _repro(project)
    assert "reference_logps" not in ran and {"train", "evaluate", "promote"} <= set(ran), ran


def _default_params(project, dotted: dict) -> None:
    """The checkout's own params.yaml (the embedded default), with dotted-key edits."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for key, value in dotted.items():
        node = params
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def sft_champion(tmp_path_factory):
    """The embedded default trained with SFT and promoted, once for every objective aligned from it."""
    project = copy_project(tmp_path_factory.mktemp("sft") / "project")
    _default_params(project, {})
    _repro(project)
    assert _report(project, "promote")["decision"] == "promoted", _report(project, "promote")
    shutil.rmtree(project / "checkpoints", ignore_errors=True)  # the SFT run's resume state: not copied per objective
    return project


# Each objective aligned from the SFT champion, with the settings that pass its gate on the embedded default
# (bench figures in tests/README.md's row). The SFT guard: exact match may not drop by more than 0.05.
ALIGNED = {
    # 2e-4 raised preference accuracy to 0.835 but cut exact match 0.79 -> 0.74, exactly the guard
    "dpo": {"train.steps": 200, "train.lr": 1e-4},
    "kto": {"train.steps": 200, "train.lr": 2e-4},
    # reference-free: it starts from the SFT champion's adapter, and its rewards are measured from it
    "orpo": {"train.steps": 200, "train.lr": 2e-4, "train.orpo.odds_ratio_weight": 0.5},
}


@pytest.mark.nightly  # the embedded default's SFT run once (~4 min), then each objective's run from it (~4 min)
@pytest.mark.slow
@pytest.mark.parametrize("objective", list(ALIGNED))
def test_sft_then_a_preference_objective_raises_preference_accuracy_over_the_sft_champion(
    sft_champion, tmp_path, objective
):
    """Issue 34's and 46's acceptance: on the bundled task families, SFT is trained and promoted; then the same
    prompts as preference data (the right answer chosen, a plausible wrong one of its family rejected: pairs for
    dpo and orpo, the two answers unpaired and labelled for kto) align it, starting from the SFT champion (dpo's
    and kto's reference too). The candidate's preference accuracy rises significantly over the SFT champion's (the
    gate's paired bootstrap) and the gate promotes it."""
    project = tmp_path / "project"
    shutil.copytree(sft_champion, project, symlinks=True)
    sft_id = json.loads((project / "models/registry/champion.json").read_text())["id"]
    aligned = {
        "train.objective": objective,
        **ALIGNED[objective],
        "promote.primary_metric": PREFERENCE,
        "promote.max_regression": 0.05,  # the SFT guard: exact match may not drop by more
    }
    _default_params(project, aligned)
    ran, wall_s = _repro(project)
    assert "reference_logps" in ran and "train" in ran, ran
    assert json.loads((project / "models/reference_logps/reference.json").read_text())["champion"] == sft_id
    scores = json.loads((project / "eval/scores.json").read_text())
    figures = {m: scores[m]["metrics"] for m in ("base", "champion", "candidate")}
    promote = _report(project, "promote")
    record = {"wall_s": wall_s, "scores": figures, "promote": promote}
    (tmp_path.parent / f"sft_then_{objective}.json").write_text(json.dumps(record, indent=1))
    assert scores["champion"]["id"] == sft_id
    assert promote["decision"] == "promoted", promote
    assert scores["preference"]["anchor"] == "champion" and _metric(scores, "champion") == 0.5, scores["preference"]
    assert _metric(scores, "candidate") > 0.5, scores
    shutil.rmtree(project / "checkpoints", ignore_errors=True)
