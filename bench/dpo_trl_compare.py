"""DPO: fineflow's train stage vs TRL's DPOTrainer on the same base, pairs, beta and optimizer steps, side by side in
one run: real (non-pad) tokens/s of the training loop, its wall time, and the final preference accuracy of each
side's adapter on the same held-out pairs, scored by one function for both.

    .venv/bin/python bench/dpo_trl_compare.py [--steps 40] [--repeats 3] [--threads N] [--project DIR] \
        [--only fineflow,trl,trl-precomputed]

Inputs come from the real stages: a fresh copy of this project (bench/chat_quality.copy_project) with BENCH_PARAMS
over params.yaml (the embedded ~1M-parameter Llama briefly pretrained, ~500 bundled train pairs and 100 eval pairs,
rows of 256, train.objective dpo with train.preference.reference base) and `dvc repro reference_logps` in it
(base, data, validate, tokenize, fingerprint, reference_logps: ~2 min on 2 busy cores). --project DIR builds it there
and keeps it, or reuses it when DIR already holds models/reference_logps/reference.json. Both sides train on
data/validated/train.jsonl's
pairs: fineflow from the tokenize stage's pair shards of them, TRL from the same rows as text.

Methods (each run in a fresh Python process, --repeats rounds interleaved, the table gives each method's median
loop time and the per-round ratios under it, as bench/trl_compare.py does):

fineflow         fineflow.train.procedure.train_rank() in-process (one rank, accelerate on CPU, fp32) with the
                 project's params, train.steps = --steps, checkpointing off (the only eval+save is fit()'s last one,
                 timed as checkpoint_s and taken out of the loop time). Pairs packed whole into rows of
                 tokenize.seq_len (chosen then rejected, each attending only to itself: varlen attention, fused
                 LoRA), micro_batch_size rows x grad_accum per step. REFERENCE LOG-PROBS: read from the reference
                 stage's cache (models/reference_logps/train.logps.bin: the base's per-token log-probs, computed once by
                 `dvc repro reference_logps`), so no reference forward is inside the loop. The cost of computing them is
                 measured separately in the same worker after training ("ref s": the base loaded as the stage
                 loads it and the train shard scored with the stage's function), and the fresh result is checked
                 byte-identical to the cache.
TRL              trl.DPOTrainer (trl 1.16) as shipped for LoRA: the base model and a peft LoraConfig (train.lora's r,
                 alpha, dropout, target modules) given to the trainer, so the reference is the base with the adapter
                 disabled. REFERENCE LOG-PROBS: computed ON THE FLY, a no-grad forward of every micro-batch with
                 the adapter disabled, inside the measured loop (TRL's default).
TRL precomputed  the same with precompute_ref_log_probs=True: TRL scores every train pair with the adapter disabled
                 while the trainer is built, before training (its "ref s", outside the loop like fineflow's).

TRL's rows: prompt = fineflow's rendered prompt (fineflow.tokenize.template.render_prompt), chosen / rejected =
RESPONSE_PREFIX + the answer (TRL appends EOS), the text fineflow trains for each side; the bench checks TRL's
token ids and completion mask equal fineflow's encoding of every pair (fineflow.tokenize.pairs.encode_pairs) and
prints how many do. Pairs per step: TRL's per_device_train_batch_size = the pairs in fineflow's micro-step on
average (rows x pairs per row, rounded), the same grad_accum and steps; each micro-batch is 2 x batch sequences
padded to the longest (TRL's padding_free is disabled in 1.16). Same beta (train.preference.beta), sigmoid loss,
AdamW with fineflow's lr and weight decay, fineflow's schedule (fineflow.train.schedule.lr_multiplier),
max_grad_norm, no gradient checkpointing (DPOConfig defaults it on), fp32 (DPOConfig defaults bf16 on), no eval, no
saving, no logging, dataloader_num_workers 0, seed = params.seed. TRL's loop time runs from on_train_begin to
the last on_step_end (batches fetched and collated inside it, as fineflow's loop includes its data wait); its
real tokens are the attention-mask tokens of the batches it trained on. "cpu s" beside each loop time is the
process's CPU seconds over the same loop (all threads): a second view on a shared machine, not a substitute for a
quiet one (under load it inflates too). Both sides count a pair's prompt twice (it is in both sequences) and
the reference forward's tokens not at all.

Final preference accuracy: each side's final adapter scored by preference_scores() below, the evaluate stage's
own scorer (fineflow.evaluate.scoring.pair_scorer over data/validated/eval.jsonl: every eval pair's chosen and
rejected log-probs, the rewards anchored to the base, r(y) = beta * (logp_M(y) - logp_base(y)), a pair right when
r(chosen) > r(rejected), half on a tie), each adapter loaded on the base with peft as the evaluate stage loads a
candidate. Every round's adapter is scored; the table gives the last round's and says whether rounds differ.

The machine's load average before and after is printed: every method shares the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# importing trl_compare keeps accelerate (fineflow's and TRL's) on the CPU and the hubs offline, as it does there
from bench.chat_quality import OFFLINE, copy_project, dvc  # noqa: E402
from bench.trl_compare import median, rows_drawn, trainer_config, with_steps  # noqa: E402

MODES = ("fineflow", "trl", "trl-precomputed")

# params.yaml's values changed for the bench's project (dotted keys): the default embedded model, a shorter
# pretraining and a smaller dataset, so that building it and --repeats 3 fit in minutes on 2 cores.
BENCH_PARAMS = {
    "base.corpus_docs": 5000,
    "base.steps": 300,
    "data.n_train": 500,
    "data.n_eval": 100,
    "tokenize.seq_len": 256,
    "train.objective": "dpo",
    "train.preference.reference": "base",
    "train.micro_batch_size": 4,
    "train.grad_accum": 1,
    "train.warmup_steps": 5,
    "evaluate.limit": None,
}


def fail(message: str) -> None:
    print(f"bench/dpo_trl_compare.py: {message}", file=sys.stderr)
    raise SystemExit(2)


# ---------------------------------------------------------------------------------------------- inputs


def prepare_project(project: Path | None, tmp: Path) -> tuple[Path, str]:
    """(a project with the reference_logps stage's outputs, how it was had): reused, or built with
    `dvc repro reference_logps`."""
    if project is not None and (project / "models/reference_logps/reference.json").is_file():
        return project, f"reused {project}"
    if project is not None and project.exists() and any(project.iterdir()):
        fail(f"--project {project}: not empty and no models/reference_logps/reference.json (give an empty folder)")
    project = project or tmp / "project"
    project.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    copy_project(project)
    params_file = project / "params.yaml"
    params = yaml.safe_load(params_file.read_text(encoding="utf-8"))
    for dotted, value in BENCH_PARAMS.items():
        node = params
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    params_file.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(project)}
    dvc(project, env, "repro", "reference")
    return project, f"built in {project} by `dvc repro reference_logps` ({time.perf_counter() - started:.0f} s)"


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# -------------------------------------------------------------------------------------------- fineflow


def run_fineflow(params, project: Path, tmp: Path, threads: int) -> dict:
    import torch

    from fineflow.tokenize.shards import PackedShard
    from fineflow.train.procedure import train_rank

    torch.set_num_threads(threads)
    cfg, shards = params.train, project / "data/shards"
    shard = PackedShard(shards / "train")
    drawn = rows_drawn(params, shard, shards / "train")  # (examples, real tokens): a pair is two examples
    adapter = tmp / "adapter"
    cpu = cpu_timed_fit()
    report = train_rank(
        params,
        shards,
        project / "models/base",
        tmp / "checkpoints",
        adapter,
        tmp / "steps.jsonl",
        reference=project / "models/reference_logps",
    )
    eval_save_s = float(report.get("checkpoint_s", 0.0))
    steps = report.get("steps", cfg.steps)
    exact = drawn is not None and drawn[1] == int(report["tokens"])
    pairs_per_step = (
        drawn[0] / 2 / steps if exact else cfg.micro_batch_size * cfg.grad_accum * shard.meta["pairs"] / len(shard)
    )
    first = json.loads((tmp / "steps.jsonl").read_text().splitlines()[0])
    ref_s, same = reference_cost(params, project, tmp)
    return {
        "name": "fineflow train stage (packed pairs)",
        "steps": steps,
        "pairs_per_step": pairs_per_step,
        "pairs_exact": exact,
        "tokens": int(report["tokens"]),
        "cells": steps * cfg.micro_batch_size * cfg.grad_accum * shard.meta["seq_len"],
        "loop_s": float(report["loop_s"]) - eval_save_s,
        "loop_cpu_s": cpu["end"] - cpu["start"],
        "ref_s": ref_s,
        "ref_in_loop": False,
        "threads": torch.get_num_threads(),
        "adapter": str(adapter),
        "note": (
            f"first step loss {first.get('loss')} (log 2 = 0.693147: reference = the policy at step 0); final loss "
            f"{report.get('final_loss')}; loop_s {report['loop_s']} incl. the final eval+save {eval_save_s:.2f} s "
            f"(taken out); reference log-probs from models/reference_logps (cached), a fresh computation of the train "
            f"split's {'is byte-identical to' if same else 'DIFFERS from'} the cache"
        ),
    }


def cpu_timed_fit() -> dict:
    """The process CPU seconds around fineflow.train.loop.fit (all threads; the recipe imports fit when it trains,
    so wrapping the module's attribute reaches it): {"start", "end"} once it has run. On a shared machine a
    process's CPU time moves much less than its wall time with the other jobs' load."""
    from fineflow.train import loop

    fit, cpu = loop.fit, {}

    def timed(*args, **kwargs):
        cpu["start"] = time.process_time()
        try:
            return fit(*args, **kwargs)
        finally:
            cpu["end"] = time.process_time()

    loop.fit = timed
    return cpu


def reference_cost(params, project: Path, tmp: Path) -> tuple[float, bool]:
    """(seconds the reference_logps stage's work takes for the train split: the base loaded as the stage loads it, every
    trained token of the train shard scored; whether the result equals the cached train.logps.bin byte for byte)."""
    from fineflow.base_source import resolve_base_model
    from fineflow.stages.reference_logps import load_reference_model
    from fineflow.tokenize.shards import PackedShard
    from fineflow.train.pair_shards import PairShard, logps_file, write_shard_logps

    cfg = params.train
    started = time.perf_counter()
    model, device, _, autocast = load_reference_model(
        params, resolve_base_model(params.model, project / "models/base"), None
    )
    out = tmp / logps_file("train")
    shard = PairShard(PackedShard(project / "data/shards/train"))
    write_shard_logps(model, shard, out, cfg.micro_batch_size, device, cfg.attention == "varlen", autocast)
    seconds = time.perf_counter() - started
    return seconds, out.read_bytes() == (project / "models/reference_logps" / logps_file("train")).read_bytes()


# ------------------------------------------------------------------------------------------------- TRL


def trl_pairs(rows: list[dict]) -> list[dict]:
    """The validated pairs as TRL's standard preference rows: fineflow's prompt and each answer as fineflow trains
    it (TRL appends the EOS itself)."""
    from fineflow.tokenize.template import RESPONSE_PREFIX, render_prompt

    out = []
    for number, row in enumerate(rows, start=1):
        if row.get("messages"):
            fail(f"train row {number}: chat pairs are not supported by this bench (bundled instruction pairs only)")
        prompt = render_prompt(row["instruction"], row.get("input") or "")
        out.append(
            {"prompt": prompt, "chosen": RESPONSE_PREFIX + row["chosen"], "rejected": RESPONSE_PREFIX + row["rejected"]}
        )
    return out


def build_trl(params, base_dir: Path, rows: list[dict], out_dir: Path, precompute: bool, batch_size: int):
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from fineflow.base_source import resolve_base_model
    from fineflow.train.schedule import lr_multiplier

    cfg = params.train
    reference = resolve_base_model(params.model, base_dir)
    tokenizer = AutoTokenizer.from_pretrained(reference)
    torch.manual_seed(params.seed)
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    lora = cfg.lora
    peft_config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    args = DPOConfig(
        **trainer_config(DPOConfig, params, out_dir, batch_size),
        beta=cfg.preference.beta,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=precompute,
    )

    class Clock(TrainerCallback):
        start = end = cpu_start = cpu_end = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.end, self.cpu_end = time.perf_counter(), time.process_time()

    class CountingDPOTrainer(DPOTrainer):
        """DPOTrainer that tallies what each micro-batch holds and times its reference precomputation."""

        precompute_s = 0.0

        def _precompute_ref_logps(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return super()._precompute_ref_logps(*args, **kwargs)
            finally:
                self.precompute_s += time.perf_counter() - started

        def training_step(self, model, inputs, *args, **kwargs):
            t = self.tally
            t["tokens"] += int(inputs["attention_mask"].sum())
            t["cells"] += inputs["input_ids"].numel()
            t["pairs"] += inputs["input_ids"].shape[0] // 2  # chosen rows then rejected rows
            t["threads"] = t["threads"] or torch.get_num_threads()
            return super().training_step(model, inputs, *args, **kwargs)

    clock = Clock()
    CountingDPOTrainer.tally = {"tokens": 0, "cells": 0, "pairs": 0, "threads": None}
    trainer = CountingDPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(trl_pairs(rows)),
        processing_class=tokenizer,
        callbacks=[clock],
        peft_config=peft_config,
    )
    # TRL wraps the model with the adapter itself (so its reference is the base with the adapter disabled): the
    # optimizer over the adapter's parameters can only be made now; the Trainer keeps one it finds set
    optimizer = torch.optim.AdamW(
        [p for p in trainer.model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    trainer.optimizer = optimizer
    trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, cfg.steps, cfg.schedule)
    )
    return trainer, clock


def same_encoding(trainer, rows: list[dict]) -> str:
    """How many of TRL's tokenized pairs equal fineflow's encoding of them (both sides' token ids and trained mask)."""
    try:
        from fineflow.tokenize.pairs import encode_pairs

        encoded = encode_pairs(trainer.processing_class, rows)
        data = trainer.train_dataset
        if len(data) != len(rows):
            return f"TRL kept {len(data)} of {len(rows)} pairs"
        same = 0
        for i, (prompt, chosen, rejected) in enumerate(
            zip(data["prompt_ids"], data["chosen_ids"], data["rejected_ids"])
        ):
            sides = [(prompt + chosen, len(chosen)), (prompt + rejected, len(rejected))]
            for k, (ids, answer) in enumerate(sides):
                ff_ids, mask = encoded.example(2 * i + k)
                same += ids == list(ff_ids) and [0] * (len(ids) - answer) + [1] * answer == list(mask)
        return f"token ids + trained mask identical to fineflow's encoding for {same}/{2 * len(rows)} sequences"
    except Exception as exc:  # noqa: BLE001 - informational only
        return f"encoding not compared ({type(exc).__name__}: {exc})"


def run_trl(params, project: Path, tmp: Path, threads: int, precompute: bool, batch_size: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    rows = read_rows(project / "data/validated/train.jsonl")
    started = time.perf_counter()
    trainer, clock = build_trl(params, project / "models/base", rows, tmp / "trl", precompute, batch_size)
    setup_s = time.perf_counter() - started
    encoding = same_encoding(trainer, rows)
    torch.set_num_threads(threads)
    started = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - started
    adapter = tmp / "adapter"
    trainer.model.save_pretrained(str(adapter))
    t, steps = trainer.tally, trainer.state.global_step
    return {
        "name": "TRL DPOTrainer, reference precomputed" if precompute else "TRL DPOTrainer, reference on the fly",
        "steps": steps,
        "pairs_per_step": t["pairs"] / max(1, steps),
        "pairs_exact": True,
        "tokens": t["tokens"],
        "cells": t["cells"],
        "loop_s": clock.end - clock.start,
        "loop_cpu_s": clock.cpu_end - clock.cpu_start,
        "ref_s": trainer.precompute_s if precompute else None,
        "ref_in_loop": not precompute,
        "threads": t["threads"],
        "adapter": str(adapter),
        "note": (
            f"setup {setup_s:.1f} s (incl. precomputing {trainer.precompute_s:.1f} s); trainer.train() "
            f"{train_s:.1f} s; {len(trainer.train_dataset)} pairs, {encoding}; per_device_train_batch_size "
            f"{trainer.args.per_device_train_batch_size} pairs x grad_accum {trainer.args.gradient_accumulation_steps}"
        ),
    }


# -------------------------------------------------------------------------------- preference accuracy


def preference_scores(params, project: Path, adapters: dict[str, Path]) -> dict[str, dict]:
    """The evaluate stage's preference metrics of each adapter on the project's eval pairs: its pair scorer
    (fineflow.evaluate.scoring.pair_scorer), the base scored once as the anchor, each adapter loaded on the base with
    peft and unloaded again, as the evaluate stage scores a candidate. {name: {preference_accuracy, reward_margin}}."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fineflow.base_source import resolve_base_model
    from fineflow.evaluate.scoring import pair_scorer

    scorer = pair_scorer(params, project / "data/validated/eval.jsonl")
    reference = resolve_base_model(params.model, project / "models/base")
    tokenizer = AutoTokenizer.from_pretrained(reference)
    base = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    base_logps = scorer(base, tokenizer)
    scores = {}
    for name, path in adapters.items():
        model = PeftModel.from_pretrained(base, str(path), is_trainable=False).eval()
        scores[name] = scorer.summarize(scorer(model, tokenizer), base_logps)[0]
        base = model.unload()  # the next adapter goes on the plain base again
    return scores


# ------------------------------------------------------------------------------------------------ main


def run_isolated(mode: str, args, project: Path, run_tmp: Path, batch: int) -> dict:
    """One method's run in a fresh interpreter (bench/trl_compare.py's reasons: no inherited threads, allocator
    state or imports)."""
    out = run_tmp / "result.json"
    command = [sys.executable, __file__, "--worker", mode, "--steps", str(args.steps), "--threads", str(args.threads)]
    command += ["--project", str(project), "--tmp", str(run_tmp), "--batch", str(batch), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        fail(f"{mode} run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def worker_main(args) -> None:
    """--worker MODE: one method on the prepared project; its result JSON to --out."""
    import datasets
    import torch
    import transformers

    from fineflow.core.config import load_params

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    params = with_steps(load_params(args.project / "params.yaml"), args.steps)
    torch.set_num_threads(args.threads)
    if args.worker == "fineflow":
        result = run_fineflow(params, args.project, args.tmp, args.threads)
    else:
        result = run_trl(params, args.project, args.tmp, args.threads, args.worker == "trl-precomputed", args.batch)
    args.out.write_text(json.dumps({**result, "mode": args.worker}))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps for every method (default 40)")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch.set_num_threads for every method (default: the CPUs this process may use)",
    )
    parser.add_argument(
        "--project", type=Path, help="build the inputs here and keep them, or reuse them (default: a temp dir)"
    )
    parser.add_argument("--only", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians reported (default 3)")
    for hidden in ("--worker", "--tmp", "--out"):  # internal: one method in a fresh process (run_isolated)
        parser.add_argument(hidden, type=str if hidden == "--worker" else Path, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker_main(args)
    modes = [m.strip() for m in args.only.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        fail(f"--only takes a comma-separated subset of {','.join(MODES)}")
    import torch
    import transformers
    import trl

    from fineflow.core.config import load_params
    from fineflow.tokenize.shards import PackedShard

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # peft's unload() calls a renamed transformers API
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fineflow-dpo-bench-") as tmp_name:
        tmp = Path(tmp_name)
        project, how = prepare_project(args.project.resolve() if args.project else None, tmp)
        params = with_steps(load_params(project / "params.yaml"), args.steps)
        cfg = params.train
        shard = PackedShard(project / "data/shards/train")
        pairs_per_row = shard.meta["pairs"] / len(shard)
        batch = max(1, round(cfg.micro_batch_size * pairs_per_row))  # x grad_accum: TRL pairs/step = fineflow's
        print_setup(args, project, how, params, shard, batch, load_before, trl.__version__, transformers, torch)
        rounds = []
        for round_index in range(args.repeats):
            results = []
            for mode in modes:
                print(f"--- round {round_index + 1}/{args.repeats}: running {mode} ...", flush=True)
                run_tmp = tmp / f"round{round_index}-{mode}"
                run_tmp.mkdir()
                results.append(run_isolated(mode, args, project, run_tmp, batch))
            rounds.append(results)
        print("scoring every adapter on the eval pairs ...", flush=True)
        adapters = {(i, r["mode"]): Path(r["adapter"]) for i, rnd in enumerate(rounds) for r in rnd}
        scores = preference_scores(params, project, adapters)
    print(f"\nload average after: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")
    print_table(rounds, scores)


def print_setup(args, project, how, params, shard, batch, load_before, trl_version, transformers, torch) -> None:
    cfg = params.train
    meta = shard.meta
    print(
        f"trl {trl_version}, transformers {transformers.__version__}, torch {torch.__version__}; "
        f"torch.set_num_threads({args.threads}) in every method; {args.steps} optimizer steps each; "
        f"load average {load_before:.2f} on {os.cpu_count()} CPUs"
    )
    print(
        f"project: {how}; train pairs: {meta['pairs']} in {len(shard)} rows of {meta['seq_len']} "
        f"({meta['pairs'] / len(shard):.2f} pairs/row, real-token share {meta.get('real_token_share')})"
    )
    print(
        f"LoRA r={cfg.lora.r} alpha={cfg.lora.alpha} dropout={cfg.lora.dropout} "
        f"on {','.join(cfg.lora.target_modules)}; "
        f"lr {cfg.lr} {cfg.schedule}, warmup {cfg.warmup_steps}, max_grad_norm {cfg.max_grad_norm}; dpo beta "
        f"{cfg.preference.beta}; fineflow {cfg.micro_batch_size} rows x {cfg.grad_accum} accum per step, TRL "
        f"{batch} pairs x {cfg.grad_accum} accum",
        flush=True,
    )


def print_table(rounds: list[list[dict]], scores: dict) -> None:
    header = (
        f"{'method':40} {'steps':>5} {'pairs/st':>8} {'real tokens':>11} {'pad share':>9} {'loop s':>7} "
        f"{'tok/s':>7} {'fineflow/x':>10} {'cpu s':>7} {'tok/cpu-s':>9} {'fineflow/x':>10} "
        f"{'ref s':>12} {'loop+ref s':>10} {'pref acc':>8} {'margin':>8}"
    )
    print(header)
    print("-" * len(header))
    last = len(rounds) - 1
    results = [
        {**r, **{key: median([rnd[i][key] for rnd in rounds]) for key in ("loop_s", "loop_cpu_s")}}
        for i, r in enumerate(rounds[-1])
    ]
    for i, r in enumerate(results):
        ref = [rnd[i]["ref_s"] for rnd in rounds if rnd[i]["ref_s"] is not None]
        r["ref_med"] = median(ref) if ref else None
    ff = next((r for r in results if r["mode"] == "fineflow"), None)
    ff_rate = ff["tokens"] / ff["loop_s"] if ff else None
    ff_cpu_rate = ff["tokens"] / ff["loop_cpu_s"] if ff else None
    for r in results:
        rate = r["tokens"] / r["loop_s"]
        ratio = f"{ff_rate / rate:9.2f}x" if ff_rate else f"{'-':>10}"
        cpu_rate = r["tokens"] / r["loop_cpu_s"]
        cpu_ratio = f"{ff_cpu_rate / cpu_rate:9.2f}x" if ff_cpu_rate else f"{'-':>10}"
        pairs = f"{r['pairs_per_step']:8.2f}" if r["pairs_exact"] else f"~{r['pairs_per_step']:7.2f}"
        ref = "in the loop" if r["ref_in_loop"] else f"{r['ref_med']:.2f}"
        total = r["loop_s"] + (r["ref_med"] or 0.0)
        score = scores[(last, r["mode"])]
        print(
            f"{r['name']:40} {r['steps']:5d} {pairs} {r['tokens']:11,d} {1 - r['tokens'] / r['cells']:9.1%} "
            f"{r['loop_s']:7.2f} {rate:7.0f} {ratio} {r['loop_cpu_s']:7.2f} {cpu_rate:9.0f} {cpu_ratio} "
            f"{ref:>12} {total:10.2f} "
            f"{score['preference_accuracy']:8.3f} {score['reward_margin']:8.4f}"
        )
    print(
        f"(loop s, cpu s, ref s = medians of {len(rounds)} interleaved rounds; pref acc, margin: the last round's "
        "adapters)"
    )
    for i, r in enumerate(results):
        per_round = [r2["tokens"] / r2["loop_s"] for r2 in (rnd[i] for rnd in rounds)]
        per_cpu = [r2["tokens"] / r2["loop_cpu_s"] for r2 in (rnd[i] for rnd in rounds)]
        accuracies = [scores[(k, r["mode"])]["preference_accuracy"] for k in range(len(rounds))]
        same = "the same every round" if len(set(accuracies)) == 1 else f"per round {accuracies}"
        line = (
            f"  {r['name']}: tok/s per round {', '.join(f'{x:.0f}' for x in per_round)}; tok/cpu-s "
            f"{', '.join(f'{x:.0f}' for x in per_cpu)}; pref acc {same}"
        )
        if ff is not None and r is not ff:
            k = results.index(ff)
            ratios = [(rnd[k]["tokens"] / rnd[k]["loop_s"]) / (rnd[i]["tokens"] / rnd[i]["loop_s"]) for rnd in rounds]
            line += f"; fineflow/this per round {', '.join(f'{x:.2f}x' for x in ratios)}"
        print(line)
    print()
    for r in results:
        print(f"{r['name']}: {r['note']}")
    print(
        "tok/s = real (non-pad) tokens of the trained batches / loop seconds (a pair's prompt counted in both of its "
        "sequences, the reference forward's tokens not counted); cpu s = the process's CPU seconds over the same loop "
        "(all threads; fineflow's includes the final eval+save), tok/cpu-s = tokens / cpu s. "
        "pad share = padded share of the positions the "
        "policy computed on (fineflow: packed rows; TRL: 2 x batch sequences padded to the longest). ref s = "
        "computing the train pairs' reference log-probs outside the loop (fineflow: the reference_logps stage; TRL: "
        "precompute_ref_log_probs). pref acc / margin = fineflow_preference's preference_accuracy / reward_margin "
        "(rewards anchored to the base) on the eval pairs, one scorer for all."
    )


if __name__ == "__main__":
    main()
