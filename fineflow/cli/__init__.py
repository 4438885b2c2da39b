"""The ``fineflow`` command. Subcommands: ``plan`` (the GPU memory planner, fineflow.train.planner), ``recipe
list|show|apply`` (model-family recipes written into params.yaml after the planner's check: fineflow.recipes),
``registry verify|rollback|repair|list`` (the model registry: fineflow.registry.verify, rollback and repair in
fineflow.registry.champion), ``lineage`` (fineflow.registry.lineage) and ``data add`` (new training data for the
on-new-data deployment), ``doctor`` (fineflow.goodput.doctor), ``params-doc`` (the params reference:
fineflow.params_doc), ``serve`` (the champion's GGUF export, OpenAI-compatible: fineflow.export.serve) and
``reward score`` (rows scored by the champion reward model: fineflow.objectives.reward_model).

    __init__.py           build_parser() (every subcommand's module adds its own) and main(), the console script
    __main__.py           ``python -m fineflow.cli``
    plan_commands.py      ``fineflow plan``: the planner's arguments as its Setup, format_plan and format_table
    recipe_commands.py    ``fineflow recipe list|show|apply``
    registry_commands.py  ``fineflow registry verify|rollback|repair|list`` and ``fineflow lineage``
    data_commands.py      ``fineflow data add``
    ci_command.py         ``fineflow ci``
    doctor_command.py     ``fineflow doctor``
    docs_commands.py      ``fineflow params-doc`` and ``fineflow dvc-deps``: the generated params page and code deps
    serve_command.py      ``fineflow serve``
    reward_command.py     ``fineflow reward score``

    fineflow plan --model 7B --method lora --precision bf16 --micro-batch 4 --seq-len 2048
    fineflow plan --model 8B --micro-batch 2 --seq-len 4096 --attention flash --device-gib 80
    fineflow plan --model models/base --method full --gpus 8 --sharding fsdp --device-gib 80 --auto-fit
    fineflow plan --table --gradient-checkpointing --device-gib 80
    fineflow plan --model meta-llama/Llama-3.1-70B-Instruct --gpus 8 --sharding fsdp --gradient-checkpointing
    fineflow recipe list
    fineflow recipe apply llama3-8b-lora [--params params.yaml] [--gpus 1 --device-memory-gib 48]
    fineflow registry verify [--registry models/registry] [--champion models/champion]
    FINEFLOW_REGISTRY_KEY=... fineflow registry verify   # keyed: every entry's HMAC is checked too
    fineflow registry rollback [--to ID] [--allow-unpromoted REASON] [--registry ...] [--champion ...]
    fineflow registry repair [--seal-head]  # finish what a promote or rollback that died left (they do it too)
    fineflow registry list
    fineflow lineage models/champion     # or a candidate id, or reports/lineage/<id>.json
    fineflow data add data/mine/train.jsonl   # dvc add it, then tell Prefect (the on-new-data deployment runs)
    fineflow doctor [reports/goodput.json] [--json] [--fail-on severe|warn|never]   # a run's bottlenecks
    fineflow params-doc --out docs/reference/params.md [--check]   # the params reference, from config.py
    fineflow serve [--export-dir models/export] [--type q8_0] [--host 127.0.0.1] [--port 8000] [--threads 4]
    fineflow reward score rows.jsonl [--out scored.jsonl] [--registry models/registry]   # each row's reward
    python -m fineflow.cli plan ...     # the same, without the installed script

Exit status of plan: 0 when the plan fits (or no --device-gib was given), 1 when it does not; of registry
verify (and repair): 0 when the log's hash chain, the stored candidates and the installed champion are intact,
1 (naming the first bad line) when not. 2 on bad input everywhere.
"""

from __future__ import annotations

import argparse
import sys

from fineflow.cli import (
    ci_command,
    data_commands,
    docs_commands,
    doctor_command,
    plan_commands,
    recipe_commands,
    registry_commands,
    reward_command,
    serve_command,
)
from fineflow.errors import FineflowError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fineflow", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    plan_commands.add_parser(sub)
    recipe_commands.add_parser(sub)
    registry_commands.add_parser(sub)  # registry, then lineage
    data_commands.add_parser(sub)
    ci_command.add_parser(sub)
    doctor_command.add_parser(sub)
    docs_commands.add_parser(sub)  # params-doc, then dvc-deps
    serve_command.add_parser(sub)
    reward_command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except FineflowError as exc:
        print(f"fineflow {args.command}: error: {exc}", file=sys.stderr)
        return 2
