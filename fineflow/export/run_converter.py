"""llama.cpp's ``convert_hf_to_gguf.py``, run unchanged, with a known pre-tokenizer name for a GPT-2 byte-level BPE.

    python -m fineflow.export.run_converter CONVERTER_DIR MODEL_DIR --outfile F.gguf --outtype f16

(what ``fineflow.export.gguf.convert`` runs in a subprocess: the converter's own arguments after CONVERTER_DIR.)

llama.cpp names a BPE tokenizer's pre-tokenizer (``tokenizer.ggml.pre``) by a fingerprint: the sha256 of the ids
the tokenizer gives one fixed text. The fingerprint includes the vocabulary, so a tokenizer trained here (the
embedded base's, or any custom one) is never in the converter's table, and the converter refuses it: "BPE
pre-tokenizer was not recognized". Its documented remedy (convert_hf_to_gguf_update.py) downloads published models
to regenerate the table, which cannot hold a tokenizer trained locally. The pre-tokenizer itself, though, is
often exactly one llama.cpp knows: a ``ByteLevel`` pre-tokenizer with GPT-2's regex, no prefix space and no
normalizer is GPT-2's, which the converter's own table names ``gpt-2`` (for openai-community/gpt2) and llama.cpp
implements with that regex. So the converter's hook that chooses the name (``TextModel.get_vocab_base_pre``) runs
as written, and only where it refuses and tokenizer.json declares GPT-2's pre-tokenizer is the answer ``gpt-2``;
any other tokenizer is still refused. The GGUF format is llama.cpp's own throughout, and the export's parity check
(``fineflow.export.parity``) then proves the GGUF's tokenizer gives the training tokenizer's ids on every eval
prompt.
"""

from __future__ import annotations

import json
import logging
import runpy
import sys
from pathlib import Path

GPT2_NAME = "gpt-2"  # llama.cpp's name (LLAMA_VOCAB_PRE_TYPE_GPT2) for GPT-2's byte-level pre-tokenizer
logger = logging.getLogger("fineflow-export")


def declared_pre_tokenizer(model_dir: Path) -> str | None:
    """``gpt-2`` when model_dir/tokenizer.json declares exactly GPT-2's pre-tokenization, else None."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    spec = json.loads(path.read_text(encoding="utf-8"))
    pre = spec.get("pre_tokenizer") or {}
    gpt2 = (
        pre.get("type") == "ByteLevel"
        and pre.get("add_prefix_space") is False
        and pre.get("use_regex", True) is True
        and spec.get("normalizer") is None
        and (spec.get("model") or {}).get("type") == "BPE"
    )
    return GPT2_NAME if gpt2 else None


def with_declared_fallback(original):
    """TextModel.get_vocab_base_pre as the converter wrote it, answering ``gpt-2`` only where it refuses a
    tokenizer whose tokenizer.json declares GPT-2's pre-tokenizer."""

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            name = declared_pre_tokenizer(self.dir_model)
            if name is None:
                raise
            logger.warning("pre-tokenizer not in llama.cpp's table; tokenizer.json declares GPT-2's: %r", name)
            return name

    return get_vocab_base_pre


def main(argv: list[str]) -> None:
    converter = Path(argv[0]).resolve()
    # as the script itself sets up: its `conversion` package from beside it, and its own gguf-py before any
    # installed gguf (the script inserts it too, but only after this module has imported `conversion`)
    sys.path[:0] = [str(converter), str(converter / "gguf-py")]
    import conversion.base

    conversion.base.TextModel.get_vocab_base_pre = with_declared_fallback(conversion.base.TextModel.get_vocab_base_pre)
    sys.argv = [str(converter / "convert_hf_to_gguf.py"), *argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
