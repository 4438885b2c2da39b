"""The registry and the champion's artefacts, through the promote stage's real code on the tiny base model.

Two quickly made LoRA adapters (random lora_B, so they change the model) stand in for trained candidates;
scores.json is written by hand, so no lm-eval run is needed. Shows: promotion installs the adapter, a merged
model and the tokenizer (same logits through stock PeftModel and AutoModelForCausalLM), a model card with
YAML front matter; the registry keeps every candidate by id; a tampered log fails verify naming the line;
rollback reinstalls the previous champion, is logged, and verify still passes; `fineflow lineage` prints
the tree with the git commit and package versions. The promoted project is built once per module; every test
gets its own copy, so the tests pass in any order.
"""

import json
import shutil
import subprocess

import pytest
import yaml

from fineflow import cli
from fineflow.registry.store import candidate_id, read_log, verify_log

P = "fineflow_synth/exact_match"
EVAL_SHA = "e" * 64


def _entry(right: int, n: int = 40, cid: str | None = None) -> dict:
    samples = [{"doc_id": i, "target": "t", "prediction": "p", "exact_match": float(i < right)} for i in range(n)]
    out = {
        "status": "ok",
        "metrics": {"fineflow_synth": {"exact_match": right / n}},
        "samples": {"fineflow_synth": samples},
    }
    return {**out, "id": cid} if cid else out


def _write_scores(path, candidate: int, base: int, champion: tuple[int, str] | None = None):
    scores = {
        "tasks": ["fineflow_synth"],
        "eval_rows": "data/validated/eval.jsonl",
        "eval_data_sha256": EVAL_SHA,
        "base": _entry(base),
        "candidate": _entry(candidate),
    }
    if champion:
        scores["champion"] = _entry(champion[0], cid=champion[1])
    path.write_text(json.dumps(scores))
    return path


@pytest.fixture(scope="module")
def adapters(built, tmp_path_factory):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("adapters")
    made = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(built / "models/base")
        model = get_peft_model(
            base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.2)
        model.save_pretrained(out / f"adapter{seed}")
        made.append(out / f"adapter{seed}")
    return made


@pytest.fixture(scope="module")
def promoted_once(built, adapters, tmp_path_factory, tiny_params_module):
    """adapter1 promoted over the base, a tie refused, then adapter2 promoted over adapter1. Built once per
    module and never handed to a test: tests get a copy (promoted)."""
    from fineflow.stages import promote

    root = tmp_path_factory.mktemp("project")  # a git checkout: the lineage needs a commit
    (root / "README.md").write_text("fixture\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(git + ["add", "-A"], cwd=root, check=True)
    subprocess.run(git + ["commit", "-qm", "fixture"], cwd=root, check=True)
    (root / "reports").mkdir()
    train_report = root / "reports/train.json"
    train_report.write_text(json.dumps({"wall_s": 12.5, "tokens_per_s": 4321.0, "steps": 4}))
    champion, registry, runs = root / "models/champion", root / "models/registry", root / "reports/lineage"
    first, second = adapters
    kw = dict(
        base_dir=built / "models/base",
        train_report=train_report,
        lineage_dir=runs,
        shards_dir=built / "data/shards",
        root=root,
    )
    reports = [promote.run(tiny_params_module, _write_scores(root / "s1.json", 30, 5), first, champion, registry, **kw)]
    id1 = reports[0]["candidate_id"]
    reports.append(
        promote.run(
            tiny_params_module, _write_scores(root / "s2.json", 32, 5, (30, id1)), second, champion, registry, **kw
        )
    )
    reports.append(
        promote.run(
            tiny_params_module, _write_scores(root / "s3.json", 40, 5, (30, id1)), second, champion, registry, **kw
        )
    )
    return {
        "root": root,
        "champion": champion,
        "registry": registry,
        "runs": runs,
        "reports": reports,
        "ids": [id1, reports[2]["candidate_id"]],
        "base": built / "models/base",
    }


@pytest.fixture
def promoted(promoted_once, tmp_path):
    """This test's own copy of the promoted project (git checkout, registry, champion, lineage runs), so a test
    that rolls back or tampers changes nothing another test reads, whatever the order tests run in."""
    root = tmp_path / "project"
    shutil.copytree(promoted_once["root"], root, symlinks=True)
    return {
        **promoted_once,
        "root": root,
        "champion": root / "models/champion",
        "registry": root / "models/registry",
        "runs": root / "reports/lineage",
    }


@pytest.fixture(scope="module")
def tiny_params_module():
    from fineflow.config import parse_params
    from tests.conftest import TINY_PARAMS

    return parse_params(TINY_PARAMS)


def test_decisions_and_registry_layout(promoted, adapters):
    first, tie, second = promoted["reports"]
    id1, id2 = promoted["ids"]
    assert first["decision"] == "promoted" and first["ci_low"] > 0
    assert tie["decision"] == "refused" and "includes 0" in tie["reason"]
    assert second["decision"] == "promoted" and second["reference"] == f"champion {id1}"
    assert id1 == candidate_id(adapters[0]) and len(id1) == 16 and id1 != id2
    registry = promoted["registry"]
    assert sorted(p.name for p in (registry / "candidates").iterdir()) == sorted([id1, id2])
    record = json.loads((registry / "candidates" / id2 / "record.json").read_text())
    assert record["eval_data_sha256"] == EVAL_SHA and record["metrics"] == {P: 1.0}
    assert record["lineage"]["artefacts"]["adapter"]["files"] and "run" not in record["lineage"]  # deterministic
    assert json.loads((registry / "champion.json").read_text()) == {"id": id2, "seq": 3}
    log = read_log(registry)
    assert [e["decision"] for e in log] == ["promoted", "refused", "promoted"]
    assert log[1]["stats"]["ci_low"] <= 0 and log[2]["champion_before"] == id1
    assert verify_log(registry) == []
    # the full manifest (git, times, user, host) is outside the registry
    manifest = json.loads((promoted["runs"] / f"{id2}.json").read_text())
    assert manifest["run"]["git"]["commit"] and manifest["run"]["user"] and manifest["packages"]["peft"]


def test_champion_holds_adapter_merged_model_tokenizer_and_lineage(promoted):
    champion = promoted["champion"]
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "README.md",
        "lineage.json",
        "champion.json",
        "merged/model.safetensors",
        "merged/config.json",
        "merged/tokenizer.json",
    ):
        assert (champion / name).is_file(), name
    assert json.loads((champion / "champion.json").read_text())["candidate_id"] == promoted["ids"][1]
    assert not list(champion.parent.glob(".champion.*"))  # no staging left over


def test_adapter_and_merged_model_load_with_stock_classes_and_agree(promoted):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    champion = promoted["champion"]
    tokenizer = AutoTokenizer.from_pretrained(champion)
    assert AutoTokenizer.from_pretrained(champion / "merged").get_vocab() == tokenizer.get_vocab()
    ids = tokenizer("Extract the city: Porto, 2024-03-05", return_tensors="pt").input_ids
    base = AutoModelForCausalLM.from_pretrained(promoted["base"]).eval()
    with torch.no_grad():
        plain = base(ids).logits
        adapted = PeftModel.from_pretrained(base, champion).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(champion / "merged").eval()(ids).logits
    assert torch.allclose(adapted, merged, atol=1e-4), (adapted - merged).abs().max()
    assert (adapted - plain).abs().max() > 1e-3  # the adapter is not a no-op


def test_model_card_front_matter(promoted):
    text = (promoted["champion"] / "README.md").read_text()
    assert text.startswith("---\n")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["base_model"] == str(promoted["base"]) and front["license"] == "apache-2.0"
    assert front["library_name"] == "peft" and "fineflow" in front["tags"]
    assert any(d.startswith("fineflow-eval-rows:sha256:" + EVAL_SHA) for d in front["datasets"])
    [result] = front["model-index"][0]["results"]
    assert result["dataset"]["name"] == "fineflow_synth" and result["metrics"][0]["value"] == 1.0
    assert "CI" in text and "tokens_per_s 4321.0" in text and "wall_s 12.5" in text and "train.lora.r" in text


def test_tampered_log_fails_verify_naming_the_line(promoted, capsys):
    registry = promoted["registry"]
    assert cli.main(["registry", "verify", "--registry", str(registry)]) == 0
    log = registry / "promotions.jsonl"
    lines = log.read_text().splitlines()
    lines[1] = lines[1].replace('"decision": "refused"', '"decision": "promoted"')
    log.write_text("\n".join(lines) + "\n")
    assert cli.main(["registry", "verify", "--registry", str(registry)]) == 1
    out = capsys.readouterr().out
    assert "promotions.jsonl:3:" in out and "line 2 was edited" in out


def test_lineage_cli_prints_a_tree(promoted, capsys):
    args = ["--registry", str(promoted["registry"]), "--runs", str(promoted["runs"])]
    assert cli.main(["lineage", str(promoted["champion"]), *args]) == 0
    out = capsys.readouterr().out
    commit = json.loads((promoted["runs"] / f"{promoted['ids'][1]}.json").read_text())["run"]["git"]["commit"]
    assert f"git {commit}" in out and "torch 2." in out and "transformers" in out and "peft" in out
    assert "tokenizer_hash" in out and "adapter_model.safetensors" in out
    assert cli.main(["lineage", promoted["ids"][0][:8], *args]) == 0  # by (a prefix of) a candidate id
    assert promoted["ids"][0] in capsys.readouterr().out


def test_rollback_reinstalls_the_previous_champion_and_is_logged(promoted, capsys):
    registry, champion = promoted["registry"], promoted["champion"]
    id1, id2 = promoted["ids"]
    assert cli.main(["registry", "rollback", "--registry", str(registry), "--champion", str(champion)]) == 0
    assert f"{id2} -> {id1}" in capsys.readouterr().out
    assert json.loads((champion / "champion.json").read_text())["candidate_id"] == id1
    assert json.loads((registry / "champion.json").read_text())["id"] == id1
    stored = registry / "candidates" / id1
    assert (champion / "adapter_model.safetensors").read_bytes() == (stored / "adapter_model.safetensors").read_bytes()
    assert (champion / "merged/model.safetensors").is_file()
    last = read_log(registry)[-1]
    assert last["decision"] == "rollback" and last["candidate_id"] == id1 and last["champion_before"] == id2
    assert verify_log(registry) == []
    assert (
        cli.main(["registry", "rollback", "--to", id2[:6], "--registry", str(registry), "--champion", str(champion)])
        == 0
    )  # and forward again, by id prefix
    assert json.loads((registry / "champion.json").read_text())["id"] == id2 and verify_log(registry) == []


def test_stage_refuses_missing_scores_and_incomplete_lineage(promoted, adapters, built, tmp_path, tiny_params_module):
    from fineflow.stages import promote

    champion, registry = tmp_path / "champion", tmp_path / "registry"
    kw = dict(base_dir=built / "models/base", root=promoted["root"])
    missing = promote.run(
        tiny_params_module,
        tmp_path / "nope.json",
        adapters[0],
        champion,
        registry,
        shards_dir=built / "data/shards",
        **kw,
    )
    assert missing["decision"] == "refused" and "cannot read evaluation scores" in missing["reason"]
    no_shards = promote.run(
        tiny_params_module,
        _write_scores(tmp_path / "s.json", 40, 0),
        adapters[0],
        champion,
        registry,
        shards_dir=tmp_path / "no-shards",
        **kw,
    )
    assert no_shards["decision"] == "refused" and "lineage is incomplete" in no_shards["reason"]
    assert "data.tokenizer_hash" in no_shards["reason"]
    assert [e["decision"] for e in read_log(registry)] == ["refused", "refused"] and verify_log(registry) == []
    assert json.loads((champion / "champion.json").read_text()) == {"candidate_id": None}  # nothing installed


def test_promotion_whose_champion_build_fails_leaves_champion_log_and_alias_as_they_were(
    promoted, adapters, built, tiny_params_module, monkeypatch
):
    """The gate passes, then assembling the new champion fails midway (here: the disk fills while the base's
    tokenizer is loaded). promote builds aside before it logs or swaps anything, so the installed champion is
    byte for byte the old one, the log has no entry for a promotion that did not happen, and verify passes."""
    import transformers

    from fineflow.registry.store import alias_id
    from fineflow.stages import promote

    root, champion, registry = promoted["root"], promoted["champion"], promoted["registry"]
    id2 = promoted["ids"][1]  # the champion now; adapters[0] (the first champion) comes back and beats it

    def files(path):
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}

    before = files(champion), (registry / "promotions.jsonl").read_bytes()

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_space)
    with pytest.raises(OSError, match="No space left on device"):
        promote.run(
            tiny_params_module,
            _write_scores(root / "s4.json", 40, 5, (30, id2)),
            adapters[0],
            champion,
            registry,
            base_dir=built / "models/base",
            lineage_dir=promoted["runs"],
            shards_dir=built / "data/shards",
            root=root,
        )
    assert (files(champion), (registry / "promotions.jsonl").read_bytes()) == before
    assert alias_id(registry) == id2 and verify_log(registry) == []
    assert (champion.parent / ".champion.staging/adapter_model.safetensors").is_file()  # it failed mid-build
