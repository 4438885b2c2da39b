"""The promotion gate and the on-disk model registry.

A candidate becomes champion only if its primary metric beats the reference (the current champion, or
the base model when there is none) by ``promote.min_delta``, a seeded paired bootstrap over the
per-sample scores puts the lower end of the delta's confidence interval above 0 (so a lucky run on a
small eval set is not promoted), and no other metric regresses by more than ``promote.max_regression``.
It is refused outright, with the reason, when an evaluation is missing or failed, the eval data differs
from the champion's, or the candidate's lineage manifest is missing or incomplete.

The registry (``models/registry``, DVC-tracked, persist)::

    candidates/<id>/          every candidate evaluated, by id (short sha256 of its adapter files):
                              the adapter (or full model) files + record.json (metrics, samples, eval data
                              hash, decision, deterministic lineage)
    champion.json             the alias: {"id": ..., "seq": <log entry that installed it>}
    promotions.jsonl          append-only; each entry carries the sha256 of the previous line
    HEAD                      sha256 of the last line (so editing the last entry is detectable too)

The champion is a stable path (``models/champion``) replaced atomically: the new one is assembled in a
temporary sibling directory and swapped in with renames. ``fineflow registry verify`` checks the chain,
``fineflow registry rollback`` reinstalls an earlier champion and logs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from fineflow.reports import sha256_file

CHAMPION_FILE = "champion.json"
LOG_FILE = "promotions.jsonl"
HEAD_FILE = "HEAD"
RECORD_FILE = "record.json"
ID_LEN = 16


@dataclass(frozen=True)
class Bootstrap:
    """Paired bootstrap of mean(candidate - reference) over per-sample scores."""

    delta: float
    ci_low: float
    ci_high: float
    p_value: float  # one-sided: share of bootstrap deltas <= 0
    n: int
    confidence: float
    samples: int
    seed: int

    def describe(self) -> str:
        return (f"{self.delta:+.4f}, {self.confidence:.0%} CI [{self.ci_low:+.4f}, {self.ci_high:+.4f}], "
                f"p={self.p_value:.3f}, n={self.n}")


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    primary: str
    candidate: float | None
    reference: float | None
    reference_name: str
    regressions: dict
    stats: dict | None = None  # the Bootstrap as a dict, when it was computed


def flatten(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    """{task: {metric: v}} -> {"task/metric": v}."""
    return {f"{task}/{name}": value for task, values in metrics.items() for name, value in values.items()}


def paired_bootstrap(candidate: Sequence[float], reference: Sequence[float], samples: int = 2000,
                     confidence: float = 0.95, seed: int = 0) -> Bootstrap:
    """Resample the paired differences with replacement ``samples`` times (numpy, seeded): mean delta,
    percentile CI and the one-sided p-value. Memory stays bounded for long eval sets (chunks of rows)."""
    import numpy as np

    diffs = np.asarray(candidate, dtype=np.float64) - np.asarray(reference, dtype=np.float64)
    n = int(diffs.size)
    if n == 0:
        raise ValueError("no paired samples")
    rng = np.random.default_rng(seed)
    means = np.empty(samples, dtype=np.float64)
    chunk = max(1, (1 << 22) // n)
    for start in range(0, samples, chunk):
        k = min(chunk, samples - start)
        means[start:start + k] = diffs[rng.integers(0, n, size=(k, n))].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return Bootstrap(delta=round(float(diffs.mean()), 6), ci_low=round(float(low), 6), ci_high=round(float(high), 6),
                     p_value=round(float((means <= 0).mean()), 6), n=n, confidence=confidence, samples=samples,
                     seed=seed)


def decide(candidate: dict[str, float], reference: dict[str, float], reference_name: str, primary: str,
           min_delta: float, max_regression: float, stats: Bootstrap | None = None) -> Decision:
    """The gate on numbers. Metrics are flat {"task/metric": value}, higher is better. With stats (the
    paired bootstrap of the primary metric) the delta is the paired mean and its CI must exclude 0."""
    cand, ref = candidate.get(primary), reference.get(primary)
    st = asdict(stats) if stats else None

    def refuse(reason: str, regressions: dict | None = None) -> Decision:
        return Decision(False, reason, primary, cand, ref, reference_name, regressions or {}, st)

    if cand is None:
        return refuse(f"the candidate has no value for the primary metric {primary}")
    if ref is None:
        return refuse(f"the {reference_name} has no value for the primary metric {primary}")
    regressions = {key: round(reference[key] - value, 6) for key, value in candidate.items()
                   if key != primary and key in reference and reference[key] - value > max_regression}
    if regressions:
        return refuse(f"regressed beyond promote.max_regression={max_regression} on {sorted(regressions)} "
                      f"versus the {reference_name}: " + ", ".join(f"{k} -{v:.4f}" for k, v in sorted(regressions.items())),
                      regressions)
    delta = stats.delta if stats else cand - ref
    evidence = f" ({stats.describe()})" if stats else ""
    if delta < min_delta:
        return refuse(f"{primary} {cand:.4f} does not beat the {reference_name}'s {ref:.4f} by "
                      f"promote.min_delta={min_delta}: delta {delta:+.4f}{evidence}")
    if stats and stats.ci_low <= 0:
        return refuse(f"{primary} delta {delta:+.4f} over the {reference_name} is within noise: the "
                      f"{stats.confidence:.0%} CI [{stats.ci_low:+.4f}, {stats.ci_high:+.4f}] includes 0 "
                      f"(p={stats.p_value:.3f}, n={stats.n})")
    return Decision(True, f"{primary} {cand:.4f} beats the {reference_name}'s {ref:.4f} by {delta:+.4f} "
                          f"(>= {min_delta}){evidence} with no regression", primary, cand, ref, reference_name, {}, st)


def _refused(reason: str, primary: str, reference_name: str = "reference") -> Decision:
    return Decision(False, reason, primary, None, None, reference_name, {}, None)


def _per_sample(entry: dict, primary: str) -> dict | None:
    """{doc_id: score} of the primary metric from an evaluation entry's samples, or None."""
    task, _, metric = primary.partition("/")
    rows = (entry.get("samples") or {}).get(task)
    if not rows:
        return None
    scores = {r["doc_id"]: float(r[metric]) for r in rows
              if isinstance(r.get(metric), (int, float)) and "doc_id" in r}
    return scores or None


def same_id(a: str | None, b: str | None) -> bool:
    """Candidate ids match when one is a prefix of the other (short ids vs the log's older full hashes)."""
    return bool(a and b) and (a.startswith(b) or b.startswith(a))


def gate(scores: dict, champion: dict | None, lineage_missing: list[str] | None, *, primary: str,
         min_delta: float, max_regression: float, bootstrap_samples: int, confidence: float, seed: int,
         eval_data_sha256: str | None) -> Decision:
    """The whole gate. scores is eval/scores.json; champion the current champion's record ({"id",
    "metrics" flat, "samples", "eval_data_sha256"}) or None; lineage_missing the REQUIRED lineage fields
    that are absent (None: no manifest at all). Never promotes on missing or doubtful evidence."""
    candidate = scores.get("candidate")
    if candidate and candidate.get("status", "ok") != "ok":
        return _refused(f"the candidate's evaluation failed: {candidate.get('error', 'no error given')}", primary)
    if not candidate or not candidate.get("metrics"):
        return _refused("no candidate evaluation in the scores: run the evaluate stage", primary)
    if lineage_missing is None:
        return _refused("the candidate has no lineage manifest", primary)
    if lineage_missing:
        return _refused(f"the candidate's lineage is incomplete: missing {', '.join(lineage_missing)}", primary)

    if champion is None:
        reference_name, reference = "base model", scores.get("base")
        if reference and reference.get("status", "ok") != "ok":
            return _refused(f"the base model's evaluation failed: {reference.get('error', 'no error given')}",
                            primary, reference_name)
        if not reference or not reference.get("metrics"):
            return _refused("no base model evaluation in the scores (needed when there is no champion)", primary,
                            reference_name)
    else:
        cid = champion["id"]
        reference_name = f"champion {cid[:ID_LEN]}"
        recorded = champion.get("eval_data_sha256")
        if recorded and not eval_data_sha256:
            return _refused("the scores do not say which eval data they were computed on (no eval_data_sha256), "
                            f"so they cannot be compared with the {reference_name}'s", primary, reference_name)
        if recorded and recorded != eval_data_sha256:
            return _refused(f"evaluated on different eval data than the {reference_name}: sha256 "
                            f"{eval_data_sha256[:12]} now, {recorded[:12]} when it was promoted; evaluate on the "
                            "champion's eval data (or roll back / re-baseline deliberately)", primary, reference_name)
        evaluated = scores.get("champion")
        if evaluated is not None:
            if evaluated.get("status", "ok") != "ok":
                return _refused(f"the {reference_name}'s evaluation failed: "
                                f"{evaluated.get('error', 'no error given')}", primary, reference_name)
            if evaluated.get("id") and not same_id(evaluated["id"], cid):
                return _refused(f"the scores evaluated champion {evaluated['id'][:ID_LEN]} but the registry's "
                                f"champion is {cid[:ID_LEN]}: re-run the evaluate stage", primary, reference_name)
            reference = evaluated
        elif not recorded:
            return _refused(f"the {reference_name} has no recorded eval data hash and was not re-evaluated in "
                            "this run, so its metrics cannot be compared", primary, reference_name)
        else:
            reference = {"metrics": None, "flat": champion.get("metrics") or {}, "samples": champion.get("samples")}

    cand_flat = flatten(candidate["metrics"])
    ref_flat = reference.get("flat") if reference.get("metrics") is None else flatten(reference["metrics"])
    cand_samples, ref_samples = _per_sample(candidate, primary), _per_sample(reference, primary)
    if cand_flat.get(primary) is None or ref_flat.get(primary) is None:
        return decide(cand_flat, ref_flat, reference_name, primary, min_delta, max_regression)
    if cand_samples is None or ref_samples is None:
        who = "candidate" if cand_samples is None else reference_name
        return Decision(False, f"no per-sample {primary} scores for the {who}: the gate needs them for the paired "
                               "bootstrap", primary, cand_flat.get(primary), ref_flat.get(primary), reference_name,
                        {}, None)
    if set(cand_samples) != set(ref_samples):
        return Decision(False, f"the candidate's and the {reference_name}'s per-sample scores cover different docs "
                               f"({len(cand_samples)} vs {len(ref_samples)}): not comparable", primary,
                        cand_flat.get(primary), ref_flat.get(primary), reference_name, {}, None)
    docs = sorted(cand_samples)
    stats = paired_bootstrap([cand_samples[d] for d in docs], [ref_samples[d] for d in docs], bootstrap_samples,
                             confidence, seed)
    return decide(cand_flat, ref_flat, reference_name, primary, min_delta, max_regression, stats)


# ---- files ---------------------------------------------------------------------------------------


def directory_hash(path: Path, exclude: tuple[str, ...] = ()) -> str:
    """sha256 over the relative names and bytes of every file below path (sorted): a content id."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name not in exclude):
        digest.update(str(file.relative_to(path)).encode() + b"\0")
        digest.update(bytes.fromhex(sha256_file(file)))
    return digest.hexdigest()


def candidate_id(adapter_dir: Path) -> str:
    """The short content id of an adapter (or full model) directory."""
    return directory_hash(adapter_dir, exclude=(RECORD_FILE,))[:ID_LEN]


def _write_json(path: Path, payload: dict) -> None:
    from fineflow.reports import write_json_atomic

    write_json_atomic(path, payload)


def read_champion(champion_dir: Path) -> dict | None:
    """The installed champion's record (its metrics at promotion), or None when there is no champion yet."""
    try:
        record = json.loads((champion_dir / CHAMPION_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    return record if record.get("candidate_id") else None


def current_champion(registry_dir: Path, champion_dir: Path) -> dict | None:
    """The champion the gate compares with: {"id", "metrics" (flat), "samples", "eval_data_sha256"}.

    The registry alias is authoritative; a champion installed before the registry had candidates (an
    older champion.json with metrics only) is still honoured, with no samples and no eval data hash."""
    alias = registry_dir / CHAMPION_FILE
    if alias.is_file():
        cid = json.loads(alias.read_text(encoding="utf-8")).get("id")
        if cid:
            record = read_record(registry_dir, cid)
            return {"id": cid, "metrics": record.get("metrics") or {}, "samples": record.get("samples"),
                    "eval_data_sha256": record.get("eval_data_sha256")}
    legacy = read_champion(champion_dir)
    if legacy is None:
        return None
    return {"id": legacy["candidate_id"], "metrics": legacy.get("metrics") or {}, "samples": legacy.get("samples"),
            "eval_data_sha256": legacy.get("eval_data_sha256")}


def read_record(registry_dir: Path, cid: str) -> dict:
    from fineflow.errors import FineflowError

    path = candidate_dir(registry_dir, cid) / RECORD_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise FineflowError(f"{path}: cannot read the candidate record ({exc})") from None


def candidate_dir(registry_dir: Path, cid: str) -> Path:
    """candidates/<id>; a unique prefix of an id is accepted."""
    from fineflow.errors import FineflowError

    root = registry_dir / "candidates"
    exact = root / cid
    if exact.is_dir():
        return exact
    matches = sorted(p for p in root.glob(f"{cid}*") if p.is_dir()) if root.is_dir() else []
    if len(matches) == 1:
        return matches[0]
    raise FineflowError(f"{root}: no single candidate with id {cid!r} ({len(matches)} match)")


def store_candidate(registry_dir: Path, adapter_dir: Path, cid: str, record: dict) -> Path:
    """Keep the candidate's files and record under candidates/<id> (assembled aside, renamed in)."""
    dest = registry_dir / "candidates" / cid
    staging = dest.with_name(f".{cid}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    if dest.is_dir():  # the same adapter evaluated again: files are identical by construction
        _write_json(dest / RECORD_FILE, record)
        return dest
    shutil.copytree(adapter_dir, staging)
    _write_json(staging / RECORD_FILE, record)
    os.replace(staging, dest)
    return dest


def swap_in(staging: Path, champion_dir: Path) -> None:
    """Replace champion_dir by the complete staging dir with two renames; nothing half-written is visible."""
    retired = champion_dir.with_name(f".{champion_dir.name}.retired")
    shutil.rmtree(retired, ignore_errors=True)
    if champion_dir.exists():
        os.replace(champion_dir, retired)
    os.replace(staging, champion_dir)
    shutil.rmtree(retired, ignore_errors=True)


def staging_dir(champion_dir: Path) -> Path:
    staging = champion_dir.with_name(f".{champion_dir.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def install_champion(adapter_dir: Path, champion_dir: Path, record: dict) -> None:
    """Replace champion_dir with the adapter plus its record, via a temp dir and renames."""
    staging = staging_dir(champion_dir)
    shutil.copytree(adapter_dir, staging)
    (staging / CHAMPION_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    swap_in(staging, champion_dir)


def ensure_empty_champion(champion_dir: Path) -> None:
    """Before the first promotion the champion path still exists (DVC tracks it), holding a null record."""
    champion_dir.mkdir(parents=True, exist_ok=True)
    if not (champion_dir / CHAMPION_FILE).exists():
        (champion_dir / CHAMPION_FILE).write_text(json.dumps({"candidate_id": None}) + "\n", encoding="utf-8")


def set_alias(registry_dir: Path, cid: str, seq: int) -> None:
    _write_json(registry_dir / CHAMPION_FILE, {"id": cid, "seq": seq})


# ---- the promotion log ---------------------------------------------------------------------------


def _entry_hash(line: str) -> str:
    return hashlib.sha256(line.encode("utf-8")).hexdigest()


def append_log(registry_dir: Path, entry: dict) -> dict:
    """Append entry to the promotion log, chained to the previous entry by its sha256; HEAD follows."""
    registry_dir.mkdir(parents=True, exist_ok=True)
    path = registry_dir / LOG_FILE
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    full = {"seq": len(lines) + 1, "prev_sha256": _entry_hash(lines[-1]) if lines else None, **entry}
    line = json.dumps(full, sort_keys=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    (registry_dir / HEAD_FILE).write_text(_entry_hash(line) + "\n", encoding="utf-8")
    return full


def read_log(registry_dir: Path) -> list[dict]:
    path = registry_dir / LOG_FILE
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []


def verify_log(registry_dir: Path) -> list[str]:
    """Problems with the registry, first the first bad line of the chain; [] when it is intact.

    Checks: every line is JSON with seq = its line number and prev_sha256 = sha256 of the line before;
    HEAD (when present) is the sha256 of the last line; every stored candidate's files still hash to its
    id; the champion alias names a stored candidate."""
    path = registry_dir / LOG_FILE
    if not path.exists():
        return [f"{path}: no promotion log"]
    problems: list[str] = []
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    previous = None
    for number, line in enumerate(lines, start=1):
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            return [f"{where}: not valid JSON (the line was edited or truncated)"]
        if not isinstance(entry, dict):
            return [f"{where}: not a JSON object"]
        expected = _entry_hash(previous) if previous is not None else None
        if entry.get("prev_sha256") != expected:
            return [f"{where}: prev_sha256 does not match the sha256 of line {number - 1} (line {number - 1} was "
                    "edited, inserted or removed)" if number > 1 else f"{where}: the first entry has a prev_sha256"]
        if entry.get("seq") != number:
            return [f"{where}: seq {entry.get('seq')} != line number {number} (entries removed or reordered)"]
        previous = line
    head = registry_dir / HEAD_FILE
    if head.exists() and previous is not None and head.read_text(encoding="utf-8").strip() != _entry_hash(previous):
        return [f"{path}:{len(lines)}: the last entry does not match {head} (the last line was edited)"]
    for cdir in sorted((registry_dir / "candidates").glob("*")) if (registry_dir / "candidates").is_dir() else []:
        if cdir.is_dir() and not cdir.name.startswith(".") and candidate_id(cdir) != cdir.name:
            problems.append(f"{cdir}: files no longer hash to the candidate id (changed after it was stored)")
    alias = registry_dir / CHAMPION_FILE
    if alias.exists():
        cid = json.loads(alias.read_text(encoding="utf-8")).get("id")
        if cid and not (registry_dir / "candidates" / cid).is_dir():
            problems.append(f"{alias}: names champion {cid}, which is not in {registry_dir / 'candidates'}")
    return problems


def champion_history(registry_dir: Path) -> list[str]:
    """Candidate ids that were champion, oldest first, as the log's promoted/rollback entries say."""
    return [e["candidate_id"] for e in read_log(registry_dir)
            if e.get("decision") in ("promoted", "rollback") and e.get("candidate_id")]


def decision_record(decision: Decision) -> dict:
    return asdict(decision)
