"""The evaluate stage on the tiny config: both bundled tasks, user task folders, lm-eval registry names
(offline), and base + candidate + champion scored on one loaded base model."""

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from fineflow.errors import FineflowError
from tests.conftest import TINY_PARAMS, random_adapter

TASKS = ["fineflow_synth", "fineflow_synth_mc"]


def _params(**evaluate):
    from fineflow.core.config import parse_params

    raw = yaml.safe_load(yaml.safe_dump(TINY_PARAMS))
    raw["evaluate"].update(evaluate)
    return parse_params(raw)


def _params_with(overrides: dict):
    from fineflow.core.config import parse_params
    from tests.conftest import write_params

    return parse_params(yaml.safe_load(write_params(Path(tempfile.mkdtemp()) / "params.yaml", overrides).read_text()))


def _scores_by_hand(candidate_right: int, base_right: int, n: int = 40) -> dict:
    """scores.json as evaluate writes it, with per-doc exact matches made up (no lm-eval run)."""

    def entry(right):
        samples = [{"doc_id": i, "target": "t", "prediction": "p", "exact_match": float(i < right)} for i in range(n)]
        return {
            "status": "ok",
            "metrics": {"fineflow_synth": {"exact_match": right / n}},
            "samples": {"fineflow_synth": samples},
        }

    return {
        "tasks": ["fineflow_synth"],
        "eval_rows": "data/validated/eval.jsonl",
        "eval_data_sha256": "e" * 64,
        "base": entry(base_right),
        "candidate": entry(candidate_right),
    }


def _rows(built):
    return [json.loads(line) for line in (built / "data/validated/eval.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def adapter(built, tmp_path_factory):
    """A LoRA adapter with non-zero weights (so it changes the base's scores), saved like train's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(built / "models/base"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("adapter") / "candidate"
    model.save_pretrained(path)
    return path


def _champion(adapter, path, record: dict, corrupt: bool = False):
    shutil.copytree(adapter, path)
    (path / "champion.json").write_text(json.dumps(record))
    if corrupt:
        (path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    return path


def _run(built, adapter, tmp_path, params, champion=None, base_dir=None):
    from fineflow.evaluate.scoring import evaluate_models

    return evaluate_models(
        params,
        base_dir or built / "models/base",
        adapter,
        built / "data/validated/eval.jsonl",
        tmp_path / "eval",
        tmp_path / "lm_eval",
        champion,
    )


def test_mc_choices_hold_the_target_once_among_four(built):
    from fineflow.evaluate.bundled_tasks.choices import add_choices

    rows = _rows(built)
    docs = add_choices(rows)
    assert docs == add_choices(rows)  # seeded by doc index: the same options every run
    larger = {r["output"] for r in rows if r["instruction"] == "Which number is larger?"}
    for row, doc in zip(rows, docs):
        assert len(doc["choices"]) == 4 == len(set(doc["choices"]))
        assert doc["choices"].count(row["output"]) == 1 and doc["choices"][doc["gold"]] == row["output"]
        if row["instruction"] == "Which number is larger?" and len(larger) >= 4:  # same family preferred
            assert set(doc["choices"]) <= larger
    # a task field, when the rows carry one, is the family
    tagged = [{"instruction": "x", "output": str(i), "task": "a" if i < 4 else "b"} for i in range(8)]
    assert all(set(d["choices"]) == {"0", "1", "2", "3"} for d in add_choices(tagged)[:4])


def test_base_candidate_and_champion_on_one_base(built, adapter, tmp_path):
    import hashlib

    champion = _champion(adapter, tmp_path / "champion", {"candidate_id": "abc"})
    report = _run(built, adapter, tmp_path, _params(), champion)
    scores = json.loads((tmp_path / "eval/scores.json").read_text())
    rows = _rows(built)
    assert set(scores) == {
        "tasks",
        "eval_rows",
        "eval_data_sha256",
        "base_digest",
        "base_scored",
        "base",
        "candidate",
        "champion",
    }
    assert scores["tasks"] == TASKS and scores["champion"]["id"] == "abc"
    assert scores["eval_data_sha256"] == hashlib.sha256((built / "data/validated/eval.jsonl").read_bytes()).hexdigest()
    for name in ("base", "candidate", "champion"):
        result = scores[name]
        assert result["status"] == "ok" and set(result["metrics"]) == set(TASKS)
        assert 0 <= result["metrics"]["fineflow_synth"]["exact_match"] <= 1
        assert 0 <= result["metrics"]["fineflow_synth_mc"]["acc"] <= 1
        for task, metric in (("fineflow_synth", "exact_match"), ("fineflow_synth_mc", "acc")):
            samples = result["samples"][task]
            assert [s["doc_id"] for s in samples] == list(range(6))  # evaluate.limit
            assert all(s[metric] in (0, 1) and s["target"] == rows[s["doc_id"]]["output"] for s in samples)
            assert len((tmp_path / f"eval/samples/{name}/{task}.jsonl").read_text().splitlines()) == 6
        assert all(len(s["loglikelihoods"]) == 4 for s in result["samples"]["fineflow_synth_mc"])
        raw = json.loads((tmp_path / f"lm_eval/{name}.json").read_text())
        assert set(raw["results"]) == set(TASKS) and "samples" not in raw
        assert report["models"][name]["status"] == "ok" and report["models"][name]["score_s"] > 0
        assert set(report[name]) == {"fineflow_synth/exact_match", "fineflow_synth_mc/acc"}

    def lls(name):
        return [s["loglikelihoods"] for s in scores[name]["samples"]["fineflow_synth_mc"]]

    # the champion is the candidate's adapter: the same scores, so the two adapters did not stack ...
    assert lls("champion") == lls("candidate")
    # ... and the adapter did change the base model's scores
    assert lls("base") != lls("candidate")
    assert report["eval_s"] >= report["load_s"] + report["score_s"]
    print(
        f"\nevaluate, tiny config, 2 tasks x 6 docs x 3 models: total {report['eval_s']:.2f} s = tasks "
        f"{report['tasks_s']:.2f} + load {report['load_s']:.2f} + score {report['score_s']:.2f}; "
        f"per model {report['models']}"
    )


def test_failing_champion_is_recorded_and_the_stage_goes_on(built, adapter, tmp_path):
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors import SafetensorError

    from fineflow.evaluate.harness import ModelScorer

    champion = _champion(adapter, tmp_path / "champion", {"candidate_id": "bad"}, corrupt=True)
    report = _run(built, adapter, tmp_path, _params(tasks=["fineflow_synth_mc"]), champion)
    scores = json.loads((tmp_path / "eval/scores.json").read_text())
    assert scores["base"]["status"] == scores["candidate"]["status"] == "ok"
    assert scores["champion"]["status"] == "failed"
    assert scores["champion"]["error"].startswith("SafetensorError: Error while deserializing header")
    assert scores["champion"]["id"] == "bad"
    assert report["models"]["champion"]["status"] == "failed" and report["champion"] == {}
    # a half-loaded adapter never stays in the shared base model
    scorer = ModelScorer(str(built / "models/base"), ["fineflow_synth_mc"], None, 8, 6)
    scorer.load_base()
    with pytest.raises(SafetensorError, match="Error while deserializing header"):  # the corrupt file itself
        scorer.score("adapter", champion)
    assert not any(isinstance(module, BaseTunerLayer) for module in scorer.base.modules())


def test_user_task_dir_is_indexed_with_the_bundled_tasks(built, adapter, tmp_path):
    from fineflow.evaluate.harness import BUNDLED_TASKS

    user = tmp_path / "my_tasks"
    user.mkdir()
    text = (BUNDLED_TASKS / "fineflow_synth_mc.yaml").read_text()
    text = text.replace("task: fineflow_synth_mc", "task: my_synth_mc").replace(
        "{eval_file}", str((built / "data/validated/eval.jsonl").resolve())
    )
    (user / "my_synth_mc.yaml").write_text(text)
    for helper in ("choices.py", "prompts.py"):
        shutil.copy(BUNDLED_TASKS / helper, user / helper)
    report = _run(built, adapter, tmp_path, _params(tasks=["my_synth_mc"], task_dirs=[str(user)]))
    assert set(report["candidate"]) == {"my_synth_mc/acc"} and 0 <= report["candidate"]["my_synth_mc/acc"] <= 1


@pytest.fixture
def task_managers(monkeypatch):
    """Every lm-eval TaskManager built, by its include_defaults: True means lm-eval indexed its 200+ built-in
    task folders (~10 s), which local task names must never cost."""
    import lm_eval.tasks

    built_with = []

    class Recording(lm_eval.tasks.TaskManager):
        def __init__(self, *args, include_defaults=True, **kwargs):
            built_with.append(include_defaults)
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Recording)
    return built_with


def test_unknown_task_name_is_a_clear_error_without_indexing_lm_eval(built, tmp_path, task_managers):
    from fineflow.evaluate.harness import prepare_task_dir, resolve_tasks

    task_dir = prepare_task_dir(tmp_path / "tasks", built / "data/validated/eval.jsonl", 8)
    with pytest.raises(FineflowError) as error:
        resolve_tasks(["fineflow_synth", "no_such_task_xyz"], task_dir, [])
    message = str(error.value)
    assert "unknown task(s) ['no_such_task_xyz']" in message
    assert "available locally: ['fineflow_synth', 'fineflow_synth_mc']" in message
    assert task_managers == [False]  # the local index only: a text scan ruled out lm-eval's registry
    with pytest.raises(FineflowError, match=r"evaluate\.task_dirs names folder\(s\) that do not exist: \[.*missing'\]"):
        resolve_tasks(["fineflow_synth"], task_dir, [str(tmp_path / "missing")])


def test_registry_task_offline_says_it_needs_its_dataset_before_any_model_is_loaded(
    built, adapter, tmp_path, monkeypatch, task_managers
):
    from fineflow.evaluate.harness import ModelScorer

    loads = []
    monkeypatch.setattr(ModelScorer, "load_base", lambda self: loads.append(self.base_source) or 0.0)
    with pytest.raises(FineflowError) as error:
        _run(built, adapter, tmp_path, _params(tasks=["fineflow_synth", "arc_easy"]))
    message = str(error.value)
    assert "lm-eval registry task 'arc_easy' needs its dataset" in message and "HF_DATASETS_OFFLINE" in message
    assert "Traceback" not in message and not (tmp_path / "eval/scores.json").exists()
    assert task_managers == [False, True]  # a registry name does need lm-eval's full index ...
    assert loads == []  # ... but the task is built and refused before the base model is loaded


def test_a_failing_candidate_fails_the_stage_and_records_nothing(built, adapter, tmp_path):
    """A recorded failure would be a cached success to DVC: later runs would skip the evaluation. The stage exits 2
    (a user error, with the record the layers above read), writes no scores, and says what to do."""
    from fineflow.core.reports import read_error_record
    from fineflow.stages import evaluate
    from tests.conftest import write_params

    broken = tmp_path / "candidate"
    shutil.copytree(adapter, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    params = write_params(tmp_path / "params.yaml", {"evaluate.tasks": ["fineflow_synth_mc"]})
    report = tmp_path / "reports/evaluate.json"
    argv = ["--params", str(params), "--report", str(report), "--base-dir", str(built / "models/base")]
    argv += ["--adapter", str(broken), "--eval-rows", str(built / "data/validated/eval.jsonl")]
    argv += ["--out", str(tmp_path / "eval"), "--raw-results", str(tmp_path / "lm_eval")]
    assert evaluate.main(argv) == 2
    assert not (tmp_path / "eval/scores.json").exists() and not report.exists()
    message = read_error_record(report)["message"]
    assert "the candidate's evaluation failed" in message and "SafetensorError" in message and str(broken) in message


def _lora_on(base_dir, path, seed: int):
    return random_adapter(base_dir, path, seed, std=0.5, targets=("q_proj",))


def _git_checkout(root):
    root.mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text("fixture\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "fixture"]):
        subprocess.run((git if command[0] != "init" else ["git"]) + command, cwd=root, check=True)
    return root


def test_a_new_base_model_is_judged_against_its_own_base_with_the_old_champion_side_by_side(built, adapter, tmp_path):
    """model.base changed to a base of another shape while the champion is an adapter for the old one: the
    registry knows each champion's base by content, so evaluate scores the old champion as its merged model (its
    own base and tokenizer, never its adapter around the new base) on the same docs; promote.on_base_change
    decides, and the log entry records the switch."""
    from fineflow.base_source import base_digest, base_identity
    from fineflow.registry.champion import promote
    from fineflow.registry.promotion_log import read_log
    from fineflow.stages import base

    root = _git_checkout(tmp_path / "project")
    champion, registry = root / "models/champion", root / "models/registry"
    old_base, new_base = built / "models/base", tmp_path / "new_base"
    base.run(_params_with({"model.hidden_size": 48, "model.intermediate_size": 96}), new_base)
    old_digest, new_digest = (base_digest(base_identity(str(b))) for b in (old_base, new_base))
    assert old_digest != new_digest
    kw = dict(shards_dir=built / "data/shards", root=root, lineage_dir=root / "reports/lineage")

    # the old champion: `adapter` (on the old base), promoted over the old base on hand-written scores
    first = tmp_path / "first_scores.json"
    first.write_text(json.dumps({**_scores_by_hand(30, 5), "base_digest": old_digest}))
    assert promote(_params(), first, adapter, champion, registry, base_dir=old_base, **kw)["decision"] == "promoted"
    assert json.loads((champion / "champion.json").read_text())["base_digest"] == old_digest

    candidate = _lora_on(new_base, tmp_path / "candidate", seed=3)
    report = _run(built, candidate, tmp_path, _params(tasks=["fineflow_synth"]), champion, base_dir=new_base)
    scores = json.loads((tmp_path / "eval/scores.json").read_text())
    assert scores["base_digest"] == new_digest
    assert scores["champion"]["status"] == "ok", scores["champion"]  # not "size mismatch ... PeftModel"
    assert (scores["champion"]["evaluated_as"], scores["champion"]["base_digest"]) == ("merged model", old_digest)
    docs = [[s["doc_id"] for s in scores[m]["samples"]["fineflow_synth"]] for m in ("candidate", "champion")]
    assert docs[0] == docs[1] == list(range(6)) and report["models"]["champion"]["status"] == "ok"

    decisions = {}
    for policy in ("refuse", "compare_to_base"):
        params = _params_with({"evaluate.tasks": ["fineflow_synth"], "promote.on_base_change": policy})
        decisions[policy] = promote(
            params, tmp_path / "eval/scores.json", candidate, champion, registry, base_dir=new_base, **kw
        )
    refused, compared = decisions["refuse"], decisions["compare_to_base"]
    assert refused["decision"] == "refused" and "promote.on_base_change is refuse" in refused["reason"]
    assert compared["reference"] == "base model" and "the base model changed" in compared["reason"]
    assert compared["base_change"] == {"from": old_digest, "to": new_digest, "policy": "compare_to_base"}
    assert compared["vs_old_champion"]["evaluated_as"] == "merged model"
    assert "fineflow_synth/exact_match" in compared["vs_old_champion"]["candidate_vs_champion"]
    logged = read_log(registry)[-1]
    assert logged["context"]["base_change"]["to"] == new_digest and logged["reference_name"] == "base model"


def test_a_changed_eval_set_is_judged_by_the_eval_change_policy_and_reported(built, adapter, tmp_path):
    """The eval rows changed since the champion's promotion (hashes e... then f...): with compare_on_current the
    candidate is judged against the champion re-scored on the new rows in this run (not refused for ever); with
    refuse it is refused; the report and the log say the eval set changed, from what to what."""
    from fineflow.registry.champion import promote
    from fineflow.registry.promotion_log import read_log

    root = _git_checkout(tmp_path / "project")
    champion, registry = root / "models/champion", root / "models/registry"
    kw = dict(base_dir=built / "models/base", shards_dir=built / "data/shards", root=root, lineage_dir=root / "lin")
    first = tmp_path / "first.json"
    first.write_text(json.dumps(_scores_by_hand(20, 5)))
    champion_id = promote(_params(), first, adapter, champion, registry, **kw)["candidate_id"]
    candidate = _lora_on(built / "models/base", tmp_path / "candidate", seed=4)
    rescored = _scores_by_hand(36, 5)
    rescored["eval_data_sha256"] = "f" * 64
    rescored["champion"] = {**_scores_by_hand(20, 5)["candidate"], "id": champion_id}
    second = tmp_path / "second.json"
    second.write_text(json.dumps(rescored))
    for policy, decision in (("refuse", "refused"), ("compare_on_current", "promoted")):
        report = promote(_params_with({"promote.on_eval_change": policy}), second, candidate, champion, registry, **kw)
        assert report["decision"] == decision, report["reason"]
        assert report["eval_change"] == {"from": "e" * 64, "to": "f" * 64, "policy": policy}
        assert read_log(registry)[-1]["context"]["eval_change"]["policy"] == policy
    assert "promote.on_eval_change is refuse" in read_log(registry)[-2]["reason"]


def test_chat_eval_rows_are_prompted_exactly_as_training_rendered_them(built, adapter, tmp_path):
    """The base's tokenizer has a chat template (the embedded one does, as instruct models do) and the rows are
    chat `messages`: training renders them with that template, and so does evaluation (not the fineflow template
    "### Instruction: ...", a format training never used): every evaluated prompt is the training prompt, token
    for token, and a multiple-choice option is scored as the response training saw."""
    from transformers import AutoTokenizer

    from fineflow.evaluate.scoring import evaluate_models
    from fineflow.tokenize.template import chat_template_of, encode_batch

    base = built / "models/base"
    tokenizer = AutoTokenizer.from_pretrained(base)
    assert chat_template_of(tokenizer)
    rows = []
    for row in _rows(built):
        user = row["instruction"] + (f"\n{row['input']}" if row.get("input") else "")
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]
        rows.append({"instruction": user, "input": "", "output": row["output"], "messages": messages})
    eval_rows = tmp_path / "eval.jsonl"
    eval_rows.write_text("".join(json.dumps(r) + "\n" for r in rows))
    evaluate_models(_params(), base, adapter, eval_rows, tmp_path / "eval", tmp_path / "lm_eval")
    for task in ("fineflow_synth", "fineflow_synth_mc"):
        logged = (tmp_path / f"eval/samples/candidate/{task}.jsonl").read_text().splitlines()
        assert len(logged) == 6
        for sample in map(json.loads, logged):
            row = rows[sample["doc_id"]]
            trained = encode_batch(tokenizer, [row])  # what the tokenize stage wrote for this row
            mask = trained.mask.tolist()
            prompt_tokens, response_tokens = trained.ids[: mask.index(1)].tolist(), trained.ids[mask.index(1) :]
            for request in sample["arguments"]:
                context = request[0] if isinstance(request, list) else request["arg_0"]
                assert not context.startswith("### Instruction")
                assert tokenizer.encode(context, add_special_tokens=False) == prompt_tokens
            if task == "fineflow_synth_mc":  # the gold option is scored as the trained response begins
                gold = [r[1] if isinstance(r, list) else r["arg_1"] for r in sample["arguments"]][sample["target"]]
                gold_tokens = tokenizer.encode(gold, add_special_tokens=False)
                assert response_tokens[: len(gold_tokens)].tolist() == gold_tokens


def test_task_dirs_outside_the_folder_dvc_tracks_are_refused_by_the_stage(tmp_path):
    """dvc.yaml declares eval_tasks/ as the evaluate stage's task dependency (DVC takes no list param as deps):
    a task folder elsewhere would let an edited task hand back the old scores. The stage refuses it up front,
    as a user error naming the folder, before any model is loaded."""
    from fineflow.core.reports import read_error_record
    from fineflow.stages import evaluate
    from tests.conftest import write_params

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    params = write_params(tmp_path / "params.yaml", {"evaluate.task_dirs": [str(elsewhere)]})
    report = tmp_path / "reports/evaluate.json"
    argv = ["--params", str(params), "--report", str(report), "--task-root", str(tmp_path / "eval_tasks")]
    argv += ["--base-dir", "models/base", "--adapter", "models/candidate", "--eval-rows", "eval.jsonl", "--out", "eval"]
    assert evaluate.main(argv) == 2
    message = read_error_record(report)["message"]
    assert str(elsewhere) in message and "outside" in message and "dvc.yaml" in message
    evaluate.check_tracked_task_dirs([str(tmp_path / "eval_tasks/mine")], tmp_path / "eval_tasks")  # under it: fine
