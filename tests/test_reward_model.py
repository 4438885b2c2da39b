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
