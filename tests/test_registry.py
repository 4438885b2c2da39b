"""The registry and the champion's artefacts, through the promote stage's real code on the tiny base model.

Two quickly made LoRA adapters (random lora_B, so they change the model) stand in for trained candidates;
scores.json is written by hand, so no lm-eval run is needed. Shows: promotion installs the adapter, a merged
model and the tokenizer (same logits through stock PeftModel and AutoModelForCausalLM), a model card with
YAML front matter; the registry keeps every candidate by id; a tampered log fails verify naming the line;
rollback reinstalls the previous champion, is logged, and verify still passes; `fineflow lineage` prints
the tree with the git commit and package versions. The promoted project is built once per module; every test
gets its own copy, so the tests pass in any order.

The registry's durability through real processes: the promote stage SIGKILLed at points inside its registry
write (tests/registry_crash.py) leaves a state `verify` names and the next writer repairs; a rollback survives
the next `dvc repro` and `dvc checkout` in a git+DVC checkout; a rolled-back candidate is not promoted again;
promote holds the registry lock for every write. (The same on fake candidates, in milliseconds:
tests/test_registry_durability.py.)
"""

import fcntl
import json
import shutil
import signal
import subprocess
import sys

import pytest
import yaml

from fineflow import cli
from fineflow.errors import APPROVAL_NEEDED_EXIT
from fineflow.registry.install import champion_files_hash
from fineflow.registry.promotion_log import read_log
from fineflow.registry.store import alias_id, candidate_id
from fineflow.registry.verify import verify_log
from tests.conftest import EVAL_SHA, ROOT, copy_project, random_adapter, venv_env, write_params
from tests.conftest import write_scores as _write_scores

P = "fineflow_synth/exact_match"


@pytest.fixture(scope="module")
def adapters(built, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters")
    return [random_adapter(built / "models/base", out / f"adapter{seed}", seed) for seed in (1, 2)]


@pytest.fixture(scope="module")
def promoted_once(built, adapters, tmp_path_factory, tiny_params_module):
    """adapter1 promoted over the base, a tie refused, then adapter2 promoted over adapter1. Built once per
    module and never handed to a test: tests get a copy (promoted)."""
    from fineflow.registry.champion import promote

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
    reports = [promote(tiny_params_module, _write_scores(root / "s1.json", 30, 5), first, champion, registry, **kw)]
    id1 = reports[0]["candidate_id"]
    reports.append(
        promote(tiny_params_module, _write_scores(root / "s2.json", 32, 5, (30, id1)), second, champion, registry, **kw)
    )
    reports.append(
        promote(tiny_params_module, _write_scores(root / "s3.json", 40, 5, (30, id1)), second, champion, registry, **kw)
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
    from fineflow.core.config import parse_params
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
    alias = json.loads((registry / "champion.json").read_text())
    assert (alias["id"], alias["seq"]) == (id2, 3) and alias["files_sha256"] == champion_files_hash(
        promoted["champion"]
    )
    log = read_log(registry)
    assert [e["decision"] for e in log] == ["promoted", "refused", "promoted"]
    assert log[1]["stats"]["ci_low"] <= 0 and log[2]["champion_before"] == id1
    assert verify_log(registry, promoted["champion"]) == []
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


def test_the_entry_that_installed_the_champion_binds_every_served_file(promoted, capsys):
    """Issue 29: the merged weights replaced and the alias's content hash recomputed passed verify; the log entry
    that installed the champion now records every file a server loads, and verify checks them against it."""
    from fineflow.registry.install import champion_manifest
    from fineflow.registry.promotion_log import last_champion_entry
    from fineflow.registry.store import read_alias, set_alias

    registry, champion = promoted["registry"], promoted["champion"]
    entry = last_champion_entry(registry)
    served = {"merged/model.safetensors", "merged/config.json", "tokenizer.json", "README.md", "champion.json"}
    assert served <= set(entry["champion_files"]) and entry["champion_files"] == champion_manifest(champion)
    weights = champion / "merged/model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    alias = read_alias(registry)
    set_alias(registry, alias["id"], alias["seq"], champion_files_hash(champion))
    args = ["--registry", str(registry), "--champion", str(champion)]
    assert cli.main(["registry", "verify", *args]) == 1
    assert f"merged/model.safetensors: differs from what entry {entry['seq']} installed" in capsys.readouterr().out


def test_two_promotions_of_the_same_inputs_leave_the_same_registry_whatever_their_run_figures(
    promoted, adapters, built, tiny_params_module
):
    """The registry is a DVC output the Prefect flow and `dvc repro` must leave alike, though their trainings'
    wall times differ: the entry binds the card but for its run figures."""
    from fineflow.registry.champion import promote
    from tests.test_chaos import tree

    root = promoted["root"]
    registries = []
    for name, wall_s in (("one", 12.5), ("two", 99.0)):
        report = root / f"reports/train-{name}.json"
        report.write_text(json.dumps({"wall_s": wall_s, "tokens_per_s": 4321.0 / wall_s, "steps": 4}))
        models = root / f"models-{name}"
        kw = dict(base_dir=promoted["base"], train_report=report, shards_dir=built / "data/shards", root=root)
        promote(
            tiny_params_module, _write_scores(root / "s.json", 30, 5), adapters[0], models / "c", models / "r", **kw
        )
        assert f"wall_s {wall_s}" in (models / "c/README.md").read_text()
        registries.append(tree(models / "r"))
    assert registries[0] == registries[1]


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
    assert verify_log(registry, champion) == []
    assert (
        cli.main(["registry", "rollback", "--to", id2[:6], "--registry", str(registry), "--champion", str(champion)])
        == 0
    )  # and forward again, by id prefix
    assert json.loads((registry / "champion.json").read_text())["id"] == id2 and verify_log(registry, champion) == []
    # rebuilt without the run's figures, the champion's files are the ones its promotion recorded (but its
    # champion.json, which names the entry): a rebuild, and a second run of the same inputs, log the same files
    promoted_files, rebuilt_files = (
        {k: v for k, v in e["champion_files"].items() if k != "champion.json"}
        for e in (read_log(registry)[2], read_log(registry)[-1])
    )
    assert read_log(registry)[2]["candidate_id"] == id2 and rebuilt_files == promoted_files
    assert "wall_s 12.5" not in (champion / "README.md").read_text()  # the card's run figures are not bound


def test_stage_refuses_missing_scores_and_incomplete_lineage(promoted, adapters, built, tmp_path, tiny_params_module):
    from fineflow.registry.champion import promote

    champion, registry = tmp_path / "champion", tmp_path / "registry"
    kw = dict(base_dir=built / "models/base", root=promoted["root"])
    missing = promote(
        tiny_params_module,
        tmp_path / "nope.json",
        adapters[0],
        champion,
        registry,
        shards_dir=built / "data/shards",
        **kw,
    )
    assert missing["decision"] == "refused" and "cannot read evaluation scores" in missing["reason"]
    no_shards = promote(
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
    assert [e["decision"] for e in read_log(registry)] == ["refused", "refused"] and verify_log(
        registry, champion
    ) == []
    assert json.loads((champion / "champion.json").read_text()) == {"candidate_id": None}  # nothing installed


def test_promotion_whose_champion_build_fails_leaves_champion_log_and_alias_as_they_were(
    promoted, adapters, built, tiny_params_module, monkeypatch
):
    """The gate passes, then assembling the new champion fails midway (here: the disk fills while the base's
    tokenizer is loaded). promote builds aside before it logs or swaps anything, so the installed champion is
    byte for byte the old one, the log has no entry for a promotion that did not happen, and verify passes."""
    import transformers

    from fineflow.registry.champion import promote
    from fineflow.registry.store import alias_id

    root, champion, registry = promoted["root"], promoted["champion"], promoted["registry"]
    id2 = promoted["ids"][1]  # the champion now; adapters[0] (the first champion) comes back and beats it

    def files(path):
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}

    before = files(champion), (registry / "promotions.jsonl").read_bytes()

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_space)
    with pytest.raises(OSError, match="No space left on device"):
        promote(
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
    assert alias_id(registry) == id2 and verify_log(registry, champion) == []
    assert (champion.parent / ".champion.staging/adapter_model.safetensors").is_file()  # it failed mid-build


# ---- durability through real processes ----------------------------------------------------------------


CRASH = ROOT / "tests/registry_crash.py"


def _promote_argv(promoted, built, scores) -> list[str]:
    """The promote stage's arguments on the promoted copy, adapter1 (the first champion) as the candidate."""
    root = promoted["root"]
    write_params(root / "params.yaml")
    return [
        *("--params", str(root / "params.yaml"), "--scores", str(scores)),
        *("--champion", str(promoted["champion"]), "--registry", str(promoted["registry"])),
        *("--base-dir", str(built / "models/base"), "--shards", str(built / "data/shards")),
        *("--lineage", str(promoted["runs"])),
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "point, named, committed",
    [
        ("mid_append", "half-written", False),
        ("after_append", "a writer died between the log append and the install", True),
        ("before_alias", "a writer died between the log append and the install", True),
    ],
)
def test_promote_killed_inside_its_registry_write_is_named_by_verify_and_repaired(
    point, named, committed, promoted, adapters, built, capsys
):
    """adapter1 comes back and beats the champion (adapter2); the stage dies at point. A promotion whose log
    entry was committed is finished by the repair; one that was not leaves the old champion, and nothing logged."""
    root, registry, champion = promoted["root"], promoted["registry"], promoted["champion"]
    id1, id2 = promoted["ids"]
    argv = _promote_argv(promoted, built, _write_scores(root / "s4.json", 40, 5, (30, id2)))
    done = subprocess.run(
        [sys.executable, str(CRASH), point, *argv, "--adapter", str(adapters[0])],
        cwd=root,
        env=venv_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert read_champion_id(champion) in (id1, id2)  # the champion directory is never missing
    paths = ["--registry", str(registry), "--champion", str(champion)]
    assert cli.main(["registry", "verify", *paths]) == 1
    assert named in capsys.readouterr().out
    assert cli.main(["registry", "repair", *paths]) == 0
    expected = (id1, 4) if committed else (id2, 3)
    assert (read_champion_id(champion), len(read_log(registry))) == expected
    assert verify_log(registry, champion) == [] and not list(champion.parent.glob(".champion.*"))


def read_champion_id(champion) -> str | None:
    return json.loads((champion / "champion.json").read_text())["candidate_id"]


def test_the_next_promote_repairs_a_crashed_install_before_it_judges(promoted, adapters, built, tiny_params_module):
    """The log says adapter1 was promoted (entry 4) but the writer died before the swap: the next promote run
    finishes that install first, then judges its own candidate against adapter1, the champion the log names."""
    from fineflow.registry.champion import promote
    from fineflow.registry.promotion_log import append_log

    root, registry, champion = promoted["root"], promoted["registry"], promoted["champion"]
    id1, id2 = promoted["ids"]
    append_log(registry, {"candidate_id": id1, "decision": "promoted", "promote": True, "champion_before": id2})
    assert alias_id(registry) == id2 and verify_log(registry, champion)
    messages = []
    report = promote(
        tiny_params_module,
        _write_scores(root / "s5.json", 30, 5, (30, id1)),
        adapters[1],
        champion,
        registry,
        base_dir=built / "models/base",
        lineage_dir=promoted["runs"],
        shards_dir=built / "data/shards",
        root=root,
        log=messages.append,
    )
    assert any("entry 4" in m and id1 in m for m in messages), messages
    assert report["reference"] == f"champion {id1}" and report["decision"] == "refused"
    assert alias_id(registry) == id1 and verify_log(registry, champion) == []


def test_promote_writes_only_while_holding_the_registry_lock(
    promoted, adapters, built, tiny_params_module, monkeypatch
):
    from fineflow.registry import champion as champion_mod
    from fineflow.registry.store import lock_path

    registry = promoted["registry"]
    seen = []

    def probe(name, real):
        def wrapper(*args, **kwargs):
            with open(lock_path(registry), "a") as fh, pytest.raises(BlockingIOError):
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: by this promote
            seen.append(name)
            return real(*args, **kwargs)

        return wrapper

    for name in ("current_champion", "store_candidate", "append_log", "swap_in", "set_alias"):
        monkeypatch.setattr(champion_mod, name, probe(name, getattr(champion_mod, name)))
    report = champion_mod.promote(
        tiny_params_module,
        _write_scores(promoted["root"] / "s6.json", 40, 5, (30, promoted["ids"][1])),
        adapters[0],
        promoted["champion"],
        registry,
        base_dir=built / "models/base",
        lineage_dir=promoted["runs"],
        shards_dir=built / "data/shards",
        root=promoted["root"],
        log=lambda m: None,
    )
    assert report["decision"] == "promoted"
    assert seen == ["current_champion", "store_candidate", "append_log", "swap_in", "set_alias"]


def test_a_rolled_back_candidate_is_not_promoted_again_on_its_old_scores(promoted, adapters, built, tiny_params_module):
    """promote run again on the scores that promoted adapter2 (as `dvc repro` does when promote's inputs
    changed) would undo the rollback; the gate refuses it, naming the rollback entry."""
    from fineflow.registry.champion import promote, rollback

    registry, champion = promoted["registry"], promoted["champion"]
    id1, id2 = promoted["ids"]
    seq = rollback(registry, champion, log=lambda m: None)["log_seq"]
    report = promote(
        tiny_params_module,
        _write_scores(promoted["root"] / "s3.json", 40, 5, (30, id1)),
        adapters[1],
        champion,
        registry,
        base_dir=built / "models/base",
        lineage_dir=promoted["runs"],
        shards_dir=built / "data/shards",
        root=promoted["root"],
        log=lambda m: None,
    )
    assert report["decision"] == "refused" and f"rolled back by entry {seq}" in report["reason"]
    assert alias_id(registry) == id1 and verify_log(registry, champion) == []


# ---- a rollback in a git+DVC checkout -----------------------------------------------------------------


def _dvc(project, *args) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=project, env=venv_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _promote_status(project) -> dict:
    return json.loads(_dvc(project, "status", "--json", "promote").stdout or "{}")


def _repro_promote(project) -> bool:
    """`dvc repro --single-item promote`, as the flow runs it; whether the stage ran."""
    return "Running stage 'promote'" in _dvc(project, "repro", "--single-item", "promote").stdout


def _rollback(project, monkeypatch, capsys) -> str:
    """`fineflow registry rollback` with its default paths, run from the project (in this process: the
    stage's recorded base model, models/base, is relative to it)."""
    monkeypatch.chdir(project)
    assert cli.main(["registry", "rollback"]) == 0
    return capsys.readouterr().out


@pytest.mark.scenario
@pytest.mark.slow
def test_a_rollback_survives_the_next_dvc_repro_and_dvc_checkout(built, adapters, tmp_path, monkeypatch, capsys):
    """In a git+DVC checkout, promote (run by `dvc repro --single-item promote`, as the flow runs it) promotes
    adapter1, then adapter2. A rollback made while promote's inputs have changed since it ran is not recorded
    in dvc.lock (that would mark the new inputs judged); the promote run that follows refuses the candidate
    rolled back from, and the champion stays. A rollback made when only promote's outputs changed is recorded:
    the next `dvc repro` has nothing to run. `dvc checkout` keeps each, and the registry's lock file is outside
    the outputs (`dvc status` stays clean)."""
    project = copy_project(tmp_path / "project")
    shutil.copytree(built / "models/base", project / "models/base")
    shutil.copytree(built / "data/shards", project / "data/shards")
    shutil.copytree(built / "data/validated", project / "data/validated")  # promote's lineage reads its sources
    (project / "models/base_fingerprint.json").write_text("{}\n")
    (project / "eval").mkdir()
    ids = []
    for adapter, (candidate, champion) in zip(adapters, [(30, None), (40, 30)]):
        shutil.rmtree(project / "models/candidate", ignore_errors=True)
        shutil.copytree(adapter, project / "models/candidate")
        _write_scores(project / "eval/scores.json", candidate, 5, (champion, ids[-1]) if ids else None)
        assert _repro_promote(project)
        ids.append(alias_id(project / "models/registry"))
    id1, id2 = ids
    assert _promote_status(project) == {}  # the registry's lock file is beside its outputs, not in them
    registry, champion = project / "models/registry", project / "models/champion"

    write_params(project / "params.yaml", {"promote.max_regression": 0.01})  # promote's inputs change
    out = _rollback(project, monkeypatch, capsys)
    assert f"{id2} -> {id1}" in out and "dvc.lock: not recorded" in out and "changed deps" in out
    assert _repro_promote(project)  # promote runs on adapter2 and its old scores, and refuses it
    last = read_log(registry)[-1]
    assert (last["decision"], last["candidate_id"]) == ("refused", id2) and "rolled back" in last["reason"]
    assert read_champion_id(champion) == id1 and not _repro_promote(project)
    _dvc(project, "checkout", "--force", "promote")
    assert read_champion_id(champion) == id1 and verify_log(registry, champion) == []

    out = _rollback(project, monkeypatch, capsys)  # forward to adapter2 again, deliberately
    assert f"{id1} -> {id2}" in out and "dvc.lock: recorded" in out
    assert not _repro_promote(project)  # dvc.lock holds the rolled-back outputs: promote is up to date
    _dvc(project, "checkout", "--force", "promote")
    assert read_log(registry)[-1]["decision"] == "rollback" and read_champion_id(champion) == id2
    assert verify_log(registry, champion) == [] and _promote_status(project) == {}


# ---- a person's approval (promote.require_approval) ------------------------------------------------------


def _promote_stage(root, argv, adapter, approval: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m fineflow.stages.promote` as DVC runs it, with FINEFLOW_APPROVAL set to approval when given."""
    env = {k: v for k, v in venv_env().items() if k != "FINEFLOW_APPROVAL"}
    if approval is not None:
        env["FINEFLOW_APPROVAL"] = json.dumps(approval)
    command = [sys.executable, "-m", "fineflow.stages.promote", *argv, "--adapter", str(adapter)]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_with_require_approval_the_gates_promotion_waits_for_a_person_whose_answer_goes_into_the_log(
    promoted, adapters, built
):
    """adapter1 comes back and beats the champion (adapter2). With promote.require_approval the stage writes
    nothing and exits 3 with the gate's evidence on record, also for an answer given for another candidate; a
    rejection is logged as a refusal with the approver's reason; on new scores the gate passes it again and an
    approval promotes it, the approver in the log and the report."""
    root, registry, champion = promoted["root"], promoted["registry"], promoted["champion"]
    id1, id2 = promoted["ids"]
    argv = _promote_argv(promoted, built, _write_scores(root / "s4.json", 40, 5, (30, id2)))
    write_params(root / "params.yaml", {"promote.require_approval": True})
    argv += ["--report", str(root / "reports/promote.json")]
    log_before = (registry / "promotions.jsonl").read_bytes()

    for answer in (None, {"approved": True, "approver": "alice", "candidate_id": id2}):
        waiting = _promote_stage(root, argv, adapters[0], answer)
        assert waiting.returncode == APPROVAL_NEEDED_EXIT, waiting.stdout + waiting.stderr
        assert "waiting for approval" in waiting.stderr and "FINEFLOW_APPROVAL=" in waiting.stderr
        record = json.loads((root / "reports/promote.error.json").read_text())
        evidence = record["evidence"]
        assert record["kind"] == "approval_needed" and evidence["candidate_id"] == id1
        assert evidence["decision"] == "promoted" and evidence["ci_low"] > 0 and evidence["p_value"] is not None
        assert (registry / "promotions.jsonl").read_bytes() == log_before and read_champion_id(champion) == id2

    bad = _promote_stage(root, argv, adapters[0], {"approved": "yes"})
    assert bad.returncode == 2 and "approved: must be true or false" in bad.stderr and "approver:" in bad.stderr

    rejected = _promote_stage(root, argv, adapters[0], {"approved": False, "approver": "bob", "comment": "n=40"})
    assert rejected.returncode == 0, rejected.stdout + rejected.stderr
    last = read_log(registry)[-1]
    assert (last["decision"], last["candidate_id"]) == ("refused", id1)
    assert last["reason"].startswith("rejected by bob: n=40 (the gate alone: ")
    assert last["context"]["approval"] == {"approved": False, "approver": "bob", "comment": "n=40"}
    assert read_champion_id(champion) == id2 and not (root / "reports/promote.error.json").exists()

    argv[argv.index("--scores") + 1] = str(_write_scores(root / "s5.json", 39, 5, (30, id2)))
    approved = _promote_stage(root, argv, adapters[0], {"approved": True, "approver": "alice", "candidate_id": id1})
    assert approved.returncode == 0, approved.stdout + approved.stderr
    last = read_log(registry)[-1]
    assert (last["decision"], last["candidate_id"]) == ("promoted", id1) and "approved by alice" in last["reason"]
    assert last["context"]["approval"]["approver"] == "alice"
    report = json.loads((root / "reports/promote.json").read_text())
    assert report["decision"] == "promoted" and report["approval"]["approver"] == "alice"
    assert read_champion_id(champion) == id1 and verify_log(registry, champion) == []


def test_registry_list_names_every_candidate_its_decision_and_the_champion(promoted, capsys):
    """`fineflow registry list`, as docs/stages.md shows it (tests/test_docs.py maps each command to its test)."""
    assert cli.main(["registry", "list", "--registry", str(promoted["registry"])]) == 0
    out = capsys.readouterr().out
    id1, id2 = promoted["ids"]
    assert id1 in out and f"* {id2}  promoted" in out and f"champion: {id2}" in out
