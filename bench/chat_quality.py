"""Chat data end to end: a chat-trained candidate against its base, prompted as training rendered the rows.

    .venv/bin/python bench/chat_quality.py [--steps 800] [--keep DIR]

Issue 15: evaluation used to prompt chat-trained models with the fineflow template (`### Instruction: ...`),
a format training never used, and a chat-trained candidate scored 0.30 against 1.00 for the same data in the
fineflow format. This runs the real pipeline (`dvc repro`, every stage) in a fresh copy of the project on the
bundled dataset rewritten as OpenAI-style `messages` rows (`data.mapping.messages: messages`), with the
repo's params.yaml otherwise (train.steps from --steps). The embedded base's tokenizer carries a chat template,
as instruct models do, so training renders every row with it; evaluation must prompt each eval row the same
way. Prints the base and the candidate per task and metric side by side, the gate's decision, and the first
logged eval row's prompt as lm-eval sent it next to the training rendering (they must be equal).

Not a test: the default config trains for minutes. The tests (tests/test_evaluation.py) check the prompt
equality on the tiny config; this shows the effect on quality.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def copy_project(dest: Path) -> None:
    """The project's tracked (and untracked, not ignored) files at dest, as a git repository of its own."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(git + ["add", "-A"], cwd=dest, check=True)
    subprocess.run(git + ["commit", "-qm", "bench"], cwd=dest, check=True)


def as_chat(row: dict) -> dict:
    """An instruction row as a chat: the instruction (and its input) from the user, the output from the assistant."""
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]}


def convert(src: Path, dest: Path) -> tuple[int, int]:
    """Rewrite a bundled split as chat rows. Lines that are not instruction rows (the bundled train split's
    deliberately bad rows) are kept as they are, so the data gate still meets them. Returns (chat, kept)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    chat = kept = 0
    with src.open(encoding="utf-8") as fin, dest.open("w", encoding="utf-8") as fout:
        for line in fin:
            try:
                row = json.loads(line)
                fout.write(json.dumps(as_chat(row), ensure_ascii=False) + "\n")
                chat += 1
            except (ValueError, TypeError, KeyError):
                fout.write(line)
                kept += 1
    return chat, kept


def dvc(project: Path, env: dict, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"dvc {' '.join(args)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return done.stdout


def set_chat_params(project: Path, steps: int) -> None:
    params_file = project / "params.yaml"
    params = yaml.safe_load(params_file.read_text(encoding="utf-8"))
    params["data"].update(train_path="data/chat/train.jsonl", eval_path="data/chat/eval.jsonl")
    params["data"]["mapping"]["messages"] = "messages"
    params["train"]["steps"] = steps
    params_file.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")


def training_rendering(project: Path, row: dict) -> str:
    """An eval row's prompt as the tokenize stage renders it for training."""
    from transformers import AutoTokenizer

    from fineflow.tokenize.template import render_pair

    tokenizer = AutoTokenizer.from_pretrained(project / "models/base")
    return render_pair(tokenizer, row)[0]


def print_scores_and_gate(project: Path) -> dict:
    """Base and candidate per task and metric side by side, and the gate's decision; returns the candidate's
    first logged eval sample (lm-eval's record: doc, arguments, responses)."""
    scores = json.loads((project / "eval/scores.json").read_text())
    promote = json.loads((project / "reports/promote.json").read_text())
    print(f"{'task':<24}{'metric':<16}{'base':>10}{'candidate':>12}{'delta':>10}")
    for task, metrics in scores["candidate"]["metrics"].items():
        for metric, value in metrics.items():
            base = scores["base"]["metrics"][task][metric]
            print(f"{task:<24}{metric:<16}{base:>10.3f}{value:>12.3f}{value - base:>+10.3f}")
    print(f"gate: {promote['decision']}: {promote['reason']}")
    sample_files = sorted((project / "eval/samples/candidate").glob("*.jsonl"))
    return json.loads(sample_files[0].read_text().splitlines()[0]) if sample_files else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=800, help="train.steps (the default config's: 800)")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="fineflow-chat-"))
    project = work / "project"
    copy_project(project)
    env = {
        **os.environ,
        **OFFLINE,
        "HF_HOME": str(project / ".cache/huggingface"),
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
    }
    began = time.monotonic()
    dvc(project, env, "repro", "--single-item", "data")  # the bundled splits, then as chat rows
    counts = {
        split: convert(project / f"data/raw/{split}.jsonl", project / f"data/chat/{split}.jsonl")
        for split in ("train", "eval")
    }
    set_chat_params(project, args.steps)
    dvc(project, env, "repro")
    wall = time.monotonic() - began

    train = json.loads((project / "reports/train.json").read_text())
    print(f"chat rows: {counts}; train.steps {args.steps}; final loss {train.get('final_loss')}; wall {wall:.0f} s")
    logged = print_scores_and_gate(project)
    print(
        "first eval row, training's prompt:", json.dumps(training_rendering(project, logged["doc"]) if logged else "-")
    )
    # lm-eval logs each request's arguments: (context, generation kwargs) or (context, continuation)
    evaluated = logged["arguments"][0][0] if logged.get("arguments") else "(no sample logged)"
    print("first eval row, evaluated prompt: ", json.dumps(evaluated))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
