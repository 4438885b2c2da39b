"""The registry holds across crashes and concurrent writers, on small fake candidates.

Candidates here are directories of a few bytes stored with the registry's own functions; the champion's slow
assembly (``champion.build_champion``: merged model, tokenizer, card) is replaced by a copy of the adapter
files plus a fake merged file, so every test runs in milliseconds. The same procedures on real adapters,
through real processes (SIGKILL at points inside promote, ``dvc repro`` after a rollback), are in
tests/test_registry.py.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil

import pytest

from fineflow import cli
from fineflow.errors import FineflowError
from fineflow.registry import card, install, promotion_log, store, verify
from fineflow.registry import champion as champion_mod

P = "synth/exact_match"


# ---- a small registry ----------------------------------------------------------------------------------


def _adapter(root, text: str):
    """An adapter directory of two small files; its id is the hash of their bytes, as for a real one."""
    root.mkdir(parents=True)
    (root / "adapter_model.safetensors").write_text(f"weights {text}")
    (root / "adapter_config.json").write_text("{}")
    return root


def fake_build(staging, source, base_ref, record, train):
    """build_champion without a model: the adapter files, stand-ins for the merged model and the tokenizer, and
    the model card (what build_champion writes, override notice included)."""
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns(store.RECORD_FILE))
    (staging / "merged").mkdir()
    (staging / "merged/model.safetensors").write_text(f"merged {record['candidate_id']}")
    (staging / "tokenizer.json").write_text("{}")
    (staging / store.CARD_FILE).write_text(card.model_card(record, base_ref, train, True))
    return staging


def _store(registry, adapter, decision: str = "promoted") -> tuple[str, dict]:
    cid = store.candidate_id(adapter)
    record = {"candidate_id": cid, "base_model": "base", "metrics": {P: 0.5}, "decision": decision}
    store.store_candidate(registry, adapter, cid, record)
    return cid, record


def _install(registry, champion, cid: str, record: dict, decision: str = "promoted") -> dict:
    """What promote does for a passing candidate: build the champion, log the decision with its files, install."""
    staging = fake_build(install.staging_dir(champion), store.candidate_dir(registry, cid), "base", record, None)
    entry = {"candidate_id": cid, "decision": decision, "promote": True}
    entry = champion_mod.log_decision(registry, entry, staging, record)
    champion_mod.install_built(staging, champion, registry, cid, record, entry["seq"])
    return entry


def _two_promotions(tmp_path, monkeypatch, key: str | None = None) -> dict:
    """A registry that promoted a, then b (the champion now); build_champion is the fake one."""
    monkeypatch.setattr(champion_mod, "build_champion", fake_build)
    if key:
        monkeypatch.setenv(promotion_log.KEY_VAR, key)
    registry, champion = tmp_path / "models/registry", tmp_path / "models/champion"
    install.ensure_empty_champion(champion)
    ids = []
    for name in ("a", "b"):
        cid, record = _store(registry, _adapter(tmp_path / f"adapter-{name}", name))
        _install(registry, champion, cid, record)
        ids.append(cid)
    assert verify.verify_log(registry, champion, key=key) == []
    return {"registry": registry, "champion": champion, "ids": ids, "tmp": tmp_path, "key": key}


@pytest.fixture
def reg(tmp_path, monkeypatch):
    """Two promotions, unkeyed."""
    return _two_promotions(tmp_path, monkeypatch)


@pytest.fixture
def keyed(tmp_path, monkeypatch):
    """Two promotions with FINEFLOW_REGISTRY_KEY set (it stays set for the test)."""
    return _two_promotions(tmp_path, monkeypatch, key="s3cret")


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- one lock around every write -----------------------------------------------------------------------


def _append_many(registry, start, n: int) -> None:
    start.wait()
    for i in range(n):
        promotion_log.append_log(registry, {"decision": "refused", "writer": os.getpid(), "i": i})


@pytest.mark.slow  # two processes
def test_two_processes_appending_at_once_keep_one_chain(tmp_path):
    """Without a lock both read the same last line and write the same seq: the chain forks."""
    registry = tmp_path / "registry"
    registry.mkdir()
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    writers = [ctx.Process(target=_append_many, args=(registry, start, 80)) for _ in range(2)]
    for w in writers:
        w.start()
    start.set()
    for w in writers:
        w.join(120)
        assert w.exitcode == 0
    log = promotion_log.read_log(registry)
    assert [e["seq"] for e in log] == list(range(1, 161))
    assert len({e["writer"] for e in log}) == 2 and verify.verify_log(registry) == []


def _read_heads(path, start, stop, bad) -> None:
    start.wait()
    while not stop.is_set():
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = "<missing>"
        try:
            whole = len(json.loads(text)["last_sha256"]) == 64
        except (ValueError, KeyError, TypeError):
            whole = False
        bad.value += not whole


@pytest.mark.slow  # two processes
def test_a_reader_never_sees_a_partial_head(tmp_path):
    """HEAD is replaced by a rename: a reader sees the old HEAD or the new one, never an empty or partial file."""
    registry = tmp_path / "registry"
    promotion_log.append_log(registry, {"decision": "refused"})
    ctx = multiprocessing.get_context("fork")
    start, stop, bad = ctx.Event(), ctx.Event(), ctx.Value("i", 0)
    reader = ctx.Process(target=_read_heads, args=(registry / promotion_log.HEAD_FILE, start, stop, bad))
    reader.start()
    start.set()
    for i in range(150):
        promotion_log.append_log(registry, {"decision": "refused", "i": i})
    stop.set()
    reader.join(60)
    assert bad.value == 0


def _assert_locked(registry):
    """Another open file description cannot take the registry lock: someone (this writer) holds it."""
    with open(store.lock_path(registry), "a") as fh:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_rollback_writes_only_while_holding_the_registry_lock(reg, monkeypatch):
    registry, champion = reg["registry"], reg["champion"]
    seen = []
    for name in ("append_log", "swap_in", "set_alias"):
        real = getattr(champion_mod, name)

        def probe(*args, _real=real, _name=name, **kwargs):
            _assert_locked(registry)
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(champion_mod, name, probe)
    champion_mod.rollback(registry, champion)
    assert seen == ["append_log", "swap_in", "set_alias"]
    with open(store.lock_path(registry), "a") as fh:  # released afterwards
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_lock_is_reentrant_and_lives_beside_the_registry_not_inside_it(tmp_path):
    """Inside models/registry (a DVC output) the lock file would change the output's hash."""
    registry = tmp_path / "models/registry"
    with store.registry_lock(registry):
        with store.registry_lock(registry):  # promote holds it and append_log takes it again
            promotion_log.append_log(registry, {"decision": "refused"})
        _assert_locked(registry)
    assert store.lock_path(registry).parent == registry.parent
    assert sorted(p.name for p in registry.iterdir()) == [promotion_log.HEAD_FILE, promotion_log.LOG_FILE]


# ---- HEAD and a half-written last line ------------------------------------------------------------------


def test_a_half_written_last_line_is_named_by_verify_and_cut_by_repair(tmp_path):
    registry = tmp_path / "registry"
    for decision in ("refused", "refused"):
        promotion_log.append_log(registry, {"decision": decision})
    log = registry / promotion_log.LOG_FILE
    whole = log.read_bytes()
    with log.open("a") as fh:
        fh.write('{"candidate_id": "c0ffee", "decis')  # the writer died mid-append
    [problem] = verify.verify_log(registry)
    assert "promotions.jsonl:3:" in problem and "half-written" in problem and "repair" in problem
    messages = []
    promotion_log.repair_log(registry, log=messages.append)
    assert log.read_bytes() == whole and verify.verify_log(registry) == []
    assert len(messages) == 1 and "promotions.jsonl:3" in messages[0] and '"decis' in messages[0]
    assert promotion_log.append_log(registry, {"decision": "refused"})["seq"] == 3


def test_an_edited_last_line_is_refused_not_repaired(tmp_path):
    """Only a tail without its newline is a crash's doing; a complete line that fails the chain is an edit."""
    registry = tmp_path / "registry"
    for decision in ("refused", "promoted"):
        promotion_log.append_log(registry, {"decision": decision})
    log = registry / promotion_log.LOG_FILE
    log.write_text(log.read_text().replace('"promoted"', '"refused"'))
    edited = log.read_bytes()
    promotion_log.repair_log(registry, log=lambda m: None)
    assert log.read_bytes() == edited
    [problem] = verify.verify_log(registry)
    assert "last line was edited" in problem


def test_head_one_entry_behind_is_named_and_caught_up(tmp_path):
    """The writer died between the log's fsync and HEAD's rename: the entry stands, HEAD follows it."""
    registry = tmp_path / "registry"
    promotion_log.append_log(registry, {"decision": "refused"})
    behind = (registry / promotion_log.HEAD_FILE).read_bytes()
    promotion_log.append_log(registry, {"decision": "refused"})
    (registry / promotion_log.HEAD_FILE).write_bytes(behind)
    [problem] = verify.verify_log(registry)
    assert "HEAD is one entry behind" in problem and "promotions.jsonl:2" in problem
    promotion_log.repair_log(registry, log=lambda m: None)
    assert verify.verify_log(registry) == []


# ---- the champion directory: never missing --------------------------------------------------------------


def test_a_swap_that_dies_midway_still_leaves_a_whole_champion(tmp_path, monkeypatch):
    """Two renames leave a moment with no champion (a crash there leaves none at all); the exchange does not."""
    champion = tmp_path / "champion"
    (champion / "merged").mkdir(parents=True)
    (champion / "adapter_model.safetensors").write_text("old")
    staging = install.staging_dir(champion)
    (staging / "merged").mkdir(parents=True)
    (staging / "adapter_model.safetensors").write_text("new")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError(errno.EIO, "killed between the renames")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    try:
        install.swap_in(staging, champion)
    except OSError:
        pass
    assert (champion / "adapter_model.safetensors").read_text() in ("old", "new")


def test_without_an_exchange_the_swap_falls_back_to_two_renames(tmp_path, monkeypatch):
    def unsupported(a, b):
        raise OSError(errno.EINVAL, "RENAME_EXCHANGE not supported here")

    monkeypatch.setattr(install, "_exchange", unsupported)
    champion = tmp_path / "champion"
    champion.mkdir()
    (champion / "a").write_text("old")
    staging = install.staging_dir(champion)
    staging.mkdir()
    (staging / "a").write_text("new")
    install.swap_in(staging, champion)
    assert _files(champion) == {"a": b"new"} and sorted(p.name for p in tmp_path.iterdir()) == ["champion"]


def test_the_exchange_leaves_nothing_beside_the_champion(tmp_path):
    champion = tmp_path / "champion"
    champion.mkdir()
    (champion / "a").write_text("old")
    staging = install.staging_dir(champion)
    staging.mkdir()
    (staging / "a").write_text("new")
    inode = staging.stat().st_ino
    install.swap_in(staging, champion)
    assert champion.stat().st_ino == inode  # the staged directory itself, renamed in
    assert _files(champion) == {"a": b"new"} and sorted(p.name for p in tmp_path.iterdir()) == ["champion"]


# ---- a crash between the log append and the install -----------------------------------------------------


def _log_promotion_without_installing(reg, name: str) -> tuple[str, int]:
    """promote got as far as the log append for a new candidate, then died."""
    cid, _ = _store(reg["registry"], _adapter(reg["tmp"] / f"adapter-{name}", name))
    entry = promotion_log.append_log(reg["registry"], {"candidate_id": cid, "decision": "promoted", "promote": True})
    return cid, entry["seq"]


def test_a_crash_after_the_log_append_is_reported_and_the_next_writer_finishes_the_install(reg):
    registry, champion = reg["registry"], reg["champion"]
    cid, seq = _log_promotion_without_installing(reg, "c")
    problems = verify.verify_log(registry, champion)
    assert any(f"entry {seq}" in p and cid in p and "alias" in p for p in problems), problems
    assert any(f"entry {seq}" in p and cid in p and str(champion) in p for p in problems), problems
    messages = []
    champion_mod.recover(registry, champion, log=messages.append)
    assert store.alias_id(registry) == cid and verify.verify_log(registry, champion) == []
    assert json.loads((champion / "champion.json").read_text())["promotion_seq"] == seq
    assert (champion / "merged/model.safetensors").read_text() == f"merged {cid}"
    assert any(f"entry {seq}" in m for m in messages)


def test_a_crash_between_the_swap_and_the_alias_is_finished_without_rebuilding(reg, monkeypatch):
    registry, champion = reg["registry"], reg["champion"]
    cid, seq = _log_promotion_without_installing(reg, "c")
    record = store.read_record(registry, cid)
    staging = fake_build(install.staging_dir(champion), store.candidate_dir(registry, cid), "base", record, None)
    monkeypatch.setattr(champion_mod, "set_alias", lambda *a, **k: None)  # the writer died before the alias
    champion_mod.install_built(staging, champion, registry, cid, record, seq)
    monkeypatch.undo()
    assert store.alias_id(registry) == reg["ids"][1]
    [problem] = verify.verify_log(registry, champion)
    assert "alias" in problem and f"entry {seq}" in problem

    def no_build(*args, **kwargs):
        raise AssertionError("the installed champion is complete: nothing to rebuild")

    monkeypatch.setattr(champion_mod, "build_champion", no_build)
    champion_mod.recover(registry, champion, log=lambda m: None)
    assert store.alias_id(registry) == cid and verify.verify_log(registry, champion) == []


def test_a_champion_directory_lost_midway_through_a_fallback_swap_is_rebuilt(reg):
    registry, champion = reg["registry"], reg["champion"]
    os.replace(champion, champion.with_name(".champion.retired"))  # the gap of two renames
    champion_mod.recover(registry, champion, log=lambda m: None)
    assert verify.verify_log(registry, champion) == []
    assert not list(champion.parent.glob(".champion.*"))  # leftovers of crashed writers are cleared


def test_the_repair_command_repairs_and_verify_then_passes(reg, capsys):
    registry, champion = reg["registry"], reg["champion"]
    _log_promotion_without_installing(reg, "c")
    args = ["--registry", str(registry), "--champion", str(champion)]
    assert cli.main(["registry", "verify", *args]) == 1
    assert "the next promote or rollback repairs it" in capsys.readouterr().out
    assert cli.main(["registry", "repair", *args]) == 0
    assert cli.main(["registry", "verify", *args]) == 0


# ---- verify checks the champion ------------------------------------------------------------------------


def test_verify_checks_the_champions_files_and_record_against_the_log(reg):
    registry, champion = reg["registry"], reg["champion"]
    cid = reg["ids"][1]
    (champion / "adapter_model.safetensors").write_text("edited")
    [problem] = verify.verify_log(registry, champion)
    assert "adapter_model.safetensors" in problem and f"candidates/{cid}" in problem
    (champion / "adapter_model.safetensors").write_text("weights b")
    (champion / "merged/model.safetensors").write_text("edited")
    [problem] = verify.verify_log(registry, champion)
    assert "merged/model.safetensors" in problem and "entry 2" in problem
    (champion / "merged/model.safetensors").write_text(f"merged {cid}")
    assert verify.verify_log(registry, champion) == []
    card = (champion / "README.md").read_text()
    (champion / "README.md").write_text("a card with other claims")  # the card is served: bound too
    [problem] = verify.verify_log(registry, champion)
    assert "README.md" in problem and "entry 2" in problem
    (champion / "README.md").unlink()  # absent (DVC does not restore it: .dvcignore), so not served
    assert verify.verify_log(registry, champion) == []
    (champion / "README.md").write_text(card)
    data = json.loads((champion / "champion.json").read_text())
    (champion / "champion.json").write_text(json.dumps({**data, "candidate_id": reg["ids"][0]}))
    problems = verify.verify_log(registry, champion)
    assert any("champion.json" in p and reg["ids"][0] in p for p in problems), problems


def test_verify_names_an_alias_that_disagrees_with_the_log(reg):
    registry = reg["registry"]
    store.set_alias(registry, reg["ids"][0], 1)
    [problem] = verify.verify_log(registry)
    assert "alias" in problem and "entry 2" in problem and reg["ids"][1] in problem


# ---- keyed mode: tamper evidence against deliberate edits -------------------------------------------


def _forge(registry, line_no: int, old: str, new: str) -> None:
    """What someone who knows the format does: edit a line, then recompute every later prev_sha256 and HEAD."""
    path = registry / promotion_log.LOG_FILE
    lines = path.read_text().splitlines()
    lines[line_no - 1] = lines[line_no - 1].replace(old, new)
    for i in range(line_no, len(lines)):
        entry = json.loads(lines[i])
        entry["prev_sha256"] = hashlib.sha256(lines[i - 1].encode()).hexdigest()
        lines[i] = json.dumps(entry, sort_keys=True)
    path.write_text("\n".join(lines) + "\n")
    (registry / promotion_log.HEAD_FILE).write_text(hashlib.sha256(lines[-1].encode()).hexdigest() + "\n")


def test_a_recomputed_chain_passes_plain_verify_but_not_keyed_verify(tmp_path, monkeypatch):
    registry = tmp_path / "registry"
    monkeypatch.setenv(promotion_log.KEY_VAR, "s3cret")
    for decision in ("refused", "promoted", "refused"):
        promotion_log.append_log(registry, {"decision": decision, "metrics": {P: 0.5}})
    assert all(e.get("hmac") for e in promotion_log.read_log(registry))
    assert verify.verify_log(registry, key="s3cret") == []
    _forge(registry, 2, '"promoted"', '"refused"')
    assert verify.verify_log(registry) == []  # the chain alone guards against accidents only
    [problem] = verify.verify_log(registry, key="s3cret")
    assert "promotions.jsonl:2:" in problem and "hmac" in problem
    assert verify.verify_log(registry, key="another key")  # a wrong key fails too


def test_keyed_verify_names_entries_written_without_the_key(tmp_path, monkeypatch, capsys):
    registry = tmp_path / "registry"
    promotion_log.append_log(registry, {"decision": "refused"})
    monkeypatch.setenv(promotion_log.KEY_VAR, "s3cret")
    promotion_log.append_log(registry, {"decision": "refused"})
    [problem] = verify.verify_log(registry, key="s3cret")
    assert "promotions.jsonl:1:" in problem and "no hmac" in problem
    assert cli.main(["registry", "verify", "--registry", str(registry)]) == 1  # the CLI reads the key
    monkeypatch.delenv(promotion_log.KEY_VAR)
    assert cli.main(["registry", "verify", "--registry", str(registry)]) == 0
    assert f"{promotion_log.KEY_VAR} is not set" in capsys.readouterr().out


# ---- rollback --to takes registry ids only -------------------------------------------------------------


@pytest.mark.parametrize("target", ["../../evil", "*", "[ab]*", "a/b", "", "ABC", "a b", "..", "0x12"])
def test_rollback_to_accepts_only_registry_ids(reg, target, capsys):
    evil = _adapter(reg["tmp"] / "evil", "evil")  # what ../../evil names, seen from models/registry/candidates
    (evil / store.RECORD_FILE).write_text(json.dumps({"candidate_id": "evil", "base_model": "base"}))
    before = _files(reg["champion"]), (reg["registry"] / promotion_log.LOG_FILE).read_bytes()
    argv = ["registry", "rollback", "--to", target, "--registry", str(reg["registry"])]
    assert cli.main([*argv, "--champion", str(reg["champion"])]) == 2
    assert "not a registry id" in capsys.readouterr().err
    assert (_files(reg["champion"]), (reg["registry"] / promotion_log.LOG_FILE).read_bytes()) == before
    with pytest.raises(FineflowError, match="not a registry id"):
        store.candidate_dir(reg["registry"], target)


# ---- a rollback is not undone by the next promote ---------------------------------------------------------


def test_a_rolled_back_candidate_is_refused_until_it_is_reinstalled_deliberately(reg):
    registry, champion = reg["registry"], reg["champion"]
    a, b = reg["ids"]
    assert promotion_log.rollback_refusal(registry, b) is None
    result = champion_mod.rollback(registry, champion)
    assert (result["from"], result["to"]) == (b, a)
    reason = promotion_log.rollback_refusal(registry, b)
    assert f"entry {result['log_seq']}" in reason and f"rollback --to {b}" in reason
    assert promotion_log.rollback_refusal(registry, a) is None
    champion_mod.rollback(registry, champion, to=b)  # forward again, deliberately
    assert promotion_log.rollback_refusal(registry, b) is None
    assert promotion_log.rollback_refusal(registry, a) is not None


# ---- keyed mode binds what is served and the log's length (issue 29) ---------------------------------------


def _verify_keyed(reg) -> list[str]:
    return verify.verify_log(reg["registry"], reg["champion"], key=reg["key"])


@pytest.mark.parametrize(
    "served", ["merged/model.safetensors", "tokenizer.json", store.CARD_FILE, "merged/model-00002.safetensors"]
)
def test_keyed_verify_names_a_served_file_changed_even_with_the_alias_hash_recomputed(keyed, served):
    """Someone with write access but not the key replaces (or adds) a file a server loads and recomputes the
    alias's files_sha256: the keyed log entry that installed the champion still names the original bytes."""
    registry, champion = keyed["registry"], keyed["champion"]
    (champion / served).write_text("weights of someone else's choosing")
    alias = store.read_alias(registry)
    store.set_alias(registry, alias["id"], alias["seq"], install.champion_files_hash(champion))
    problems = _verify_keyed(keyed)
    assert any(served in p and "entry 2" in p for p in problems), problems


def _cut_log(registry, keep: int) -> None:
    path = registry / promotion_log.LOG_FILE
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:keep]))


@pytest.mark.parametrize("head", ["deleted", "recomputed"])
def test_keyed_verify_names_trailing_entries_deleted(keyed, head):
    registry = keyed["registry"]
    promotion_log.append_log(registry, {"decision": "refused", "candidate_id": "f" * 16})
    _cut_log(registry, 2)  # entry 3 (a refusal: nothing installed after it) is gone
    head_file = registry / promotion_log.HEAD_FILE
    if head == "deleted":
        head_file.unlink()
    else:  # as the unkeyed HEAD is computed: the sha256 of the (new) last line
        last = (registry / promotion_log.LOG_FILE).read_text().splitlines()[-1]
        head_file.write_text(hashlib.sha256(last.encode()).hexdigest() + "\n")
    problems = _verify_keyed(keyed)
    assert problems and "HEAD" in problems[0], problems
    # and no keyed writer extends (and so vouches for) a log its HEAD does not
    with pytest.raises(FineflowError, match="HEAD"):
        promotion_log.append_log(registry, {"decision": "refused"})
    promotion_log.repair_log(registry, log=lambda m: None)  # nor does repair, which promote runs first
    assert _verify_keyed(keyed)


def test_keyed_verify_names_an_edited_last_line_with_head_deleted(keyed):
    """An edit the entry's HMAC does not see (the HMAC is over the parsed entry): a duplicate key that a
    first-key-wins reader takes as "promoted", and other bytes; with HEAD deleted the chain cannot tell."""
    registry = keyed["registry"]
    promotion_log.append_log(registry, {"decision": "refused", "candidate_id": "f" * 16})
    path = registry / promotion_log.LOG_FILE
    lines = path.read_text().splitlines()
    lines[-1] = '{"decision": "promoted", ' + lines[-1][1:]
    path.write_text("\n".join(lines) + "\n")
    (registry / promotion_log.HEAD_FILE).unlink()
    problems = _verify_keyed(keyed)
    assert problems and "promotions.jsonl:3" in problems[0], problems


def _refused_candidate(reg, name: str = "c") -> str:
    """A candidate the gate refused: stored, and logged as refused."""
    cid, _ = _store(reg["registry"], _adapter(reg["tmp"] / f"adapter-{name}", name), decision="refused")
    promotion_log.append_log(reg["registry"], {"candidate_id": cid, "decision": "refused", "promote": False})
    return cid


def test_a_rollback_to_a_candidate_the_gate_refused_needs_an_override_and_is_logged_as_one(keyed, capsys):
    registry, champion = keyed["registry"], keyed["champion"]
    refused = _refused_candidate(keyed)
    before = _files(champion), (registry / promotion_log.LOG_FILE).read_bytes()
    args = ["--to", refused, "--registry", str(registry), "--champion", str(champion)]
    assert cli.main(["registry", "rollback", *args]) == 2
    err = capsys.readouterr().err
    assert "never promoted" in err and "--allow-unpromoted" in err
    assert (_files(champion), (registry / promotion_log.LOG_FILE).read_bytes()) == before
    assert cli.main(["registry", "rollback", *args, "--allow-unpromoted", "hotfix: b leaks PII"]) == 0
    last = promotion_log.read_log(registry)[-1]
    assert last["decision"] == "rollback" and last["candidate_id"] == refused
    assert last["override"] == {"unpromoted": True, "reason": "hotfix: b leaks PII"}
    assert "never promoted by the gate" in (champion / store.CARD_FILE).read_text()
    assert _verify_keyed(keyed) == []
    assert cli.main(["registry", "verify", "--registry", str(registry), "--champion", str(champion)]) == 0
    out = capsys.readouterr().out
    assert "never promoted by the gate" in out and "hotfix: b leaks PII" in out


def test_verify_names_a_rollback_to_an_unpromoted_candidate_logged_without_the_override(reg):
    """What main's rollback wrote (or a hand edit of an unkeyed log): an install of a refused candidate with no
    logged override."""
    registry = reg["registry"]
    refused = _refused_candidate(reg)
    promotion_log.append_log(registry, {"candidate_id": refused, "decision": "rollback", "promote": True})
    problems = verify.verify_log(registry)
    assert any("promotions.jsonl:4" in p and refused in p and "never promoted" in p for p in problems), problems


def test_keyed_head_one_behind_is_finished_and_head_ahead_is_truncation(keyed):
    """A keyed append writes the line, then HEAD: a crash between leaves HEAD one entry behind a complete, keyed
    last line (repair finishes HEAD); HEAD ahead of the log is truncation (verify fails, repair leaves it)."""
    registry = keyed["registry"]
    head = registry / promotion_log.HEAD_FILE
    behind = head.read_bytes()
    promotion_log.append_log(registry, {"decision": "refused", "candidate_id": "f" * 16})
    ahead = head.read_bytes()
    head.write_bytes(behind)
    [problem] = _verify_keyed(keyed)
    assert "one entry behind" in problem
    promotion_log.repair_log(registry, log=lambda m: None)
    assert _verify_keyed(keyed) == [] and head.read_bytes() == ahead
    # the last newline removed: not a half-written line to cut, since the keyed HEAD counts it
    path = registry / promotion_log.LOG_FILE
    path.write_bytes(path.read_bytes()[:-1])
    [problem] = _verify_keyed(keyed)
    assert "promotions.jsonl:3: no newline" in problem
    promotion_log.repair_log(registry, log=lambda m: None)
    assert len(path.read_text().splitlines()) == 3 and _verify_keyed(keyed) == []
    # HEAD ahead of the log (entry 3 cut off with its newline): truncation, which repair leaves for verify
    _cut_log(registry, 2)
    promotion_log.repair_log(registry, log=lambda m: None)
    [problem] = _verify_keyed(keyed)
    assert "counts 3 entries, the log has 2" in problem and "removed from its end" in problem


def test_an_unkeyed_head_of_the_old_format_is_still_read(reg):
    """Registries written before HEAD carried a count: HEAD is the bare sha256 of the last line."""
    registry = reg["registry"]
    last = (registry / promotion_log.LOG_FILE).read_text().splitlines()[-1]
    (registry / promotion_log.HEAD_FILE).write_text(hashlib.sha256(last.encode()).hexdigest() + "\n")
    assert verify.verify_log(registry, reg["champion"]) == []
    (registry / promotion_log.HEAD_FILE).write_text("0" * 64 + "\n")
    [problem] = verify.verify_log(registry, reg["champion"])
    assert "last line was edited" in problem


def test_a_keyed_log_with_an_unkeyed_head_is_sealed_only_on_request(keyed, capsys):
    """A log keyed by a fineflow whose HEAD was the bare sha256: keyed verify and appends refuse it (the same
    HEAD is what someone who truncated the log would write), until a person who checked it seals it."""
    registry = keyed["registry"]
    last = (registry / promotion_log.LOG_FILE).read_text().splitlines()[-1]
    (registry / promotion_log.HEAD_FILE).write_text(hashlib.sha256(last.encode()).hexdigest() + "\n")
    [problem] = _verify_keyed(keyed)
    assert "no valid hmac" in problem and "--seal-head" in problem
    args = ["--registry", str(registry), "--champion", str(keyed["champion"])]
    assert cli.main(["registry", "repair", *args]) == 1  # repair alone does not re-key it
    assert cli.main(["registry", "repair", "--seal-head", *args]) == 0
    assert _verify_keyed(keyed) == [] and "now names the log's 2 entries (keyed)" in capsys.readouterr().out


def test_a_crash_between_the_log_append_and_the_swap_installs_the_staged_champion_the_entry_recorded(
    keyed, monkeypatch
):
    """The staged copy is the one whose files the keyed entry recorded: recover swaps it in rather than build
    again (a rebuild need not give the same bytes: the card's run figures are not in the record)."""
    registry, champion = keyed["registry"], keyed["champion"]
    cid, record = _store(registry, _adapter(keyed["tmp"] / "adapter-c", "c"))
    staging = fake_build(install.staging_dir(champion), store.candidate_dir(registry, cid), "base", record, None)
    (staging / store.CARD_FILE).write_text("a card with this run's figures")
    champion_mod.log_decision(registry, {"candidate_id": cid, "decision": "promoted", "promote": True}, staging, record)

    def no_build(*args, **kwargs):
        raise AssertionError("the staged champion is the one the entry recorded: nothing to build")

    monkeypatch.setattr(champion_mod, "build_champion", no_build)
    champion_mod.recover(registry, champion, log=lambda m: None)
    assert store.alias_id(registry) == cid and _verify_keyed(keyed) == []
    assert (champion / store.CARD_FILE).read_text() == "a card with this run's figures"
    assert not staging.exists()


def test_the_card_is_bound_but_for_its_run_figures_which_differ_between_two_runs_of_the_same_inputs(keyed):
    """The registry is a DVC output that the flow and `dvc repro` must leave alike: the entry binds every line
    of the card but the run figures (wall time, tokens/s), and only figures as the card writes them."""
    card_path = keyed["champion"] / store.CARD_FILE
    text = card_path.read_text()
    assert card.NO_RUN_FIGURES in text
    card_path.write_text(text.replace(card.NO_RUN_FIGURES, card.RUN_FIGURES + "wall_s 3.5, tokens_per_s 1234.5"))
    assert _verify_keyed(keyed) == []
    card_path.write_text(text.replace(card.NO_RUN_FIGURES, card.RUN_FIGURES + "wall_s 3.5, audited by the safety team"))
    [problem] = _verify_keyed(keyed)
    assert "README.md" in problem and "entry 2" in problem


def test_with_the_key_set_on_an_unkeyed_registry_a_torn_line_is_still_repaired_and_appends_go_on(tmp_path, monkeypatch):
    """Keyed verify never vouches for a log not keyed from its first entry, but its promotions are not stopped."""
    registry = tmp_path / "registry"
    for _ in range(2):
        promotion_log.append_log(registry, {"decision": "refused"})
    monkeypatch.setenv(promotion_log.KEY_VAR, "s3cret")
    with (registry / promotion_log.LOG_FILE).open("a") as fh:
        fh.write('{"candidate_id": "c0ffee", "decis')
    [message] = promotion_log.repair_log(registry, log=lambda m: None)
    assert "half-written" in message
    assert promotion_log.append_log(registry, {"decision": "refused"})["seq"] == 3
    assert verify.verify_log(registry) == []
    [problem] = verify.verify_log(registry, key="s3cret")
    assert "carry no hmac" in problem


def test_no_champion_is_built_from_a_stored_candidate_whose_files_were_changed(keyed):
    """A rollback (or a promote of the same adapter) would otherwise install the changed files, and the keyed
    entry would record them as served."""
    registry, champion = keyed["registry"], keyed["champion"]
    a = keyed["ids"][0]
    (registry / "candidates" / a / "adapter_model.safetensors").write_text("weights of someone else's choosing")
    before = _files(champion), (registry / promotion_log.LOG_FILE).read_bytes()
    with pytest.raises(FineflowError, match="no longer hash to the candidate id"):
        champion_mod.rollback(registry, champion, to=a)
    with pytest.raises(FineflowError, match="no longer hash to the candidate id"):
        _store(registry, _adapter(keyed["tmp"] / "adapter-a-again", "a"))
    assert (_files(champion), (registry / promotion_log.LOG_FILE).read_bytes()) == before
