"""Each stage's real code on the tiny config: the files it promises exist and its report has its figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import ROOT, run_dirs, venv_env, write_params


def test_base_is_a_loadable_hf_model_dir(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(built / "models/base")
    tokenizer = AutoTokenizer.from_pretrained(built / "models/base")
    assert model.config.model_type == "llama" and tokenizer.eos_token == "</s>"
    assert tokenizer.decode(tokenizer.encode("Paris 2024-03-05")) == "Paris 2024-03-05"


def test_data_is_deterministic_and_has_bad_rows(built, tiny_params, tmp_path):
    from fineflow.stages import data

    report = data.run(tiny_params, tmp_path / "train.jsonl", tmp_path / "eval.jsonl")
    assert (tmp_path / "train.jsonl").read_bytes() == (built / "data/raw/train.jsonl").read_bytes()
    assert report["bad_rows_injected"] >= 5 and report["eval_rows"] == 16
    eval_rows = set((tmp_path / "eval.jsonl").read_text().splitlines())
    raw_train = (tmp_path / "train.jsonl").read_text().splitlines()
    assert sum(line in eval_rows for line in raw_train) == 1  # the one deliberately leaked row
    validated = (built / "data/validated/train.jsonl").read_text().splitlines()
    assert not set(validated) & eval_rows  # ...which validation removed


def test_validate_catches_every_injected_bad_row(built):
    from fineflow.data.synth import BAD_KINDS

    report = json.loads((built / "reports/validate.json").read_text())
    kept = (built / "data/validated/train.jsonl").read_text().splitlines()
    quarantined = [json.loads(x) for x in (built / "data/validated/quarantine.jsonl").read_text().splitlines()]
    raw = (built / "data/raw/train.jsonl").read_text().splitlines()
    assert report["rows_in"] == len(raw) == len(kept) + len(quarantined) and report["passed"]
    assert all(q["reasons"] for q in quarantined)
    # one bad row of each kind: all quarantined except the near-duplicate, which is kept with a warning
    assert len(raw) - 160 == len(BAD_KINDS) and len(quarantined) == len(BAD_KINDS) - 1
    assert report["rows_warned"] == 1 and len(kept) == 161
    failed = {name for name, check in report["checks"].items() if check["failed_rows"]}
    assert {
        "no_pii(text)",
        "no_leakage(eval)",
        "unique(row)",
        "near_unique(normalized)",
        "non_empty(output)",
        "length_chars(text)",
        "not_null(output)",
    } <= failed


def test_validate_renders_data_docs_of_the_suite(built):
    docs = built / "reports/data_docs"
    assert (docs / "train/index.html").exists() and (docs / "eval/index.html").exists()
    [page] = (docs / "train/validations").rglob("*.html")
    html = page.read_text()
    for column in ("pii_kinds", "eval_overlap", "near_duplicate_of", "output"):  # the suite's checks are on the page
        assert column in html


def test_tokenize_writes_memmap_shards_with_meta(built):
    meta = json.loads((built / "data/shards/train/meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["examples"] == 161 and meta["truncated_examples"] == 0
    assert meta["tokenizer_hash"] and meta["template_hash"] and 0.5 < meta["real_token_share"] <= 1
    for name in ("tokens.bin", "loss_mask.bin", "positions.bin", "examples.idx"):
        assert (built / "data/shards/train" / name).stat().st_size > 0


@pytest.fixture(scope="module")
def trained(built, tmp_path_factory):
    """One in-process, single-rank training run (the worker a launched rank runs), reading the shared base
    model and shards and writing into a folder of its own. Returns (built, that folder, the report)."""
    from accelerate.state import AcceleratorState

    from fineflow.core.config import parse_params
    from fineflow.train import procedure
    from tests.conftest import TINY_PARAMS

    out = tmp_path_factory.mktemp("trained")
    AcceleratorState._reset_state(reset_partial_state=True)  # a launched rank is a fresh process; here, reset
    try:
        report = procedure.train_rank(
            parse_params(TINY_PARAMS),
            built / "data/shards",
            built / "models/base",
            out / "checkpoints",
            out / "models/candidate",
            out / "reports/train_steps.jsonl",
            out / "logs",
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return built, out, report


def test_train_writes_adapter_checkpoints_and_step_log(trained):
    built, out, report = trained
    assert report["steps"] == 4 and report["world_size"] == 1 and report["tokens_per_s"] > 0
    for key in ("final_loss", "data_wait_s", "compute_s", "optimizer_s", "checkpoint_s", "eval_loss"):
        assert key in report
    adapter = load_file(out / "models/candidate/adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)  # the adapter only, never the frozen base
    config = json.loads((out / "models/candidate/adapter_config.json").read_text())
    # byte-stable across processes (peft writes a set), and no absolute path of this checkout
    assert config["target_modules"] == sorted(config["target_modules"])
    assert config["base_model_name_or_path"] == str(built / "models/base")  # as passed in, not resolved
    [run_dir] = run_dirs(out / "checkpoints")  # one directory per training configuration
    # keep_last 2, and the run marked finished: a later run of the same inputs trains again, never resumes it
    # tracker_run.txt: the TensorBoard run its attempts log to (logs/fineflow/<that name>)
    assert sorted(p.name for p in run_dir.iterdir()) == ["FINISHED", "step-0000002", "step-0000004", "tracker_run.txt"]
    assert report["resumed_from_step"] == 0 and report["checkpoint_write_s"] is not None
    steps = [json.loads(x) for x in (out / "reports/train_steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and all("data_wait_s" in s for s in steps)
    assert all(s["peak_mem_mb"] > 0 and s["tokens_per_s"] > 0 for s in steps)
    assert report["plan"]["gib"]["total"] > 0 and report["plan"]["changes"] == []  # sized before training
    # accelerate's TensorBoard tracker wrote an event file with the step metrics
    assert list((out / "logs").rglob("events.out.tfevents.*"))


def test_evaluate_then_promote(trained, tiny_params, tmp_path):
    from fineflow.evaluate.scoring import evaluate_models
    from fineflow.registry.champion import promote

    built, out, _ = trained
    candidate = out / "models/candidate"  # read only: the outputs below go to this test's own tmp_path
    report = evaluate_models(
        tiny_params,
        built / "models/base",
        candidate,
        built / "data/validated/eval.jsonl",
        tmp_path / "eval",
        tmp_path / "reports/lm_eval",
    )
    assert set(report["base"]) == {"fineflow_synth/exact_match", "fineflow_synth_mc/acc"} == set(report["candidate"])
    scores = json.loads((tmp_path / "eval/scores.json").read_text())
    assert len(scores["candidate"]["samples"]["fineflow_synth"]) == 6  # evaluate.limit
    # the shards and a git checkout complete the lineage, so the gate gets to compare the evaluations
    decision = promote(
        tiny_params,
        tmp_path / "eval/scores.json",
        candidate,
        tmp_path / "models/champion",
        tmp_path / "models/registry",
        shards_dir=built / "data/shards",
        root=ROOT,
    )
    # 4 LoRA steps on a tiny random model, 6 docs: no gain the paired bootstrap's CI could put above 0
    assert decision["decision"] == "refused" and decision["reference"] == "base model", decision
    assert decision["candidate_value"] is not None and decision["reference_value"] is not None
    log = (tmp_path / "models/registry/promotions.jsonl").read_text().splitlines()
    assert len(log) == 1 and json.loads(log[0])["decision"] == "refused"
    assert json.loads((tmp_path / "models/champion/champion.json").read_text()) == {"candidate_id": None}


def _run_stage_cli(module, args, cwd):
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=venv_env(), capture_output=True, text=True
    )


@pytest.mark.slow
def test_stage_cli_reports_bad_params_without_traceback(tmp_path):
    write_params(tmp_path / "params.yaml", {"train.lr": -1, "train.colour": "red"})
    result = _run_stage_cli("fineflow.stages.data", ["--train", "t.jsonl", "--eval", "e.jsonl"], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "params.yaml: train.lr must be > 0 (got -1)" in result.stderr
    assert "params.yaml: train.colour is not a known key" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "content, expected",
    [
        (b"", "the file is empty"),
        (b'{"instruction": "a", "output": "b"}\n{"instruction": "a",\n', "raw/train.jsonl:2: malformed JSON"),
        (b'{"instruction": "a", "answer": "b"}\n', 'required field "output" is missing from every row'),
    ],
)
def test_validate_cli_bad_input_gives_one_clear_error(tmp_path, content, expected):
    write_params(tmp_path / "params.yaml", {"validate.max_bad_share": 0.1})
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw/train.jsonl").write_bytes(content)
    (tmp_path / "raw/eval.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    result = _run_stage_cli(
        "fineflow.stages.validate",
        ["--train", "raw/train.jsonl", "--eval", "raw/eval.jsonl", "--out", "validated"],
        tmp_path,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert expected in result.stderr


def test_a_user_error_leaves_a_record_that_the_next_run_of_the_stage_removes(tmp_path, monkeypatch):
    import argparse

    from fineflow.core.entry import run_entry
    from fineflow.core.reports import read_error_record
    from fineflow.errors import DataError

    monkeypatch.delenv("FINEFLOW_TRAIN_WORKER", raising=False)
    args = argparse.Namespace(params=str(write_params(tmp_path / "params.yaml")), report=str(tmp_path / "r/x.json"))

    def bad(params):
        raise DataError("raw/train.jsonl:3: no output field")

    assert run_entry("x", args, bad) == 2
    assert read_error_record(args.report) == {
        "stage": "x",
        "kind": "user_error",
        "message": "raw/train.jsonl:3: no output field",
    }
    assert run_entry("x", args, lambda params: {}) == 0
    assert read_error_record(args.report) is None and (tmp_path / "r/x.json").exists()
    # a crash (anything but a user error) propagates: a traceback and exit 1, no record, so it is retried
    with pytest.raises(ZeroDivisionError):
        run_entry("x", args, lambda params: 1 / 0)
    assert read_error_record(args.report) is None


@pytest.mark.parametrize(
    "base, problem",
    [
        ("./my-modle", "is not a directory"),
        ("some-org/never-downloaded-model", "is not in the Hugging Face cache"),
    ],
)
def test_a_base_that_is_not_there_is_a_user_error_before_anything_loads(tmp_path, monkeypatch, capsys, base, problem):
    from fineflow.core.reports import read_error_record
    from fineflow.stages import base as base_stage

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_params(tmp_path / "params.yaml", {"model.base": base})
    assert base_stage.main(["--out", "models/base"]) == 2
    assert problem in capsys.readouterr().err and "model.base" in read_error_record("reports/base.json")["message"]
    assert not (tmp_path / "models/base").exists()


def _hub_snapshot(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A Hugging Face cache entry for repo_id as huggingface_hub lays it out (refs/main -> snapshots/<commit>)."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs/main").write_text("c" * 40)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return snapshot


def test_a_hub_id_cached_only_in_part_is_refused_offline_naming_the_id_the_cache_and_how_to_fetch_it(
    tmp_path, monkeypatch, capsys
):
    """With model.base a hub id and the hub offline, a cached snapshot folder without its config.json (a download
    cut short) is refused by the base stage, naming the id, the cache and how to fetch it, rather than taken as
    the base for a later stage to crash on in transformers."""
    from fineflow.stages import base as base_stage

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    _hub_snapshot(tmp_path / "hf/hub", "Qwen/Qwen2.5-0.5B", {"README.md": b"# partial\n"})
    write_params(tmp_path / "params.yaml", {"model.base": "Qwen/Qwen2.5-0.5B"})
    assert base_stage.main(["--out", "models/base"]) == 2
    err = capsys.readouterr().err
    assert "'Qwen/Qwen2.5-0.5B' is not in the Hugging Face cache" in err and str(tmp_path / "hf/hub") in err
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B" in err and "unset HF_HUB_OFFLINE" in err
    assert "Traceback" not in err and not (tmp_path / "models/base").exists()


def test_a_hub_id_in_the_users_cache_is_used_offline_and_online_one_not_cached_is_downloaded(tmp_path, monkeypatch):
    """The decision, without a network: a cached snapshot is used as it is (offline or not); an uncached hub id
    is downloaded once by the base stage when the hub is online, refused when it is offline; a local dir is a
    dir. The cache is the user's (HF_HOME, or HF_HUB_CACHE when set)."""
    from fineflow.base_source import base_source, hub_cache_dir
    from fineflow.errors import FineflowError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert hub_cache_dir() == tmp_path / "home/hub"
    _hub_snapshot(tmp_path / "home/hub", "org/cached", {"config.json": b"{}"})
    (tmp_path / "local-model").mkdir()
    for offline in ("1", "0"):
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        assert base_source("org/cached") == "cache" and base_source("local-model") == "dir"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert base_source("org/not-cached") == "download"
    monkeypatch.setenv("HF_HUB_OFFLINE", "true")
    with pytest.raises(FineflowError, match="is not in the Hugging Face cache"):
        base_source("org/not-cached")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere"


def test_fineflow_puts_the_hub_offline_only_where_nothing_needs_it(tmp_path, monkeypatch):
    """The embedded default and a local base run with the hub offline and a project cache; with a hub id the
    user's own HF settings and cache apply (an air-gapped cluster sets HF_HUB_OFFLINE=1 itself), so a hub model
    works through the README's commands; a value the caller set always wins."""
    from fineflow.core.runtime import HUB_VARIABLES, apply_offline_environment, params_model_base, process_environment

    (tmp_path / "models/mine").mkdir(parents=True)
    for base in ("embedded", "models/mine", "/abs/model", None):
        env = process_environment(tmp_path, base)
        assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == str(tmp_path.resolve() / ".cache/huggingface")
    hub = process_environment(tmp_path, "Qwen/Qwen2.5-0.5B")
    assert not set(HUB_VARIABLES) & set(hub) and hub["DO_NOT_TRACK"] == "1"

    write_params(tmp_path / "params.yaml", {"model.base": "Qwen/Qwen2.5-0.5B"})
    assert params_model_base(tmp_path) == "Qwen/Qwen2.5-0.5B" and params_model_base(tmp_path / "none") is None
    for name in HUB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", "/home/me/.cache/huggingface")
    apply_offline_environment(tmp_path)  # model.base from the project's params.yaml: a hub id
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["HF_HOME"] == "/home/me/.cache/huggingface"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    apply_offline_environment(tmp_path, model_base="embedded")
    assert os.environ["HF_HUB_OFFLINE"] == "0" and os.environ["HF_DATASETS_OFFLINE"] == "1"  # the caller's wins


def test_a_stage_writes_the_few_figures_worth_diffing_beside_its_full_report(tmp_path, monkeypatch):
    """Each stage writes its few curated figures to reports/metrics/<stage>.json, what dvc.yaml declares as
    metrics, so `dvc metrics show` stays readable (not every nested field of every report: GX expectation names,
    planner byte counts, the decision's sentence); the full report is unchanged beside it."""
    import argparse

    import yaml

    from fineflow.core.entry import run_entry

    monkeypatch.delenv("FINEFLOW_TRAIN_WORKER", raising=False)
    args = argparse.Namespace(
        params=str(write_params(tmp_path / "params.yaml")), report=str(tmp_path / "r/promote.json")
    )
    report = {"decision": "promoted", "reason": "a sentence", "delta": 0.4, "ci_low": 0.3, "ci_high": 0.5}
    report |= {"p_value": 0.0, "candidate_value": 0.5, "reference_value": 0.1, "lineage": "reports/lineage/x.json"}
    assert run_entry("promote", args, lambda params: dict(report)) == 0
    metrics = json.loads((tmp_path / "r/metrics/promote.json").read_text())
    assert metrics == {
        k: report[k]
        for k in ("decision", "delta", "ci_low", "ci_high", "p_value", "candidate_value", "reference_value")
    }
    assert json.loads((tmp_path / "r/promote.json").read_text())["reason"] == "a sentence"  # the full report
    args.report = str(tmp_path / "r/evaluate.json")
    scores = {"base": {"t/em": 0.1}, "candidate": {"t/em": 0.4}, "models": {"base": {"load_s": 3.0}}}
    assert run_entry("evaluate", args, lambda params: dict(scores)) == 0
    assert json.loads((tmp_path / "r/metrics/evaluate.json").read_text()) == {"candidate": {"t/em": 0.4}}
    declared = yaml.safe_load((ROOT / "dvc.yaml").read_text())["metrics"]
    assert declared and all(path.startswith("reports/metrics/") for path in declared)


@pytest.mark.slow
def test_dvc_repro_refuses_missing_input_paths_at_its_first_stage_before_pretraining(tmp_path):
    """params.yaml names input files that are not there: the first stage `dvc repro` runs (base) refuses at
    once, exit 2, naming every key and path, instead of pretraining the base and leaving it to DVC to fail at
    validate with a bare "No such file or directory"."""
    from tests.conftest import copy_project

    missing = {"data.train_path": "mine/train.jsonl", "evaluate.task_dirs": ["eval_tasks/mine"]}
    project = copy_project(tmp_path / "project", missing)
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "repro"], cwd=project, env=venv_env(), capture_output=True, text=True
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "failed to reproduce 'base'" in output and "exited with 2" in output, output
    assert "Traceback" not in output and "No such file or directory" not in output, output
    assert "data.train_path: no such file: 'mine/train.jsonl'" in output, output
    assert "evaluate.task_dirs: no such folder: 'eval_tasks/mine'" in output, output
    assert not (project / "models/base").exists()  # the base was not pretrained
    record = json.loads((project / "reports/base.error.json").read_text())
    assert record["kind"] == "user_error" and "data.train_path" in record["message"]
