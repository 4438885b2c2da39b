"""The champion's merged model as GGUF files: llama.cpp's converter writes the float GGUF, llama.cpp's quantizer
the quantized ones. fineflow writes none of the format itself.

The converter (``convert_hf_to_gguf.py``, found by ``fineflow.export.tooling``) runs in a subprocess of this
interpreter (``fineflow.export.run_converter``): it reads the model directory's safetensors lazily, tensor by
tensor, so memory stays about one tensor however large the model, and it carries the tokenizer (vocabulary, merges,
special tokens) and the chat template (``chat_template.jinja`` or tokenizer_config.json's) into the file's
metadata. Each quantized type is then ``llama_model_quantize`` (llama-cpp-python's binding of llama.cpp's
quantizer, what ``llama-quantize`` runs) applied to that float file, as llama.cpp documents.

What the converter and the quantizer print goes to the export's llama.cpp log when one is open
(``fineflow.export.native_log``), and a failure names the tool, its last lines and that log.

Each file is then parity-checked (``export_model``: fineflow.export.parity's checks, each failing with its reason),
as the export stage's format (``GGUF``: the report's exports, the one ``fineflow serve`` serves, its card lines)
and as promote's check before installing (``parity_before_promotion``, export.block_promotion).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from fineflow.core.config import Params
from fineflow.errors import FineflowError
from fineflow.export import native_log
from fineflow.export.interface import ExportFormat, ExportJob, Trained
from fineflow.export.parity import check_scores, reference_answers, runtime_answers, verdict, vocabulary_checks
from fineflow.export.serve import serving_choice
from fineflow.export.tooling import converter_dir, require_llama_cpp, sha256_of, toolchain
from fineflow.export.trained import trained_side

FLOAT_TYPES = ("f16", "bf16")  # the converter's --outtype
# params names of the quantized types -> llama.cpp's file types (llama_ftype; what llama-quantize calls them)
QUANT_FTYPES = {
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
}
UNRECOGNIZED_PRE = "BPE pre-tokenizer was not recognized"
PARITY_LOG_FILE = "promote_parity.llama_cpp.log"  # promote's parity check's llama.cpp log, beside the champion
LLAMA_SERVER_PORT = 8080  # llama.cpp's llama-server default
FINEFLOW_SERVE_PORT = 8000  # fineflow serve's default


def gguf_name(kind: str) -> str:
    return f"model-{kind}.gguf"


def convert(model_dir: Path, out_file: Path, outtype: str) -> Path:
    """llama.cpp's converter: model_dir (a Hugging Face model directory) -> out_file, a float GGUF."""
    if outtype not in FLOAT_TYPES:
        raise FineflowError(f"params.yaml: export.float_type must be one of {FLOAT_TYPES} (got {outtype!r})")
    command = [sys.executable, "-m", "fineflow.export.run_converter", str(converter_dir()), str(model_dir)]
    command += ["--outfile", str(out_file), "--outtype", outtype]
    native, start = native_log.current(), native_log.mark()  # its output into the export's llama.cpp log, if open
    stdout = native.fd if native is not None else subprocess.PIPE
    done = subprocess.run(command, stdout=stdout, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0 or not out_file.is_file():
        output = native_log.output_since(start) if native is not None else done.stdout
        raise FineflowError(_conversion_failure(model_dir, output, done.returncode))
    return out_file


def _conversion_failure(model_dir: Path, output: str, returncode: int) -> str:
    """What went wrong in the converter, in one message naming the model directory and the log."""
    if UNRECOGNIZED_PRE in output:
        return (
            f"{model_dir}: llama.cpp's converter does not know this tokenizer's pre-tokenizer ({UNRECOGNIZED_PRE}) "
            "and its tokenizer.json does not declare GPT-2's byte-level one: a GGUF of it would tokenize differently "
            "from training. Use a base whose tokenizer llama.cpp supports (convert_hf_to_gguf.py --print-supported-"
            "models), or add it with llama.cpp's convert_hf_to_gguf_update.py" + native_log.where()
        )
    return native_log.failure(f"{model_dir}: llama.cpp's converter failed (exit status {returncode})", output)


def quantize(float_file: Path, out_file: Path, kind: str, threads: int | None = None) -> Path:
    """llama.cpp's quantizer (llama_model_quantize) on a float GGUF."""
    if kind not in QUANT_FTYPES:
        raise FineflowError(f"params.yaml: export.quantized: {kind!r} is not one of {sorted(QUANT_FTYPES)}")
    llama_cpp = require_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_FTYPES[kind])
    params.nthread = threads or 0  # 0: llama.cpp uses every hardware thread
    start = native_log.mark()
    with native_log.native_output():  # its loader's dump and its line per tensor: the log's
        status = llama_cpp.llama_model_quantize(str(float_file).encode(), str(out_file).encode(), ctypes.byref(params))
    if status != 0 or not out_file.is_file():
        what = f"{float_file}: llama.cpp's quantizer failed for {kind} (status {status})"
        raise FineflowError(native_log.failure(what, native_log.output_since(start)))
    return out_file


def export_gguf(
    model_dir: Path, out_dir: Path, float_type: str, quantized: list[str], threads: int | None = None, log=print
) -> dict[str, dict]:
    """Every GGUF params ask for, in out_dir: {kind: {"file", "bytes", "sha256"}}, the float type first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    float_file = convert(model_dir, out_dir / gguf_name(float_type), float_type)
    files = {float_type: float_file}
    log(f"export: {float_file.name} written by llama.cpp's converter ({float_file.stat().st_size:,} bytes)")
    native = native_log.current()
    for kind in quantized:
        warnings = native.warnings if native is not None else 0
        files[kind] = quantize(float_file, out_dir / gguf_name(kind), kind, threads)
        # its warnings (a tensor whose row length the type cannot take, quantized to a fallback type instead) are
        # the log's; that there were some is the stage's line
        warned = native is not None and native.warnings > warnings
        note = f"; llama.cpp warned, see {native.path}" if warned else ""
        log(f"export: {files[kind].name} quantized by llama.cpp ({files[kind].stat().st_size:,} bytes{note})")
    return {
        kind: {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_of(path)}
        for kind, path in files.items()
    }


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
    """GGUF files of model_dir (any Hugging Face model directory) in out_dir, each with its parity verdict:
    {"eval_docs", "exports": per type its file, size, sha256, whether it is shippable and why not}. trained: what
    they are held to (None: built from model_dir and eval_rows). What llama.cpp prints while converting, quantizing
    and answering goes to llama_log (default: out_dir/llama_cpp.log), not the console."""
    with native_log.llama_cpp_log(llama_log or out_dir / native_log.LOG_FILE):
        if trained is None:
            trained = trained_side(model_dir, eval_rows, work_dir, params)
        return _export_model(model_dir, out_dir, params, log, trained)


def _export_model(model_dir: Path, out_dir: Path, params: Params, log: Callable[[str], None], trained: Trained) -> dict:
    cfg, docs = params.export, trained.docs
    files = export_gguf(model_dir, out_dir, cfg.float_type, list(cfg.quantized), cfg.threads, log)
    max_gen_toks = params.evaluate.max_gen_toks
    log(f"export: the merged model answers {len(docs)} eval docs (transformers, the reference)")
    reference = reference_answers(model_dir, trained.tokenizer, docs, max_gen_toks, trained.stop_ids)
    bootstrap = {
        "samples": params.promote.bootstrap_samples,
        "confidence": params.promote.confidence,
        "seed": params.seed,
    }
    exports = {}
    for kind, record in files.items():
        gguf_file = out_dir / record["file"]
        checks = vocabulary_checks(gguf_file, trained.tokenizer, trained.generation_eos, docs)
        answers = runtime_answers(gguf_file, docs, max_gen_toks, cfg.threads)
        checks.append(check_scores(answers, reference, docs, cfg.tolerance.get(kind), bootstrap))
        exports[kind] = {**record, **verdict(kind, checks)}
        _log_verdict(exports[kind], log)
    return {"eval_docs": len(docs), "exports": exports}


def _log_verdict(export: dict, log: Callable[[str], None]) -> None:
    scores = export["checks"]["scores"]["figures"]
    state = "shippable" if export["shippable"] else "NOT shippable: " + "; ".join(export["reasons"])
    log(
        f"export: {export['file']} exact match {scores['exact_match']:.3f} (transformers "
        f"{scores['reference_exact_match']:.3f}, delta {scores['delta']:+.3f}, CI {scores['ci']}), {state}"
    )


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


class GGUF(ExportFormat):
    """GGUF files for llama.cpp (and what reads GGUF: Ollama, LM Studio, llama-cpp-python's server): export.float_type
    and each of export.quantized, each parity-checked. Its entries: the report's "exports" (per type its file and
    verdict), "eval_docs", "source" (which of the champion's forms was converted), "tools" (which llama.cpp) and
    "serve" (the type ``fineflow serve`` serves: fineflow.export.serve.serving_choice)."""

    name = "gguf"
    summary = "GGUF files for llama.cpp, each parity-checked against the model the gate evaluated"

    def write(self, job: ExportJob, report: dict) -> dict:
        exported = export_model(
            job.model_dir, job.eval_rows, job.out_dir, job.work_dir, job.params, job.log, job.trained
        )
        tools = toolchain()
        # which of the champion's forms was converted, by name (a path into the scratch folder would change every run)
        champion_dir, model_dir = job.champion_dir, job.model_dir
        source = model_dir.relative_to(champion_dir).as_posix() if model_dir.is_relative_to(champion_dir) else None
        return {
            "source": source or "the adapter merged onto its base (fineflow.registry.merge)",
            "tools": {key: tools[key] for key in ("llama_cpp_python", "converter_sha256")},
            **exported,
            "serve": serving_choice(exported["exports"]),
        }

    def serving(self, report: dict, out_dir: Path) -> list[str]:
        """fineflow serve's command and llama.cpp's own server's, for the served type."""
        served = report.get("serve")
        if served is None:
            return ["No shippable export whose scores were gated: `fineflow serve` refuses by default.", ""]
        gguf = report["exports"][served]["file"]
        return [
            f"OpenAI-compatible, on http://127.0.0.1:{FINEFLOW_SERVE_PORT}/v1 (llama-cpp-python's server, {served}):",
            "",
            "```bash",
            f"fineflow serve --export-dir {out_dir} --type {served}",
            "```",
            "",
            "llama.cpp's own server (the chat template from the file: `--jinja`):",
            "",
            "```bash",
            f"llama-server -m {out_dir / gguf} --jinja --host 127.0.0.1 --port {LLAMA_SERVER_PORT}",
            "```",
            "",
        ]
