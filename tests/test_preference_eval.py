"""Preference evaluation (train.objective dpo/simpo) and the gate on it: each eval pair's chosen and rejected
answers scored by the base, the candidate and the champion (fineflow.evaluate.pair_ranking), the task
fineflow_preference in scores.json beside the lm-eval tasks (whose target is then the chosen answer), and the
promotion gate's paired bootstrap on fineflow_preference/preference_accuracy with the SFT task as regression guard.

The pairs are the tiny project's eval rows (the bundled task families): chosen = the row's right output, rejected
= the output of another eval row of the same family (a plausible wrong answer)."""

import json
from dataclasses import replace

import numpy as np
import pytest
import yaml

from fineflow.errors import FineflowError
from fineflow.registry.gate import GatePolicy, promotion_decision
from tests.conftest import TINY_PARAMS, random_adapter
from tests.test_promotion import entry  # a model's scores.json entry from per-doc values

ACC = "fineflow_preference/preference_accuracy"
MARGIN = "fineflow_preference/reward_margin"
GUARD = "fineflow_synth/exact_match"
H = "e" * 64
STEPS = 30  # the taught adapter's training steps


def preference_pairs(rows: list[dict]) -> list[dict]:
    """Each SFT row as a pair: its output chosen, the next row of the same family's (different) output rejected."""
    pairs = []
    for i, row in enumerate(rows):
        family = row["instruction"].split()[0]  # Extract / Rewrite / Which / Reverse
        others = [r["output"] for r in rows[i + 1 :] + rows[:i] if r["instruction"].split()[0] == family]
        wrong = next(o for o in others if o != row["output"])
        pairs.append(
            {"instruction": row["instruction"], "input": row["input"], "chosen": row["output"], "rejected": wrong}
        )
    return pairs


@pytest.fixture(scope="module")
def pair_rows(built, tmp_path_factory):
    """data/validated/eval.jsonl as a preference eval set (16 pairs of the tiny project)."""
    rows = [json.loads(line) for line in (built / "data/validated/eval.jsonl").read_text().splitlines()]
    path = tmp_path_factory.mktemp("pairs") / "eval.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in preference_pairs(rows)), encoding="utf-8")
    return path


def _params(**overrides):
    from fineflow.core.config import parse_params

    raw = yaml.safe_load(yaml.safe_dump(TINY_PARAMS))
    raw["train"]["objective"] = "dpo"
    raw["train"].setdefault("preference", {})["beta"] = 0.5
    for section, values in overrides.items():
        raw[section].update(values)
    return parse_params(raw)


def _tokenizer(built):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built / "models/base")


def _model(built, adapter=None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built / "models/base")
    return (PeftModel.from_pretrained(model, str(adapter)) if adapter else model).eval()


def _answer_logp(model, ids: list[int], mask: list[int]):
    import torch

    logps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], dim=-1)
    return (logps.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1) * torch.tensor(mask[1:])).sum()


@pytest.fixture(scope="module")
def chosen_adapter(built, pair_rows, tmp_path_factory):
    """A LoRA adapter taught to prefer the eval pairs' chosen answers (a few full-batch steps of the DPO loss
    against the base, -logsigmoid((logp(c) - logp_base(c)) - (logp(r) - logp_base(r)))): a candidate with a real
    preference gain, built in seconds, so the gate's promotion can be seen through the real evaluate stage."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fineflow.evaluate.pair_ranking import encode_answers, read_pairs

    torch.manual_seed(0)
    encoded = encode_answers(_tokenizer(built), read_pairs(pair_rows))
    examples = [encoded.example(i) for i in range(len(encoded))]
    with torch.no_grad():
        base = [float(_answer_logp(_model(built), *example)) for example in examples]
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(built / "models/base"),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    for _ in range(STEPS):
        for k in range(0, len(examples), 2):
            chosen, rejected = _answer_logp(model, *examples[k]), _answer_logp(model, *examples[k + 1])
            gap = (chosen - base[k]) - (rejected - base[k + 1])
            (-torch.nn.functional.logsigmoid(gap) / len(examples)).backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path_factory.mktemp("chosen") / "candidate"
    model.save_pretrained(path)
    return path


def direct_logprob(model, tokenizer, prompt: str, response: str) -> float:
    """The model run on prompt + answer (tokenized as the tokenize stage's encode_pair does: prompt, response, EOS
    unless the template ended the turn), summing log p of each answer token given everything before it."""
    import torch

    from fineflow.tokenize.template import encode_pair

    ids, mask = encode_pair(tokenizer, prompt, response)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logps = torch.log_softmax(logits, dim=-1)
    return sum(float(logps[t - 1, ids[t]]) for t in range(1, len(ids)) if mask[t])


# ---- pair scoring --------------------------------------------------------------------------------


def test_a_scored_pairs_logprob_equals_the_model_run_on_prompt_and_answer(built, pair_rows, chosen_adapter):
    from fineflow.evaluate.pair_ranking import PairScorer, answer_row, read_pairs
    from fineflow.tokenize.template import render_pair

    tokenizer, pairs = _tokenizer(built), read_pairs(pair_rows)
    as_chat = [{"messages": [{"role": "user", "content": f"{p['instruction']}\n\n{p['input']}"}]} for p in pairs[:4]]
    pairs += [{**chat, "chosen": p["chosen"], "rejected": p["rejected"]} for chat, p in zip(as_chat, pairs)]
    for model in (_model(built), _model(built, chosen_adapter)):
        batched = PairScorer(pairs, 0.5, batch_size=5, seq_len=128)(model, tokenizer)  # batches cut across pairs
        one_by_one = PairScorer(pairs, 0.5, batch_size=1, seq_len=128)(model, tokenizer)
        assert batched == PairScorer(pairs, 0.5, batch_size=5, seq_len=128)(model, tokenizer)  # deterministic
        for side in ("chosen", "rejected"):
            direct = [direct_logprob(model, tokenizer, *render_pair(tokenizer, answer_row(p, p[side]))) for p in pairs]
            np.testing.assert_allclose(batched[side], direct, rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(batched[side], one_by_one[side], rtol=1e-5, atol=1e-4)  # padding changes nothing
            assert all(v < 0 for v in batched[side])


def test_chat_pairs_are_scored_on_the_reply_the_chat_template_renders(built):
    """A chat pair (messages up to the answer) renders like the SFT row whose last message is the answer."""
    from fineflow.evaluate.pair_ranking import answer_row, encode_answers
    from fineflow.tokenize.template import encode_batch

    pair = {"messages": [{"role": "user", "content": "Which number is larger? 3 or 7"}], "chosen": "7", "rejected": "3"}
    sft = {"messages": [*pair["messages"], {"role": "assistant", "content": "7"}]}
    assert answer_row(pair, "7")["messages"] == sft["messages"]
    tokenizer = _tokenizer(built)
    assert encode_answers(tokenizer, [pair]).example(0) == encode_batch(tokenizer, [sft], "last_assistant").example(0)


def test_rewards_are_anchored_to_the_base_and_a_tie_is_half_right():
    from fineflow.evaluate.pair_ranking import PairScorer

    pairs = [{"chosen": f"c{i}", "rejected": f"r{i}"} for i in range(4)]
    scorer = PairScorer(pairs, beta=0.5, batch_size=2, seq_len=8)
    base = {"chosen": [-5.0, -5.0, -5.0, -2.0], "rejected": [-1.0, -1.0, -1.0, -9.0]}  # the base prefers rejected 3/4
    model = {"chosen": [-3.0, -5.0, -6.0, -2.0], "rejected": [-1.0, -1.0, -1.0, -9.0]}
    metrics, samples = scorer.summarize(model, base)
    # r(y) = beta * (logp(y) - logp_base(y)): margins +1, 0, -0.5, 0 -> right, tie, wrong, tie
    assert [s["reward_margin"] for s in samples] == [1.0, 0.0, -0.5, 0.0]
    assert [s["preference_accuracy"] for s in samples] == [1.0, 0.5, 0.0, 0.5]
    assert metrics == {"preference_accuracy": 0.5, "reward_margin": 0.125}
    assert [s["prediction"] for s in samples] == ["c0", None, "r2", None] and samples[0]["target"] == "c0"
    assert [s["doc_id"] for s in samples] == [0, 1, 2, 3]
    # the base against itself: every pair a tie, at chance, whatever its own log-probs prefer
    assert scorer.summarize(base, base)[0] == {"preference_accuracy": 0.5, "reward_margin": 0.0}


def test_a_preference_objective_with_an_sft_eval_set_is_a_clear_error(built, tmp_path):
    from fineflow.evaluate.pair_ranking import read_pairs

    bad = tmp_path / "eval.jsonl"
    bad.write_text(
        json.dumps({"instruction": "i", "chosen": "a", "rejected": "b"})
        + "\n"
        + json.dumps({"instruction": "i", "output": "o"})
        + "\n"
    )
    with pytest.raises(FineflowError, match=r"eval.jsonl:2: .*no string chosen or rejected.*data.mapping.chosen"):
        read_pairs(bad)
    assert len(read_pairs(bad, limit=1)) == 1  # evaluate.limit: only the rows scored are read


def test_fineflow_preference_in_evaluate_tasks_is_implied_by_pairs_and_refused_without():
    from fineflow.evaluate.pair_ranking import lm_eval_tasks

    assert lm_eval_tasks(["fineflow_synth", "fineflow_preference"], preference=True) == ["fineflow_synth"]
    assert lm_eval_tasks(["fineflow_synth"], preference=False) == ["fineflow_synth"]
    with pytest.raises(
        FineflowError, match=r"lists fineflow_preference.*evaluated on preference pairs \(dpo, simpo, orpo, kto\)"
    ):
        lm_eval_tasks(["fineflow_synth", "fineflow_preference"], preference=False)
    with pytest.raises(FineflowError, match=r"lists only fineflow_preference; keep an lm-eval task"):
        lm_eval_tasks(["fineflow_preference"], preference=True)


# ---- the gate on hand-written scores ------------------------------------------------------------

POLICY = GatePolicy(
    primary_metric=ACC, min_delta=0.0, max_regression=0.05, bootstrap_samples=2000, confidence=0.95, seed=0
)


def model(right_pairs: int, exact: int, margin: float, n: int = 40) -> dict:
    return entry(
        {
            ACC: [float(i < right_pairs) for i in range(n)],
            MARGIN: [margin] * n,
            GUARD: [float(i < exact) for i in range(n)],
        }
    )


CHAMPION = {"id": "c" * 16, "eval_data_sha256": H}


def judged(candidate: dict, champion: dict) -> object:
    scores = {"base": model(0, 0, 0.0), "candidate": candidate, "champion": {**champion, "id": CHAMPION["id"]}}
    return promotion_decision(scores, {**CHAMPION, "metrics": {}}, [], POLICY, H)


def test_a_candidate_that_ranks_pairs_significantly_better_is_promoted():
    d = judged(model(34, 20, 1.5), model(20, 20, 0.8))
    assert d.promote and d.primary == ACC and d.candidate == 0.85 and d.reference == 0.5
    assert d.stats["ci_low"] > 0 and "beats the champion" in d.reason


def test_a_preference_tie_is_refused():
    d = judged(model(20, 20, 0.8), model(20, 20, 0.8))
    assert not d.promote and d.stats["delta"] == 0 and "includes 0" in d.reason


def test_a_candidate_that_forgets_its_sft_task_is_refused_whatever_its_preference_accuracy():
    # +0.35 preference accuracy, but exact match 0.50 -> 0.40: beyond promote.max_regression 0.05
    d = judged(model(34, 16, 1.5), model(20, 20, 0.8))
    assert not d.promote and d.regressions == {GUARD: 0.1}
    assert f"regressed beyond promote.max_regression=0.05 on ['{GUARD}']" in d.reason
    # within max_regression (0.50 -> 0.475) it is promoted
    assert judged(model(34, 19, 1.5), model(20, 20, 0.8)).promote


def test_a_smaller_reward_margin_is_reported_but_vetoes_nothing():
    # more pairs right with a smaller mean margin: better ranking, not a regression (the margin is beta x nats)
    d = judged(model(34, 20, 0.3), model(20, 20, 0.8))
    assert d.promote and d.regressions == {}
    # as the primary metric it decides like any other
    margin_gate = replace(POLICY, primary_metric=MARGIN)
    scores = {
        "base": model(0, 0, 0.0),
        "candidate": model(34, 20, 0.3),
        "champion": {**model(20, 20, 0.8), "id": CHAMPION["id"]},
    }
    refused = promotion_decision(scores, {**CHAMPION, "metrics": {}}, [], margin_gate, H)
    assert not refused.promote and refused.primary == MARGIN


# ---- through the real evaluate stage -----------------------------------------------------------------


def _evaluate(built, eval_rows, candidate, out, params, champion=None):
    from fineflow.evaluate.scoring import evaluate_models

    report = evaluate_models(
        params, built / "models/base", candidate, eval_rows, out / "eval", out / "lm_eval", champion
    )
    return json.loads((out / "eval/scores.json").read_text()), report


@pytest.fixture(scope="module")
def preference_scores(built, pair_rows, chosen_adapter, tmp_path_factory):
    """The real evaluate stage on the 16 pairs: candidate the adapter taught the chosen answers, champion a random
    adapter; fineflow_preference listed in evaluate.tasks (optional: pairs imply it). (scores.json, report, out)."""
    out = tmp_path_factory.mktemp("evaluated")
    champion = random_adapter(built / "models/base", out / "champion", seed=3)
    (champion / "champion.json").write_text(json.dumps({"candidate_id": CHAMPION["id"]}))
    tasks = ["fineflow_synth", "fineflow_synth_mc", "fineflow_preference"]
    scores, report = _evaluate(
        built, pair_rows, chosen_adapter, out, _params(evaluate={"limit": None, "tasks": tasks}), champion
    )
    return scores, report, out


def test_the_evaluate_stage_scores_pairs_and_the_gate_promotes_only_a_real_preference_gain(
    preference_scores, pair_rows
):
    """Every model scored on fineflow_preference beside the lm-eval tasks (on the chosen answers), then the gate on
    that scores.json: the taught candidate over the base (at chance) and over the random champion; a tie refused."""
    scores, report, out = preference_scores
    pairs = [json.loads(line) for line in pair_rows.read_text().splitlines()]
    assert scores["tasks"] == ["fineflow_synth", "fineflow_synth_mc", "fineflow_preference"]
    assert scores["preference"] == {"task": "fineflow_preference", "beta": 0.5, "anchor": "base", "pairs": len(pairs)}
    for name in ("base", "candidate", "champion"):
        samples = scores[name]["samples"]
        assert [s["doc_id"] for s in samples["fineflow_preference"]] == list(range(len(pairs)))
        assert [s["target"] for s in samples["fineflow_synth"]] == [p["chosen"] for p in pairs]  # the SFT guard
        assert set(report[name]) >= {ACC, MARGIN, GUARD}
        lines = (out / f"eval/samples/{name}/fineflow_preference.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == samples["fineflow_preference"]
        assert "fineflow_preference" not in json.loads((out / f"lm_eval/{name}.json").read_text())["results"]
    base = scores["base"]["samples"]["fineflow_preference"]
    assert {(s["preference_accuracy"], s["reward_margin"]) for s in base} == {(0.5, 0.0)}  # the anchor: chance
    candidate, random_one = (scores[n]["metrics"]["fineflow_preference"] for n in ("candidate", "champion"))
    print(f"\npreference accuracy / reward margin: taught {candidate}, random adapter {random_one}")
    assert candidate["preference_accuracy"] > 0.9 and candidate["reward_margin"] > 0

    first = promotion_decision(scores, None, [], replace(POLICY, max_regression=0.0), H)  # no champion yet: vs the base
    assert first.promote and first.reference == 0.5 and first.stats["n"] == len(pairs), first.reason
    record = {**CHAMPION, "metrics": {}}
    over_random = promotion_decision(scores, record, [], replace(POLICY, max_regression=0.0), H)
    assert over_random.promote and over_random.stats["ci_low"] > 0 and not over_random.regressions, over_random.reason
    tie = promotion_decision({**scores, "candidate": scores["champion"]}, record, [], POLICY, H)
    assert not tie.promote and tie.stats["delta"] == 0, tie.reason
    print(f"gate: vs base {first.reason}; vs random champion {over_random.reason}; tie {tie.reason}")


def test_the_promote_stage_installs_a_preference_champion_and_judges_the_next_candidate_against_it(
    built, preference_scores, chosen_adapter, tmp_path
):
    """promote (the stage's procedure) with promote.primary_metric fineflow_preference/preference_accuracy: the
    taught adapter is promoted over the base and its per-pair scores recorded; the random adapter, judged against
    that champion on the same pairs, is refused."""
    import subprocess

    from fineflow.registry.champion import promote

    scores, _, out = preference_scores
    params = _params(promote={"primary_metric": ACC, "max_regression": 0.2})  # the primary metric decides here
    root = tmp_path / "project"  # a git checkout: the lineage needs a commit
    root.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "fixture"], cwd=root, check=True)
    champion, registry = root / "models/champion", root / "models/registry"
    (root / "train.json").write_text(json.dumps({"wall_s": 1.0, "tokens_per_s": 100.0, "steps": 4}))
    kw = dict(base_dir=built / "models/base", shards_dir=built / "data/shards", root=root, lineage_dir=root / "runs")
    kw["train_report"] = root / "train.json"
    first_scores = root / "first.json"
    first_scores.write_text(json.dumps({k: v for k, v in scores.items() if k != "champion"}))
    first = promote(params, first_scores, chosen_adapter, champion, registry, **kw)
    assert first["decision"] == "promoted", first["reason"]
    recorded = json.loads((champion / "champion.json").read_text())
    assert recorded["metrics"][ACC] == scores["candidate"]["metrics"]["fineflow_preference"]["preference_accuracy"]
    # the next run: the random adapter is the candidate, the taught one (now champion) re-scored beside it
    installed = {**scores["candidate"], "id": recorded["candidate_id"]}
    second_scores = root / "second.json"
    second_scores.write_text(json.dumps({**scores, "candidate": scores["champion"], "champion": installed}))
    second = promote(params, second_scores, out / "champion", champion, registry, **kw)
    assert second["decision"] == "refused" and "does not beat the champion" in second["reason"], second["reason"]
    print(f"\npromote: first {first['reason']}; second {second['reason']}")


def test_an_sft_objective_writes_the_scores_main_writes(built, tmp_path):
    """With train.objective sft nothing of the preference task appears: the keys and tasks are main's."""
    from fineflow.core.config import parse_params

    adapter = random_adapter(built / "models/base", tmp_path / "candidate", seed=1)
    params = parse_params(yaml.safe_load(yaml.safe_dump(TINY_PARAMS)))
    scores, _ = _evaluate(built, built / "data/validated/eval.jsonl", adapter, tmp_path, params)
    assert "preference" not in scores and scores["tasks"] == ["fineflow_synth", "fineflow_synth_mc"]
    assert all("fineflow_preference" not in scores[n]["metrics"] for n in ("base", "candidate"))
    assert not list((tmp_path / "eval/samples").rglob("fineflow_preference.jsonl"))


def test_a_dpo_candidates_rewards_are_measured_from_its_reference_when_that_is_the_champion(tmp_path):
    """DPO's reference is the champion (train.preference.reference champion, named in reference.json): the rewards
    are the candidate's own implicit rewards, so the champion it started from ties on every pair (0.5) and a pair
    counts for the candidate when it moved toward chosen past the champion. Any other reference: the base."""
    from fineflow.evaluate.pair_ranking import PairScorer
    from fineflow.evaluate.scoring import preference_anchor

    champion = tmp_path / "champion"
    champion.mkdir()
    (champion / "champion.json").write_text(json.dumps({"candidate_id": "c0ffee"}))
    reference = tmp_path / "reference.json"
    for record, expected in (
        ({"objective": "dpo", "champion": "c0ffee"}, "champion"),
        ({"objective": "dpo", "champion": "another"}, "base"),  # the champion changed since the reference
        ({"objective": "dpo", "champion": None}, "base"),  # reference: base, or no champion then
        ({"objective": "simpo", "needed": False}, "base"),
        ({"objective": "orpo", "needed": False, "champion": "c0ffee"}, "champion"),  # it started from the champion
    ):
        reference.write_text(json.dumps(record))
        assert preference_anchor(reference, champion) == expected, record
    assert preference_anchor(None, champion) == preference_anchor(reference, None) == "base"
    scorer = PairScorer([{"chosen": "a", "rejected": "b"}] * 3, beta=0.1, batch_size=2, seq_len=64)
    champion_logps = {"chosen": [-1.0, -2.0, -3.0], "rejected": [-2.0, -1.0, -3.0]}
    candidate_logps = {"chosen": [-0.5, -1.5, -3.5], "rejected": [-2.0, -1.2, -3.0]}
    assert scorer.summarize(champion_logps, champion_logps)[0]["preference_accuracy"] == 0.5
    metrics, samples = scorer.summarize(candidate_logps, champion_logps)
    assert [s["preference_accuracy"] for s in samples] == [1.0, 1.0, 0.0]  # moved toward chosen, or away
    assert metrics["reward_margin"] == pytest.approx(0.1 * (0.5 + 0.7 - 0.5) / 3, abs=1e-6)
