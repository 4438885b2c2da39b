"""The reward model (train.objective reward_model, issue 46): its Bradley-Terry loss against the formula, the head
reading each side's own last token of a packed pair row, training through the train stage, its files, the
evaluation's pairwise accuracy, the gate and the registry's champion per model kind, the export's skip and
``fineflow reward score``.

The pair shards are test_preference_train's (numpy, per the shard contract, from the built project's rows)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fineflow.objectives import objective_for
from fineflow.objectives.reward_model import (
    CONFIG_FILE,
    HEAD_FILE,
    add_head,
    bradley_terry,
    example_rewards,
    load_reward_model,
    save_head,
    side_rewards,
)
from tests.test_preference_train import SEQ_LEN, encoded_pairs, write_pair_shard

REWARD_MODEL = objective_for("reward_model")


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


# ---- the loss against the formula -------------------------------------------------------------------------------


def test_the_loss_is_bradley_terrys_summed_over_the_pairs():
    """-log sigmoid(r_chosen - r_rejected) per pair (Stiennon et al. 2020, eq. 1), in plain floats, summed; the
    statistics are the pairs ranked right and the summed margin."""
    chosen, rejected = [1.5, -0.25, 3.0, 0.0], [0.5, 0.75, -2.0, 0.0]
    got = bradley_terry(torch.tensor(chosen), torch.tensor(rejected))
    by_hand = sum(-_log_sigmoid(c - r) for c, r in zip(chosen, rejected))
    assert float(got.loss_sum) == pytest.approx(by_hand, abs=1e-12) and got.count == 4
    assert got.rewards == (2.0, pytest.approx(sum(c - r for c, r in zip(chosen, rejected))))


def test_the_objective_trains_pairs_without_a_reference_and_is_no_language_model():
    assert REWARD_MODEL.trains_pairs and not REWARD_MODEL.needs_reference and not REWARD_MODEL.generates
    assert REWARD_MODEL.eval_task == "fineflow_reward" and REWARD_MODEL.eval_task != objective_for("dpo").eval_task


# ---- the head reads each side's last token ----------------------------------------------------------------------


def _model(base, seed: int, tmp_path, attention: str = "varlen"):
    """base + a random adapter (test_preference_train's) + a random reward head."""
    from tests.conftest import random_adapter
    from tests.test_preference_train import _load

    torch.manual_seed(seed)
    model = _load(base, random_adapter(base, tmp_path / f"adapter-{seed}", seed=seed), attention)
    return add_head(model, torch.randn(1, model.config.hidden_size))


def _alone(model, ids: list[int]) -> float:
    """The reward of one sequence run alone, by another path: the backbone's last hidden state (no logits_to_keep,
    no output projection) at its last token, times the head's weight."""
    with torch.no_grad():
        hidden = model.get_base_model().model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    return float(hidden.double() @ model.reward_head.weight[0].double())


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
def test_packed_pairs_get_the_rewards_of_each_side_scored_alone(built, tmp_path, attention):
    """Several pairs a row, rows batched: the reward of each side equals the side run alone (read at its own last
    token, not the row's), and the loss is Bradley-Terry's on those."""
    from fineflow.tokenize.shards import PackedShard
    from fineflow.tokenize.tokenization import load_tokenizer
    from fineflow.train.attention import layout_kwargs, layout_of
    from fineflow.train.pair_shards import PairShard

    base = built / "models/base"
    tokenizer = load_tokenizer(str(base))
    rows = [json.loads(line) for line in (built / "data/validated/train.jsonl").read_text().splitlines()][:12]
    pairs = encoded_pairs(rows, tokenizer)
    write_pair_shard(tmp_path / "train", pairs, SEQ_LEN, tokenizer.pad_token_id or 0, len(tokenizer))
    shard = PairShard(PackedShard(tmp_path / "train"))
    assert len(shard) < len(pairs)  # several pairs share a row
    model = _model(base, 3, tmp_path, attention)
    packed, loss, count = [], 0.0, 0
    for start in range(0, len(shard), 2):
        arrays = shard.batch(list(range(start, min(start + 2, len(shard)))))
        batch = {key: torch.from_numpy(value) for key, value in arrays.items()}
        extra = layout_kwargs(layout_of(arrays["position_ids"], attention == "varlen"))
        with torch.no_grad():
            packed += side_rewards(model, batch, **extra).tolist()
            got = REWARD_MODEL.loss(model, batch, None, **extra)
        loss, count = loss + float(got.loss_sum), count + got.count
    alone = [_alone(model, ids) for pair in pairs for ids, _ in pair]
    assert packed == pytest.approx(alone, rel=1e-4, abs=1e-5) and count == len(pairs)
    assert loss == pytest.approx(sum(-_log_sigmoid(c - r) for c, r in zip(alone[0::2], alone[1::2])), rel=1e-4)


def test_a_saved_reward_model_loads_and_scores_as_it_did(built, tmp_path):
    """adapter + reward_head.safetensors + reward_model.json: loaded on a fresh base, every example's reward is the
    trained model's, and example_rewards (each example alone, batched and right-padded) is the side alone."""
    from transformers import AutoModelForCausalLM

    from fineflow.evaluate.pair_ranking import encode_answers
    from fineflow.tokenize.tokenization import load_tokenizer
    from fineflow.train.model import save_adapter

    base = built / "models/base"
    model = _model(base, 5, tmp_path, "sdpa")  # right-padded batches: a padding mask, as evaluate loads models
    save_adapter(model, tmp_path / "saved")
    save_head(model, tmp_path / "saved")
    assert (tmp_path / "saved" / HEAD_FILE).is_file()
    assert json.loads((tmp_path / "saved" / CONFIG_FILE).read_text())["kind"] == "reward"
    rows = [json.loads(line) for line in (built / "data/validated/eval.jsonl").read_text().splitlines()][:5]
    pairs = [{**row, "chosen": row["output"], "rejected": rows[i - 1]["output"]} for i, row in enumerate(rows)]
    encoded = encode_answers(load_tokenizer(str(base)), pairs)
    before = example_rewards(model, encoded, batch_size=3, seq_len=SEQ_LEN)
    loaded = load_reward_model(AutoModelForCausalLM.from_pretrained(base), tmp_path / "saved")
    after = example_rewards(loaded, encoded, batch_size=4, seq_len=SEQ_LEN)
    assert after.tolist() == pytest.approx(before.tolist(), rel=1e-5, abs=1e-6)
    starts = [0, *encoded.lengths.cumsum().tolist()]
    alone = [_alone(model, encoded.ids[starts[i] : starts[i + 1]].tolist()) for i in range(len(encoded.lengths))]
    assert before.tolist() == pytest.approx(alone, rel=1e-4, abs=1e-5)


# ---- the train stage --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_train_stage_raises_the_training_pairs_accuracy_and_saves_the_head(built, tmp_path):
    """train.objective reward_model through the train stage on the tiny base: the zero head ties every pair at
    step 1 (loss exactly log 2, margin 0), the step log's reward accuracy rises over the steps and the eval pairs'
    loss falls below half of log 2, and the candidate folder holds the adapter, the trained head and
    reward_model.json. (lr 0.03: the head starts at zero and the tiny base has 16 steps to learn a ranking.)"""
    from safetensors.torch import load_file

    from tests.conftest import finish_train, train_env
    from tests.test_preference_train import LEARNS, preference_project, steps_of

    project = preference_project(built, tmp_path, "reward_model", {**LEARNS, "train.lr": 0.03})
    finish_train(project, 1, train_env(1))
    steps = steps_of(project)
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and steps[0]["reward_margin"] == 0, steps[0]
    first, last = steps[:4], steps[-4:]
    mean = lambda rows, key: sum(row[key] for row in rows) / len(rows)  # noqa: E731
    assert mean(last, "reward_accuracy") > mean(first, "reward_accuracy") + 0.2, steps
    evals = [row["eval_loss"] for row in steps if "eval_loss" in row]
    assert evals[-1] < math.log(2) / 2 < evals[0], evals  # the held-out pairs: ranked right, with a margin
    candidate = project / "models/candidate"
    assert (candidate / "adapter_model.safetensors").is_file() and (candidate / CONFIG_FILE).is_file()
    assert float(load_file(candidate / HEAD_FILE)["weight"].abs().sum()) > 0
    report = json.loads((project / "reports/train.json").read_text())
    assert report["objective"] == "reward_model" and report["final_reward_accuracy"] == steps[-1]["reward_accuracy"]


# ---- bad input: SFT rows for a reward model ---------------------------------------------------------------------


def test_sft_rows_for_a_reward_model_are_refused_by_validate_naming_file_line_and_field(built, tmp_path):
    """train.objective reward_model trains on pairs (trains_pairs): the validate stage, before any training,
    refuses instruction rows, naming the file, the line and the missing field."""
    import yaml

    from fineflow.core.config import parse_params
    from fineflow.errors import DataError
    from fineflow.stages import validate
    from tests.conftest import TINY_PARAMS

    rows = [{"instruction": f"Say {word}.", "input": "", "output": word} for word in ("hi", "yes", "no")]
    for split in ("train", "eval"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    params = yaml.safe_load(yaml.safe_dump(TINY_PARAMS))
    params["train"]["objective"] = "reward_model"
    with pytest.raises(DataError, match=r'eval\.jsonl:1: field "chosen" is missing'):
        validate.run(
            parse_params(params),
            tmp_path / "train.jsonl",
            tmp_path / "eval.jsonl",
            tmp_path / "validated",
            tmp_path / "validate.json",
            None,
            built / "models/base",
        )


# ---- evaluate: the held-out pairwise accuracy against chance ----------------------------------------------------


def _reward_candidate(base, out, seed: int, tmp_path):
    """A reward model's candidate folder as the train stage writes it: a random adapter and a random head."""
    from fineflow.train.model import save_adapter

    model = _model(base, seed, tmp_path, "sdpa")
    save_adapter(model, out)
    save_head(model, out)
    return model


def _eval_pairs(built, path, n: int = 8) -> list[dict]:
    """n held-out pairs of the built rows: the row's answer chosen, the next row's rejected."""
    rows = [json.loads(line) for line in (built / "data/validated/eval.jsonl").read_text().splitlines()][: n + 1]
    pairs = [{**row, "chosen": row.pop("output"), "rejected": rows[i + 1]["output"]} for i, row in enumerate(rows[:n])]
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    return pairs


def _reward_params(tiny_params, **promote):
    train = tiny_params.train.model_copy(update={"objective": "reward_model"})
    gate = tiny_params.promote.model_copy(update={"primary_metric": "fineflow_reward/pairwise_accuracy", **promote})
    every_pair = tiny_params.evaluate.model_copy(update={"limit": None})
    return tiny_params.model_copy(update={"train": train, "promote": gate, "evaluate": every_pair})


def test_evaluate_scores_the_candidates_pairwise_accuracy_and_the_base_as_chance(built, tmp_path, tiny_params):
    """scores.json of a reward model: the fineflow_reward task alone; per pair the candidate's two rewards (each
    answer scored alone) and 1/0 by their order; the base, which has no head, a tie (0.5) on every pair."""
    from fineflow.evaluate.pair_ranking import encode_answers
    from fineflow.evaluate.reward_ranking import evaluate_scorer
    from fineflow.objectives import objective_for
    from fineflow.tokenize.tokenization import load_tokenizer

    base = built / "models/base"
    model = _reward_candidate(base, tmp_path / "candidate", 7, tmp_path)
    pairs = _eval_pairs(built, tmp_path / "eval.jsonl")
    params = _reward_params(tiny_params)
    objective = objective_for(params.train.objective)
    evaluate_scorer(
        params, objective, base, tmp_path / "candidate", tmp_path / "eval.jsonl", tmp_path / "eval", tmp_path / "raw"
    )
    scores = json.loads((tmp_path / "eval/scores.json").read_text())
    assert scores["tasks"] == ["fineflow_reward"] and set(scores) >= {"base", "candidate"} and "champion" not in scores
    assert scores["base"]["metrics"] == {"fineflow_reward": {"pairwise_accuracy": 0.5}}
    samples = scores["candidate"]["samples"]["fineflow_reward"]
    expected = example_rewards(model, encode_answers(load_tokenizer(str(base)), pairs), 4, params.tokenize.seq_len)
    got = [value for s in samples for value in (s["reward_chosen"], s["reward_rejected"])]
    assert got == pytest.approx(expected.tolist(), abs=1e-5)
    right = [float(s["reward_chosen"] > s["reward_rejected"]) for s in samples]
    assert [s["pairwise_accuracy"] for s in samples] == right
    assert scores["candidate"]["metrics"]["fineflow_reward"]["pairwise_accuracy"] == sum(right) / len(right)


# ---- promote and the registry: a champion per model kind --------------------------------------------------------


def _reward_scores(path, base, right: int, n: int = 40):
    """scores.json as the reward model's evaluation writes it (fineflow.evaluate.reward_ranking), by hand: the
    candidate ranks `right` of n pairs, the base (by content) at chance."""
    from fineflow.base_source import read_base_digest
    from fineflow.evaluate.reward_ranking import chance_entry
    from tests.conftest import EVAL_SHA

    def ranks(k: int) -> dict:
        samples = [{"doc_id": i, "pairwise_accuracy": float(i < k)} for i in range(n)]
        entry = {"status": "ok", "metrics": {"fineflow_reward": {"pairwise_accuracy": k / n}}}
        return {**entry, "samples": {"fineflow_reward": samples}}

    scores = {"tasks": ["fineflow_reward"], "eval_data_sha256": EVAL_SHA, "base_digest": read_base_digest(str(base))}
    scores["base"] = chance_entry("fineflow_reward", n)
    scores["candidate"] = ranks(right)
    path.write_text(json.dumps(scores))
    return path


def _git_checkout(root):
    """A git checkout to promote in (the lineage reads its commit)."""
    import subprocess

    root.mkdir(parents=True)
    (root / "README.md").write_text("fixture\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "fixture"]):
        subprocess.run(["git", *command] if command[0] == "init" else git + command, cwd=root, check=True)
    return root


@pytest.mark.slow
def test_a_reward_model_is_judged_against_chance_then_its_own_kind_and_scores_rows(
    built, tmp_path, tiny_params, capsys
):
    """The first reward model beats chance (the base has no head) and is installed as the registry's reward
    champion, not as models/champion; a second is judged against it; a language model meanwhile is judged against
    its base, never the reward champion, and installed at models/champion. `fineflow registry verify` holds for
    both kinds; a rollback of a reward model and a repair touch its kind alone. `fineflow reward score` scores rows
    with the reward champion as evaluation does, and names a malformed row's file, line and field; the export
    stage skips a reward model."""
    from fineflow.cli import main
    from fineflow.registry.champion import promote, recover, rollback
    from fineflow.registry.install import read_champion
    from fineflow.registry.store import alias_id, kind_champion_dir
    from fineflow.registry.verify import verify_log
    from fineflow.stages.export import why_not_exported
    from fineflow.tokenize.tokenization import load_tokenizer
    from tests.conftest import random_adapter
    from tests.conftest import write_scores as lm_scores

    base = built / "models/base"
    root = _git_checkout(tmp_path / "project")
    champion, registry = root / "models/champion", root / "models/registry"
    kw = dict(base_dir=base, shards_dir=built / "data/shards", root=root)
    params = _reward_params(tiny_params, min_delta=0.05)
    first = _reward_candidate(base, root / "first", 11, tmp_path)
    _reward_candidate(base, root / "second", 12, tmp_path)

    report = promote(params, _reward_scores(root / "s1.json", base, 34), root / "first", champion, registry, **kw)
    assert report["decision"] == "promoted" and report["reference"] == "base model", report
    assert report["reference_value"] == 0.5 and report["ci_low"] > 0
    rid = report["candidate_id"]
    home = kind_champion_dir(registry, "reward")
    assert alias_id(registry, "reward") == rid and alias_id(registry) is None and read_champion(champion) is None
    installed = read_champion(home)
    assert installed["candidate_id"] == rid and installed["model_kind"] == "reward"
    assert {HEAD_FILE, CONFIG_FILE, "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in home.iterdir()}
    assert not (home / "merged").exists()  # a reward model is never merged into a generator
    card = (home / "README.md").read_text()
    assert f"# fineflow reward model champion {rid}" in card and "fineflow reward score" in card

    second = promote(params, _reward_scores(root / "s2.json", base, 30), root / "second", champion, registry, **kw)
    assert second["decision"] == "refused" and second["reference"] == f"champion {rid}", second

    lm = _reward_params(tiny_params).model_copy(update={"train": tiny_params.train, "promote": tiny_params.promote})
    random_adapter(base, root / "lm", seed=13)
    lm_report = promote(lm, lm_scores(root / "s3.json", 30, 5), root / "lm", champion, registry, **kw)
    assert lm_report["decision"] == "promoted" and lm_report["reference"] == "base model", lm_report
    assert alias_id(registry) == lm_report["candidate_id"] and alias_id(registry, "reward") == rid
    assert read_champion(champion)["candidate_id"] == lm_report["candidate_id"] and "model_kind" not in read_champion(
        champion
    )
    assert verify_log(registry, champion) == []
    assert "holds a reward model" in why_not_exported(params, home, installed, None)

    # a rollback to the refused reward model replaces the reward champion alone; a lost alias is repaired
    moved = rollback(registry, champion, to=second["candidate_id"], allow_unpromoted="a test")
    assert moved["from"] == rid and alias_id(registry, "reward") == second["candidate_id"]
    assert alias_id(registry) == lm_report["candidate_id"] and verify_log(registry, champion) == []
    (registry / "champion.reward.json").unlink()
    assert recover(registry, champion) and alias_id(registry, "reward") == second["candidate_id"]
    rollback(registry, champion, to=rid)  # the promoted one back, for the scoring below
    assert alias_id(registry, "reward") == rid and verify_log(registry, champion) == []

    pairs = _eval_pairs(built, tmp_path / "pairs.jsonl", n=5)
    rows = [
        {**{k: v for k, v in pair.items() if k not in ("chosen", "rejected")}, "output": pair["chosen"]}
        for pair in pairs
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert (
        main(
            [
                "reward",
                "score",
                str(tmp_path / "rows.jsonl"),
                "--registry",
                str(registry),
                "--out",
                str(tmp_path / "out.jsonl"),
            ]
        )
        == 0
    )
    scored = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    from fineflow.tokenize.template import encode_batch

    expected = example_rewards(first, encode_batch(load_tokenizer(str(base)), rows, train_on="last_assistant"), 8, 128)
    assert [row["reward"] for row in scored] == pytest.approx(expected.tolist(), abs=1e-5)
    assert [{k: v for k, v in row.items() if k != "reward"} for row in scored] == rows

    (tmp_path / "bad.jsonl").write_text(json.dumps(rows[0]) + "\n" + json.dumps({"instruction": "Say hi."}) + "\n")
    assert main(["reward", "score", str(tmp_path / "bad.jsonl"), "--registry", str(registry)]) == 2
    assert f"{tmp_path / 'bad.jsonl'}:2: output: a non-empty string" in capsys.readouterr().err
    assert main(["reward", "score", str(tmp_path / "rows.jsonl"), "--registry", str(tmp_path / "empty")]) == 2
    assert "no champion reward model: train one (train.objective reward_model" in capsys.readouterr().err


# ---- the real stages: the embedded default as a reward model ----------------------------------------------------

REWARD_RUN = {
    "train.objective": "reward_model",
    "train.steps": 400,
    "promote.primary_metric": "fineflow_reward/pairwise_accuracy",
}


@pytest.mark.nightly  # the embedded default's whole pipeline (its base pretraining ~7 of ~9 min), then train again
@pytest.mark.slow
def test_a_reward_model_of_the_embedded_default_ranks_held_out_pairs_above_chance_through_every_stage(tmp_path):
    """Issue 46's acceptance for the reward model: `dvc repro` of the embedded default with train.objective
    reward_model on the bundled pairs. Its held-out pairwise accuracy is significantly above chance (the gate's
    paired bootstrap against the base, which has no head), it is promoted as the registry's reward champion while
    models/champion stays empty, the export stage skips it, and `fineflow reward score` ranks the chosen answers of
    the eval pairs above the rejected ones as evaluation did. A train.lr edit then trains a second reward model,
    judged against the first, not against chance."""
    from fineflow.cli import main
    from fineflow.registry.store import alias_id
    from tests.conftest import copy_project
    from tests.test_preference_pipeline import _default_params, _report, _repro

    project = copy_project(tmp_path / "project")
    _default_params(project, REWARD_RUN)
    ran, wall_s = _repro(project)
    assert {"data", "validate", "tokenize", "train", "evaluate", "promote", "export"} <= set(ran), ran
    scores = json.loads((project / "eval/scores.json").read_text())
    assert scores["tasks"] == ["fineflow_reward"] and len(scores["candidate"]["samples"]["fineflow_reward"]) == 200
    assert scores["base"]["metrics"]["fineflow_reward"]["pairwise_accuracy"] == 0.5
    promote = _report(project, "promote")
    assert promote["decision"] == "promoted" and promote["reference"] == "base model", promote
    assert promote["candidate_value"] > 0.5 and promote["ci_low"] > 0, promote
    registry = project / "models/registry"
    first = alias_id(registry, "reward")
    assert first == promote["candidate_id"] and alias_id(registry) is None
    assert json.loads((project / "models/champion/champion.json").read_text()) == {"candidate_id": None}
    assert "nothing promoted yet" in _report(project, "export")["skipped"]

    pairs = [json.loads(line) for line in (project / "data/validated/eval.jsonl").read_text().splitlines()][:40]
    rows = [
        {**{k: pair[k] for k in ("instruction", "input")}, "output": pair[side]}
        for pair in pairs
        for side in ("chosen", "rejected")
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "scored.jsonl"
    assert main(["reward", "score", str(tmp_path / "rows.jsonl"), "--registry", str(registry), "--out", str(out)]) == 0
    rewards = [json.loads(line)["reward"] for line in out.read_text().splitlines()]
    by_eval = scores["candidate"]["samples"]["fineflow_reward"][:40]
    assert rewards == pytest.approx([r for s in by_eval for r in (s["reward_chosen"], s["reward_rejected"])], abs=1e-4)

    _default_params(project, {**REWARD_RUN, "train.lr": 0.01})
    ran, second_wall_s = _repro(project)
    assert {"train", "evaluate", "promote"} <= set(ran) and "tokenize" not in ran, ran
    second = _report(project, "promote")
    assert second["reference"] == f"champion {first}" and second["reference_value"] == promote["candidate_value"]
    figures = {"wall_s": [wall_s, second_wall_s], "first": promote, "second": second}
    (tmp_path.parent / "reward_model.json").write_text(json.dumps(figures, indent=1))
