"""The evaluate stage on the tiny config: both bundled tasks, user task folders, lm-eval registry names
(offline), and base + candidate + champion scored on one loaded base model."""

import json
import shutil

import pytest
import yaml

from fineflow.errors import FineflowError
from tests.conftest import TINY_PARAMS

TASKS = ["fineflow_synth", "fineflow_synth_mc"]


def _params(**evaluate):
    from fineflow.config import parse_params

    raw = yaml.safe_load(yaml.safe_dump(TINY_PARAMS))
    raw["evaluate"].update(evaluate)
    return parse_params(raw)


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


def _run(built, adapter, tmp_path, params, champion=None):
    from fineflow.stages import evaluate

    return evaluate.run(
        params,
        built / "models/base",
        adapter,
        built / "data/validated/eval.jsonl",
        tmp_path / "eval",
        tmp_path / "lm_eval",
        champion,
    )


def test_mc_choices_hold_the_target_once_among_four(built):
    from fineflow.evaluate.evaltasks.choices import add_choices

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

    champion = _champion(adapter, tmp_path / "champion", {"id": "abc"})
    report = _run(built, adapter, tmp_path, _params(), champion)
    scores = json.loads((tmp_path / "eval/scores.json").read_text())
    rows = _rows(built)
    assert set(scores) == {"tasks", "eval_rows", "eval_data_sha256", "base", "candidate", "champion"}
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

    champion = _champion(adapter, tmp_path / "champion", {"id": "bad"}, corrupt=True)
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
    monkeypatch.setattr(ModelScorer, "load_base", lambda self: loads.append(self.reference) or 0.0)
    with pytest.raises(FineflowError) as error:
        _run(built, adapter, tmp_path, _params(tasks=["fineflow_synth", "arc_easy"]))
    message = str(error.value)
    assert "lm-eval registry task 'arc_easy' needs its dataset" in message and "HF_DATASETS_OFFLINE" in message
    assert "Traceback" not in message and not (tmp_path / "eval/scores.json").exists()
    assert task_managers == [False, True]  # a registry name does need lm-eval's full index ...
    assert loads == []  # ... but the task is built and refused before the base model is loaded
