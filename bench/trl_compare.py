"""Effective (non-pad) tokens/s of fineflow's train stage vs TRL's SFTTrainer, without and with TRL's own
packing: same tiny model, same data, same optimizer steps, same CPU threads. Side by side, one run.

    .venv/bin/python bench/trl_compare.py [--steps 150] [--threads N] [--params params.yaml] \
        [--only fineflow,trl,trl-packed] [--repeats 3] [--data bundled|long-tailed]

Every method runs --repeats times, interleaved (fineflow, TRL, TRL packed, fineflow, ...), each run in a
fresh Python process, and the table gives each method's median loop time; the per-round ratios are
printed under it. On a shared 2-core
VM one run's rate moves by 15-30%, so a single round can flatter either side.

--data long-tailed runs the same comparison on a variant of the bundled rows whose prompts carry a seeded,
log-normal amount of extra context (median ~40 words, a few to the row limit; outputs unchanged), the
length shape of real instruction/RAG data; both sides tokenize and train on the same rows.

Needs the default pipeline's artefacts (`make run` first): models/base, data/validated/{train,eval}.jsonl
and data/shards. When data/shards is missing or was built from other inputs than the current params and
rows (content key mismatch, e.g. tokenize.seq_len changed), fresh shards are built into a temp dir with the
tokenize stage's own function and used instead (a few seconds); models/base and data/validated are never
rebuilt here.

fineflow      fineflow.train.procedure.train_rank() in-process: one rank, accelerate on CPU, params.yaml with
              train.steps = --steps and checkpointing off (checkpoint.every_steps = steps, so the only eval+save is
              the one fit() always does after the last step; it is timed in checkpoint_s and taken out of
              the loop time here). Packed rows of tokenize.seq_len, micro_batch_size rows x grad_accum per
              step, block-diagonal attention from per-example position ids.
TRL           trl.SFTTrainer (trl 1.16), prompt/completion rows built from data/validated/train.jsonl
              (prompt = fineflow's rendered prompt, completion = RESPONSE_PREFIX + output + EOS, so the loss is
              on the completion only, like fineflow's), no packing, padding_free off: batches padded to the
              longest example, per_device_train_batch_size = examples per fineflow step.
TRL packed    the same with packing=True and TRL 1.16's default packing_strategy "bfd", which forces
              padding_free: each step's packed rows are flattened into one sequence with per-example
              position ids (no attention mask). On CPU (sdpa attention) transformers turns those position
              ids into a block-diagonal mask, so attention does not cross examples; the bench checks this on
              a real packed batch and prints the largest logit difference vs. the examples run alone.
              per_device_train_batch_size = micro_batch_size packed rows (TRL's rows of <= max_length).

Both TRL runs use the same base model and LoRA config (params.train.lora), an AdamW with fineflow's lr and
weight decay, fineflow's own schedule (fineflow.train.schedule.lr_multiplier: linear warmup, cosine/linear decay
to 10%), max_grad_norm, no gradient checkpointing (SFTConfig's default is on), fp32, no eval, no saving,
no logging, dataloader_num_workers 0. TRL's time is its training loop (on_train_begin -> last on_step_end,
so it includes fetching/collating every batch, like fineflow's loop includes its data wait); real tokens are
the attention-mask (or, padding-free, the flattened) tokens of the batches it actually trained on.
TRL 1.16 as shipped: its loss goes through a fused LM head (log-probs in chunks, no full logits) and it
computes entropy and token accuracy on every step even with logging off; both are part of its time here.
Run it on a quiet machine: the load average before and after is printed, as every method shares the cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# CPU benchmark: keep accelerate (fineflow's Accelerator and TRL's) off any GPU, hubs offline, no telemetry.
os.environ["ACCELERATE_USE_CPU"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
from fineflow.core.runtime import apply_offline_environment

apply_offline_environment(ROOT)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

MODES = ("fineflow", "trl", "trl-packed", "fineflow-dense")  # the last: ablation, only with --only


def fail(message: str) -> None:
    print(f"bench/trl_compare.py: {message}", file=sys.stderr)
    raise SystemExit(2)


# ---------------------------------------------------------------------------------------------- inputs


def locate_inputs(params, tmp: Path) -> tuple[Path, Path, Path, str]:
    """(base_dir, rows_dir, shards_dir, note); exits 2 with instructions when the pipeline has not run."""
    base_dir, rows_dir, shards_dir = ROOT / "models/base", ROOT / "data/validated", ROOT / "data/shards"
    missing = [
        str(p.relative_to(ROOT))
        for p in (base_dir / "config.json", rows_dir / "train.jsonl", rows_dir / "eval.jsonl")
        if not p.exists()
    ]
    if missing:
        fail(
            f"missing {', '.join(missing)}: run `make run` (or `make repro`) first to build the base model and "
            "the validated rows"
        )
    from fineflow.base_source import resolve_base_model
    from fineflow.stages import tokenize

    reference = resolve_base_model(params.model, base_dir)
    if shards_current(params, reference, rows_dir, shards_dir):
        return base_dir, rows_dir, shards_dir, f"{shards_dir.relative_to(ROOT)} (content key matches)"
    built = tmp / "shards"
    started = time.perf_counter()
    tokenize.run(params, rows_dir, base_dir, built)
    return (
        base_dir,
        rows_dir,
        built,
        (
            f"rebuilt in a temp dir ({time.perf_counter() - started:.1f} s): "
            f"{shards_dir.relative_to(ROOT)} is missing or stale for the current "
            "params/rows"
        ),
    )


def shards_current(params, base: str, rows_dir: Path, shards_dir: Path) -> bool:
    try:
        from fineflow.tokenize.shards import shard_key_matches
        from fineflow.tokenize.tokenization import content_key, load_tokenizer
    except ImportError:  # an older/newer layout: fall back to the row length only
        try:
            meta = json.loads((shards_dir / "train/meta.json").read_text())
        except (OSError, ValueError):
            return False
        return meta.get("seq_len") == params.tokenize.seq_len and (shards_dir / "eval/meta.json").exists()
    tokenizer = load_tokenizer(base)
    return all(
        shard_key_matches(shards_dir / split, content_key(rows_dir / f"{split}.jsonl", tokenizer, params.tokenize))
        is not None
        for split in ("train", "eval")
    )


def with_steps(params, steps: int):
    """params with train.steps reduced and checkpointing effectively off (frozen pydantic models)."""
    train = params.train.model_copy(update={"steps": steps, "log_every": steps, "eval_every": steps, "tracker": "none"})
    checkpoint = params.checkpoint.model_copy(update={"every_steps": steps})
    return params.model_copy(update={"train": train, "checkpoint": checkpoint})


def long_tailed_rows(rows_dir: Path, out_dir: Path, base: str, seq_len: int, seed: int = 0) -> Path:
    """data/validated's train and eval rows with a seeded log-normal number of context words prepended to
    each input (words drawn from the rows' own inputs), each example kept within seq_len tokens so neither
    side truncates a response. Returns the new rows dir."""
    import numpy as np

    from fineflow.tokenize.template import encode_batch
    from fineflow.tokenize.tokenization import load_tokenizer

    tokenizer = load_tokenizer(base)
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval"):
        rows = [
            json.loads(line)
            for line in (rows_dir / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
        pool = " ".join(r.get("input") or r["instruction"] for r in rows).split()
        words = np.minimum(rng.lognormal(mean=3.7, sigma=0.9, size=len(rows)).astype(int), 2000)
        longer = []
        for row, n in zip(rows, words.tolist()):
            context = " ".join(pool[i] for i in rng.integers(0, len(pool), size=n))
            candidate = {**row, "input": f"context: {context}\n{row.get('input') or ''}"}
            while n > 0 and encode_batch(tokenizer, [candidate]).lengths[0] > seq_len:
                n = n * 3 // 4  # too long for a row: shorten the context until the whole example fits
                candidate = {**row, "input": f"context: {' '.join(context.split()[:n])}\n{row.get('input') or ''}"}
            longer.append(candidate)
        (out_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in longer), encoding="utf-8")
    return out_dir


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


# -------------------------------------------------------------------------------------------- fineflow


def run_fineflow(params, base_dir: Path, shards_dir: Path, tmp: Path, threads: int) -> dict:
    import torch

    from fineflow.tokenize.shards import PackedShard
    from fineflow.train.procedure import train_rank as worker

    torch.set_num_threads(threads)
    cfg = params.train
    shard = PackedShard(shards_dir / "train")
    seq_len = shard.meta["seq_len"]
    drawn = rows_drawn(params, shard, shards_dir / "train")
    started = time.perf_counter()
    report = worker(params, shards_dir, base_dir, tmp / "ff-checkpoints", tmp / "ff-adapter", tmp / "ff-steps.jsonl")
    total_s = time.perf_counter() - started
    # fit() always validates on the eval shard and saves after the last step (timed as checkpoint_s): not training
    eval_save_s = float(report.get("checkpoint_s", 0.0))
    loop_s = float(report["loop_s"]) - eval_save_s
    rows_per_step = cfg.micro_batch_size * cfg.grad_accum
    steps = report.get("steps", cfg.steps)
    cells = steps * rows_per_step * seq_len
    # exact examples/step when replaying the seeded sampler gives exactly the tokens the report counted
    exact = drawn is not None and drawn[1] == int(report["tokens"])
    examples_per_step = drawn[0] / steps if exact else rows_per_step * shard.meta["examples"] / len(shard)
    return {
        "name": "fineflow train stage (packed shards)",
        "steps": steps,
        "examples_per_step": examples_per_step,
        "examples_exact": exact,
        "tokens": int(report["tokens"]),
        "cells": cells,
        "loop_s": loop_s,
        "threads": torch.get_num_threads(),
        "total_s": total_s,
        "note": (
            f"report: tokens_per_s {report['tokens_per_s']} over loop_s {report['loop_s']} incl. the final "
            f"eval+save {eval_save_s:.2f} s (taken out here); final_loss {report.get('final_loss')}; "
            f"{rows_per_step} packed rows of {seq_len}/step"
        ),
    }


def rows_drawn(params, shard, shard_dir: Path) -> tuple[int, int] | None:
    """(examples, real tokens) in the rows fineflow's seeded sampler deals over the run (one rank), by replaying
    it; None if the sampler's API has moved on."""
    import numpy as np

    from fineflow.tokenize.shards import RowSampler

    cfg = params.train
    try:
        sampler = RowSampler(len(shard), params.seed, 0, 1, row_tokens=shard.real_per_row)
        rows = [r for _ in range(cfg.steps * cfg.grad_accum) for r in sampler.next_indices(cfg.micro_batch_size)]
        per_row = np.bincount(
            np.fromfile(shard_dir / "examples.idx", dtype=np.int64).reshape(-1, 3)[:, 0], minlength=len(shard)
        )
        return int(per_row[rows].sum()), shard.real_tokens(rows)
    except Exception:  # noqa: BLE001 - informational only
        return None


# ------------------------------------------------------------------------------------------------- TRL


def trl_rows(rows_path: Path, eos: str) -> list[dict]:
    from fineflow.tokenize.template import RESPONSE_PREFIX, render_prompt

    out = []
    for line in rows_path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("messages"):  # chat rows (not in the bundled data) go through the chat template in fineflow
            fail(f"{rows_path}:{len(out) + 1}: chat rows are not supported by this bench (bundled data only)")
        out.append(
            {
                "prompt": render_prompt(row["instruction"], row.get("input") or ""),
                "completion": RESPONSE_PREFIX + row["output"] + eos,
            }
        )
    return out


def trainer_config(config_cls, params, out_dir: Path, batch_size: int) -> dict:
    """What every TRL config of these benches shares (SFTConfig, DPOConfig): fineflow's steps, batch, optimizer
    settings and sequence length; fp32 on the CPU; no logging, saving, evaluation, workers or progress bar."""
    cfg = params.train
    return dict(
        output_dir=str(out_dir),
        max_steps=cfg.steps,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
        learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup_steps,
        max_grad_norm=cfg.max_grad_norm,
        max_length=params.tokenize.seq_len,
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        seed=params.seed,
        # TRL's configs default gradient checkpointing to ON; transformers 5.23 renamed it activation_checkpointing
        # (the old name is a deprecated alias). fineflow's loop does not checkpoint activations: off here too.
        **{
            (
                "activation_checkpointing"
                if "activation_checkpointing" in config_cls.__dataclass_fields__
                else "gradient_checkpointing"
            ): bool(getattr(cfg, "gradient_checkpointing", False))
        },
    )


def build_trl(params, base_dir: Path, rows_dir: Path, out_dir: Path, packing: bool, batch_size: int):
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from fineflow.base_source import resolve_base_model
    from fineflow.train.schedule import lr_multiplier

    cfg = params.train
    reference = resolve_base_model(params.model, base_dir)
    tokenizer = AutoTokenizer.from_pretrained(reference)
    dataset = Dataset.from_list(trl_rows(rows_dir / "train.jsonl", tokenizer.eos_token))

    # The same LoRA model fineflow builds (fineflow.stages.train.build_lora_model): same seed, config, dtype.
    torch.manual_seed(params.seed)
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    lora = cfg.lora
    model = get_peft_model(
        model,
        LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        ),
    )
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, cfg.steps, cfg.schedule)
    )

    args = SFTConfig(
        **trainer_config(SFTConfig, params, out_dir, batch_size),
        packing=packing,
        padding_free=False,
        completion_only_loss=True,
    )

    class Clock(TrainerCallback):
        start = end = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.end = time.perf_counter()

    class CountingSFTTrainer(SFTTrainer):
        """SFTTrainer that tallies what each micro-batch it trains on holds (tokens, padding, examples)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.tally = {"tokens": 0, "cells": 0, "examples": 0, "micro_batches": 0, "threads": None}

        def training_step(self, model, inputs, *args, **kwargs):
            ids = inputs["input_ids"]
            if "attention_mask" in inputs:  # padded batch: real = unmasked
                real, examples = int(inputs["attention_mask"].sum()), ids.shape[0]
            else:  # padding-free: one flattened sequence (pad_to_multiple_of is None off Neuron: no padding)
                real = ids.numel()
                examples = (
                    int(inputs["cu_seq_lens_q"].numel()) - 1
                    if "cu_seq_lens_q" in inputs
                    else int((inputs["position_ids"] == 0).sum())
                )
            t = self.tally
            t["tokens"] += real
            t["cells"] += ids.numel()
            t["examples"] += examples
            t["micro_batches"] += 1
            t["threads"] = t["threads"] or torch.get_num_threads()
            return super().training_step(model, inputs, *args, **kwargs)

    clock = Clock()
    trainer = CountingSFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
        optimizers=(optimizer, scheduler),
    )
    return trainer, clock


def same_encoding(trainer, rows_path: Path) -> str:
    """How many of TRL's tokenized examples equal fineflow's encoding (token ids and trained-on mask)."""
    try:
        from fineflow.tokenize.template import encode_batch

        rows = [json.loads(line) for line in rows_path.read_text(encoding="utf-8").splitlines() if line.strip()]
        encoded = encode_batch(trainer.processing_class, rows)
        data = trainer.train_dataset
        if len(data) != len(rows):
            return f"TRL kept {len(data)} of {len(rows)} rows"
        same = 0
        for i, (ids, labels) in enumerate(zip(data["input_ids"], data["labels"])):
            ff_ids, mask = encoded.example(i)
            same += ids == ff_ids and labels == [t if m else -100 for t, m in zip(ff_ids, mask)]
        return f"token ids + loss mask identical to fineflow's encoding for {same}/{len(rows)} examples"
    except Exception as exc:  # noqa: BLE001 - informational only
        return f"encoding not compared ({type(exc).__name__}: {exc})"


def packed_attention_check(trainer) -> float:
    """Largest |logit difference| between a real padding-free packed batch (as TRL feeds it) and each of its
    examples run alone: ~0 means attention and positions do not cross packed examples."""
    import torch

    collated = trainer.data_collator([trainer.train_dataset[i] for i in range(min(2, len(trainer.train_dataset)))])
    model = trainer.model
    model.eval()
    worst = 0.0
    with torch.no_grad():
        packed = model(**{k: v for k, v in collated.items() if k != "labels"}, use_cache=False).logits[0]
        starts = (collated["position_ids"][0] == 0).nonzero().flatten().tolist() + [collated["input_ids"].shape[1]]
        for a, b in itertools.pairwise(starts):
            alone = model(input_ids=collated["input_ids"][:, a:b], use_cache=False).logits[0]
            worst = max(worst, float((packed[a:b] - alone).abs().max()))
    model.train()
    return worst


def run_trl(params, base_dir: Path, rows_dir: Path, tmp: Path, threads: int, packing: bool, batch_size: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    setup_start = time.perf_counter()
    trainer, clock = build_trl(
        params, base_dir, rows_dir, tmp / ("trl-packed" if packing else "trl"), packing, batch_size
    )
    setup_s = time.perf_counter() - setup_start
    data = trainer.train_dataset
    if packing:
        data_note = (
            f"{len(data)} packed rows of <= {trainer.args.max_length}, "
            f"{sum(len(s) for s in data['seq_lengths'])} examples, {sum(len(x) for x in data['input_ids'])} tokens"
        )
    else:
        data_note = (
            f"{len(data)} examples, {sum(len(x) for x in data['input_ids'])} tokens; "
            f"{same_encoding(trainer, rows_dir / 'train.jsonl')}"
        )
    torch.set_num_threads(threads)
    started = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - started
    t = trainer.tally
    steps = trainer.state.global_step
    mode = trainer.args.packing_strategy if packing else None
    name = (
        f"TRL SFTTrainer, packing={mode}" + (" (padding-free)" if trainer.padding_free else "")
        if packing
        else "TRL SFTTrainer, no packing (pad to longest)"
    )
    note = (
        f"setup {setup_s:.1f} s; trainer.train() {train_s:.1f} s; dataset: {data_note}; "
        f"per_device_train_batch_size {trainer.args.per_device_train_batch_size} x grad_accum "
        f"{trainer.args.gradient_accumulation_steps}"
    )
    result = {
        "name": name,
        "steps": steps,
        "examples_per_step": t["examples"] / max(1, steps),
        "examples_exact": True,
        "tokens": t["tokens"],
        "cells": t["cells"],
        "loop_s": clock.end - clock.start,
        "threads": t["threads"],
        "note": note,
    }
    if packing and trainer.padding_free:
        result["cross_attention_max_logit_diff"] = packed_attention_check(trainer)
    return result


# ------------------------------------------------------------------------------------------------ main


def run_isolated(mode: str, args, base_dir: Path, rows_dir: Path, shards_dir: Path, run_tmp: Path, batch: int) -> dict:
    """One method's run in a fresh interpreter, so no method inherits another's threads, allocator state
    or imports (measured: fineflow ran 11% slower in-process after a TRL run than alone)."""
    import subprocess

    out = run_tmp / "result.json"
    command = [
        sys.executable,
        __file__,
        "--worker",
        mode,
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        "--params",
        str(args.params),
        "--base-dir",
        str(base_dir),
        "--rows-dir",
        str(rows_dir),
        "--shards-dir",
        str(shards_dir),
        "--tmp",
        str(run_tmp),
        "--batch",
        str(batch),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        fail(f"{mode} run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def worker_main(args) -> None:
    """--worker MODE: run one method on prepared inputs and write its result JSON (see run_isolated)."""
    import datasets
    import torch
    import transformers

    from fineflow.core.config import load_params

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    params = with_steps(load_params(args.params), args.steps)
    torch.set_num_threads(args.threads)
    if args.worker == "fineflow-dense":  # ablation: the dense block-diagonal mask and peft's own LoRA forward
        train = params.train.model_copy(update={"attention": "sdpa", "fused_lora": False})
        params = params.model_copy(update={"train": train})
        result = run_fineflow(params, args.base_dir, args.shards_dir, args.tmp, args.threads)
        result["name"] = "fineflow, dense mask + peft LoRA (ablation)"
    elif args.worker == "fineflow":
        result = run_fineflow(params, args.base_dir, args.shards_dir, args.tmp, args.threads)
    else:
        result = run_trl(
            params, args.base_dir, args.rows_dir, args.tmp, args.threads, args.worker == "trl-packed", args.batch
        )
    args.out.write_text(json.dumps({**result, "mode": args.worker}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps for every method (default 150)")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch.set_num_threads for every method (default: the CPUs this process may use)",
    )
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument(
        "--only",
        default=",".join(MODES[:3]),
        help=f"comma-separated subset of {','.join(MODES)} (default: the first three); "
        "fineflow-dense = fineflow with train.attention sdpa and fused_lora false (ablation)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians reported (default 3)")
    parser.add_argument("--data", choices=("bundled", "long-tailed"), default="bundled")
    # internal: one method in a fresh process (run_isolated)
    for hidden in ("--worker", "--base-dir", "--rows-dir", "--shards-dir", "--tmp", "--out"):
        parser.add_argument(hidden, type=str if hidden == "--worker" else Path, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args)
    modes = [m.strip() for m in args.only.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        fail(f"--only takes a comma-separated subset of {','.join(MODES)}")

    import datasets
    import torch
    import transformers
    import trl

    from fineflow.core.config import load_params
    from fineflow.tokenize.shards import PackedShard

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    params = with_steps(load_params(args.params), args.steps)
    cfg = params.train
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="fineflow-trl-bench-") as tmp_name:
        tmp = Path(tmp_name)
        base_dir, rows_dir, shards_dir, shard_note = locate_inputs(params, tmp)
        if args.data == "long-tailed":
            from fineflow.base_source import resolve_base_model
            from fineflow.stages import tokenize

            rows_dir = long_tailed_rows(
                rows_dir,
                tmp / "long-tailed",
                resolve_base_model(params.model, base_dir),
                params.tokenize.seq_len,
                params.seed,
            )
            shards_dir = tmp / "long-tailed-shards"
            tokenize.run(params, rows_dir, base_dir, shards_dir)
            shard_note = "built in a temp dir from the long-tailed rows"
        shard = PackedShard(shards_dir / "train")
        per_row = shard.meta["examples"] / len(shard)
        ff_examples = cfg.micro_batch_size * cfg.grad_accum * per_row
        trl_batch = max(1, round(cfg.micro_batch_size * per_row))  # x grad_accum: TRL examples/step = fineflow's
        print(
            f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}; "
            f"torch.set_num_threads({args.threads}) before every method; {args.steps} optimizer steps each; "
            f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
        )
        print(
            f"data ({args.data}): {rows_dir}/train.jsonl, {shard.meta['examples']} examples; fineflow "
            f"shards: {shard_note}; {len(shard)} rows of {shard.meta['seq_len']}, {per_row:.2f} examples/row, "
            f"{shard.meta.get('real_tokens'):,} real tokens (share {shard.meta.get('real_token_share')})"
        )
        print(
            f"model: {base_dir.relative_to(ROOT)}; LoRA r={cfg.lora.r} alpha={cfg.lora.alpha} "
            f"dropout={cfg.lora.dropout} on {','.join(cfg.lora.target_modules)}; lr {cfg.lr} {cfg.schedule}, "
            f"warmup {cfg.warmup_steps}, max_grad_norm {cfg.max_grad_norm}, weight_decay {cfg.weight_decay}"
        )
        if cfg.num_processes not in (None, 1):  # null: the profile's, 1 with auto
            print(f"note: params train.num_processes={cfg.num_processes}; this bench runs every method on 1 process")
        print(flush=True)

        rounds = []
        for round_index in range(args.repeats):
            results = []
            for mode in modes:
                print(f"--- round {round_index + 1}/{args.repeats}: running {mode} ...", flush=True)
                run_tmp = tmp / f"round{round_index}-{mode}"
                run_tmp.mkdir()
                batch = cfg.micro_batch_size if mode == "trl-packed" else trl_batch  # packed: fineflow's rows/step
                results.append(run_isolated(mode, args, base_dir, rows_dir, shards_dir, run_tmp, batch))
            rounds.append(results)

    print(f"\nload average after: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    print(
        f"fineflow examples/step = {cfg.micro_batch_size} rows x {cfg.grad_accum} accum x {per_row:.2f} "
        f"examples/row = {ff_examples:.1f}; TRL no packing: batch {trl_batch} x {cfg.grad_accum} accum"
    )
    header = (
        f"{'method':48} {'steps':>5} {'ex/step':>7} {'real tokens':>11} {'pad share':>9} {'threads':>7} "
        f"{'loop s':>7} {'eff tok/s':>9} {'fineflow/x':>10}"
    )
    print(header)
    print("-" * len(header))
    # the table: the last round's counts (identical every round: seeded) with each method's median loop time
    results = [{**r, "loop_s": median([rnd[i]["loop_s"] for rnd in rounds])} for i, r in enumerate(rounds[-1])]
    ff = next((r for r in results if r["mode"] == "fineflow"), None)
    ff_rate = ff["tokens"] / ff["loop_s"] if ff else None
    for r in results:
        rate = r["tokens"] / r["loop_s"]
        ratio = f"{ff_rate / rate:9.2f}x" if ff_rate else f"{'-':>10}"
        examples = f"{r['examples_per_step']:7.1f}" if r["examples_exact"] else f"~{r['examples_per_step']:6.1f}"
        print(
            f"{r['name']:48} {r['steps']:5d} {examples} {r['tokens']:11,d} {1 - r['tokens'] / r['cells']:9.1%} "
            f"{r['threads']!s:>7} {r['loop_s']:7.2f} {rate:9.0f} {ratio}"
        )
    print(f"(loop s = median of {len(rounds)} interleaved rounds)")
    if ff is not None and len(rounds) > 1:
        ff_index = results.index(ff)
        for i, r in enumerate(results):
            if r is ff:
                continue
            per_round = [(rnd[i]["tokens"] / rnd[i]["loop_s"]) for rnd in rounds]
            ff_round = [(rnd[ff_index]["tokens"] / rnd[ff_index]["loop_s"]) for rnd in rounds]
            ratios = [a / b for a, b in zip(ff_round, per_round)]
            print(
                f"  fineflow / {r['name']}: per round {', '.join(f'{x:.2f}x' for x in ratios)} "
                f"(rates: fineflow {', '.join(f'{x:.0f}' for x in ff_round)}; "
                f"this {', '.join(f'{x:.0f}' for x in per_round)} tok/s)"
            )
    print()
    for r in results:
        print(f"{r['name']}: {r['note']}")
        if "cross_attention_max_logit_diff" in r:
            diff = r["cross_attention_max_logit_diff"]
            print(
                f"  padding-free packed batch vs. its examples alone (CPU, sdpa): max |logit diff| {diff:.2e} -> "
                f"attention/positions {'do not cross' if diff < 1e-3 else 'CROSS'} packed examples"
            )
    print(
        "pad share = padded share of the token positions each method computed on (fineflow: packed rows of "
        "seq_len; TRL padded: batch x longest; TRL padding-free: the flattened rows, no padding). "
        "eff tok/s = real (non-pad) tokens / training-loop seconds."
    )


if __name__ == "__main__":
    main()
