"""data.sources: several datasets, each validated on its own, mixed by weight in seed (issue 34, part 3).

The example mixture (data/examples/mix: a JSONL file, a folder of Parquet shards, a `datasets` save_to_disk
folder) through the validate stage's run(); a hub dataset from an HF cache built here (never the network);
the errors for bad input; the mix's determinism; the lineage's list of sources; and one scenario: `dvc repro`
twice on a tiny project, the second after a weight change and a new source, validates only the new source.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fineflow.core.config import parse_params
from fineflow.errors import ConfigError, DataError, FineflowError
from fineflow.stages import validate
from tests.conftest import ROOT, TINY_PARAMS, copy_project, venv_env

EXAMPLES = ROOT / "data/examples/mix"
QA = {"instruction": "question", "input": None, "output": "answer"}
PC = {"instruction": "prompt", "input": None, "output": "completion"}


def example_sources(root: Path = ROOT) -> list[dict]:
    """The README's three-source mixture, with paths under root."""
    mix = root / "data/examples/mix"
    return [
        {"path": str(mix / "units.jsonl"), "weight": 1.0},
        {"path": str(mix / "arithmetic"), "weight": 0.5, "mapping": QA},
        {"path": str(mix / "capitals_saved"), "n": 45, "mapping": PC},
    ]


def params_with(sources: list[dict] | None, **data):
    raw = yaml.safe_load(yaml.safe_dump(TINY_PARAMS))
    raw["data"].update(sources=sources, **data)
    return parse_params(raw)


def run_validate(built: Path, tmp: Path, sources: list[dict], base: bool = True) -> dict:
    return validate.run(
        params_with(sources),
        built / "data/raw/train.jsonl",
        built / "data/raw/eval.jsonl",
        tmp / "validated",
        tmp / "validate.json",
        None,
        built / "models/base" if base else None,
        tmp / "source_cache",
        tmp / "hashes",
    )


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_three_sources_are_validated_apart_and_mixed_by_weight(built, tmp_path):
    report = run_validate(built, tmp_path, example_sources())
    sections = report["sources"]
    assert [s["kind"] for s in sections] == ["file", "shards", "saved"]
    assert [s["report"]["rows_in"] for s in sections] == [40, 60, 30]
    assert [s["rows_mixed"] for s in sections] == [s["report"]["rows_kept"] for s in sections[:1]] + [
        round(0.5 * sections[1]["report"]["rows_kept"]),
        45,
    ]
    assert report["validated_sources"] == [0, 1, 2] and report["reused_sources"] == []
    train = [json.loads(line) for line in lines(tmp_path / "validated/train.jsonl")]
    assert len(train) == report["rows_mixed"] == sum(s["rows_mixed"] for s in sections)
    capitals = [r for r in train if "capital" in r["instruction"]]
    assert len(capitals) == 45 and len({json.dumps(r) for r in capitals}) == 30  # n > kept: every row, then a sample
    assert {"instruction", "input", "output"} <= set(train[0])
    listing = json.loads((tmp_path / "validated/sources.json").read_text())["sources"]
    assert [(s["path"], s["rows_kept"], s.get("weight"), s.get("n")) for s in listing] == [
        (s["path"], s["report"]["rows_kept"], s.get("weight"), s.get("n")) for s in sections
    ]
    assert all(len(s["content_sha256"]) == 64 for s in listing)


def test_a_weight_change_remixes_without_validating_and_a_new_source_alone_is_validated(built, tmp_path):
    first = run_validate(built, tmp_path, example_sources())
    before = lines(tmp_path / "validated/train.jsonl")
    again = run_validate(built, tmp_path, example_sources())
    assert again["validated_sources"] == [] and again["reused_sources"] == [0, 1, 2]
    assert lines(tmp_path / "validated/train.jsonl") == before  # deterministic in seed
    assert [{**s, "validated": True} for s in again["sources"]] == first["sources"]  # the same reports, read back
    changed = example_sources()
    changed[1]["weight"] = 1.0
    extra = write_words(tmp_path / "extra.jsonl")
    third = run_validate(built, tmp_path, changed + [{"path": str(extra)}])
    assert third["validated_sources"] == [3] and third["reused_sources"] == [0, 1, 2]
    mixed = [json.loads(line) for line in lines(tmp_path / "validated/train.jsonl")]
    units = lambda rows: [r for r in rows if r["instruction"].startswith("Convert")]  # noqa: E731
    # another source's weight, or a new source, does not change which rows this one gives (in its order)
    assert units(mixed) == units([json.loads(line) for line in before])
    assert sum("plus" in r["instruction"] for r in mixed) == third["sources"][1]["report"]["rows_kept"]
    assert len(list((tmp_path / "source_cache").iterdir())) == 4  # the cache holds what the sources use


WORDS = ["lantern", "meadow", "harbour", "pebble", "thistle", "canyon", "orchard", "glacier", "ember", "violet"]


def write_words(path: Path) -> Path:
    """A fourth source: ten word-reversal rows."""
    rows = [{"instruction": f"Spell {w} backwards.", "output": w[::-1]} for w in WORDS]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_each_source_has_its_own_quarantine_and_a_blocked_source_is_named(built, tmp_path):
    bad = tmp_path / "bad.jsonl"
    rows = [json.loads(line) for line in lines(write_words(bad))]
    rows[3] = {"instruction": "Mail bob@corp.example.com now", "output": "done"}  # PII: quarantined
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    with pytest.raises(DataError) as caught:
        run_validate(built, tmp_path, example_sources()[:1] + [{"path": str(bad)}], base=False)
    message = str(caught.value)
    assert f"data.sources[1] ({bad})" in message and "validate.max_bad_share" in message
    assert "data.sources[0]" not in message
    report = json.loads((tmp_path / "validate.json").read_text())
    assert report["passed"] is False and report["sources"][1]["report"]["rows_quarantined"] == 2
    quarantine = [json.loads(line) for line in lines(tmp_path / "validated/quarantine.jsonl")]
    from_bad = [q for q in quarantine if q.get("source") == f"data.sources[1] ({bad})"]
    assert sorted(q["line"] for q in from_bad) == [4, 11] and "bob@" not in json.dumps(from_bad)
    # the failed source's result is kept: the same run again fails the same way, without validating it again
    with pytest.raises(DataError, match=r"data\.sources\[1\]"):
        run_validate(built, tmp_path, example_sources()[:1] + [{"path": str(bad)}], base=False)
    assert json.loads((tmp_path / "validate.json").read_text())["validated_sources"] == []


def test_without_sources_the_validate_outputs_are_the_same_bytes(built, tmp_path):
    validate.run(
        params_with(None),
        built / "data/raw/train.jsonl",
        built / "data/raw/eval.jsonl",
        tmp_path / "validated",
        tmp_path / "validate.json",
        None,
        built / "models/base",
        tmp_path / "source_cache",
    )
    for name in ("train.jsonl", "eval.jsonl", "quarantine.jsonl", "redactions.jsonl"):
        assert (tmp_path / "validated" / name).read_bytes() == (built / "data/validated" / name).read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "validated").iterdir()) == sorted(
        p.name for p in (built / "data/validated").iterdir()
    )
    assert list((tmp_path / "source_cache").iterdir()) == []


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ({"path": "a.jsonl", "weight": 0}, ["data.sources.1", "'a.jsonl'", "weight must be > 0"]),
        ({"path": "a.jsonl", "weight": -2}, ["data.sources.1", "'a.jsonl'", "weight must be > 0"]),
        ({"path": "a.jsonl", "weight": 1, "n": 5}, ["data.sources.1", "'a.jsonl'", "weight or n, not both"]),
        ({"path": "a.jsonl", "kind": "zip"}, ["data.sources.1", "'a.jsonl'", "kind 'zip'", "hub"]),
        ({"path": "a.jsonl", "wieght": 1}, ["data.sources.1.wieght", "not a known key"]),
    ],
)
def test_bad_source_params_name_the_source_and_the_field(source, words):
    with pytest.raises(ConfigError) as caught:
        params_with([{"path": "ok.jsonl"}, source])
    assert all(word in str(caught.value) for word in words), str(caught.value)


def test_a_missing_path_and_a_wrong_mapping_name_the_source(built, tmp_path):
    with pytest.raises(FineflowError, match=r"data\.sources\[1\]\.path: no such file or folder 'data/nope\.jsonl'"):
        run_validate(built, tmp_path, [{"path": str(EXAMPLES / "units.jsonl")}, {"path": "data/nope.jsonl"}])
    with pytest.raises(FineflowError, match=r"data\.sources\[0\]\.split: .* is one file, it has no splits"):
        run_validate(built, tmp_path, [{"path": str(EXAMPLES / "units.jsonl"), "split": "test"}])
    wrong = {**QA, "instruction": "query"}
    with pytest.raises(DataError) as caught:
        run_validate(built, tmp_path, [{"path": str(EXAMPLES / "arithmetic"), "mapping": wrong}], base=False)
    message = str(caught.value)
    assert f"data.sources[0] ({EXAMPLES / 'arithmetic'})" in message
    assert "data.sources[0].mapping.instruction is 'query'" in message and "'question'" in message


def _hub_cache(root: Path, dataset_id: str, rows: list[dict]) -> Path:
    """A Hugging Face cache holding one snapshot of a dataset repo, as `huggingface-cli download` leaves it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = root / f"datasets--{dataset_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs/main").write_text(commit)
    data = repo / "snapshots" / commit / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), data / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2]), data / "test-00000-of-00001.parquet")
    return root


def test_a_hub_dataset_is_read_from_the_cache_and_refused_offline_when_not_there(built, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = [{"question": f"What is {w} reversed?", "answer": w[::-1]} for w in WORDS]
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub_cache(tmp_path / "hub", "acme/reverse", rows)))
    report = run_validate(built, tmp_path, [{"path": "acme/reverse", "mapping": QA, "weight": 2}], base=False)
    (section,) = report["sources"]
    assert section["kind"] == "hub" and section["revision"] == "0123456789abcdef0123456789abcdef01234567"
    assert section["report"]["rows_in"] == len(WORDS) and section["rows_mixed"] == 2 * len(WORDS)  # split train only
    with pytest.raises(FineflowError) as caught:
        run_validate(built, tmp_path, [{"path": "acme/absent", "mapping": QA}], base=False)
    message = str(caught.value)
    assert "data.sources[0] (acme/absent)" in message and "offline" in message and "--repo-type dataset" in message


def test_the_mix_is_deterministic_in_seed_and_takes_exact_counts(tmp_path):
    import random

    from fineflow.data.mix import source_lines, target_rows, write_mix

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(f"a{i}\n" for i in range(100)))
    b.write_text("".join(f"b{i}\n" for i in range(30)))
    parts = [(a, 100, target_rows({"weight": 0.25}, 100), "ka"), (b, 30, target_rows({"n": 70}, 30), "kb")]
    assert write_mix(parts, 7, tmp_path / "m1") == 95
    write_mix(parts, 7, tmp_path / "m2")
    write_mix(parts, 8, tmp_path / "m3")
    first = lines(tmp_path / "m1")
    assert first == lines(tmp_path / "m2") and first != lines(tmp_path / "m3")
    assert sum(x.startswith("a") for x in first) == 25 and sum(x.startswith("b") for x in first) == 70
    assert all(first.count(f"b{i}") in (2, 3) for i in range(30))  # two full passes, then 10 more
    picked = [x for x in source_lines(a, 100, 25, random.Random(1))]
    assert len(set(picked)) == 25 and picked == sorted(picked, key=lambda x: int(x[1:]))  # file order kept


def test_the_lineage_and_the_model_card_list_every_source(tmp_path):
    from fineflow.registry.card import _lineage
    from fineflow.registry.lineage import mixture_sources

    assert mixture_sources(tmp_path / "validated") == {}  # without sources: the lineage is as before
    listing = [
        {
            "path": "a.jsonl",
            "kind": "file",
            "content_sha256": "ab" * 32,
            "rows_kept": 9,
            "weight": 0.5,
            "rows_mixed": 4,
        },
        {"path": "org/x", "kind": "hub", "content_sha256": "cd" * 32, "rows_kept": 5, "n": 8, "rows_mixed": 8},
    ]
    (tmp_path / "validated").mkdir()
    (tmp_path / "validated/sources.json").write_text(json.dumps({"sources": listing}))
    data = mixture_sources(tmp_path / "validated")
    assert data == {"sources": listing}
    card = "\n".join(_lineage({"lineage": {"data": data}}))
    assert (
        "| a.jsonl | abababababababab | 9 | 0.5 | 4 |" in card and "| org/x | cdcdcdcdcdcdcdcd | 5 | n=8 | 8 |" in card
    )


def _repro(project: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "repro", "tokenize"], cwd=project, env=venv_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.nightly  # three dvc repros (~55 s); make test keeps the same reuse through the functions
@pytest.mark.slow
def test_dvc_repro_twice_validates_only_the_new_source(tmp_path):
    """A weight change and a new source: validate runs, but only the new source is validated; tokenize re-runs."""
    project = tmp_path / "project"
    sources = [{**s, "path": str(Path(s["path"]).relative_to(ROOT))} for s in example_sources()]
    copy_project(project, {"data.sources": sources})
    first = _repro(project)
    report = json.loads((project / "reports/validate.json").read_text())
    assert report["validated_sources"] == [0, 1, 2], first
    shards_key = json.loads((project / "data/shards/train/meta.json").read_text())["content_key"]
    write_words(project / "data/examples/mix/words.jsonl")
    sources[1]["weight"] = 1.0
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["data"]["sources"] = sources + [{"path": "data/examples/mix/words.jsonl", "weight": 2}]
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    second = _repro(project)
    report = json.loads((project / "reports/validate.json").read_text())
    assert report["validated_sources"] == [3] and report["reused_sources"] == [0, 1, 2], second
    assert "Running stage 'validate'" in second and "Running stage 'tokenize'" in second
    assert "data.sources[0] (data/examples/mix/units.jsonl): unchanged, validation reused" in second
    assert json.loads((project / "data/shards/train/meta.json").read_text())["content_key"] != shards_key
    listing = json.loads((project / "data/validated/sources.json").read_text())["sources"]
    assert [s["rows_mixed"] for s in listing] == [listing[0]["rows_kept"], listing[1]["rows_kept"], 45, 20]
    assert "Running stage" not in _repro(project).replace("Running stage 'fingerprint'", "")  # then nothing
