"""The promotion gate's decisions and the hash-chained promotion log."""

import dataclasses
import json
from dataclasses import replace

import pytest

from fineflow.registry.gate import GatePolicy, decide
from fineflow.registry.install import ensure_empty_champion, read_champion, staging_dir, swap_in
from fineflow.registry.promotion_log import append_log
from fineflow.registry.store import alias_id, set_alias

P = "synth/exact_match"
POLICY = GatePolicy(
    primary_metric=P, min_delta=0.05, max_regression=0.0, bootstrap_samples=2000, confidence=0.95, seed=0
)


def test_improvement_beyond_min_delta_promotes():
    d = decide({P: 0.6, "other/acc": 0.5}, {P: 0.2, "other/acc": 0.5}, "base model", POLICY)
    assert d.promote and "beats the base model" in d.reason


def test_improvement_below_min_delta_is_refused():
    d = decide({P: 0.22}, {P: 0.2}, "base model", POLICY)
    assert not d.promote and "promote.min_delta=0.05" in d.reason


def test_regression_on_another_metric_is_refused():
    d = decide(
        {P: 0.9, "other/acc": 0.3}, {P: 0.2, "other/acc": 0.5}, "champion abc", replace(POLICY, max_regression=0.1)
    )
    assert not d.promote and "other/acc" in d.reason and d.regressions == {"other/acc": 0.2}


def test_missing_primary_metric_is_refused():
    assert not decide({}, {P: 0.2}, "base model", replace(POLICY, min_delta=0.0)).promote
    assert not decide({P: 0.2}, {}, "base model", replace(POLICY, min_delta=0.0)).promote


def test_log_entries_chain_by_hash(tmp_path):
    first = append_log(tmp_path, {"decision": "refused"})
    second = append_log(tmp_path, {"decision": "promoted"})
    lines = (tmp_path / "promotions.jsonl").read_text().splitlines()
    import hashlib

    assert first["prev_sha256"] is None and second["seq"] == 2
    assert json.loads(lines[1])["prev_sha256"] == hashlib.sha256(lines[0].encode()).hexdigest()


def _files(root):
    """{relative path: bytes} of every file below root: a directory's whole content, to compare."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _write(root, files: dict[str, str]):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_before_the_first_promotion_the_champion_path_holds_no_champion(tmp_path):
    champion = tmp_path / "champion"
    ensure_empty_champion(champion)
    assert json.loads((champion / "champion.json").read_text()) == {"candidate_id": None}
    assert read_champion(champion) is None


def test_swap_in_replaces_the_whole_champion_and_leaves_nothing_beside_it(tmp_path):
    champion = _write(
        tmp_path / "champion",
        {"adapter_model.safetensors": "old", "merged/model.safetensors": "old", "only_in_old.txt": "old"},
    )
    staging = staging_dir(champion)
    assert staging.parent == champion.parent  # same filesystem: the swap is a rename
    _write(staging, {"adapter_model.safetensors": "new", "merged/model.safetensors": "new"})
    swap_in(staging, champion)
    assert _files(champion) == {"adapter_model.safetensors": b"new", "merged/model.safetensors": b"new"}  # not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["champion"]  # no staging or retired copy left over


def test_swap_in_installs_a_first_champion_where_there_was_none(tmp_path):
    staging = _write(staging_dir(tmp_path / "champion"), {"adapter_model.safetensors": "first"})
    swap_in(staging, tmp_path / "champion")
    assert _files(tmp_path / "champion") == {"adapter_model.safetensors": b"first"}


def test_staging_dir_discards_what_a_crashed_build_left(tmp_path):
    leftover = _write(tmp_path / ".champion.staging", {"adapter_model.safetensors": "half"})
    staging = staging_dir(tmp_path / "champion")
    assert staging == leftover and not staging.exists()  # the next build starts empty, never on top of a half one


def _registry_with_two_champions(tmp_path):
    """A registry whose log promoted "a" then "b" (the champion installed now); the base model named in the
    records is never loaded by the test. Returns the registry, the champion and the two ids."""
    from fineflow.registry.store import candidate_id

    registry, champion = tmp_path / "registry", tmp_path / "champion"
    ids = []
    for name in ("a", "b"):
        files = {"adapter_model.safetensors": f"weights {name}", "adapter_config.json": "{}"}
        _write(tmp_path / f"adapter-{name}", files)
        cid = candidate_id(tmp_path / f"adapter-{name}")
        record = json.dumps({"candidate_id": cid, "base_model": "base", "metrics": {P: 0.5}})
        _write(registry / "candidates" / cid, {**files, "record.json": record})
        entry = append_log(registry, {"candidate_id": cid, "decision": "promoted"})
        ids.append(cid)
    set_alias(registry, ids[1], entry["seq"])
    _write(
        champion,
        {
            "adapter_model.safetensors": "weights b",
            "merged/model.safetensors": "merged b",
            "champion.json": json.dumps({"candidate_id": ids[1], "promotion_seq": 2}),
        },
    )
    return registry, champion, ids


def test_a_champion_build_that_fails_midway_leaves_the_old_champion_and_the_log_as_they_were(tmp_path, monkeypatch):
    """build_champion (promote and rollback both use it) assembles the next champion aside; here it fails after
    the adapter files were copied, when loading the base model's tokenizer (e.g. a full disk or a missing base).
    The installed champion, the log and the alias must be untouched: nothing is logged or swapped before the
    build is complete."""
    import transformers

    from fineflow.registry.champion import rollback

    registry, champion, ids = _registry_with_two_champions(tmp_path)
    before = _files(champion), (registry / "promotions.jsonl").read_bytes(), (registry / "HEAD").read_bytes()

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_space)
    with pytest.raises(OSError, match="No space left on device"):
        rollback(registry, champion)
    assert (_files(champion), (registry / "promotions.jsonl").read_bytes(), (registry / "HEAD").read_bytes()) == before
    assert alias_id(registry) == ids[1]
    assert _files(tmp_path / ".champion.staging") == {
        "adapter_model.safetensors": b"weights a",
        "adapter_config.json": b"{}",
    }  # the failure was midway


# ---- the whole gate: paired bootstrap, refusals ----------------------------------------------------

from fineflow.registry.gate import decision_record, paired_bootstrap, promotion_decision  # noqa: E402

H = "e" * 64  # the eval data's sha256 (with POLICY, the gate's arguments in most tests)


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


def test_the_gate_policy_is_built_once_from_the_promote_params_and_the_run_seed():
    from fineflow.core.config import parse_params
    from tests.conftest import TINY_PARAMS

    promote = {**TINY_PARAMS["promote"], "min_delta": 0.2, "on_eval_change": "refuse", "bootstrap_samples": 500}
    params = parse_params({**TINY_PARAMS, "seed": 11, "promote": promote})
    cfg = params.promote
    assert GatePolicy.from_params(params) == GatePolicy(
        primary_metric=cfg.primary_metric,
        min_delta=0.2,
        max_regression=cfg.max_regression,
        bootstrap_samples=500,
        confidence=cfg.confidence,
        seed=11,
        on_eval_change="refuse",
        on_base_change=cfg.on_base_change,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        POLICY.min_delta = 0.0  # type: ignore[misc]


def test_bootstrap_is_seeded_and_brackets_the_mean():
    a, b = hits(30), hits(10)
    first, again = paired_bootstrap(a, b, 2000, 0.95, 3), paired_bootstrap(a, b, 2000, 0.95, 3)
    assert first == again and first.delta == 0.5 and first.ci_low < 0.5 < first.ci_high and first.p_value == 0.0


def test_gate_promotes_a_clear_improvement_over_the_base():
    d = promotion_decision({"base": entry({P: hits(5)}), "candidate": entry({P: hits(25)})}, None, [], POLICY, H)
    assert d.promote and "beats the base model" in d.reason and d.stats["ci_low"] > 0 and "CI" in d.reason


def test_gate_refuses_a_tie_within_noise():
    # 22/40 vs 20/40, on different docs: +0.05 meets min_delta, but the CI straddles 0
    scores = {"base": entry({P: hits(20)}), "candidate": entry({P: hits(22, offset=10)})}
    d = promotion_decision(scores, None, [], POLICY, H)
    assert not d.promote and "includes 0" in d.reason and d.stats["ci_low"] <= 0 < d.stats["ci_high"]
    assert d.stats["delta"] == 0.05 and 0 < d.stats["p_value"] < 1


def test_gate_refuses_a_regression_on_a_secondary_task():
    scores = {
        "base": entry({P: hits(5), "other/acc": hits(30)}),
        "candidate": entry({P: hits(35), "other/acc": hits(25)}),
    }
    d = promotion_decision(scores, None, [], POLICY, H)
    assert not d.promote and "other/acc" in d.reason and d.regressions == {"other/acc": 0.125}


@pytest.mark.parametrize(
    "scores, expected",
    [
        ({"base": entry({P: hits(5)})}, "no candidate evaluation"),
        ({"candidate": entry({P: hits(30)})}, "no base model evaluation"),
        (
            {"base": entry({P: hits(5)}), "candidate": {"status": "failed", "error": "OOM"}},
            "candidate's evaluation failed: OOM",
        ),
        ({"base": entry({P: hits(5)}), "candidate": {"status": "ok", "metrics": {}}}, "no candidate evaluation"),
        (
            {"base": entry({P: hits(5)}), "candidate": {**entry({P: hits(30)}), "status": "failed", "error": "OOM"}},
            "candidate's evaluation failed: OOM",
        ),
        (
            {"base": {**entry({P: hits(5)}), "status": "failed", "error": "boom"}, "candidate": entry({P: hits(30)})},
            "base model's evaluation failed: boom",
        ),
    ],
)
def test_gate_refuses_a_missing_or_failed_evaluation(scores, expected):
    d = promotion_decision(scores, None, [], POLICY, H)
    assert not d.promote and expected in d.reason


CHAMPION = {"id": "c" * 16, "metrics": {P: 0.25}, "samples": entry({P: hits(10)})["samples"], "eval_data_sha256": H}


def test_gate_compares_with_the_champion_not_the_base():
    scores = {
        "base": entry({P: hits(0)}),
        "candidate": entry({P: hits(12)}),
        "champion": {**entry({P: hits(10)}), "id": CHAMPION["id"]},
    }
    d = promotion_decision(scores, CHAMPION, [], POLICY, H)
    assert not d.promote and "champion cccc" in d.reason  # +0.05 over the champion is within noise
    better = promotion_decision({**scores, "candidate": entry({P: hits(30)})}, CHAMPION, [], POLICY, H)
    assert better.promote and better.reference == 0.25


def test_gate_uses_the_champions_recorded_samples_when_it_was_not_re_evaluated():
    d = promotion_decision({"base": entry({P: hits(0)}), "candidate": entry({P: hits(30)})}, CHAMPION, [], POLICY, H)
    assert d.promote and d.reference_name == "champion " + "c" * 16


def test_gate_refuses_a_failed_champion_evaluation():
    scores = {
        "base": entry({P: hits(0)}),
        "candidate": entry({P: hits(30)}),
        "champion": {"status": "failed", "error": "corrupt adapter", "id": CHAMPION["id"]},
    }
    d = promotion_decision(scores, CHAMPION, [], POLICY, H)
    assert not d.promote and "evaluation failed: corrupt adapter" in d.reason


def test_gate_follows_the_eval_change_policy():
    """The eval set changed since the champion's promotion: promote.on_eval_change decides (a candidate is not
    refused for ever), and the decision says what changed, from what to what."""
    new_data = "f" * 64
    rescored = {"champion": {**entry({P: hits(10)}), "id": CHAMPION["id"]}}  # the champion on the current data
    scores = {"base": entry({P: hits(0)}), "candidate": entry({P: hits(30)})}
    change = {"from": H, "to": new_data}
    on_current = replace(POLICY, on_eval_change="compare_on_current")
    refuse = replace(POLICY, on_eval_change="refuse")

    d = promotion_decision({**scores, **rescored}, CHAMPION, [], on_current, new_data)
    assert d.promote and d.reference == 0.25 and d.context["eval_change"] == {**change, "policy": "compare_on_current"}
    d = promotion_decision({**scores, **rescored}, CHAMPION, [], refuse, new_data)
    assert not d.promote and "promote.on_eval_change is refuse" in d.reason and "ffffffffffff now" in d.reason
    assert d.context["eval_change"] == {**change, "policy": "refuse"}
    # the champion's metrics recorded at promotion were computed on the old data: never compared with the new
    d = promotion_decision(scores, CHAMPION, [], on_current, new_data)
    assert not d.promote and "was not re-scored on it in this run" in d.reason
    unknown = promotion_decision(scores, CHAMPION, [], POLICY, None)
    assert not unknown.promote and "eval_data_sha256" in unknown.reason


def test_gate_follows_the_base_change_policy():
    """model.base changed: the champion is an adapter for another base, so the gate does not compare with it as if
    nothing had changed; promote.on_base_change decides, and compare_to_base judges against the candidate's own
    base and reports the old champion's merged model side by side."""
    champion = {**CHAMPION, "base_digest": "a" * 16}
    scores = {
        "base": entry({P: hits(0)}),
        "candidate": entry({P: hits(30)}),
        "champion": {**entry({P: hits(35)}), "id": CHAMPION["id"], "evaluated_as": "merged model"},
        "base_digest": "b" * 16,
    }
    d = promotion_decision(scores, champion, [], replace(POLICY, on_base_change="compare_to_base"), H)
    assert d.promote and d.reference_name == "base model" and d.reference == 0.0
    assert "the base model changed: champion cccccccccccccccc was trained on base aaaa" in d.reason
    assert d.context["base_change"] == {"from": "a" * 16, "to": "b" * 16, "policy": "compare_to_base"}
    side = d.context["vs_old_champion"]
    assert side["evaluated_as"] == "merged model" and side["metrics"] == {P: 35 / 40}
    assert side["candidate_vs_champion"][P]["delta"] == pytest.approx(-5 / 40)  # reported, not gating
    d = promotion_decision(scores, champion, [], replace(POLICY, on_base_change="refuse"), H)
    assert not d.promote and "promote.on_base_change is refuse" in d.reason and d.context["base_change"]
    # the same base: the champion is the reference, as before
    same = promotion_decision({**scores, "base_digest": "a" * 16}, champion, [], POLICY, H)
    assert not same.promote and same.reference_name.startswith("champion") and "base_change" not in same.context


def test_gate_refuses_a_champion_mismatch_and_a_champion_without_evidence():
    scores = {
        "base": entry({P: hits(0)}),
        "candidate": entry({P: hits(30)}),
        "champion": {**entry({P: hits(10)}), "id": "d" * 16},
    }
    assert "re-run the evaluate stage" in promotion_decision(scores, CHAMPION, [], POLICY, H).reason
    # a candidate stored from unreadable scores records no eval data hash; a rollback can still install it
    unhashed = {**CHAMPION, "samples": None, "eval_data_sha256": None}
    d = promotion_decision({"base": entry({P: hits(0)}), "candidate": entry({P: hits(30)})}, unhashed, [], POLICY, H)
    assert not d.promote and "no recorded eval data hash" in d.reason


@pytest.mark.parametrize(
    "missing, expected",
    [
        (None, "has no lineage manifest"),
        (
            ["run.git.commit", "data.tokenizer_hash"],
            "lineage is incomplete: missing run.git.commit, data.tokenizer_hash",
        ),
    ],
)
def test_gate_refuses_incomplete_lineage(missing, expected):
    d = promotion_decision({"base": entry({P: hits(5)}), "candidate": entry({P: hits(30)})}, None, missing, POLICY, H)
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
    from fineflow.registry.verify import verify_log

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


def test_a_promote_re_run_after_its_decision_was_logged_does_not_judge_again(tmp_path):
    """promote killed after its log entry (or DVC re-running it with nothing changed): the re-run finds the same
    candidate judged on the same scores and params as the log's last entry and reuses that verdict, instead of
    judging again and logging a second verdict (a promoted candidate against itself: refused)."""
    from fineflow.core.config import parse_params
    from fineflow.registry.champion import already_decided, decided_as
    from tests.conftest import TINY_PARAMS

    params = parse_params(TINY_PARAMS)
    decision = promotion_decision({"base": entry({P: hits(5)}), "candidate": entry({P: hits(30)})}, None, [], POLICY, H)
    logged = append_log(
        tmp_path,
        {
            "candidate_id": "a" * 16,
            "decision": "promoted",
            **decision_record(decision),
            "scores_sha256": "s" * 64,
            "params": params.model_dump(mode="json", by_alias=True),
        },
    )
    again = already_decided(tmp_path, "a" * 16, "s" * 64, params)
    assert again == logged and decided_as(again) == decision
    assert already_decided(tmp_path, "b" * 16, "s" * 64, params) is None  # another candidate
    assert already_decided(tmp_path, "a" * 16, "t" * 64, params) is None  # other scores
    other = parse_params({**TINY_PARAMS, "promote": {**TINY_PARAMS["promote"], "min_delta": 0.2}})
    assert already_decided(tmp_path, "a" * 16, "s" * 64, other) is None  # another gate: judged anew


# ---- a person's approval (promote.require_approval) ------------------------------------------------------


def test_an_approval_answers_for_what_the_gate_would_promote_and_never_overturns_a_refusal():
    from fineflow.errors import ApprovalNeeded
    from fineflow.registry.approval import Approval, apply_approval

    passed = promotion_decision({"base": entry({P: hits(5)}), "candidate": entry({P: hits(25)})}, None, [], POLICY, H)
    refused = promotion_decision({"base": entry({P: hits(20)}), "candidate": entry({P: hits(21)})}, None, [], POLICY, H)
    assert passed.promote and not refused.promote
    assert apply_approval(refused, "c1", None, {}) == refused  # no one is asked about a refusal
    assert apply_approval(refused, "c1", Approval(True, "alice"), {}) == refused  # nor can overturn it
    for unanswered in (None, Approval(True, "alice", candidate_id="c0")):  # none, or for another candidate
        with pytest.raises(ApprovalNeeded, match="c1 passed the gate") as waiting:
            apply_approval(passed, "c1", unanswered, {"candidate_id": "c1"})
        assert waiting.value.evidence == {"candidate_id": "c1"}
    approved = apply_approval(passed, "c1", Approval(True, "alice", "read 20 samples", "c1"), {})
    assert approved.promote and approved.reason == f"{passed.reason}; approved by alice: read 20 samples"
    assert approved.context["approval"] == {"approved": True, "approver": "alice", "comment": "read 20 samples"}
    rejected = apply_approval(passed, "c1", Approval(False, "bob", "eval set too small"), {})
    assert not rejected.promote and rejected.stats == passed.stats  # the gate's evidence stays on record
    assert rejected.reason.startswith("rejected by bob: eval set too small (the gate alone: ")


@pytest.mark.parametrize(
    "text, problems",
    [
        ("yes", ["not JSON"]),
        ("[true]", ["expected a JSON object"]),
        ('{"approved": "yes", "approver": " ", "by": 1}', ["approved: must be", "approver: must name", "'by'"]),
    ],
)
def test_a_malformed_approval_is_refused_naming_the_variable_and_every_problem(text, problems):
    from fineflow.errors import FineflowError
    from fineflow.registry.approval import approval_from_env

    with pytest.raises(FineflowError) as refused:
        approval_from_env({"FINEFLOW_APPROVAL": text})
    assert str(refused.value).startswith("FINEFLOW_APPROVAL: ")
    assert all(problem in str(refused.value) for problem in problems), str(refused.value)


def test_an_approval_from_the_environment():
    from fineflow.registry.approval import Approval, approval_from_env

    assert approval_from_env({}) is None and approval_from_env({"FINEFLOW_APPROVAL": " "}) is None
    given = approval_from_env({"FINEFLOW_APPROVAL": '{"approved": false, "approver": "bob ", "candidate_id": "c1"}'})
    assert given == Approval(False, "bob", "", "c1")


def test_when_the_base_and_the_eval_set_change_in_one_run_both_changes_are_recorded():
    champion = {**CHAMPION, "base_digest": "a" * 16}
    scores = {"base": entry({P: hits(0)}), "candidate": entry({P: hits(30)}), "base_digest": "b" * 16}
    gate = replace(POLICY, on_base_change="compare_to_base")
    for policy in ("compare_on_current", "refuse"):
        d = promotion_decision(scores, champion, [], replace(gate, on_eval_change=policy), "f" * 64)
        assert d.context["base_change"] == {"from": "a" * 16, "to": "b" * 16, "policy": "compare_to_base"}
        assert d.context["eval_change"] == {"from": H, "to": "f" * 64, "policy": policy}
    d = promotion_decision(scores, champion, [], replace(gate, on_base_change="refuse"), "f" * 64)
    assert not d.promote and d.context["base_change"] and d.context["eval_change"]["to"] == "f" * 64
