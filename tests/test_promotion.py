"""The promotion gate's decisions and the hash-chained promotion log."""

import json

from fineflow.promotion import (append_log, decide, directory_hash, ensure_empty_champion, install_champion,
                                read_champion)

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
