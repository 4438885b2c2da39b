"""The champion's model card (``README.md``): Hugging Face YAML front matter, how to load it, the evaluation
table with paired-bootstrap CIs versus the base model, the training params and run figures, and the lineage.
Written from the candidate's registry record, so a rollback rebuilds the same card but for its run figures
(``card_digest``: what the log entry binds of it)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import yaml

LICENSE_PLACEHOLDER = "apache-2.0"  # fineflow's own license; replace with your base model's and data's terms
TRAIN_FIGURES = ("wall_s", "tokens_per_s", "steps", "tokens", "final_loss", "eval_loss", "world_size")
TRAIN_PARAMS = (
    "method",
    "precision",
    "steps",
    "lr",
    "schedule",
    "warmup_steps",
    "micro_batch_size",
    "grad_accum",
    "weight_decay",
    "max_grad_norm",
    "num_processes",
)


RUN_FIGURES = "Training run: "
NO_RUN_FIGURES = "Training run figures (wall time, tokens/s): not given to the promote stage (--train-report)."
_FIGURE = re.compile(rf"({'|'.join(TRAIN_FIGURES)}) (-?[0-9.]+(e[-+]?[0-9]+)?|None|nan|-?inf)")


# The export stage's section, last in the card (fineflow.export.exports_card): written after the promotion, so the log
# entry that installed the champion cannot bind it; the exports are bound by their own sha256s in export.json.
EXPORTS_HEADING = "## Exports"


def card_digest(text: str) -> str:
    """The card's sha256 as the log entry that installs the champion records it: of every line but the run
    figures (wall time, tokens/s, ...), which differ between two runs of the same inputs (the registry, a DVC
    output, must not), and but the export stage's section (EXPORTS_HEADING to the end). Only a line of figures as
    _training writes them is left out: any other text in it counts."""
    text = without_exports(text)

    def bound(line: str) -> str:
        figures = line.removeprefix(RUN_FIGURES).split(", ")
        is_figures = line.startswith(RUN_FIGURES) and all(_FIGURE.fullmatch(f) for f in figures)
        return "<run figures>" if is_figures or line == NO_RUN_FIGURES else line

    return hashlib.sha256("\n".join(bound(line) for line in text.split("\n")).encode("utf-8")).hexdigest()


def without_exports(text: str) -> str:
    """The card as promote wrote it: the export stage's section cut off."""
    lines = text.split("\n")
    return "\n".join(lines[: lines.index(EXPORTS_HEADING)]) if EXPORTS_HEADING in lines else text


def train_figures(train_report: Path | None, log=print) -> dict | None:
    """The training run's figures (wall time, tokens/s, ...) from the train stage's report; None when not
    given or unreadable (the card says so instead of failing the promotion)."""
    if train_report is None:
        return None
    try:
        report = json.loads(train_report.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        log(f"promote: no training figures for the model card ({train_report}: {exc})")
        return None
    return {key: report[key] for key in TRAIN_FIGURES if key in report}


def model_card(record: dict, base_ref: str, train: dict | None, is_adapter: bool, merged: bool = True) -> str:
    """A Hugging Face model card: YAML front matter (base_model, license, library_name, datasets by hash,
    tags, model-index) and the evaluation table with bootstrap CIs, training params and figures."""
    cid, kind = record["candidate_id"], record.get("model_kind")  # kind: a model that scores text (no kind: an LM)
    what = f"A {'LoRA adapter' if is_adapter else 'fine-tuned model'} of `{base_ref}`"
    if kind:
        what = f"A {kind} model (a LoRA adapter of `{base_ref}` and a scalar head: it scores text, never generates)"
    lines = [
        "---",
        yaml.safe_dump(front_matter(record, base_ref, is_adapter), sort_keys=False).rstrip(),
        "---",
        "",
        f"# fineflow {kind + ' model ' if kind else ''}champion {cid}",
        "",
        f"{what} trained and promoted by fineflow. Candidate id = first 16 hex of the sha256 over its adapter files.",
        "",
        f"**License:** `{LICENSE_PLACEHOLDER}` is a placeholder written by fineflow; set the terms of your "
        "base model and training data before publishing.",
        "",
    ]
    lines += _override(record)
    lines += (_scorer_usage(kind) if kind else _usage(base_ref, is_adapter, merged)) + [""]
    lines += _evaluation(record)
    lines += _training(record, train)
    lines += _lineage(record)
    return "\n".join(lines)


def front_matter(record: dict, base_ref: str, is_adapter: bool) -> dict:
    """The card's YAML header, the fields the Hugging Face Hub indexes; datasets are named by content hash."""
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
    kind = record.get("model_kind")
    return {
        "base_model": base_ref,
        "license": LICENSE_PLACEHOLDER,
        "library_name": "peft" if is_adapter else "transformers",
        "pipeline_tag": "text-classification" if kind else "text-generation",
        "tags": [
            "fineflow",
            *([f"{kind}-model"] if kind else []),
            (params.get("train") or {}).get("method", "lora"),
            "peft" if is_adapter else "full",
            f"base_model:adapter:{base_ref}" if is_adapter else f"base_model:finetune:{base_ref}",
        ],
        "datasets": datasets,
        "model-index": [
            {
                "name": f"fineflow-{cid}",
                "results": [
                    {"task": {"type": "text-generation"}, "dataset": {"name": task, "type": task}, "metrics": rows}
                    for task, rows in by_task.items()
                ],
            }
        ],
    }


def _override(record: dict) -> list[str]:
    """A champion installed by `fineflow registry rollback --allow-unpromoted`: the card says so first."""
    override = record.get("override")
    if not override:
        return []
    return [
        f"**Override:** this champion was never promoted by the gate; it was installed by `fineflow registry "
        f"rollback --allow-unpromoted` (reason: {override.get('reason')}).",
        "",
    ]


def _usage(base_ref: str, is_adapter: bool, merged: bool) -> list[str]:
    lines = ["## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer"]
    if is_adapter:
        lines += [
            "from peft import PeftModel",
            "",
            f"base = AutoModelForCausalLM.from_pretrained({base_ref!r})",
            "model = PeftModel.from_pretrained(base, 'models/champion')       # the adapter",
        ]
        if merged:
            lines += ["merged = AutoModelForCausalLM.from_pretrained('models/champion/merged')  # or the merged model"]
    else:
        lines += ["model = AutoModelForCausalLM.from_pretrained('models/champion')"]
    lines += ["tokenizer = AutoTokenizer.from_pretrained('models/champion')", "```"]
    if is_adapter and not merged:
        lines += [
            "",
            "No merged model is stored (promote.merged): this champion is the adapter and its base, named in "
            "champion.json by path and content digest. Build the merged model, shard by shard, with "
            "`python -m fineflow.registry.merge --champion models/champion --out DIR`.",
        ]
    return lines


def _scorer_usage(kind: str) -> list[str]:
    """How a champion of a kind that scores text is used: `fineflow reward score` (fineflow/cli/reward_command.py)."""
    return [
        "## Use",
        "",
        f"Score each row of a JSONL file (a prompt and its answer) with the registry's champion {kind} model:",
        "",
        "```",
        "fineflow reward score rows.jsonl --out scored.jsonl",
        "```",
        "",
        "This folder holds the adapter, the head and its description beside it, and the tokenizer; in Python, "
        "the objective's `load_trained(base, folder)` (fineflow.objectives) loads it on its base.",
    ]


def _evaluation(record: dict) -> list[str]:
    """Every metric against the base, with the paired bootstrap the record holds (vs_base); then the gate's
    own reason when a bootstrap decided it."""
    metrics = record.get("metrics") or {}
    vs_base, base_metrics = record.get("vs_base") or {}, record.get("base_metrics") or {}
    lines = [
        "## Evaluation",
        "",
        "Per-sample paired bootstrap versus the base model (seeded; percentile CI; p = share of resampled "
        "deltas <= 0).",
        "",
        "| task | metric | value | base | delta | CI | p |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, value in sorted(metrics.items()):
        task, _, metric = key.partition("/")
        s = vs_base.get(key)
        ci = f"[{s['ci_low']:+.4f}, {s['ci_high']:+.4f}] ({s['confidence']:.0%})" if s else "—"
        base_value = f"{base_metrics[key]:.4f}" if key in base_metrics else "—"
        lines.append(
            f"| {task} | {metric} | {value:.4f} | {base_value} | "
            + (f"{s['delta']:+.4f} | {ci} | {s['p_value']:.3f} |" if s else "— | — | — |")
        )
    if record.get("stats"):
        lines += ["", f"Promotion gate: {record.get('reason', '')}"]
    if "QLoRA" in (record.get("base_scored") or ""):  # which base a QLoRA adapter was scored on (evaluate.qlora_base)
        lines += ["", f"Scored on the {record['base_scored']}."]
    return lines


def _training(record: dict, train: dict | None) -> list[str]:
    params = (record.get("lineage") or {}).get("params") or {}
    lines = ["", "## Training", "", "| param | value |", "|---|---|", f"| seed | {params.get('seed')} |"]
    train_params = dict(params.get("train") or {})
    lora = train_params.pop("lora", None) or {}
    lines += [f"| train.{key} | {train_params[key]} |" for key in TRAIN_PARAMS if key in train_params]
    # sorted: the record as promote holds it and as read back from record.json (keys sorted) give one card
    lines += [f"| train.lora.{key} | {value} |" for key, value in sorted(lora.items())]
    if "tokenize" in params:
        lines.append(f"| tokenize.seq_len | {params['tokenize'].get('seq_len')} |")
    if train:
        return lines + ["", RUN_FIGURES + ", ".join(f"{k} {v}" for k, v in train.items())]
    return lines + ["", NO_RUN_FIGURES]


def _lineage(record: dict) -> list[str]:
    data = ((record.get("lineage") or {}).get("data")) or {}
    return [
        "",
        "## Lineage",
        "",
        f"Data: tokenizer {data.get('tokenizer_hash')}, template {data.get('template_hash')}, "
        f"eval rows sha256 {record.get('eval_data_sha256')}.",
        *_sources(data.get("sources")),
        "`fineflow lineage models/champion` prints the full manifest (params, packages, dvc.lock hashes).",
        "",
    ]


def _sources(sources: list[dict] | None) -> list[str]:
    """The train split's sources when it is a mixture (data.sources): each by content, with its share."""
    if not sources:
        return []
    lines = ["", "| source | content sha256 | rows kept | weight | rows mixed |", "|---|---|---|---|---|"]
    for s in sources:
        amount = f"n={s['n']}" if s.get("n") is not None else f"{s.get('weight'):g}"
        lines.append(f"| {s['path']} | {s['content_sha256'][:16]} | {s['rows_kept']} | {amount} | {s['rows_mixed']} |")
    return lines + [""]
