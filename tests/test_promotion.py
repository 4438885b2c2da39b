"""The promotion gate's decisions and the hash-chained promotion log."""

import json

import pytest

from fineflow.registry.gate import decide
from fineflow.registry.store import append_log, directory_hash, ensure_empty_champion, install_champion, read_champion

P = "synth/exact_match"


def test_improvement_beyond_min_delta_promotes():
    d = decide({P: 0.6, "other/acc": 0.5}, {P: 0.2, "other/acc": 0.5}, "base model", P, 0.05, 0.0)
    assert d.promote and "beats the base model" in d.reason


def test_improvement_below_min_delta_is_refused():
    d = decide({P: 0.22}, {P: 0.2}, "base model", P, 0.05, 0.0)
    assert not d.promote and "promote.min_delta=0.05" in d.reason


def test_regression_on_another_metric_is_refused():
    d = decide({P: 0.9, "other/acc": 0.3}, {P: 0.2, "other/acc": 0.5}, "champion abc", P, 0.05, 0.1)
    assert not d.promote and "other/acc" in d.reason and d.regressions == {"other/acc": 0.2}


def test_missing_primary_metric_is_refused():
    assert not decide({}, {P: 0.2}, "base model", P, 0.0, 0.0).promote
    assert not decide({P: 0.2}, {}, "base model", P, 0.0, 0.0).promote


def test_log_entries_chain_by_hash(tmp_path):
    first = append_log(tmp_path, {"decision": "refused"})
    second = append_log(tmp_path, {"decision": "promoted"})
    lines = (tmp_path / "promotions.jsonl").read_text().splitlines()
    import hashlib

    assert first["prev_sha256"] is None and second["seq"] == 2
    assert json.loads(lines[1])["prev_sha256"] == hashlib.sha256(lines[0].encode()).hexdigest()


def test_champion_install_replaces_atomically(tmp_path):
    champion = tmp_path / "champion"
    ensure_empty_champion(champion)
    assert read_champion(champion) is None
    for version in ("one", "two"):
        adapter = tmp_path / version
        adapter.mkdir()
        (adapter / "adapter_model.safetensors").write_text(version)
        install_champion(adapter, champion, {"candidate_id": directory_hash(adapter), "metrics": {P: 1.0}})
    assert (champion / "adapter_model.safetensors").read_text() == "two"
    assert read_champion(champion)["candidate_id"] == directory_hash(tmp_path / "two")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["champion", "one", "two"]  # no staging left over


# ---- the whole gate: paired bootstrap, refusals ----------------------------------------------------

from fineflow.registry.gate import paired_bootstrap, promotion_decision  # noqa: E402

H = "e" * 64
GATE = dict(primary=P, min_delta=0.05, max_regression=0.0, bootstrap_samples=2000, confidence=0.95, seed=0,
            eval_data_sha256=H)


def entry(per_task: dict[str, list[float]], status="ok") -> dict:
    """An evaluation entry as scores.json holds it, from per-doc scores per task ("task/metric": [...])."""
    metrics, samples = {}, {}
    for key, values in per_task.items():
        task, metric = key.split("/")
        metrics.setdefault(task, {})[metric] = sum(values) / len(values)
        rows = samples.setdefault(task, [{"doc_id": i, "target": "t", "prediction": "p"} for i in range(len(values))])
        for row, value in zip(rows, values):
            row[metric] = value
    return {"status": status, "metrics": metrics, "samples": samples}


def hits(n_right: int, n: int = 40, offset: int = 0) -> list[float]:
    return [1.0 if (i - offset) % n < n_right else 0.0 for i in range(n)]


def test_bootstrap_is_seeded_and_brackets_the_mean():
    a, b = hits(30), hits(10)
    first, again = paired_bootstrap(a, b, 2000, 0.95, 3), paired_bootstrap(a, b, 2000, 0.95, 3)
    assert first == again and first.delta == 0.5 and first.ci_low < 0.5 < first.ci_high and first.p_value == 0.0


def test_gate_promotes_a_clear_improvement_over_the_base():
    d = promotion_decision({"base": entry({P: hits(5)}), "candidate": entry({P: hits(25)})}, None, [], **GATE)
    assert d.promote and "beats the base model" in d.reason and d.stats["ci_low"] > 0 and "CI" in d.reason


def test_gate_refuses_a_tie_within_noise():
    # 22/40 vs 20/40, on different docs: +0.05 meets min_delta, but the CI straddles 0
    scores = {"base": entry({P: hits(20)}), "candidate": entry({P: hits(22, offset=10)})}
    d = promotion_decision(scores, None, [], **GATE)
    assert not d.promote and "includes 0" in d.reason and d.stats["ci_low"] <= 0 < d.stats["ci_high"]
    assert d.stats["delta"] == 0.05 and 0 < d.stats["p_value"] < 1


def test_gate_refuses_a_regression_on_a_secondary_task():
    scores = {"base": entry({P: hits(5), "other/acc": hits(30)}),
              "candidate": entry({P: hits(35), "other/acc": hits(25)})}
    d = promotion_decision(scores, None, [], **GATE)
    assert not d.promote and "other/acc" in d.reason and d.regressions == {"other/acc": 0.125}


@pytest.mark.parametrize("scores, expected", [
    ({"base": entry({P: hits(5)})}, "no candidate evaluation"),
    ({"candidate": entry({P: hits(30)})}, "no base model evaluation"),
    ({"base": entry({P: hits(5)}), "candidate": {"status": "failed", "error": "OOM"}},
     "candidate's evaluation failed: OOM"),
    ({"base": entry({P: hits(5)}), "candidate": {"status": "ok", "metrics": {}}}, "no candidate evaluation"),
    ({"base": entry({P: hits(5)}), "candidate": {**entry({P: hits(30)}), "status": "failed", "error": "OOM"}},
     "candidate's evaluation failed: OOM"),
    ({"base": {**entry({P: hits(5)}), "status": "failed", "error": "boom"}, "candidate": entry({P: hits(30)})},
     "base model's evaluation failed: boom"),
])
def test_gate_refuses_a_missing_or_failed_evaluation(scores, expected):
    d = promotion_decision(scores, None, [], **GATE)
    assert not d.promote and expected in d.reason


CHAMPION = {"id": "c" * 16, "metrics": {P: 0.25}, "samples": entry({P: hits(10)})["samples"], "eval_data_sha256": H}


def test_gate_compares_with_the_champion_not_the_base():
    scores = {"base": entry({P: hits(0)}), "candidate": entry({P: hits(12)}),
              "champion": {**entry({P: hits(10)}), "id": CHAMPION["id"]}}
    d = promotion_decision(scores, CHAMPION, [], **GATE)
    assert not d.promote and "champion cccc" in d.reason  # +0.05 over the champion is within noise
    better = promotion_decision({**scores, "candidate": entry({P: hits(30)})}, CHAMPION, [], **GATE)
    assert better.promote and better.reference == 0.25


def test_gate_uses_the_champions_recorded_samples_when_it_was_not_re_evaluated():
    d = promotion_decision({"base": entry({P: hits(0)}), "candidate": entry({P: hits(30)})}, CHAMPION, [], **GATE)
    assert d.promote and d.reference_name == "champion " + "c" * 16


def test_gate_refuses_a_failed_champion_evaluation():
    scores = {"base": entry({P: hits(0)}), "candidate": entry({P: hits(30)}),
              "champion": {"status": "failed", "error": "corrupt adapter", "id": CHAMPION["id"]}}
    d = promotion_decision(scores, CHAMPION, [], **GATE)
    assert not d.promote and "evaluation failed: corrupt adapter" in d.reason


def test_gate_refuses_different_eval_data_than_the_champions():
    scores = {"base": entry({P: hits(0)}), "candidate": entry({P: hits(30)})}
    d = promotion_decision(scores, CHAMPION, [], **{**GATE, "eval_data_sha256": "f" * 64})
    assert not d.promote and "different eval data" in d.reason and "ffffffffffff" in d.reason
    unknown = promotion_decision(scores, CHAMPION, [], **{**GATE, "eval_data_sha256": None})
    assert not unknown.promote and "eval_data_sha256" in unknown.reason


def test_gate_refuses_a_champion_mismatch_and_a_legacy_champion_without_evidence():
    scores = {"base": entry({P: hits(0)}), "candidate": entry({P: hits(30)}),
              "champion": {**entry({P: hits(10)}), "id": "d" * 16}}
    assert "re-run the evaluate stage" in promotion_decision(scores, CHAMPION, [], **GATE).reason
    legacy = {"id": "a" * 64, "metrics": {P: 0.25}, "samples": None, "eval_data_sha256": None}
    d = promotion_decision({"base": entry({P: hits(0)}), "candidate": entry({P: hits(30)})}, legacy, [], **GATE)
    assert not d.promote and "no recorded eval data hash" in d.reason


@pytest.mark.parametrize("missing, expected", [
    (None, "has no lineage manifest"), (["run.git.commit", "data.tokenizer_hash"],
                                        "lineage is incomplete: missing run.git.commit, data.tokenizer_hash")])
def test_gate_refuses_incomplete_lineage(missing, expected):
    d = promotion_decision({"base": entry({P: hits(5)}), "candidate": entry({P: hits(30)})}, None, missing, **GATE)
    assert not d.promote and expected in d.reason


def test_lineage_required_fields():
    from fineflow.registry.lineage import REQUIRED, missing_fields

    assert missing_fields(None) == list(REQUIRED)
    full = {}
    for dotted in REQUIRED:
        node = full
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = "x"
    assert missing_fields(full) == []
    full["run"]["git"]["commit"] = None
    assert missing_fields(full) == ["run.git.commit"]


def test_verify_names_the_first_edited_line(tmp_path):
    from fineflow.registry.store import verify_log

    for decision in ("refused", "promoted", "refused"):
        append_log(tmp_path, {"decision": decision, "metrics": {P: 0.5}})
    assert verify_log(tmp_path) == []
    path = tmp_path / "promotions.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1].replace('"promoted"', '"refused"'), lines[2]]) + "\n")
    [problem] = verify_log(tmp_path)
    assert "promotions.jsonl:3:" in problem and "line 2 was edited" in problem
    path.write_text("\n".join([lines[0], lines[1], lines[2].replace("0.5", "0.9")]) + "\n")  # the last line
    [problem] = verify_log(tmp_path)
    assert "promotions.jsonl:3:" in problem and "last line was edited" in problem
