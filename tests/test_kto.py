"""KTO (fineflow.objectives.kto) through the stages a user runs: feedback rows (an SFT row and a boolean label) are
mapped, checked and quarantined by the validate stage, packed by the tokenize stage beside their KL samples, scored
by the reference_logps stage and trained by the train stage; evaluate ranks the held-out rows' desirable answers
against their undesirable ones. The loss itself against the paper's formula: tests/test_objectives.py; against
TRL's: bench/objective_losses_trl.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fineflow.core.config import parse_params
from fineflow.errors import DataError
from fineflow.stages import data, tokenize, validate
from tests.conftest import TINY_PARAMS, TRAIN_OVERRIDES, _merge, finish_train, train_env, write_params

KTO = {"train": {"objective": "kto"}}


def _kto_params(**train):
    return parse_params(_merge(TINY_PARAMS, {"train": {"objective": "kto", **train}}))


def _validate(params, root: Path, base: Path | None = None) -> dict:
    return validate.run(
        params,
        root / "data/raw/train.jsonl",
        root / "data/raw/eval.jsonl",
        root / "data/validated",
        root / "reports/validate.json",
        None,
        base,
    )


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def feedback(built, tmp_path_factory) -> Path:
    """The bundled data as kto's feedback rows (each pair's prompt twice: its right answer labelled true, a wrong
    one false; the injected bad rows include a missing label, a label "yes" and an answer labelled both ways),
    validated with the tiny base's tokenizer and tokenized."""
    root = tmp_path_factory.mktemp("kto")
    shutil.copytree(built / "models/base", root / "models/base")
    params = _kto_params()
    data.run(params, root / "data/raw/train.jsonl", root / "data/raw/eval.jsonl")
    report = _validate(params, root, root / "models/base")
    (root / "reports").mkdir(exist_ok=True)
    (root / "reports/validate.json").write_text(json.dumps(report), encoding="utf-8")
    tokenize.run(params, root / "data/validated", root / "models/base", root / "data/shards")
    return root


def test_the_validate_stage_quarantines_each_bad_feedback_row_naming_its_line_and_field(feedback):
    raw = _rows(feedback / "data/raw/train.jsonl")
    quarantine = _rows(feedback / "data/validated/quarantine.jsonl")
    reasons = {entry["line"]: " | ".join(entry["reasons"]) for entry in quarantine}
    missing = [n for n, row in enumerate(raw, start=1) if "label" not in row and "output" in row]
    not_boolean = [n for n, row in enumerate(raw, start=1) if row.get("label") == "yes"]
    assert missing and not_boolean
    for line in missing:
        assert f'data/raw/train.jsonl:{line}: field "label" is missing' in reasons[line], reasons[line]
    for line in not_boolean:
        assert "failed type_bool(label) (label is 'yes', not true or false)" in reasons[line], reasons[line]
    both_ways = [reason for reason in reasons.values() if "feedback_consistent(label)" in reason]
    assert both_ways and all("labels the same answer to this prompt the other way" in r for r in both_ways)
    kept = _rows(feedback / "data/validated/train.jsonl")
    assert all(isinstance(row["label"], bool) for row in kept)
    report = json.loads((feedback / "reports/validate.json").read_text())
    desirable = sum(row["label"] for row in kept)
    assert report["labels"]["train"] == {"desirable": desirable, "undesirable": len(kept) - desirable}
    assert report["kto_weighted_label_ratio"] == pytest.approx(desirable / (len(kept) - desirable), abs=1e-4)


def test_a_split_with_one_label_only_is_refused_naming_the_file(tmp_path):
    params = _kto_params()
    data.run(params, tmp_path / "data/raw/train.jsonl", tmp_path / "data/raw/eval.jsonl")
    rows = [row for row in _rows(tmp_path / "data/raw/train.jsonl") if row.get("label") is True]
    (tmp_path / "data/raw/train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(DataError, match=r"data/validated/train.jsonl: no undesirable \(label false\) row was kept"):
        _validate(params, tmp_path)
    report = json.loads((tmp_path / "reports/validate.json").read_text())
    assert report["passed"] is False


def test_feedback_rows_without_a_label_are_refused_before_any_training(tmp_path):
    """SFT rows handed to kto: every row fails the label's schema check, so the gate blocks the split."""
    sft = parse_params(TINY_PARAMS)
    data.run(sft, tmp_path / "data/raw/train.jsonl", tmp_path / "data/raw/eval.jsonl")
    with pytest.raises(DataError, match=r"column_exists\(label\)|not_null\(label\)|label"):
        _validate(_kto_params(), tmp_path)


def test_the_tokenize_stage_packs_each_answer_beside_a_kl_sample_of_another_prompt(feedback):
    from fineflow.tokenize.pairs import _prompt_key, feedback_units
    from fineflow.tokenize.shards import FEEDBACK_SHARD, PackedShard

    shard = PackedShard(feedback / "data/shards/train")
    assert shard.meta["objective"] == FEEDBACK_SHARD
    kept = _rows(feedback / "data/validated/train.jsonl")
    assert shard.meta["pairs"] == len(kept)  # one unit per row: its answer and its KL sample
    pairs = np.fromfile(feedback / "data/shards/train/pairs.idx", dtype=np.int64).reshape(-1, 2)
    examples = np.fromfile(feedback / "data/shards/train/examples.idx", dtype=np.int64).reshape(-1, 3)
    desirable = np.memmap(feedback / "data/shards/train/desirable.bin", dtype=np.uint8, mode="r")
    desirable = desirable.reshape(shard.meta["rows"], shard.meta["seq_len"])
    sampled = 0
    for (answer, sample), row in zip(pairs.tolist(), kept):
        a_row, a_start, a_len = examples[answer]
        s_row, s_start, s_len = examples[sample]
        assert a_row == s_row and s_start == a_start + a_len and s_len >= 1  # side by side, the answer first
        assert set(desirable[a_row, a_start : s_start + s_len].tolist()) == {int(row["label"])}
        assert shard.loss_mask[a_row, a_start : a_start + a_len].any()  # the answer keeps its trained tokens
        sampled += bool(shard.loss_mask[s_row, s_start : s_start + s_len].any())
    # tokenize.seq_len 128 here: most samples keep only their prompt (left out of the KL estimate), not all
    assert 0 < sampled < len(kept), sampled
    # each sample: the row's prompt with the answer of a row with another prompt
    by_prompt = {}
    for row in kept:
        by_prompt.setdefault(_prompt_key(row), set()).add(row["output"])
    for row, sample in feedback_units(kept):
        assert _prompt_key(sample) == _prompt_key(row)
        assert any(sample["output"] in outputs for key, outputs in by_prompt.items() if key != _prompt_key(row))
    # the feedback shard is keyed apart from an SFT shard of the same rows, and KTO's eval rows are feedback too
    assert json.loads((feedback / "data/shards/eval/meta.json").read_text())["objective"] == FEEDBACK_SHARD


def test_the_held_out_feedback_rows_make_back_the_bundled_pairs(feedback):
    """evaluate's preference task ranks a prompt's desirable answer against its undesirable one: the bundled
    eval split unpaired (fineflow.data.synth.unpaired) gives back exactly its pairs."""
    from fineflow.data.synth import split_train_eval_pairs
    from fineflow.evaluate.pair_ranking import read_pairs

    params = _kto_params()
    _, pairs = split_train_eval_pairs(params.data.n_train, params.data.n_eval, params.seed)
    got = read_pairs(feedback / "data/validated/eval.jsonl")
    strip = lambda pair: {k: pair[k] for k in ("instruction", "input", "chosen", "rejected")}  # noqa: E731
    assert [strip(pair) for pair in got] == [strip(pair) for pair in pairs]


def test_kto_moves_the_policy_toward_desirable_answers_and_away_from_undesirable_ones(feedback):
    """The objective's loss, through the feedback shard's packed batch and the reference's cached log-probs, trains
    the tiny base: on 8 packed rows of units, 40 Adam steps give most rows a reward r - z of their label's sign
    (7 of 8 here) and the loss falls steadily from exactly 0.5 (policy = reference: 1 - sigmoid(0)) to under half."""
    import torch
    from transformers import AutoModelForCausalLM

    from fineflow.objectives import objective_for
    from fineflow.tokenize.shards import PackedShard
    from fineflow.train.attention import layout_kwargs, layout_of
    from fineflow.train.pair_shards import PairShard, logps_file, write_shard_logps

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(feedback / "models/base", attn_implementation="sdpa")
    train = PackedShard(feedback / "data/shards/train")
    logps = feedback / "ref" / logps_file("train")
    write_shard_logps(model, PairShard(train), logps, 8, "cpu", varlen=False)
    arrays = PairShard(train, logps).batch(list(range(8)))
    batch = {key: torch.from_numpy(value) for key, value in arrays.items()}
    extra = layout_kwargs(layout_of(arrays["position_ids"], False), "cpu")
    kto, cfg = objective_for("kto"), _kto_params().train
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        got = kto.loss(model, batch, cfg, **extra)
        losses.append(float(got.loss_sum) / got.count)
        optimizer.zero_grad()
        (got.loss_sum / got.count).backward()
        optimizer.step()
    assert losses[0] == pytest.approx(0.5, abs=1e-6)
    assert losses[-1] < losses[20] < losses[0] and losses[-1] < 0.25, losses
    assert got.rewards[0] >= 0.75 * got.count, got.rewards


@pytest.mark.slow
def test_kto_trains_through_the_fingerprint_reference_and_train_stages(feedback, tmp_path):
    """The stages as dvc.yaml runs them: reference_logps scores the feedback shards with the base, the train stage
    trains the policy on them; its first step is exactly KTO's loss at the reference (every log-ratio 0, z = 0:
    0.5 per row) with a zero reward margin, and its report names the objective. (Held out, a tiny model's 16 KTO
    steps do not move preference accuracy the way DPO's do; the nightly SFT -> KTO run on the embedded default is
    that acceptance.)"""
    from tests.test_preference_train import run_stage, steps_of

    for folder in ("models/base", "data/shards", "data/validated"):
        shutil.copytree(feedback / folder, tmp_path / folder)
    learns = {"train.steps": 8, "train.micro_batch_size": 4, "train.grad_accum": 2, "checkpoint.every_steps": 4}
    write_params(tmp_path / "params.yaml", {**TRAIN_OVERRIDES, "train.objective": "kto", **learns})
    run_stage(tmp_path, "fingerprint")
    run_stage(tmp_path, "reference_logps")
    finish_train(tmp_path, 1, train_env(1))
    steps = steps_of(tmp_path)
    assert steps[0]["loss"] == pytest.approx(0.5, abs=1e-6) and steps[0]["reward_margin"] == 0
    report = json.loads((tmp_path / "reports/train.json").read_text())
    assert report["objective"] == "kto" and report["steps"] == learns["train.steps"]
