"""The champion's exports: its merged model found (or built, streamed), written as GGUF files, each parity-checked.

``export_champion`` is what the export stage runs; ``export_model`` does the same for any Hugging Face model
directory (the tests' SmolLM2, a model promoted elsewhere). The report lists every GGUF with its size, sha256,
whether it is shippable and, when not, each failed check's reason (``fineflow.export.parity``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fineflow.core.config import Params
from fineflow.errors import FineflowError
from fineflow.export.gguf import export_gguf
from fineflow.export.native_log import LOG_FILE, llama_cpp_log
from fineflow.export.parity import (
    EvalDoc,
    check_scores,
    eval_docs,
    reference_answers,
    runtime_answers,
    trained_stop_ids,
    verdict,
    vocabulary_checks,
)
from fineflow.export.vllm import write_vllm_layout
from fineflow.objectives import objective_for

PARITY_LOG_FILE = "promote_parity.llama_cpp.log"  # promote's parity check's llama.cpp log, beside the champion


def champion_model_dir(champion_dir: Path, work_dir: Path, log: Callable[[str], None] = print) -> Path:
    """The champion's full model: merged/ when promote stored it, its own files for a fully fine-tuned champion,
    else the adapter merged onto its base now, shard by shard (fineflow.registry.merge), into work_dir."""
    from fineflow.registry.install import read_champion
    from fineflow.registry.merge import build_merged

    if not read_champion(champion_dir):
        raise FineflowError(f"{champion_dir}: no champion (champion.json) to export: the export follows a promotion")
    if (champion_dir / "merged" / "config.json").is_file():
        return champion_dir / "merged"
    if (champion_dir / "adapter_config.json").is_file():
        log(f"export: {champion_dir} is adapter-only: merging it onto its base, streamed")
        shutil.rmtree(work_dir / "merged", ignore_errors=True)
        build_merged(champion_dir, work_dir / "merged")
        return work_dir / "merged"
    if (champion_dir / "config.json").is_file():
        return champion_dir
    raise FineflowError(f"{champion_dir}: neither merged/, an adapter nor a model: re-run promote")


def rendered_eval_docs(
    eval_rows: Path, tokenizer, work_dir: Path, limit: int | None, pairs: bool = False
) -> list[EvalDoc]:
    """The eval rows with their prompts as the evaluate stage renders them (the training rendering). pairs: the
    rows are preference pairs (a pair objective's eval rows), each answered with its chosen answer."""
    from fineflow.evaluate.harness import render_eval_rows

    if not eval_rows.is_file():
        raise FineflowError(f"{eval_rows}: no eval rows: the parity check answers the evaluate stage's eval docs")
    work_dir.mkdir(parents=True, exist_ok=True)
    docs = eval_docs(render_eval_rows(eval_rows, tokenizer, work_dir / "eval_rows.jsonl", pairs=pairs), limit)
    if not docs:
        raise FineflowError(f"{eval_rows}: no eval rows to check the exports on")
    return docs


@dataclass(frozen=True)
class Trained:
    """What the exports are held to: the training tokenizer, the eval docs as the evaluate stage renders them, and
    the ids the model was trained to stop on (its EOS, generation_config's eos_token_id)."""

    tokenizer: object
    docs: list[EvalDoc]
    generation_eos: int | list[int] | None
    stop_ids: list[int]


def trained_side(model_dir: Path, eval_rows: Path, work_dir: Path, params: Params) -> Trained:
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # the validate stage wrote the eval rows the objective trains on
    pairs = objective_for(params.train.objective).trains_pairs
    docs = rendered_eval_docs(eval_rows, tokenizer, work_dir, params.export.parity_docs, pairs)
    generation_eos = _generation_eos(model_dir, GenerationConfig)
    return Trained(tokenizer, docs, generation_eos, trained_stop_ids(tokenizer, generation_eos))


def export_model(
    model_dir: Path,
    eval_rows: Path,
    out_dir: Path,
    work_dir: Path,
    params: Params,
    log: Callable[[str], None] = print,
    trained: Trained | None = None,
    llama_log: Path | None = None,
) -> dict:
    """GGUF files of model_dir in out_dir, each with its parity verdict; the export's report. What llama.cpp prints
    while converting, quantizing and answering goes to llama_log (default: out_dir/llama_cpp.log), not the console."""
    with llama_cpp_log(llama_log or out_dir / LOG_FILE):
        return _export_model(model_dir, eval_rows, out_dir, work_dir, params, log, trained)


def _export_model(
    model_dir: Path,
    eval_rows: Path,
    out_dir: Path,
    work_dir: Path,
    params: Params,
    log: Callable[[str], None],
    trained: Trained | None,
) -> dict:
    cfg = params.export
    trained = trained or trained_side(model_dir, eval_rows, work_dir, params)
    tokenizer, docs, generation_eos, stop_ids = (
        trained.tokenizer,
        trained.docs,
        trained.generation_eos,
        trained.stop_ids,
    )
    files = export_gguf(model_dir, out_dir, cfg.float_type, list(cfg.quantized), cfg.threads, log)
    max_gen_toks = params.evaluate.max_gen_toks
    log(f"export: the merged model answers {len(docs)} eval docs (transformers, the reference)")
    reference = reference_answers(model_dir, tokenizer, docs, max_gen_toks, stop_ids)
    bootstrap = {
        "samples": params.promote.bootstrap_samples,
        "confidence": params.promote.confidence,
        "seed": params.seed,
    }
    exports = {}
    for kind, record in files.items():
        gguf_file = out_dir / record["file"]
        checks = vocabulary_checks(gguf_file, tokenizer, generation_eos, docs)
        answers = runtime_answers(gguf_file, docs, max_gen_toks, cfg.threads)
        checks.append(check_scores(answers, reference, docs, cfg.tolerance.get(kind), bootstrap))
        exports[kind] = {**record, **verdict(kind, checks)}
        _log_verdict(exports[kind], log)
    return {"eval_docs": len(docs), "exports": exports}


def _generation_eos(model_dir: Path, generation_config_class) -> int | list[int] | None:
    """generation_config.json's eos_token_id (the ids generation stopped on in evaluation), if the model has one."""
    try:
        return generation_config_class.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        return None


def _log_verdict(export: dict, log: Callable[[str], None]) -> None:
    scores = export["checks"]["scores"]["figures"]
    state = "shippable" if export["shippable"] else "NOT shippable: " + "; ".join(export["reasons"])
    log(
        f"export: {export['file']} exact match {scores['exact_match']:.3f} (transformers "
        f"{scores['reference_exact_match']:.3f}, delta {scores['delta']:+.3f}, CI {scores['ci']}), {state}"
    )


def export_champion(
    champion_dir: Path, eval_rows: Path, out_dir: Path, work_dir: Path, params: Params, log=print
) -> dict:
    """The champion's GGUF exports with their parity verdicts (the export stage's library call)."""
    from fineflow.export.serve import serving_choice
    from fineflow.export.tooling import toolchain
    from fineflow.registry.install import read_champion

    model_dir = champion_model_dir(champion_dir, work_dir, log)
    trained = trained_side(model_dir, eval_rows, work_dir, params)
    report = export_model(model_dir, eval_rows, out_dir, work_dir, params, log, trained)
    # which of the champion's forms was exported, by name (a path into the scratch folder would change every run)
    source = model_dir.relative_to(champion_dir).as_posix() if model_dir.is_relative_to(champion_dir) else None
    tools = toolchain()
    served = serving_choice(report["exports"])
    return {
        "champion": (read_champion(champion_dir) or {}).get("candidate_id"),
        "source": source or "the adapter merged onto its base (fineflow.registry.merge)",
        "tools": {key: tools[key] for key in ("llama_cpp_python", "converter_sha256")},
        **report,
        "serve": served,
        "ollama": ollama_modelfile(trained, out_dir, report["exports"][served or params.export.float_type]["file"]),
        "vllm": write_vllm_layout(champion_dir, out_dir),
    }


def ollama_modelfile(trained: Trained, out_dir: Path, gguf: str) -> dict:
    """out_dir/Modelfile for the GGUF named (the served one, else the float one): its template derived from the
    training template and checked on the eval conversations, its stops the ids the model was trained to stop on."""
    from fineflow.export.ollama import write_modelfile

    conversations = [doc.conversation for doc in trained.docs]
    return write_modelfile(out_dir, gguf, trained.tokenizer, trained.stop_ids, conversations)


def parity_before_promotion(
    staging: Path, base_ref: str, eval_rows: Path, params: Params, log: Callable[[str], None] = print
) -> dict:
    """export.block_promotion: the staged champion (promote's assembly, before anything is logged or installed)
    exported to its float type and every quantized type with a tolerance, into scratch beside it, and parity-checked
    as the export stage checks; {"passed", "reasons", "exports": per type its verdict and score figures}. The files
    are dropped: the export stage writes the champion's exports once it is champion. llama.cpp's output is kept,
    beside the champion's folder (models/promote_parity.llama_cpp.log)."""
    import tempfile

    from fineflow.registry.merge import build_merged

    cfg = params.export
    gated = [kind for kind in cfg.quantized if kind in cfg.tolerance]
    checked = params.model_copy(update={"export": cfg.model_copy(update={"quantized": gated})})
    with tempfile.TemporaryDirectory(prefix=".parity-", dir=staging.parent) as scratch:
        work = Path(scratch)
        model_dir = staging / "merged"
        if not (model_dir / "config.json").is_file():  # an adapter-only champion, or a full model at its root
            model_dir = staging
            if (staging / "adapter_config.json").is_file():
                build_merged(staging, work / "merged", base=base_ref)
                model_dir = work / "merged"
        llama_log = staging.with_name(PARITY_LOG_FILE)
        report = export_model(model_dir, eval_rows, work / "gguf", work, checked, log, llama_log=llama_log)
    exports = {
        kind: {
            "shippable": export["shippable"],
            "reasons": export["reasons"],
            **{key: export["checks"]["scores"]["figures"][key] for key in ("exact_match", "delta", "ci", "gated")},
        }
        for kind, export in report["exports"].items()
    }
    reasons = [f"{kind}: {reason}" for kind, export in exports.items() for reason in export["reasons"]]
    return {"passed": not reasons, "reasons": reasons, "exports": exports}
