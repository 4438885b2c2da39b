"""Naive against tuned, side by side: the same fine-tuning job run twice, each measured by the goodput ledger.

    .venv/bin/python bench/goodput.py [--steps 200] [--checkpoint-every 50] [--price-usd 4.0] [--repeats 1]
        [--project .] [--params params.yaml] [--out bench/goodput.json]

Needs the pipeline's artefacts (`make run` first): models/base, data/validated/train.jsonl, data/shards.

naive  one process, the loop most fine-tuning scripts start as: tokenizes each step's rows on the fly inside the
       loop (fineflow's own per-example encoder, one row at a time), pads them to the step's longest, dense sdpa
       attention with a padding mask, peft's own LoRA forward, a plain (unfused) AdamW, no prefetch, and a
       synchronous checkpoint (torch.save of the model and optimizer, fsync) every --checkpoint-every steps.
tuned  fineflow's train stage as dvc.yaml runs it (launcher -> accelerate launch -> rank) with params.yaml's
       defaults: packed shards made ahead, varlen attention, fused LoRA, fused AdamW, prefetch, asynchronous
       checkpoints every --checkpoint-every steps.

Both train the same LoRA config on the same rows for the same number of optimizer steps; each naive step takes as
many examples as a tuned step's packed rows hold on average. Each job runs in a scratch project under a temp dir,
as its own run (FINEFLOW_RUN_ID), and the goodput stage (fineflow.stages.goodput) writes its ledger, priced at
--price-usd per device-hour (cost.device_hour_usd): CPU time priced as if it were that GPU's, so the dollar figures
are the ledger's shares made concrete; the ratio naive/tuned does not depend on the price. With --repeats N the
jobs take turns (naive, tuned, naive, ...) and the table shows each figure's median.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from fineflow.core.dvc_project import stage_command

ROOT = Path(__file__).resolve().parent.parent
# the stages' command lines as dvc.yaml writes them
TRAIN_CMD = stage_command("train", ROOT, python=sys.executable)
GOODPUT_CMD = stage_command("goodput", ROOT, python=sys.executable)


NAIVE_SETTINGS = {  # what the naive loop does, in params terms: its ledger's settings say so (the doctor reads them)
    "train": {"prefetch": 0, "attention": "sdpa", "fused_lora": False, "precision": "no"},
    "checkpoint": {"mode": "sync"},
}


def scratch_project(
    project: Path, params_path: Path, scratch: Path, steps: int, every: int, price: float, naive: bool = False
) -> Path:
    """A project that shares the base and shards (read only) with params for this job."""
    scratch.mkdir(parents=True)
    for rel in ("models/base", "data/shards", "data/validated"):
        (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
        (scratch / rel).symlink_to((project / rel).resolve())
    params = yaml.safe_load(params_path.read_text(encoding="utf-8"))
    params["train"].update({"steps": steps, "tracker": "none", "eval_every": steps, "log_every": max(1, steps // 4)})
    params["checkpoint"].update({"every_steps": every})
    params.setdefault("cost", {})["device_hour_usd"] = price
    for section, values in (NAIVE_SETTINGS if naive else {}).items():
        params[section].update(values)
    (scratch / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    return scratch


def run(cmd: list[str], cwd: Path, env: dict) -> None:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def job(kind: str, project: Path, params_path: Path, scratch: Path, steps: int, every: int, price: float) -> dict:
    """Run one job in its scratch project and return its ledger."""
    scratch_project(project, params_path, scratch, steps, every, price, naive=kind == "naive")
    env = {**os.environ, "FINEFLOW_RUN_ID": f"bench-{kind}-{scratch.name}", "FINEFLOW_RUN_STARTED": repr(time.time())}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if kind == "tuned":
        run(TRAIN_CMD, scratch, env)
    else:
        run([sys.executable, str(Path(__file__).resolve()), "--naive-worker", "--project", str(scratch)], scratch, env)
    run(GOODPUT_CMD, scratch, env)
    return json.loads((scratch / "reports/goodput.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------------------------
# the naive job, in its own process (--naive-worker)


def naive_batches(rows: list[dict], per_step: int, seed: int):
    """Each step's rows, in a seeded shuffled order, round after round."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        for i in range(0, len(order) - per_step + 1, per_step):
            yield [rows[j] for j in order[i : i + per_step]]


def naive_worker(scratch: Path) -> int:
    """The naive loop (module docstring), timed into the same spans and report fields as the train stage."""
    from fineflow.core.journal import Attempt, ledger_dir

    attempt = Attempt(ledger_dir(scratch / "reports/train.json"), "train")
    attempt.start()
    entered = time.perf_counter()
    spans: dict[str, float] = {}
    import peft  # noqa: F401 - imports are start-up, as in the train stage
    import torch
    import transformers  # noqa: F401

    from fineflow.core.config import load_params
    from fineflow.core.reports import write_json_atomic
    from fineflow.tokenize.template import encode_pair, render_pair
    from fineflow.tokenize.tokenization import load_tokenizer
    from fineflow.train import flops
    from fineflow.train.model import build_model
    from fineflow.train.planner import load_shape
    from fineflow.train.profile import load_profile

    params = load_params(scratch / "params.yaml")
    cfg = params.train  # NAIVE_SETTINGS: sdpa, peft's forward, fp32, no prefetch; checkpoints sync
    base = str(scratch / "models/base")
    meta = json.loads((scratch / "data/shards/train/meta.json").read_text(encoding="utf-8"))
    per_step = max(1, round(meta["examples"] / meta["rows"] * cfg.micro_batch_size * cfg.grad_accum))
    rows = [json.loads(line) for line in (scratch / "data/validated/train.jsonl").read_text().splitlines() if line]
    loading = time.perf_counter()
    model = build_model(base, params, load_profile(cfg.accelerate_profile), fuse_lora=False)
    tokenizer = load_tokenizer(base)
    spans["model_load"] = time.perf_counter() - loading
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    started = time.perf_counter()
    spans["setup"] = started - entered - spans["model_load"]
    totals = dict.fromkeys(("data_wait_s", "compute_s", "optimizer_s", "checkpoint_s", "log_s"), 0.0)
    preprocess = 0.0
    tokens = padded = 0
    every = params.checkpoint.every_steps
    batches = naive_batches(rows, per_step, params.seed)
    steps_log = (scratch / "reports/train_steps.jsonl").open("w", encoding="utf-8")
    loss_value = float("nan")
    model.train()
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        picked = next(batches)
        encoded = [encode_pair(tokenizer, *render_pair(tokenizer, row)) for row in picked]  # on the fly
        preprocess += time.perf_counter() - t0
        longest = min(max(len(ids) for ids, _ in encoded), params.tokenize.seq_len)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ids = torch.full((len(encoded), longest), pad, dtype=torch.long)
        labels = torch.full((len(encoded), longest), -100, dtype=torch.long)
        attention = torch.zeros((len(encoded), longest), dtype=torch.long)
        for i, (example, mask) in enumerate(encoded):
            example, mask = example[:longest], mask[:longest]
            ids[i, : len(example)] = torch.tensor(example)
            attention[i, : len(example)] = 1
            labels[i, : len(example)] = torch.tensor([t if m else -100 for t, m in zip(example, mask, strict=True)])
        totals["data_wait_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        totals["compute_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss)
        totals["optimizer_s"] += time.perf_counter() - t0
        tokens += int(attention.sum())
        padded += attention.numel()
        if step % every == 0 or step == cfg.steps:
            t0 = time.perf_counter()
            path = scratch / "checkpoints" / f"step-{step}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as fh:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            totals["checkpoint_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        steps_log.write(json.dumps({"step": step, "loss": round(loss_value, 5), "tokens": int(attention.sum())}) + "\n")
        steps_log.flush()
        totals["log_s"] += time.perf_counter() - t0
    loop_s = time.perf_counter() - started
    steps_log.close()
    saving = time.perf_counter()
    model.save_pretrained(scratch / "models/candidate")
    shape = load_shape(base)
    matmul = shape.params - (0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    mean_len = tokens / (cfg.steps * per_step)
    per_token = flops.flops_per_token(matmul, trainable, "lora", shape.num_layers, shape.q_dim, mean_len / 2, False)
    peak = flops.peak_flops("cpu", "cpu", "no")
    report = {
        "stage": "train",
        "steps": cfg.steps,
        "resumed_from_step": 0,
        "recomputed_steps": 0,
        "method": "lora",
        "precision": "no",
        "attention": "sdpa (padded to the step's longest)",
        "final_loss": round(loss_value, 5),
        "tokens": tokens,
        "tokens_this_attempt": tokens,
        "padded_tokens": padded,
        "tokens_per_s": round(tokens / loop_s, 1),
        "world_size": 1,
        "trainable_parameters": trainable,
        "micro_batch_size": per_step,
        "grad_accum": 1,
        "gradient_checkpointing": False,
        "loop_s": round(loop_s, 3),
        "loop_totals": {k: round(v, 4) for k, v in totals.items()},
        "preprocess_s": round(preprocess, 4),
        "peak_mem_mb": 0.0,
        "device": {
            "type": "cpu",
            "name": "cpu",
            "count": 1,
            "bf16_capable": False,
            "bf16_speedup": None,
            "precision": "no",
        },
        "flops": {
            "model_per_token": round(per_token["model"]),
            "peak_per_device": peak["flops_per_s"],
            "peak_source": peak["source"],
            **flops.utilization(per_token, tokens / loop_s, peak, 1),
        },
        "grad_sync_measured": False,
    }
    spans.update({f"loop_{key.removesuffix('_s')}": value for key, value in totals.items()})
    spans["loop_other"] = loop_s - sum(totals.values())
    write_json_atomic(scratch / "reports/train.json", report)
    spans["save"] = time.perf_counter() - saving  # the adapter, the FLOPs (a CPU's measured peak), the report
    attempt.end(0, spans)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# the table


def figures(ledger: dict) -> dict:
    train = ledger.get("train") or {}
    cost = ledger.get("cost") or {}
    loop = float(train.get("loop_s") or 0.0)
    totals = train.get("loop_totals") or {}
    return {
        "total_s": ledger["total_s"],
        "goodput": ledger["goodput"],
        "train_goodput": ledger.get("train_goodput"),
        "loop_compute_share": (totals.get("compute_s", 0) + totals.get("optimizer_s", 0)) / loop if loop else None,
        "tokens_per_s_loop": train.get("tokens_per_s"),
        "tokens_per_s_run": (train.get("tokens_this_attempt") or 0) / ledger["total_s"],
        "usd_per_1m_tokens": cost.get("usd_per_1m_tokens"),
        "run_usd": cost.get("run_usd"),
        "mfu": ledger.get("mfu"),
        **{f"s_{name}": seconds for name, seconds in ledger["buckets"].items()},
        "unaccounted_s": ledger["unaccounted_s"],
        "doctor_first": (ledger.get("findings") or [{}])[0].get("cause"),
    }


def median(values: list):
    numbers = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(numbers) if numbers else (values[0] if values else None)


def table(results: dict[str, list[dict]], price: float) -> str:
    rows = {kind: {key: median([f[key] for f in runs]) for key in runs[0]} for kind, runs in results.items()}
    naive, tuned = rows["naive"], rows["tuned"]
    lines = [f"priced at ${price}/device-hour; medians of {len(results['naive'])} run(s) each", ""]
    lines.append(f"{'figure':<24} {'naive':>12} {'tuned':>12} {'naive/tuned':>12}")
    for key in naive:
        a, b = naive[key], tuned[key]
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            ratio = f"{a / b:12.2f}" if b else f"{'-':>12}"
            lines.append(f"{key:<24} {a:12.4g} {b:12.4g} {ratio}")
        else:
            lines.append(f"{key:<24} {a!s:>12} {b!s:>12}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", type=Path, default=ROOT)
    parser.add_argument("--params", type=Path, default=None, help="default: the project's params.yaml")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--price-usd", type=float, default=4.0, help="$ per device-hour (default: an H100's)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--only", default="naive,tuned")
    parser.add_argument("--out", type=Path, default=None, help="the ledgers and the table as JSON")
    parser.add_argument("--naive-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.naive_worker:
        return naive_worker(args.project)
    project = args.project.resolve()
    for rel in ("models/base", "data/shards/train/meta.json", "data/validated/train.jsonl"):
        if not (project / rel).exists():
            sys.exit(f"{project / rel} is missing: run the pipeline first (make run)")
    params_path = args.params or project / "params.yaml"
    kinds = [k for k in ("naive", "tuned") if k in args.only.split(",")]
    results: dict[str, list[dict]] = {kind: [] for kind in kinds}
    ledgers: dict[str, list[dict]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="fineflow-goodput-bench-") as tmp:
        for round_ in range(args.repeats):
            for kind in kinds:
                scratch = Path(tmp) / f"{kind}-{round_}"
                ledger = job(kind, project, params_path, scratch, args.steps, args.checkpoint_every, args.price_usd)
                ledgers[kind].append(ledger)
                results[kind].append(figures(ledger))
                print(
                    f"{kind} round {round_ + 1}: goodput {ledger['goodput']:.1%}, {ledger['total_s']:.1f} s", flush=True
                )
    text = table(results, args.price_usd) if len(kinds) == 2 else json.dumps(results, indent=1)
    print(text)
    if args.out:
        args.out.write_text(json.dumps({"results": results, "ledgers": ledgers, "table": text}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
