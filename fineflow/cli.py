"""The ``fineflow`` command. Subcommands: ``plan`` (the GPU memory planner, fineflow.train.planner), ``recipe
list|show|apply`` (model-family recipes written into params.yaml after the planner's check: fineflow.recipes),
``registry verify|rollback|repair|list`` (the model registry: fineflow.registry.verify, rollback and repair in
fineflow.registry.champion), ``lineage`` (fineflow.registry.lineage) and ``data add`` (new training data for the
on-new-data deployment), ``doctor`` (fineflow.goodput.doctor), ``params-doc`` (the params reference:
fineflow.params_doc) and ``serve`` (the champion's GGUF export, OpenAI-compatible: fineflow.export.serve).

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
    python -m fineflow.cli plan ...     # the same, without the installed script

Exit status of plan: 0 when the plan fits (or no --device-gib was given), 1 when it does not; of registry
verify (and repair): 0 when the log's hash chain, the stored candidates and the installed champion are intact,
1 (naming the first bad line) when not. 2 on bad input everywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fineflow.core.errors import FineflowError


def _plan_parser(sub) -> None:
    from fineflow.train.planner import KNOWN_SHAPES, METHODS, OPTIMIZERS, PRECISIONS, SHARDINGS

    p = sub.add_parser(
        "plan",
        help="predict peak GPU memory per device before launching a run",
        description="Predict peak GPU memory per device: weights, gradients, optimizer "
        "states, activations, overhead (conventions: fineflow/train/planner/memory.py).",
    )
    p.add_argument(
        "--model",
        default="7B",
        help=f"a known size ({', '.join(KNOWN_SHAPES)}), a recipe's hub id (e.g. Qwen/Qwen3-8B: sized without "
        "downloading), a parameter count, a config.json or a model directory (default: 7B)",
    )
    p.add_argument("--method", choices=METHODS, default="lora")
    p.add_argument("--precision", choices=tuple(PRECISIONS), default="bf16")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--micro-batch", type=int, default=1, help="rows per device per forward (default: 1)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per row (default: 2048)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--gpus", type=int, default=1, help="data-parallel ranks (default: 1)")
    p.add_argument(
        "--sharding",
        choices=SHARDINGS,
        default="none",
        help="none: DDP; zero2: gradients+optimizer sharded; fsdp/zero3: everything sharded",
    )
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument(
        "--lora-targets",
        default="all-linear",
        help="comma-separated linears (q_proj,v_proj,...: the model's names, or Llama's for a fused qkv/gate_up) or "
        "all-linear (default: every linear of the model's decoder layer)",
    )
    _plan_layout_args(p)
    p.add_argument("--device-gib", type=float, help="device memory in GiB: say whether the plan fits")
    p.add_argument(
        "--auto-fit",
        action="store_true",
        help="with --device-gib: enable gradient checkpointing, then lower the micro-batch, until it fits",
    )
    p.add_argument("--table", action="store_true", help="print full/lora/qlora for every known size")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=_run_plan)


def _plan_layout_args(p) -> None:
    """What the run does with its rows and weights: the attention kind, packing, the dtype weights are held in."""
    from fineflow.train.planner import ATTENTIONS, WEIGHT_STORAGES

    p.add_argument(
        "--attention",
        choices=(*ATTENTIONS, "flash"),
        default="varlen",
        help="train.attention's kind: varlen (default, as params.yaml) and flash (flash_attention_2) attend per "
        "example; sdpa keeps a row mask and expanded k/v per layer; eager the full score matrix",
    )
    p.add_argument(
        "--base-dtype",
        choices=WEIGHT_STORAGES,
        default="compute",
        help="how the weights are held: compute (the precision's; LoRA bases, FSDP2) or fp32 (cast as layers "
        "run: full fine-tuning under DDP/FSDP autocast, an FSDP1 LoRA base)",
    )
    p.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=1024,
        help="train.loss_chunk_tokens: the loss projects this many tokens onto the vocabulary at a time, so the "
        "logits never exist whole (default 1024, as params.yaml; 0: all tokens at once)",
    )
    p.add_argument(
        "--packed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rows hold several examples behind an attention mask, as fineflow packs them (default)",
    )


def _setup_from_args(args):
    from fineflow.train.planner import Setup

    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())  # "all-linear": every linear
    return Setup(
        method=args.method,
        precision=args.precision,
        optimizer=args.optimizer,
        micro_batch_size=args.micro_batch,
        seq_len=args.seq_len,
        grad_accum=args.grad_accum,
        gradient_checkpointing=args.gradient_checkpointing,
        num_gpus=args.gpus,
        sharding=args.sharding,
        lora_r=args.lora_r,
        lora_targets=targets,
        attention="flash_attention_2" if args.attention == "flash" else args.attention,
        packed=args.packed,
        weight_storage=args.base_dtype,
        loss_chunk_tokens=args.loss_chunk_tokens,
    )


def _describe_setup(setup) -> str:
    return (
        f"{setup.precision}, {setup.optimizer}, micro-batch {setup.micro_batch_size} x seq {setup.seq_len}, "
        f"gradient checkpointing {'on' if setup.gradient_checkpointing else 'off'}, {setup.num_gpus} GPU(s), "
        f"sharding {setup.sharding}, attention {setup.attention}, {'packed' if setup.packed else 'plain'} rows, "
        f"weights held in {'fp32' if setup.weight_storage == 'fp32' else setup.precision}, loss "
        f"{f'chunked by {setup.loss_chunk_tokens} tokens' if setup.loss_chunk_tokens else 'over all tokens'}"
    )


def format_plan(result, device_bytes: float | None = None) -> str:
    """A plan as an aligned breakdown in GiB, with the verdict when the device size is known."""
    from fineflow.train.planner import FRAGMENTATION, GiB

    s = result.setup
    method = s.method if s.method == "full" else f"{s.method} r={s.lora_r} on {', '.join(s.lora_targets)}"
    lines = [
        (f"{result.model}: {result.params / 1e9:.2f}B parameters, {method}, {result.trainable_params:,} trainable"),
        _describe_setup(s),
        "",
    ]
    rows = [
        ("weights", result.weights, ""),
        ("gradients", result.gradients, ""),
        (
            "optimizer states",
            result.optimizer_states,
            "incl. fp32 master weights" if s.method == "full" and s.precision != "fp32" else "",
        ),
        ("activations", result.activations, f"of which loss over the vocabulary {result.logits / GiB:.2f} GiB"),
        ("overhead", result.overhead, f"CUDA context/NCCL + {FRAGMENTATION:.0%} fragmentation"),
    ]
    if result.optimizer_step > result.activations:
        rows.append(("optimizer step", result.optimizer_step, "temporaries in step(), larger than activations"))
    lines += [f"  {name:<17}{value / GiB:>9.2f} GiB   {note}".rstrip() for name, value, note in rows]
    lines.append(f"  {'total':<17}{result.total / GiB:>9.2f} GiB per device")
    if device_bytes is not None:
        verdict = "fits in" if result.fits(device_bytes) else "does NOT fit in"
        lines.append(f"{verdict} {device_bytes / GiB:.1f} GiB ({result.total / device_bytes:.0%} of the device)")
    return "\n".join(lines)


def format_table(setup, device_bytes: float | None = None) -> str:
    """full/lora/qlora for every known size with setup's other settings, GiB per device."""
    from dataclasses import replace

    from fineflow.train.planner import KNOWN_SHAPES, METHODS, GiB, plan

    header = (
        f"{'model':<14}{'params':>8}  {'method':<6}{'weights':>9}{'grads':>8}{'optim':>8}{'activ':>8}"
        f"{'opt.step':>10}{'overhead':>10}{'total':>9}"
    )
    fits_col = f"  fits {device_bytes / GiB:g} GiB" if device_bytes is not None else ""
    lines = [
        (f"GiB per device; {_describe_setup(setup)}; LoRA r={setup.lora_r} on {', '.join(setup.lora_targets)}"),
        "total = weights + grads + optim + max(activ, opt.step) + overhead",
        header + fits_col,
        "-" * len(header + fits_col),
    ]
    for shape in KNOWN_SHAPES.values():
        for method in METHODS:
            r = plan(shape, replace(setup, method=method))
            row = (
                f"{shape.name:<14}{shape.params / 1e9:>7.2f}B  {method:<6}{r.weights / GiB:>9.1f}"
                f"{r.gradients / GiB:>8.1f}{r.optimizer_states / GiB:>8.1f}{r.activations / GiB:>8.1f}"
                f"{r.optimizer_step / GiB:>10.1f}{r.overhead / GiB:>10.1f}{r.total / GiB:>9.1f}"
            )
            lines.append(row + (f"  {'yes' if r.fits(device_bytes) else 'no'}" if fits_col else ""))
    return "\n".join(lines)


def _run_plan(args) -> int:
    from fineflow.train.planner import (
        DoesNotFit,
        GiB,
        auto_fit,
        load_shape,
        plan,
        what_to_change,
    )

    setup = _setup_from_args(args)
    device = args.device_gib * GiB if args.device_gib else None
    if args.table:
        print(format_table(setup, device))
        return 0
    shape = load_shape(args.model)
    result, changes = plan(shape, setup), []
    if device is not None and args.auto_fit:
        try:
            fitted = auto_fit(shape, setup, device)
        except DoesNotFit as exc:
            print(format_plan(result, device))
            print(f"refused: {exc}")
            return 1
        result, changes = fitted.plan, fitted.changes
    if args.json:
        print(
            json.dumps(
                {**result.as_dict(), "changes": changes, "fits": result.fits(device) if device else None}, indent=2
            )
        )
    else:
        print(format_plan(result, device))
        for change in changes:
            print(f"auto-fit: {change}")
        if device is not None and not result.fits(device):
            print(f"to fit: {what_to_change(shape, setup, device)}")
    return 0 if device is None or result.fits(device) else 1


def _registry_parser(sub) -> None:
    p = sub.add_parser("registry", help="verify the promotion log, roll back the champion, list candidates")
    actions = p.add_subparsers(dest="action", required=True)
    verify = actions.add_parser(
        "verify", help="check the log's hash chain (and HMACs, keyed), the stored candidates and the champion"
    )
    rollback = actions.add_parser("rollback", help="reinstall an earlier champion (logged, recorded in dvc.lock)")
    rollback.add_argument("--to", help="candidate id (or a unique prefix); default: the champion before the current")
    rollback.add_argument(
        "--allow-unpromoted",
        metavar="REASON",
        help="install a candidate the gate never promoted; the reason goes into the log entry and the model card "
        "(not needed, and not logged, for a candidate the gate promoted)",
    )
    repair = actions.add_parser("repair", help="finish what a promote or rollback that died midway left")
    repair.add_argument(
        "--seal-head",
        action="store_true",
        help="rewrite HEAD (keyed, with the key set) for the log as it stands: only for a log you have checked",
    )
    for q in (rollback, repair):
        q.add_argument("--base-dir", help="base model to merge into (default: the one recorded at promotion)")
    listing = actions.add_parser("list", help="candidates, their decisions and the champion")
    for q in (verify, rollback, repair, listing):
        q.add_argument("--registry", default="models/registry", help="registry dir (default: models/registry)")
    for q in (verify, rollback, repair):
        q.add_argument("--champion", help="installed champion dir (default: `champion` beside the registry dir)")
    verify.set_defaults(run=_run_verify)
    rollback.set_defaults(run=_run_rollback)
    repair.set_defaults(run=_run_repair)
    listing.set_defaults(run=_run_list)


def _registry_paths(args):
    """(registry dir, champion dir): the champion defaults to its place beside the registry (models/champion)."""
    from pathlib import Path

    registry = Path(args.registry)
    return registry, Path(args.champion) if args.champion else registry.parent / "champion"


def _run_verify(args) -> int:
    from fineflow.registry.promotion_log import KEY_VAR, last_champion_entry, read_log, registry_key
    from fineflow.registry.verify import override_note, verify_log

    registry, champion = _registry_paths(args)
    key = registry_key()
    problems = verify_log(registry, champion, key=key)
    if problems:
        for problem in problems:
            print(f"BROKEN: {problem}")
        return 1
    last, note = last_champion_entry(registry), override_note(registry)
    print(
        f"OK: {len(read_log(registry))} entries, hash chain intact"
        + (", every HMAC valid (HEAD's too)" if key else "")
        + ", candidates match their ids"
        + (f", champion {last['candidate_id']} as installed by entry {last['seq']}" if last else "")
    )
    if note:
        print(f"NOTE: {note}")
    if not key:
        print(f"(HMACs not checked: {KEY_VAR} is not set; the chain shows accidental edits, not deliberate ones)")
    return 0


def _run_rollback(args) -> int:
    from pathlib import Path

    from fineflow.core.workspace import held_for
    from fineflow.registry.champion import rollback
    from fineflow.registry.dvc_record import record_outputs
    from fineflow.registry.store import registry_lock

    registry, champion = _registry_paths(args)
    # not while a run holds the workspace (its promote, and the dvc.lock it writes, would race the rollback's)
    with held_for(Path.cwd(), "registry rollback"), registry_lock(registry):
        # no other write between the rollback and what dvc.lock records of it
        result = rollback(registry, champion, args.to, args.base_dir, allow_unpromoted=args.allow_unpromoted)
        note = record_outputs(registry, champion)
    print(f"rolled back: champion {result['from']} -> {result['to']} (log entry {result['log_seq']})")
    if result["override"]:
        print(f"override logged: {result['to']} was never promoted by the gate ({result['override']['reason']})")
    print(note)
    return 0


def _run_repair(args) -> int:
    from fineflow.registry.champion import recover
    from fineflow.registry.promotion_log import seal_head

    registry, champion = _registry_paths(args)
    if args.seal_head:
        seal_head(registry)
    if not recover(registry, champion, base_dir=args.base_dir):
        print("nothing to repair")
    return _run_verify(args)


def _run_list(args) -> int:
    from pathlib import Path

    from fineflow.registry.store import alias_id, stored_records

    registry = Path(args.registry)
    champion = alias_id(registry)
    for cid, record in stored_records(registry):
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in (record.get("metrics") or {}).items())
        print(f"{'*' if cid == champion else ' '} {cid}  {record.get('decision', '?'):<8}  {metrics}")
    print(f"champion: {champion or 'none'}")
    return 0


def _lineage_parser(sub) -> None:
    p = sub.add_parser(
        "lineage",
        help="print where a model came from, as a tree",
        description="Print a lineage manifest: a model dir (models/champion, a registry "
        "candidate), a candidate id, or a lineage JSON file.",
    )
    p.add_argument("target", help="model dir, candidate id, or lineage .json")
    p.add_argument("--registry", default="models/registry", help="where candidate ids are looked up")
    p.add_argument(
        "--runs",
        default="reports/lineage",
        help="full per-run manifests (git, times, user, host) by candidate id (default: reports/lineage)",
    )
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(run=_run_lineage)


def _run_lineage(args) -> int:
    from pathlib import Path

    from rich.console import Console

    from fineflow.registry.lineage import resolve, tree

    manifest = resolve(args.target, Path(args.registry), Path(args.runs))
    if args.json:
        print(json.dumps(manifest, indent=2, sort_keys=True))
    else:
        Console(soft_wrap=True).print(tree(manifest, f"lineage of {args.target}"))
    return 0


def _data_parser(sub) -> None:
    p = sub.add_parser("data", help="register new training data")
    actions = p.add_subparsers(dest="action", required=True)
    add = actions.add_parser(
        "add",
        help="track a data file with DVC and emit the fineflow.data.added event",
        description="`dvc add FILE`, then the Prefect event fineflow.data.added (resource fineflow.data.<FILE>, "
        "payload: path, md5, bytes) to the server PREFECT_API_URL names: prefect.yaml's on-new-data deployment "
        "runs the pipeline on it. Point data.train_path (or eval_path) at FILE in params.yaml.",
    )
    add.add_argument("file", help="the data file, inside the project")
    add.set_defaults(run=_run_data_add)


def _run_data_add(args) -> int:
    import os
    from pathlib import Path

    import yaml

    from fineflow.core.dvc_project import run_dvc

    path = Path(args.file)
    if not path.is_file():
        raise FineflowError(f"{path}: no such file")
    done = run_dvc(".", "add", str(path), env=dict(os.environ))
    if done.returncode != 0:  # e.g. the file is a stage's output (the embedded data stage's): DVC says so
        raise FineflowError(f"dvc add {path} failed: {(done.stdout + done.stderr).strip()[-1500:]}")
    [out] = yaml.safe_load(Path(f"{path}.dvc").read_text(encoding="utf-8"))["outs"]
    payload = {"path": path.as_posix(), "md5": out["md5"], "bytes": out.get("size")}
    print(f"tracked {path} (md5 {out['md5']}): commit {path}.dvc, and `dvc push` if you use a remote")
    if not os.environ.get("PREFECT_API_URL"):
        print("no PREFECT_API_URL: no event sent (run the flow yourself: make run)")
        return 0
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    resource = {"prefect.resource.id": f"fineflow.data.{path.as_posix()}"}
    event = emit_event(event="fineflow.data.added", resource=resource, payload=payload)
    EventsWorker.drain_all(timeout=30)  # sent before this process exits
    print(f"sent fineflow.data.added ({event.id if event else 'not sent: events are off'})")
    return 0


def _ci_parser(sub) -> None:
    from fineflow import ci

    p = sub.add_parser(
        "ci",
        help="the CI retraining job: pull, the pipeline and its gate, push, a summary",
        description=ci.__doc__.split("\n\nExit codes")[0],
        epilog="Exit codes: 0 promoted, up to date, or refused; 4 refused with --fail-on-refusal; 3 the candidate "
        "waits for approval; 2 bad params or input; 1 a crash.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--fail-on-refusal", action="store_true", help=f"exit {ci.REFUSED_EXIT} when the gate refuses")
    p.add_argument(
        "--commit",
        action="store_true",
        help="commit dvc.lock and reports/metrics when they changed ([skip ci]) and push them to the job's branch",
    )
    p.add_argument(
        "--base-ref",
        help="compare metrics against this git revision (default: the PR's base branch, "
        "else the commit the job started from)",
    )
    p.add_argument(
        "--summary",
        type=Path,
        help="the summary's file when $GITHUB_STEP_SUMMARY is not set (default: reports/ci-summary.md)",
    )
    p.add_argument("--project", type=Path, default=Path("."), help="the project (default: .)")
    p.set_defaults(run=_run_ci)


def _run_ci(args) -> int:
    from fineflow import ci

    options = ci.Options(args.project, args.fail_on_refusal, args.commit, args.base_ref, args.summary)
    return ci.run_ci(options).exit_code


def _doctor_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="read a run's goodput ledger: what starved the devices, its share of time and money, the fix",
        description="Name the bottlenecks of a run from its ledger (reports/goodput.json, written by the goodput "
        "stage): the evidence, the share of the run's time and cost, and the param to change.",
        epilog="Exit codes: 0 nothing at or above --fail-on; 1 a finding at or above it; 2 no readable ledger.",
    )
    p.add_argument("report", nargs="?", type=Path, default=Path("reports/goodput.json"), help="the ledger")
    p.add_argument("--json", action="store_true", help="print the findings (and the ledger's figures) as JSON")
    p.add_argument("--fail-on", choices=("severe", "warn", "never"), default="severe", help="exit 1 at this severity")
    p.set_defaults(run=_run_doctor)


def _run_doctor(args) -> int:
    from fineflow.goodput import doctor

    try:
        ledger = json.loads(args.report.read_text(encoding="utf-8"))
        findings = doctor.diagnose(ledger)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FineflowError(
            f"no readable goodput ledger at {args.report} ({type(exc).__name__}: {exc}); it is written by the "
            f"goodput stage at the end of `make run` / `dvc repro`"
        ) from exc
    if args.json:
        keys = ("total_s", "goodput", "train_goodput", "mfu", "hfu", "buckets", "unaccounted_s", "cost")
        print(json.dumps({"findings": findings, **{key: ledger.get(key) for key in keys}}, indent=2))
    else:
        print(doctor.format_text(ledger, findings))
    worst = doctor.worst(findings)
    if args.fail_on == "never" or worst is None:
        return 0
    return 1 if doctor.SEVERITY_RANK[worst] >= doctor.SEVERITY_RANK[args.fail_on] else 0


def _recipe_parser(sub) -> None:
    p = sub.add_parser(
        "recipe",
        help="model-family recipes (recipes/): list, show, apply one into params.yaml after the planner's check",
        description="A recipe holds what a practitioner sets for a real model (recipes/*.yaml, each value with its "
        "source). apply checks the plan fits the recipe's device (or --gpus/--device-memory-gib) and only then writes "
        "the values into params.yaml, keeping its comments and other keys (fineflow/recipes.py).",
        epilog="Exit codes: 0 applied (or listed/shown); 2 unknown recipe or key, or the plan does not fit (nothing "
        "written).",
    )
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every recipe: its device, its base model, what it is").set_defaults(
        run=_run_recipe_list
    )
    show = actions.add_parser("show", help="print a recipe file (values and their sources)")
    show.add_argument("name", help="a recipe of recipes/ (e.g. llama3-8b-lora) or a path")
    show.set_defaults(run=_run_recipe_show)
    apply = actions.add_parser("apply", help="plan it for the device, then write it into params.yaml")
    apply.add_argument("name", help="a recipe of recipes/ (e.g. llama3-8b-lora) or a path")
    apply.add_argument(
        "--params", type=Path, default=Path("params.yaml"), help="the file to write (default: params.yaml)"
    )
    apply.add_argument("--gpus", type=int, help="devices to plan for (default: the recipe's device.count)")
    apply.add_argument(
        "--device-memory-gib", type=float, help="GiB per device (default: the recipe's device.memory_gib)"
    )
    apply.set_defaults(run=_run_recipe_apply)


def _run_recipe_list(args) -> int:
    from fineflow.recipes import list_recipes

    for recipe in list_recipes():
        print(f"{recipe.name:<22}{recipe.device.label:<14}{recipe.values['model']['base']:<38}{recipe.summary}")
    return 0


def _run_recipe_show(args) -> int:
    from fineflow.recipes import load_recipe

    print(load_recipe(args.name).path.read_text(encoding="utf-8"), end="")
    return 0


def _run_recipe_apply(args) -> int:
    from fineflow.recipes import Device, apply_recipe, load_recipe
    from fineflow.train.planner import GiB

    recipe = load_recipe(args.name)
    if (args.gpus is not None and args.gpus < 1) or (
        args.device_memory_gib is not None and args.device_memory_gib <= 0
    ):
        raise FineflowError("--gpus must be >= 1 and --device-memory-gib > 0")
    device = Device(args.gpus or recipe.device.count, args.device_memory_gib or recipe.device.memory_gib)
    applied = apply_recipe(recipe, args.params, device)
    memory = applied.plan.memory
    print(
        f"planned: {memory['model']} {memory['setup']['method']}, {memory['bytes']['total'] / GiB:.2f} GiB per device "
        f"of {device.label}: fits"
    )
    for change in applied.changes:
        print(f"  {change}")
    print(
        f"wrote {len(applied.changes)} value(s) of {recipe.path} into {args.params} (its comments and other keys kept)"
    )
    return 0


def _params_doc_parser(sub) -> None:
    from fineflow.params_doc import DEFAULT_PAGE

    p = sub.add_parser(
        "params-doc",
        help="the params.yaml reference (every key's type, default, bounds, meaning) from fineflow/core/config.py",
        description="Write the params reference, generated from the typed models that validate params.yaml "
        "(fineflow/params_doc.py): to stdout, to --out, or compare it with the committed page (--check).",
        epilog=f"Exit codes: 0 written (or up to date); 1 --check found the page stale or missing. Regenerate: "
        f"fineflow params-doc --out {DEFAULT_PAGE}",
    )
    p.add_argument("--out", type=Path, help="write the page to this file (docs/reference/params.md) instead of stdout")
    p.add_argument("--check", action="store_true", help=f"exit 1 when --out (default {DEFAULT_PAGE}) is not current")
    p.set_defaults(run=_run_params_doc)


def _run_params_doc(args) -> int:
    from fineflow.params_doc import DEFAULT_PAGE, REGENERATE, render

    page = render()
    if args.check:
        path = args.out or DEFAULT_PAGE
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != page:
            state = "differs from fineflow/core/config.py" if current is not None else "is missing"
            print(f"{path} {state}: regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
    elif args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(page, encoding="utf-8")
        print(f"wrote {args.out}")
    else:
        print(page, end="")
    return 0


def _dvc_deps_parser(sub) -> None:
    p = sub.add_parser(
        "dvc-deps",
        help="each stage's code deps in dvc.yaml, from what its entry imports (fineflow/code_deps.py)",
        description="Compare each dvc.yaml stage's code dependencies with the fineflow modules its entry imports "
        "(function-level imports included), or rewrite them (--write); data deps, params and outs are kept.",
        epilog="Exit codes: 0 up to date (or written); 1 a stage's code deps differ from its imports.",
    )
    p.add_argument("--dvc-file", type=Path, default=Path("dvc.yaml"), help="the pipeline file (default dvc.yaml)")
    p.add_argument("--write", action="store_true", help="rewrite the code deps in the file")
    p.set_defaults(run=_run_dvc_deps)


def _run_dvc_deps(args) -> int:
    import yaml

    from fineflow.code_deps import rewrite, stage_code_deps

    root = args.dvc_file.resolve().parent
    text = args.dvc_file.read_text(encoding="utf-8")
    updated = rewrite(text, root, stage_code_deps(root, yaml.safe_load(text)["stages"]))
    if updated == text:
        print(f"{args.dvc_file}: every stage's code deps are what its entry imports")
        return 0
    if args.write:
        args.dvc_file.write_text(updated, encoding="utf-8")
        print(f"wrote {args.dvc_file}")
        return 0
    print(f"{args.dvc_file}: code deps differ from the imports: run `fineflow dvc-deps --write`", file=sys.stderr)
    return 1


def _serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the champion's GGUF export: an OpenAI-compatible API (llama-cpp-python's server)",
        description="Serve a GGUF the export stage wrote and the parity check passed (fineflow/export/serve.py): "
        "the file's own chat template and context length, greedy at temperature 0. Runs in the foreground.",
        epilog="Exit codes: 2 when there is nothing shippable to serve (export.json names why); else the server's.",
    )
    p.add_argument(
        "--export-dir",
        type=Path,
        default=Path("models/export"),
        help="the export stage's output (default: models/export)",
    )
    p.add_argument("--type", help='which GGUF (f16, q8_0, ...; default: export.json\'s "serve")')
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1, this machine)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument("--threads", type=int, help="llama.cpp's CPU threads (default: llama-cpp-python's, half the CPUs)")
    p.add_argument(
        "--n-ctx", type=int, default=0, help="context length in tokens (default 0: the model's, as the check ran it)"
    )
    p.add_argument("--allow-unshippable", action="store_true", help="serve an export the parity check refused")
    p.set_defaults(run=_run_serve)


def _run_serve(args) -> int:
    import os

    from fineflow.export.serve import chosen_gguf, require_server, serve_command, serving_banner

    kind, _ = chosen_gguf(args.export_dir, args.type, args.allow_unshippable)
    require_server()
    command = serve_command(
        args.export_dir,
        kind,
        args.host,
        args.port,
        args.threads,
        n_ctx=args.n_ctx,
        allow_unshippable=args.allow_unshippable,
        python=sys.executable,
    )
    print(serving_banner(args.export_dir, kind, args.host, args.port))
    print(" ".join(command), flush=True)
    os.execv(sys.executable, command)  # the server in this process: its signals and exit status are the command's
    return 0  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fineflow", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    _plan_parser(sub)
    _recipe_parser(sub)
    _registry_parser(sub)
    _lineage_parser(sub)
    _data_parser(sub)
    _ci_parser(sub)
    _doctor_parser(sub)
    _params_doc_parser(sub)
    _dvc_deps_parser(sub)
    _serve_parser(sub)
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


if __name__ == "__main__":
    raise SystemExit(main())
