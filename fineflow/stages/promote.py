"""Stage promote: the gate between a candidate adapter and the champion.

    python -m fineflow.stages.promote --scores eval/scores.json --adapter models/candidate \
        --champion models/champion --registry models/registry --base-dir models/base \
        --shards data/shards --train-report reports/train.json --lineage reports/lineage

Builds the run's lineage manifest, runs the gate (fineflow.registry.promotion.gate: min_delta, paired bootstrap CI,
no regression, refusal on missing/failed/mismatched evaluations or incomplete lineage), keeps the candidate
in the registry by id, appends the decision and its evidence to ``<registry>/promotions.jsonl``, and on
success installs the champion atomically: the PEFT adapter, the merged model (``merged/``), the tokenizer,
a model card (``README.md``) and the deterministic lineage (``lineage.json``). The full manifest (with git,
times, user, host) goes to ``<lineage>/<candidate id>.json``, outside DVC's outputs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import yaml

from fineflow.config import Params
from fineflow.errors import FineflowError
from fineflow.registry.lineage import build_manifest, deterministic, missing_fields
from fineflow.registry.promotion import (CHAMPION_FILE, RECORD_FILE, Decision, append_log, candidate_dir, candidate_id,
                                champion_history, current_champion, decision_record, directory_hash,
                                ensure_empty_champion, flatten, gate, paired_bootstrap, read_record, set_alias,
                                staging_dir, store_candidate, swap_in)
from fineflow.reports import sha256_file, write_json_atomic
from fineflow.stages._entry import log, run_entry, stage_parser

LICENSE_PLACEHOLDER = "apache-2.0"  # fineflow's own license; replace with your base model's and data's terms
TRAIN_FIGURES = ("wall_s", "tokens_per_s", "steps", "tokens", "final_loss", "eval_loss", "world_size")


def _read_scores(path: Path) -> tuple[dict | None, str | None]:
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"{path}: cannot read evaluation scores ({exc}); run the evaluate stage"


def eval_data_hash(scores: dict) -> str | None:
    """The scores' eval_data_sha256, or (older scores) the sha256 of the eval rows file they name."""
    if scores.get("eval_data_sha256"):
        return scores["eval_data_sha256"]
    rows = Path(scores.get("eval_rows") or "")
    return sha256_file(rows) if scores.get("eval_rows") and rows.is_file() else None


def base_reference(params: Params, base_dir: Path | None, adapter_dir: Path) -> str:
    """What from_pretrained loads as the base: --base-dir (or the user's model.base), else the adapter's own."""
    if base_dir is not None:
        from fineflow.model_ref import resolve_base_model

        return resolve_base_model(params.model, base_dir)
    try:
        return json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))["base_model_name_or_path"]
    except (OSError, KeyError, json.JSONDecodeError):
        raise FineflowError(f"{adapter_dir}: cannot tell the base model; pass --base-dir") from None


def _base_or_none(params: Params, base_dir: Path | None, adapter_dir: Path) -> str | None:
    try:
        return base_reference(params, base_dir, adapter_dir)
    except FineflowError:
        return None


def stats_vs(candidate: dict, reference: dict, samples: int, confidence: float, seed: int) -> dict:
    """Paired bootstrap of every task/metric both entries have per-sample scores for: {"task/metric": stats}."""
    out = {}
    for task, metrics in (candidate.get("metrics") or {}).items():
        cand_rows = {r["doc_id"]: r for r in (candidate.get("samples") or {}).get(task) or []}
        ref_rows = {r["doc_id"]: r for r in (reference.get("samples") or {}).get(task) or []}
        docs = sorted(set(cand_rows) & set(ref_rows))
        for metric in metrics:
            pairs = [(cand_rows[d][metric], ref_rows[d][metric]) for d in docs
                     if isinstance(cand_rows[d].get(metric), (int, float))
                     and isinstance(ref_rows[d].get(metric), (int, float))]
            if pairs and len(pairs) == len(cand_rows) == len(ref_rows):
                b = paired_bootstrap([c for c, _ in pairs], [r for _, r in pairs], samples, confidence, seed)
                out[f"{task}/{metric}"] = {"delta": b.delta, "ci_low": b.ci_low, "ci_high": b.ci_high,
                                           "p_value": b.p_value, "n": b.n, "confidence": confidence}
    return out


def _train_figures(train_report: Path | None) -> dict | None:
    if train_report is None:
        return None
    try:
        report = json.loads(train_report.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        log(f"promote: no training figures for the model card ({train_report}: {exc})")
        return None
    return {key: report[key] for key in TRAIN_FIGURES if key in report}


def model_card(record: dict, base_ref: str, train: dict | None, is_adapter: bool) -> str:
    """A Hugging Face model card: YAML front matter (base_model, license, library_name, datasets by hash,
    tags, model-index) and the evaluation table with bootstrap CIs, training params and figures."""
    cid, metrics = record["candidate_id"], record.get("metrics") or {}
    lineage = record.get("lineage") or {}
    data, params = lineage.get("data") or {}, lineage.get("params") or {}
    datasets = [f"fineflow-train-shard:{data['train_shard_key']}"] if data.get("train_shard_key") else []
    if record.get("eval_data_sha256"):
        datasets.append(f"fineflow-eval-rows:sha256:{record['eval_data_sha256']}")
    by_task: dict[str, list] = {}
    for key, value in sorted(metrics.items()):
        task, _, metric = key.partition("/")
        by_task.setdefault(task, []).append({"type": metric, "name": metric, "value": value})
    front = {
        "base_model": base_ref,
        "license": LICENSE_PLACEHOLDER,
        "library_name": "peft" if is_adapter else "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["fineflow", (params.get("train") or {}).get("method", "lora"), "peft" if is_adapter else "full",
                 f"base_model:adapter:{base_ref}" if is_adapter else f"base_model:finetune:{base_ref}"],
        "datasets": datasets,
        "model-index": [{"name": f"fineflow-{cid}", "results": [
            {"task": {"type": "text-generation"}, "dataset": {"name": task, "type": task}, "metrics": rows}
            for task, rows in by_task.items()]}],
    }
    vs_base, gate_stats = record.get("vs_base") or {}, record.get("stats") or {}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
             f"# fineflow champion {cid}", "",
             f"A {'LoRA adapter' if is_adapter else 'fine-tuned model'} of `{base_ref}` trained and promoted by "
             "fineflow. Candidate id = first 16 hex of the sha256 over its adapter files.", "",
             f"**License:** `{LICENSE_PLACEHOLDER}` is a placeholder written by fineflow; set the terms of your "
             "base model and training data before publishing.", "",
             "## Use", "", "```python",
             "from transformers import AutoModelForCausalLM, AutoTokenizer"]
    if is_adapter:
        lines += ["from peft import PeftModel", "",
                  f"base = AutoModelForCausalLM.from_pretrained({base_ref!r})",
                  "model = PeftModel.from_pretrained(base, 'models/champion')       # the adapter",
                  "merged = AutoModelForCausalLM.from_pretrained('models/champion/merged')  # or the merged model"]
    else:
        lines += ["model = AutoModelForCausalLM.from_pretrained('models/champion')"]
    lines += ["tokenizer = AutoTokenizer.from_pretrained('models/champion')", "```", "",
              "## Evaluation", "",
              "Per-sample paired bootstrap versus the base model (seeded; percentile CI; p = share of resampled "
              "deltas <= 0).", "",
              "| task | metric | value | base | delta | CI | p |", "|---|---|---|---|---|---|---|"]
    base_metrics = record.get("base_metrics") or {}
    for key, value in sorted(metrics.items()):
        task, _, metric = key.partition("/")
        s = vs_base.get(key)
        ci = f"[{s['ci_low']:+.4f}, {s['ci_high']:+.4f}] ({s['confidence']:.0%})" if s else "—"
        base_value = f"{base_metrics[key]:.4f}" if key in base_metrics else "—"
        lines.append(f"| {task} | {metric} | {value:.4f} | {base_value} | "
                     + (f"{s['delta']:+.4f} | {ci} | {s['p_value']:.3f} |" if s else "— | — | — |"))
    if gate_stats:
        lines += ["", f"Promotion gate: {record.get('reason', '')}"]
    lines += ["", "## Training", "", "| param | value |", "|---|---|", f"| seed | {params.get('seed')} |"]
    train_params = dict(params.get("train") or {})
    lora = train_params.pop("lora", None) or {}
    for key in ("method", "precision", "steps", "lr", "schedule", "warmup_steps", "micro_batch_size", "grad_accum",
                "weight_decay", "max_grad_norm", "num_processes"):
        if key in train_params:
            lines.append(f"| train.{key} | {train_params[key]} |")
    for key, value in lora.items():
        lines.append(f"| train.lora.{key} | {value} |")
    if "tokenize" in params:
        lines.append(f"| tokenize.seq_len | {params['tokenize'].get('seq_len')} |")
    if train:
        lines += ["", "Training run: " + ", ".join(f"{k} {v}" for k, v in train.items())]
    else:
        lines += ["", "Training run figures (wall time, tokens/s): not given to the promote stage (--train-report)."]
    lines += ["", "## Lineage", "",
              f"Data: tokenizer {data.get('tokenizer_hash')}, template {data.get('template_hash')}, "
              f"eval rows sha256 {record.get('eval_data_sha256')}.",
              "`fineflow lineage models/champion` prints the full manifest (params, packages, dvc.lock hashes).", ""]
    return "\n".join(lines)


def build_champion(staging: Path, source: Path, base_ref: str, record: dict, train: dict | None) -> Path:
    """Assemble a complete champion directory at staging: adapter files, merged model, tokenizer, card,
    lineage.json. The caller writes champion.json and swaps it in."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(source, staging, ignore=shutil.ignore_patterns(RECORD_FILE))
    is_adapter = (source / "adapter_config.json").exists()
    tokenizer = AutoTokenizer.from_pretrained(base_ref)
    if is_adapter:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(base_ref, dtype="auto")
        merged = PeftModel.from_pretrained(base, str(source)).merge_and_unload()
        with torch.no_grad():
            merged.save_pretrained(staging / "merged")  # transformers 5 writes safetensors only
        tokenizer.save_pretrained(staging / "merged")
    tokenizer.save_pretrained(staging)
    write_json_atomic(staging / "lineage.json", {"candidate_id": record["candidate_id"], **(record.get("lineage") or {})})
    (staging / "README.md").write_text(model_card(record, base_ref, train, is_adapter), encoding="utf-8")
    return staging


def _champion_json(record: dict, seq: int) -> dict:
    return {"candidate_id": record["candidate_id"], "metrics": record.get("metrics"), "promotion_seq": seq,
            "eval_data_sha256": record.get("eval_data_sha256"), "base_model": record.get("base_model"),
            "stats": record.get("stats")}


def _digest(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def run(params: Params, scores_path: Path, adapter_dir: Path, champion_dir: Path, registry_dir: Path,
        base_dir: Path | None = None, train_report: Path | None = None, lineage_dir: Path | None = None,
        shards_dir: Path = Path("data/shards"), root: Path = Path(".")) -> dict:
    cfg = params.promote
    scores, unreadable = _read_scores(scores_path)
    scores = scores or {}
    eval_hash = eval_data_hash(scores)
    cid = candidate_id(adapter_dir)
    manifest = build_manifest(params=params.model_dump(mode="json", by_alias=True), adapter_dir=adapter_dir,
                              scores_path=scores_path, eval_data_sha256=eval_hash, shards_dir=shards_dir, root=root)
    manifest["candidate_id"] = cid
    champion = current_champion(registry_dir, champion_dir)
    if unreadable:
        decision = Decision(False, unreadable, cfg.primary_metric, None, None, "reference", {}, None)
    else:
        decision = gate(scores, champion, missing_fields(manifest), primary=cfg.primary_metric,
                        min_delta=cfg.min_delta, max_regression=cfg.max_regression,
                        bootstrap_samples=cfg.bootstrap_samples, confidence=cfg.confidence, seed=params.seed,
                        eval_data_sha256=eval_hash)
    verdict = "promoted" if decision.promote else "refused"
    candidate = scores.get("candidate") or {}
    base = scores.get("base") or {}
    base_ok = base.get("status", "ok") == "ok" and candidate.get("status", "ok") == "ok"
    record = {"candidate_id": cid, "adapter_sha256": directory_hash(adapter_dir),
              "metrics": flatten(candidate.get("metrics") or {}), "samples": candidate.get("samples"),
              "base_metrics": flatten(base.get("metrics") or {}) if base_ok else {},
              "vs_base": stats_vs(candidate, base, cfg.bootstrap_samples, cfg.confidence, params.seed)
              if base_ok and candidate else {},
              "eval_data_sha256": eval_hash, "scores_sha256": manifest["eval"]["scores_sha256"],
              "decision": verdict, "reason": decision.reason, "stats": decision.stats,
              "base_model": _base_or_none(params, base_dir, adapter_dir),
              "lineage": deterministic(manifest)}
    stored = store_candidate(registry_dir, adapter_dir, cid, record)
    ensure_empty_champion(champion_dir)
    staging = None
    if decision.promote:  # the slow, failure-prone part happens before anything is logged or replaced
        if not record["base_model"]:
            raise FineflowError(f"{adapter_dir}: cannot tell the base model to merge into; pass --base-dir")
        staging = build_champion(staging_dir(champion_dir), stored, record["base_model"], record,
                                 _train_figures(train_report))
    entry = append_log(registry_dir, {"candidate_id": cid, "adapter_sha256": record["adapter_sha256"],
                                      "decision": verdict, **decision_record(decision),
                                      "metrics": record["metrics"], "eval_data_sha256": eval_hash,
                                      "scores_sha256": record["scores_sha256"],
                                      "lineage_sha256": _digest(record["lineage"]),
                                      "champion_before": champion["id"] if champion else None,
                                      "params": params.model_dump(mode="json", by_alias=True)})
    if staging is not None:
        write_json_atomic(staging / CHAMPION_FILE, _champion_json(record, entry["seq"]))
        swap_in(staging, champion_dir)
        set_alias(registry_dir, cid, entry["seq"])
    lineage_path = None
    if lineage_dir is not None:
        lineage_path = lineage_dir / f"{cid}.json"
        write_json_atomic(lineage_path, manifest)
    log(("PROMOTED: " if decision.promote else "NOT promoted: ") + decision.reason)
    stats = decision.stats or {}
    return {"decision": verdict, "reason": decision.reason, "candidate_id": cid,
            "primary_metric": decision.primary, "candidate_value": decision.candidate,
            "reference_value": decision.reference, "reference": decision.reference_name,
            "delta": stats.get("delta"), "ci_low": stats.get("ci_low"), "ci_high": stats.get("ci_high"),
            "p_value": stats.get("p_value"), "log_seq": entry["seq"],
            "lineage": str(lineage_path) if lineage_path else None}


def rollback(registry_dir: Path, champion_dir: Path, to: str | None = None, base_dir: str | None = None) -> dict:
    """Reinstall an earlier champion from candidates/<id> (default: the one before the current) atomically,
    rebuilding its merged model, tokenizer and card, and log a "rollback" entry."""
    alias = registry_dir / CHAMPION_FILE
    current = json.loads(alias.read_text(encoding="utf-8")).get("id") if alias.is_file() else None
    if to is None:
        earlier = [c for c in reversed(champion_history(registry_dir)) if c != current
                   and (registry_dir / "candidates" / c).is_dir()]
        if not earlier:
            raise FineflowError(f"{registry_dir}: no earlier champion stored in the registry to roll back to")
        to = earlier[0]
    source = candidate_dir(registry_dir, to)
    cid = source.name
    if cid == current:
        raise FineflowError(f"{cid} is already the champion")
    record = read_record(registry_dir, cid)
    base_ref = base_dir or record.get("base_model")
    if not base_ref:
        raise FineflowError(f"{source}: the record names no base model; pass --base-dir")
    staging = build_champion(staging_dir(champion_dir), source, base_ref, record, None)
    entry = append_log(registry_dir, {"candidate_id": cid, "decision": "rollback", "promote": True,
                                      "reason": f"rollback from {current} to {cid}", "champion_before": current,
                                      "metrics": record.get("metrics"),
                                      "eval_data_sha256": record.get("eval_data_sha256")})
    write_json_atomic(staging / CHAMPION_FILE, _champion_json(record, entry["seq"]))
    swap_in(staging, champion_dir)
    set_alias(registry_dir, cid, entry["seq"])
    return {"from": current, "to": cid, "log_seq": entry["seq"]}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("promote", __doc__)
    parser.add_argument("--scores", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--champion", type=Path, required=True)
    parser.add_argument("--registry", type=Path, required=True)
    parser.add_argument("--base-dir", type=Path, help="the base model dir (merged model, tokenizer, card)")
    parser.add_argument("--shards", type=Path, default=Path("data/shards"),
                        help="shards dir: tokenizer/template hashes for the lineage (default: data/shards)")
    parser.add_argument("--train-report", type=Path, help="reports/train.json: wall time and tokens/s for the card")
    parser.add_argument("--lineage", type=Path, default=Path("reports/lineage"),
                        help="where the full lineage manifest <candidate id>.json goes (default: reports/lineage)")
    args = parser.parse_args(argv)
    return run_entry("promote", args, lambda p: run(p, args.scores, args.adapter, args.champion, args.registry,
                                                    args.base_dir, args.train_report, args.lineage, args.shards))


if __name__ == "__main__":
    raise SystemExit(main())
