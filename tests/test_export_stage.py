"""The export stage in the pipeline: what it says when it exports nothing, the promotion it can block
(export.block_promotion), the card and the Prefect artifact it feeds, and what `dvc repro` re-runs around it.

The parity check itself (llama.cpp against transformers) is tests/test_export.py's; here llama.cpp runs only in the
nightly scenario, and the rest runs where llama.cpp's tools are absent (CI's venv) as well as where they are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fineflow.errors import FineflowError
from fineflow.export import tooling
from fineflow.export.parity import Check, verdict
from fineflow.registry.card import card_digest
from tests.conftest import _git_commit, gate_only_project, venv_env
from tests.test_export import _champion, _tiny_params, needs_llama_cpp

MISSING_TOOLS = {"llama_cpp_python": None, "converter_sha256": None, "missing": "llama-cpp-python is not installed"}


def _tools_file(path: Path, record: dict) -> Path:
    path.write_text(json.dumps(record), encoding="utf-8")
    return path


def test_the_export_stage_exports_nothing_and_says_why_or_refuses_when_told_to_export(built, tmp_path):
    from fineflow.stages.export import REPORT_FILE, run

    champion = _champion(built, tmp_path / "models/champion")
    promoted_card = "# c-test\n\n## Evaluation\n\n| metric | value |\n"
    (champion / "README.md").write_text(promoted_card, encoding="utf-8")
    rows, out = built / "data/validated/eval.jsonl", tmp_path / "models/export"
    missing = _tools_file(tmp_path / "tools.json", MISSING_TOOLS)
    cases = {
        "export.enabled is false": _tiny_params(enabled=False),
        "llama-cpp-python is not installed": _tiny_params(enabled="auto"),
    }
    for why, params in cases.items():
        summary = run(params, champion, rows, out, missing)
        assert summary == {"champion": "c-test", "shippable": [], "not_shippable": {}, "skipped": why}
        assert json.loads((out / REPORT_FILE).read_text(encoding="utf-8"))["skipped"] == why
        assert [p.name for p in out.iterdir()] == [REPORT_FILE]  # no card, no file that could be taken for an export
        card = (champion / "README.md").read_text(encoding="utf-8")  # the champion's card says so, once
        assert card == promoted_card + f"\n## Exports\n\nNothing exported: {why}.\n"
        assert card_digest(card) == card_digest(promoted_card)  # what the promotion log binds: unchanged
    with pytest.raises(FineflowError, match="export.enabled is true but llama-cpp-python is not installed"):
        run(_tiny_params(enabled=True), champion, rows, out, missing)
    with pytest.raises(FineflowError, match="cannot read llama.cpp's tools' record .* run the fingerprint stage"):
        run(_tiny_params(enabled="auto"), champion, rows, out, tmp_path / "absent.json")


def test_the_toolchain_record_names_what_is_missing_and_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv(tooling.CONVERTER_ENV, str(tmp_path / "nowhere"))
    record = tooling.toolchain()
    assert record["converter_sha256"] is None and "make export-tools" in record["missing"]
    assert ("converter has not been fetched" in record["missing"]) == (record["llama_cpp_python"] is not None)
    own = tmp_path / "llama.cpp"  # a converter of the user's own (a llama.cpp checkout): named by its script's hash
    own.mkdir()
    (own / tooling.CONVERTER_SCRIPT).write_text("# convert\n", encoding="utf-8")
    monkeypatch.setenv(tooling.CONVERTER_ENV, str(own))
    assert tooling.toolchain()["converter_sha256"] == tooling.sha256_of(own / tooling.CONVERTER_SCRIPT)


def _export(kind: str, nbytes: int, delta: float, gated: bool, failed: str | None = None) -> dict:
    """One export's entry as the stage reports it, with a failed check when given."""
    figures = {"exact_match": 0.7 + delta, "reference_exact_match": 0.7, "same_answer": 0.9, "delta": delta}
    figures |= {"ci": [delta - 0.01, delta + 0.01], "docs": 200, "tolerance": 0.01 if gated else None, "gated": gated}
    checks = [
        Check("token_ids", failed is None, failed, {"texts": 400, "equal": 400 if failed is None else 3}),
        Check("chat_template", True, figures={"conversations": 201, "equal": 402}),
        Check("stop_tokens", True, figures={"training_eos": 2, "gguf_eos": 2}),
        Check("scores", True, figures=figures),
    ]
    return {"file": f"model-{kind}.gguf", "bytes": nbytes, "sha256": "0" * 64, **verdict(kind, checks)}


def _report(exports: dict) -> dict:
    from fineflow.export.serve import serving_choice

    tools = {"llama_cpp_python": "0.3.36", "converter_sha256": "832db0699007f1be"}
    return {"champion": "c-9", "source": "merged", "tools": tools, "eval_docs": 200, "exports": exports} | {
        "serve": serving_choice(exports)
    }


def test_the_card_lists_every_export_with_its_parity_and_serves_the_smallest_gated_shippable_one(tmp_path):
    from fineflow.export.exports_card import export_card

    exports = {
        "f16": _export("f16", 400_000_000, 0.0, True),
        "q8_0": _export("q8_0", 200_000_000, 0.005, True, failed="the GGUF's tokenizer differs on eval text 3"),
        "q6_k": _export("q6_k", 160_000_000, -0.005, True),
        "q4_k_m": _export("q4_k_m", 100_000_000, -0.03, False),
    }
    report = _report(exports)
    assert report["serve"] == "q6_k"  # q8_0 is not shippable; q4_k_m is smaller but its scores were not gated
    card = export_card(report, {"base_model": "models/base", "promotion_seq": 4}, Path("models/export"))
    assert "base_model: models/base" in card and "promotion log entry 4" in card
    assert "| model-q4_k_m.gguf | q4_k_m | 100.0 MB | yes | 0.670 | 0.700 | -0.030 [-0.040, -0.020] | 0.900 | " in card
    assert "reported, not gated |" in card and "| model-q8_0.gguf | q8_0 | 200.0 MB | **no** |" in card
    assert "**model-q8_0.gguf is not shippable:**\n- token_ids: the GGUF's tokenizer differs on eval text 3" in card
    assert "fineflow serve --export-dir models/export --type q6_k" in card
    assert "llama-server -m models/export/model-q6_k.gguf --jinja" in card
    assert "| model-q8_0.gguf | 3/400 | 402/402 | 2, 2 |" in card
    nothing = _report({"q4_k_m": exports["q4_k_m"]})
    assert nothing["serve"] is None
    assert "`fineflow serve` refuses by default" in export_card(nothing, {}, Path("models/export"))


def test_the_promotion_artifact_after_export_lists_the_exports_or_why_there_are_none(tmp_path):
    from tasks.artifacts import exports_markdown

    folder = tmp_path / "models/export"
    folder.mkdir(parents=True)
    exports = {"f16": _export("f16", 4, 0.0, True), "q8_0": _export("q8_0", 2, 0.0, True, failed="ids differ")}
    (folder / "export.json").write_text(json.dumps(_report(exports)), encoding="utf-8")
    markdown = exports_markdown(tmp_path)
    assert "| model-f16.gguf | yes | 0.700 | +0.000 [-0.010, +0.010] |  |" in markdown
    assert "| model-q8_0.gguf | **no** |" in markdown and "token\\_ids: ids differ |" in markdown
    assert "| served by default | f16 |" in markdown
    (folder / "export.json").write_text(json.dumps({"exports": {}, "skipped": "export.enabled is false"}))
    assert exports_markdown(tmp_path).endswith("Nothing exported: export.enabled is false")


# ---------------------------------------------------------------- export.block_promotion, through promote itself


def _parity_report(passed: bool):
    """What fineflow.export.gguf.export_model returns for a staged champion: f16 passes, q8_0 as asked."""
    q8 = _export("q8_0", 2, 0.0, True, failed=None if passed else "the GGUF's tokenizer differs on eval text 0")
    return lambda model_dir, *args, **kwargs: {
        "eval_docs": 16,
        "exports": {"f16": _export("f16", 4, 0, True), **{"q8_0": q8}},
    }


def _promote(project: Path, params, eval_rows: Path | None) -> dict:
    """The promote stage's library call on a gate_only_project, as the stage makes it."""
    from fineflow.export.gguf import parity_before_promotion
    from fineflow.registry.champion import promote

    return promote(
        params,
        project / "eval/scores.json",
        project / "models/candidate",
        project / "models/champion",
        project / "models/registry",
        project / "models/base",
        shards_dir=project / "data/shards",
        root=project,
        log=lambda line: None,
        eval_rows=eval_rows,
        parity_check=parity_before_promotion,
    )


@pytest.mark.parametrize("passed", [True, False], ids=["parity-passes", "parity-fails"])
def test_with_block_promotion_a_failed_parity_check_refuses_the_candidate_and_the_log_says_why(
    built, tmp_path, monkeypatch, passed
):
    import fineflow.export.gguf as gguf
    from fineflow.registry.install import read_champion
    from fineflow.registry.promotion_log import read_log

    project = gate_only_project(built, tmp_path / "project")
    checked = {}

    def export_model(model_dir, eval_rows, out_dir, work_dir, params, log=print, llama_log=None):
        checked.update(model=model_dir, quantized=list(params.export.quantized), llama_log=llama_log)
        return _parity_report(passed)(model_dir)

    monkeypatch.setattr(gguf, "export_model", export_model)
    params = _tiny_params(block_promotion=True, quantized=["q8_0", "q4_k_m"])
    report = _promote(project, params, project / "data/validated/eval.jsonl")
    # the staged champion's merged model, on the float type and the gated types only (q4_k_m has no tolerance)
    assert checked["model"].name == "merged" and checked["quantized"] == ["q8_0"]
    assert checked["llama_log"] == project / "models/promote_parity.llama_cpp.log"  # llama.cpp's, kept after the check
    entry = read_log(project / "models/registry")[-1]
    assert entry["export_parity"]["passed"] is passed
    assert entry["export_parity"]["exports"]["f16"] == {
        "shippable": True,
        "reasons": [],
        "exact_match": 0.7,
        "delta": 0,
        "ci": [-0.01, 0.01],
        "gated": True,
    }
    record = json.loads(next((project / "models/registry/candidates").glob("*/record.json")).read_text())
    if passed:
        assert report["decision"] == entry["decision"] == record["decision"] == "promoted"
        card = (project / "models/champion/README.md").read_text(encoding="utf-8")
        assert "## Export parity (checked before promotion)" in card and "| q8_0 | 0.700 |" in card
        return
    reason = (
        "export parity failed (export.block_promotion): q8_0: token_ids: the GGUF's tokenizer differs on eval text 0"
    )
    assert report["decision"] == entry["decision"] == record["decision"] == "refused"
    assert report["reason"] == entry["reason"] == record["reason"] == reason
    assert read_champion(project / "models/champion") is None  # nothing installed: the champion stays as it was
    assert not list(project.glob("models/.champion.staging*")) and not list(project.glob("models/.parity-*"))


def test_block_promotion_without_the_eval_rows_is_a_clear_error(built, tmp_path):
    project = gate_only_project(built, tmp_path / "project")
    with pytest.raises(FineflowError, match="block_promotion: the parity check needs the eval rows; pass --eval-rows"):
        _promote(project, _tiny_params(block_promotion=True), None)


# ---------------------------------------------------------------- through `dvc repro`


def _promote_and_export_project(built: Path, path: Path, overrides: dict) -> Path:
    """gate_only_project with the export stage after promote, and the tools' record the fingerprint stage writes."""
    project = gate_only_project(built, path, overrides)
    full = yaml.safe_load((Path(__file__).resolve().parent.parent / "dvc.yaml").read_text(encoding="utf-8"))
    pipeline = yaml.safe_load((project / "dvc.yaml").read_text(encoding="utf-8"))
    pipeline["stages"]["export"] = full["stages"]["export"]
    (project / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False), encoding="utf-8")
    _tools_file(project / "models/export_tools.json", tooling.toolchain())
    _git_commit(project, "promote and export")
    return project


def _repro(project: Path, env: dict | None = None) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "repro"], cwd=project, env=env or venv_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line.split("'")[1] for line in done.stdout.splitlines() if line.startswith("Running stage")]


def _set_param(project: Path, dotted: str, value) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text(encoding="utf-8"))
    *parents, leaf = dotted.split(".")
    node = params
    for key in parents:
        node = node[key]
    node[leaf] = value
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")


@pytest.mark.scenario  # four `dvc repro` of promote and export (no training, no llama.cpp): ~40 s on 2 cores
def test_dvc_repro_re_runs_the_export_exactly_when_the_champion_export_params_or_tools_change(built, tmp_path):
    project = _promote_and_export_project(built, tmp_path / "project", {"export.enabled": "auto"})
    tools = project / "models/export_tools.json"
    _tools_file(tools, MISSING_TOOLS)  # what the fingerprint stage writes where `make export-tools` never ran
    assert _repro(project) == ["promote", "export"]
    report = json.loads((project / "models/export/export.json").read_text(encoding="utf-8"))
    assert report["champion"] and report["skipped"] == "llama-cpp-python is not installed"
    assert _repro(project) == []  # nothing changed: no re-export
    _set_param(project, "export.quantized", ["q8_0"])
    assert _repro(project) == ["export"]  # an export param: the export alone, never a second promotion
    _tools_file(tools, {**MISSING_TOOLS, "missing": "llama.cpp's converter has not been fetched"})
    assert _repro(project) == ["export"]  # other tools (here: half installed): exported again
    assert json.loads((project / "models/export/export.json").read_text())["skipped"].startswith("llama.cpp's")


@pytest.mark.nightly  # promote, then llama.cpp converts, quantizes and scores the champion twice: ~2 min
@needs_llama_cpp
def test_dvc_repro_exports_a_shippable_champion_and_block_promotion_promotes_only_after_parity(built, tmp_path):
    overrides = {"export.enabled": True, "export.quantized": ["q8_0", "q4_k_m"], "promote.bootstrap_samples": 500}
    project = _promote_and_export_project(built, tmp_path / "project", overrides)
    assert _repro(project) == ["promote", "export"]
    export = project / "models/export"
    report = json.loads((export / "export.json").read_text(encoding="utf-8"))
    assert {kind: e["shippable"] for kind, e in report["exports"].items()} == {
        "f16": True,
        "q8_0": True,
        "q4_k_m": True,
    }
    assert report["serve"] == "q8_0" and report["exports"]["q4_k_m"]["checks"]["scores"]["figures"]["gated"] is False
    card = (export / "README.md").read_text(encoding="utf-8")
    assert all(f"| model-{kind}.gguf | {kind} |" in card for kind in ("f16", "q8_0", "q4_k_m"))
    assert "fineflow serve --export-dir models/export --type q8_0" in card
    assert "llama_model_loader: - kv" in (export / "llama_cpp.log").read_text(encoding="utf-8")  # .dvcignore'd
    champion_card = (project / "models/champion/README.md").read_text(encoding="utf-8")
    assert champion_card.count("\n## Exports\n") == 1 and "| model-q8_0.gguf | q8_0 |" in champion_card
    verify = [sys.executable, "-m", "fineflow.cli", "registry", "verify"]  # the card's new section is not tampering
    done = subprocess.run(verify, cwd=project, env=venv_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _repro(project) == []

    blocked = _promote_and_export_project(built, tmp_path / "blocked", {**overrides, "export.block_promotion": True})
    assert _repro(blocked) == ["promote", "export"]
    entry = [json.loads(line) for line in (blocked / "models/registry/promotions.jsonl").read_text().splitlines()][-1]
    assert entry["decision"] == "promoted" and entry["export_parity"]["passed"] is True
    assert sorted(entry["export_parity"]["exports"]) == ["f16", "q8_0"]  # the float and the gated types
    assert "## Export parity (checked before promotion)" in (blocked / "models/champion/README.md").read_text()
    assert "llama_model_loader: - kv" in (blocked / "models/promote_parity.llama_cpp.log").read_text(encoding="utf-8")
    print(json.dumps({k: e["checks"]["scores"]["figures"] for k, e in report["exports"].items()}))


def test_after_the_export_stage_the_promotion_artifact_is_published_again_with_the_exports(tmp_path, monkeypatch):
    import tasks.artifacts as artifacts

    published = {}
    monkeypatch.setattr(artifacts, "create_table_artifact", lambda **kwargs: None)
    monkeypatch.setattr(
        artifacts, "create_markdown_artifact", lambda key, markdown, **_: published.update({key: markdown})
    )
    (tmp_path / "reports").mkdir()
    promote = {"decision": "promoted", "reason": "beats the base", "candidate_id": "c-9"}
    (tmp_path / "reports/promote.json").write_text(json.dumps(promote), encoding="utf-8")
    (tmp_path / "models/export").mkdir(parents=True)
    exports = {"f16": _export("f16", 4, 0.0, True)}
    (tmp_path / "models/export/export.json").write_text(json.dumps(_report(exports)), encoding="utf-8")
    artifacts.publish_report("export", tmp_path, {"champion": "c-9", "shippable": ["f16"]}, ran=True)
    assert published["fineflow-promotion"].startswith("### Promotion: **promoted**")
    assert (
        "#### Exports" in published["fineflow-promotion"]
        and "| model-f16.gguf | yes |" in published["fineflow-promotion"]
    )
    published.clear()
    artifacts.publish_report("export", tmp_path, {"champion": "c-9"}, ran=False)  # skipped by DVC: nothing new
    assert published == {}


def test_make_run_ends_by_saying_what_was_exported_or_why_nothing_was(capsys):
    from flows.pipeline import print_summary

    shipped = {"champion": "c-9", "shippable": ["f16", "q4_k_m", "q8_0"], "serve": "q8_0"}
    print_summary({"export": {"ran": True, "report": shipped}})
    assert "export: shippable f16, q4_k_m, q8_0; served: q8_0" in capsys.readouterr().out
    print_summary({"export": {"ran": True, "report": {"skipped": "export.enabled is false", "shippable": []}}})
    assert "export: nothing exported (export.enabled is false)" in capsys.readouterr().out
