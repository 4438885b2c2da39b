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
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

from fineflow.errors import FineflowError
from fineflow.export import native_log
from fineflow.export.tooling import converter_dir, require_llama_cpp, sha256_of

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
