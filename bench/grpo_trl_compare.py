"""GRPO: fineflow's train stage vs TRL's GRPOTrainer on the same start model, prompts, reward, group size, lengths,
sampling and optimizer steps, side by side in one run: wall time per step, generated tokens/s, and the held-out
reward of each side's final adapter after the same number of steps, scored by one function for both, as ratios.

    .venv/bin/python bench/grpo_trl_compare.py [--steps 30] [--repeats 3] [--threads N] [--project DIR] \
        [--only fineflow,trl] [--sft-steps 300]

Inputs come from the real stages: a fresh copy of this project (bench/chat_quality.copy_project) with BENCH_PARAMS
over params.yaml (the embedded ~1M-parameter Llama pretrained as by default, 1,000 bundled train rows and 100 eval rows,
rows of 96 tokens so that every packed row holds exactly one example: a fineflow step then has exactly
micro_batch_size x grad_accum prompts, a count TRL can be given) and `dvc repro tokenize` in it. The START MODEL of
both sides: fineflow's SFT train stage run for --sft-steps on those shards (a fresh process, train_rank), its
adapter merged into the base weights (models/sft_merged: so that rewards are not all zero and both sides train a
fresh LoRA on the same weights). fineflow's GRPO run takes models/sft_merged as its base and
train.preference.reference base (the reference_logps stage's record written for it: a fresh adapter, beta 0, no
reference model). --project DIR builds all that there and keeps it, or reuses it when DIR already holds
models/sft_merged and models/grpo_reference/reference.json (building: ~4 min on 2 idle cores, most of it the
base's 1,200 pretraining steps; ~7 min beside another job; the comparison itself ~2.5 min at the defaults).

Both sides (each in a fresh Python process, --repeats rounds interleaved; thread count from
fineflow.core.threads.plan_threads(1, --threads) applied before torch loads, OMP_WAIT_POLICY passive, both sides):

fineflow   fineflow.train.procedure.train_rank() in-process (one rank, accelerate on CPU, fp32) with
           params_grpo.yaml (GRPO_PARAMS over the project's params): train.objective grpo, the step's sampled
           shard rows are its prompts, each prompt's group sampled with one ``generate`` call of G rows (seeded per
           group), rewards from fineflow.rewards (exact_match), group advantages, one micro-batch per
           grad_accum of one completion per row. Checkpointing off (the only eval+save is fit()'s last one, taken
           out of the total). Per step from its step log: step_s, rollout_s (generation), reward_s, compute_s,
           optimizer_s, completion_tokens_mean.
TRL        trl.GRPOTrainer (trl 1.16) as shipped, transformers generate (no vLLM), on the same merged model with a
           peft LoraConfig of train.lora's shape. Its rows: prompt = fineflow's rendered prompt
           (fineflow.tokenize.template.render_prompt), output = the row's answer; its reward function calls
           fineflow.rewards' exact_match (build_rewards, the very RewardSet fineflow's rollouts score with) on
           each completion, so both sides score identically. The mapping (trl_grpo_kwargs, checked by
           tests/test_bench_grpo_trl.py): num_generations = group_size, max_completion_length =
           max_completion_tokens, temperature, top_p, top_k 0, beta, epsilon, epsilon_high, loss_type =
           normalization ("grpo"), scale_rewards "group" (fineflow's std-scaled advantages), num_iterations 1,
           per_device_train_batch_size = completions per fineflow micro-step (micro_batch_size prompts x G),
           gradient_accumulation_steps = grad_accum, steps_per_generation = grad_accum (TRL's default): one
           optimizer step = one generation batch of the same prompt count as fineflow's. AdamW with fineflow's lr and
           weight decay, fineflow's schedule (fineflow.train.schedule.lr_multiplier), max_grad_norm, no activation
           checkpointing, fp32, no logging/saving/eval, seed = params.seed. Per step: on_step_end to on_step_end
           (the first from on_train_begin); generation = time in GRPOTrainer._generate (prompt tokenization,
           ``generate`` of the whole generation batch left-padded in one call, decoding); reward = time in
           _calculate_rewards; completion tokens = the generated ids (to and with EOS, as fineflow counts).

Measured per side: wall time per step (the median over steps 2.. and the total of every step, fineflow's final
eval+save taken out); generated tokens/s (completion tokens / generation seconds, and / step wall seconds); the
train reward mean over the run; the HELD-OUT REWARD: heldout_reward() below, one scorer for both sides' final
adapters (and the start model): greedy generation of max_completion_tokens on every eval row's prompt (rendered as
in training), prompts of one token length batched together so nothing is padded, exact match of the stripped
completion against the row's output, with the same RewardSet. Every round's adapters are scored; the table gives
the median round and says whether rounds differ.

The machine's load average before and after is printed: both sides share the cores with whatever else runs.
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
import warnings
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# importing trl_compare keeps accelerate (fineflow's and TRL's) on the CPU and the hubs offline, as it does there
from bench.chat_quality import OFFLINE, copy_project, dvc  # noqa: E402
from bench.trl_compare import median, with_steps  # noqa: E402

MODES = ("fineflow", "trl")
MERGED = "models/sft_merged"  # the SFT start, merged: both sides' base
GRPO_REFERENCE = "models/grpo_reference"  # the reference_logps stage's record for the GRPO run (a fresh adapter)
GRPO_PARAMS_FILE = "params_grpo.yaml"

# params.yaml's values changed for the bench's project (dotted keys): the default embedded model and its full
# pretraining (a 300-step base SFTs to eval loss 1.85 and exact match 0.02: no reward to learn from), a smaller
# dataset, rows of 96 tokens (the bundled examples are 54-81 tokens: one per row).
BENCH_PARAMS = {
    "data.n_train": 1000,
    "data.n_eval": 100,
    "tokenize.seq_len": 96,
    "train.objective": "sft",
    "train.micro_batch_size": 8,
    "train.grad_accum": 1,
    "train.warmup_steps": 10,
    "evaluate.limit": None,
}
# what the GRPO run changes over them (params_grpo.yaml): both sides read these through one mapping
GRPO_PARAMS = {
    "train.objective": "grpo",
    "train.preference.reference": "base",
    "train.micro_batch_size": 4,  # prompts per micro-step (one example per row)
    "train.grad_accum": 1,
    "train.lr": 5.0e-4,  # 2e-3: both sides end further below the start (held-out 0.27 fineflow, 0.30 TRL)
    "train.warmup_steps": 3,
    "train.grpo.group_size": 4,
    "train.grpo.max_completion_tokens": 16,
    "train.grpo.temperature": 1.0,
    "train.grpo.top_p": 1.0,
    "train.grpo.beta": 0.0,
    "train.grpo.normalization": "grpo",
    "train.grpo.rewards": [{"name": "exact_match", "weight": 1.0}],
}


def fail(message: str) -> None:
    print(f"bench/grpo_trl_compare.py: {message}", file=sys.stderr)
    raise SystemExit(2)


# ---------------------------------------------------------------------------------------------- inputs


def set_dotted(params: dict, values: dict) -> dict:
    """params (a params.yaml mapping) with each dotted key's value replaced, in place; returned."""
    for dotted, value in values.items():
        node = params
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return params


def prepared(project: Path) -> bool:
    return (project / MERGED / "config.json").is_file() and (project / GRPO_REFERENCE / "reference.json").is_file()


def prepare_project(project: Path | None, tmp: Path, args) -> tuple[Path, str]:
    """(a project with the SFT start merged and the GRPO run's params and reference record, how it was had)."""
    if project is not None and prepared(project):
        return project, f"reused {project}"
    if project is not None and project.exists() and any(project.iterdir()):
        fail(f"--project {project}: not empty and not a prepared bench project (give an empty folder)")
    project = project or tmp / "project"
    project.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    copy_project(project)
    params_file = project / "params.yaml"
    params = set_dotted(yaml.safe_load(params_file.read_text(encoding="utf-8")), BENCH_PARAMS)
    params_file.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    grpo = set_dotted(yaml.safe_load(params_file.read_text(encoding="utf-8")), GRPO_PARAMS)
    (project / GRPO_PARAMS_FILE).write_text(yaml.safe_dump(grpo, sort_keys=False), encoding="utf-8")
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(project)}
    dvc(project, env, "repro", "tokenize")
    built = time.perf_counter() - started
    sft = tmp / "sft"
    sft.mkdir(exist_ok=True)
    run_worker("sft", args, project, sft)
    return project, (
        f"built in {project}: `dvc repro tokenize` {built:.0f} s, then SFT {args.sft_steps} steps merged into "
        f"{MERGED} ({time.perf_counter() - started - built:.0f} s)"
    )


def sft_start(params, project: Path, tmp: Path, sft_steps: int) -> dict:
    """fineflow's SFT train stage for sft_steps on the project's shards, its adapter merged into the base weights
    (MERGED, with the base's own tokenizer files), and the reference_logps stage's record for the GRPO run on
    that base (GRPO_REFERENCE). The start model of both sides."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fineflow.core.config import load_params
    from fineflow.stages import reference_logps
    from fineflow.train.procedure import train_rank

    sft_params = with_steps(params, sft_steps)
    adapter = tmp / "sft_adapter"
    report = train_rank(
        sft_params, project / "data/shards", project / "models/base", tmp / "checkpoints", adapter, tmp / "steps.jsonl"
    )
    base = AutoModelForCausalLM.from_pretrained(project / "models/base", dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    out = project / MERGED
    merged.save_pretrained(out)
    for path in (project / "models/base").iterdir():  # the tokenizer's files as the shards were made with
        if path.is_file() and "token" in path.name:
            shutil.copy2(path, out / path.name)
    grpo = load_params(project / GRPO_PARAMS_FILE)
    champion = tmp / "no-champion"  # train.preference.reference base: never read
    reference_logps.run(grpo, project / "data/shards", out, champion, project / GRPO_REFERENCE)
    return {"sft_final_loss": report.get("final_loss"), "sft_eval_loss": report.get("eval_loss")}


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def prompt_rows(rows: list[dict]) -> list[dict]:
    """Validated instruction rows as {prompt, output}: fineflow's rendered prompt (what its shards hold before the
    answer) and the reference answer the exact_match reward checks."""
    from fineflow.tokenize.template import render_prompt

    out = []
    for number, row in enumerate(rows, start=1):
        if row.get("messages"):
            fail(f"row {number}: chat rows are not supported by this bench (bundled instruction rows only)")
        out.append({"prompt": render_prompt(row["instruction"], row.get("input") or ""), "output": row["output"]})
    return out


# -------------------------------------------------------------------------------------- the one mapping


def fineflow_settings(params, examples_per_row: float = 1.0) -> dict:
    """What one fineflow GRPO optimizer step is, in the terms both sides share."""
    cfg, g = params.train, params.train.grpo
    return {
        "steps": cfg.steps,
        "prompts_per_step": cfg.micro_batch_size * cfg.grad_accum * examples_per_row,
        "group_size": g.group_size,
        "completions_per_micro_step": cfg.micro_batch_size * examples_per_row * g.group_size,
        "max_completion_tokens": g.max_completion_tokens,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "top_k": 0,  # fineflow's rollouts sample with top_k 0 (the whole distribution)
        "beta": g.beta,
        "epsilon": g.epsilon,
        "epsilon_high": g.epsilon_high if g.epsilon_high is not None else g.epsilon,
        "loss": g.normalization,
        "scale_rewards": "none" if g.normalization == "dr_grpo" else "group",
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        "max_grad_norm": cfg.max_grad_norm,
        "grad_accum": cfg.grad_accum,
        "lora": (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, tuple(sorted(cfg.lora.target_modules))),
        "seed": params.seed,
    }


def trl_grpo_kwargs(params, out_dir: Path, checkpointing_key: str = "activation_checkpointing") -> dict:
    """GRPOConfig's arguments for the run fineflow_settings() describes (one example per packed row): one
    optimizer step generates one batch of the same prompts count, G completions each, in grad_accum micro-steps."""
    s = fineflow_settings(params)
    per_device = int(s["completions_per_micro_step"])
    return dict(
        output_dir=str(out_dir),
        max_steps=s["steps"],
        per_device_train_batch_size=per_device,  # TRL counts completions: prompts x num_generations
        gradient_accumulation_steps=s["grad_accum"],
        steps_per_generation=s["grad_accum"],  # TRL's default: one generation batch per optimizer step
        num_iterations=1,
        num_generations=s["group_size"],
        max_completion_length=s["max_completion_tokens"],
        temperature=s["temperature"],
        top_p=s["top_p"],
        top_k=s["top_k"],
        beta=s["beta"],
        epsilon=s["epsilon"],
        epsilon_high=s["epsilon_high"],
        loss_type=s["loss"],
        scale_rewards=s["scale_rewards"],
        mask_truncated_completions=False,
        learning_rate=s["lr"],
        weight_decay=s["weight_decay"],
        max_grad_norm=s["max_grad_norm"],
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        seed=s["seed"],
        # GRPOConfig defaults activation (gradient) checkpointing ON; fineflow's loop does not checkpoint
        **{checkpointing_key: False},
    )


def trl_settings(kwargs: dict, lora) -> dict:
    """fineflow_settings()'s terms read back from GRPOConfig's arguments (and the LoraConfig given to TRL)."""
    generation_batch = kwargs["per_device_train_batch_size"] * kwargs["steps_per_generation"]
    return {
        "steps": kwargs["max_steps"],
        # generation batches per optimizer step x the prompts of one
        "prompts_per_step": (kwargs["gradient_accumulation_steps"] // kwargs["steps_per_generation"])
        * (generation_batch // kwargs["num_generations"]),
        "group_size": kwargs["num_generations"],
        "completions_per_micro_step": kwargs["per_device_train_batch_size"],
        "max_completion_tokens": kwargs["max_completion_length"],
        "temperature": kwargs["temperature"],
        "top_p": kwargs["top_p"],
        "top_k": kwargs["top_k"],
        "beta": kwargs["beta"],
        "epsilon": kwargs["epsilon"],
        "epsilon_high": kwargs["epsilon_high"],
        "loss": kwargs["loss_type"],
        "scale_rewards": kwargs["scale_rewards"],
        "lr": kwargs["learning_rate"],
        "weight_decay": kwargs["weight_decay"],
        "max_grad_norm": kwargs["max_grad_norm"],
        "grad_accum": kwargs["gradient_accumulation_steps"],
        "lora": (lora.r, lora.lora_alpha, lora.lora_dropout, tuple(sorted(lora.target_modules))),
        "seed": kwargs["seed"],
    }


def lora_config(params):
    from peft import LoraConfig

    lora = params.train.lora
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )


# -------------------------------------------------------------------------------------------- fineflow


def run_fineflow(params, project: Path, tmp: Path) -> dict:
    import torch

    from fineflow.train.procedure import train_rank

    adapter = tmp / "adapter"
    steps_log = tmp / "steps.jsonl"
    report = train_rank(
        params,
        project / "data/shards",
        project / MERGED,
        tmp / "checkpoints",
        adapter,
        steps_log,
        reference=project / GRPO_REFERENCE,
    )
    records = read_rows(steps_log)
    g = params.train.grpo
    steps = []
    for r in records:
        completions = sum(map(len, r["rows"])) * g.group_size  # rows: each micro-batch's; a prompt per row
        steps.append(
            {
                # fit()'s last step holds its final eval and save: not GRPO's work, out of the step here
                "step_s": r["step_s"] - r.get("train_eval_s", 0.0) - r.get("checkpoint_s", 0.0),
                "generate_s": r.get("rollout_s", 0.0),
                "reward_s": r.get("reward_s", 0.0),
                "train_s": r.get("compute_s", 0.0) + r.get("optimizer_s", 0.0),
                "completion_tokens": round(r["completion_tokens_mean"] * completions),
                "completions": completions,
                "reward_mean": r["reward_mean"],
            }
        )
    return {
        "name": "fineflow train stage",
        "steps": steps,
        "threads": torch.get_num_threads(),
        "adapter": str(adapter),
        "note": f"final loss {report.get('final_loss')}; loop_s {report.get('loop_s')}",
    }


# ------------------------------------------------------------------------------------------------- TRL


def build_trl(params, project: Path, out_dir: Path):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fineflow.rewards import build_rewards
    from fineflow.train.schedule import lr_multiplier

    cfg = params.train
    base = str(project / MERGED)
    tokenizer = AutoTokenizer.from_pretrained(base)
    torch.manual_seed(params.seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    fields = GRPOConfig.__dataclass_fields__
    key = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    args = GRPOConfig(**trl_grpo_kwargs(params, out_dir, key))
    rewards = build_rewards([spec.as_dict() for spec in cfg.grpo.rewards], where="train.grpo.rewards")

    def fineflow_reward(prompts, completions, output, **_):
        """fineflow's rewards (the RewardSet its rollouts score with) on TRL's completions, stripped as there."""
        return rewards.score([c.strip() for c in completions], [{"output": o} for o in output]).total

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []
            self.start = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with each generation batch's generation and reward seconds and generated tokens tallied."""

        def _generate(self, prompts):
            started = time.perf_counter()
            out = super()._generate(prompts)
            self.tally["generate_s"].append(time.perf_counter() - started)
            self.tally["completion_tokens"].append(sum(len(ids) for ids in out[1]))
            self.tally["completions"].append(len(out[1]))
            return out

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            started = time.perf_counter()
            out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self.tally["reward_s"].append(time.perf_counter() - started)
            self.tally["reward_mean"].append(float(out.nansum(dim=1).mean()))
            return out

        def _generate_and_score_completions(self, inputs):
            started = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.tally["rollout_s"].append(time.perf_counter() - started)
            return out

    TimedGRPOTrainer.tally = {
        k: [] for k in ("generate_s", "reward_s", "rollout_s", "completion_tokens", "completions", "reward_mean")
    }
    clock = Clock()
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[fineflow_reward],
        args=args,
        train_dataset=Dataset.from_list(prompt_rows(read_rows(project / "data/validated/train.jsonl"))),
        processing_class=tokenizer,
        callbacks=[clock],
        peft_config=lora_config(params),
    )
    # the optimizer over the adapter TRL made, with fineflow's schedule (as bench/dpo_trl_compare.py does)
    optimizer = torch.optim.AdamW(
        [p for p in trainer.model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    trainer.optimizer = optimizer
    trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, cfg.steps, cfg.schedule)
    )
    return trainer, clock, rewards


def same_prompt_tokens(tokenizer, rows: list[dict]) -> str:
    """How many prompts TRL tokenizes (processing_class(text=...), as its _tokenize_prompts does) to the ids fineflow's
    tokenize stage gives them (encode without special tokens)."""
    prompts = [r["prompt"] for r in rows]
    trl_ids = tokenizer(text=prompts)["input_ids"]
    same = sum(a == tokenizer.encode(p, add_special_tokens=False) for a, p in zip(trl_ids, prompts))
    return f"prompt token ids identical to fineflow's for {same}/{len(prompts)} train prompts"


def run_trl(params, project: Path, tmp: Path) -> dict:
    import torch

    trainer, clock, rewards = build_trl(params, project, tmp / "trl")
    rows = prompt_rows(read_rows(project / "data/validated/train.jsonl"))
    prompts_check = same_prompt_tokens(trainer.processing_class, rows)
    trainer.train()
    rewards.close()
    adapter = tmp / "adapter"
    trainer.model.save_pretrained(str(adapter))
    t = trainer.tally
    ends = [clock.start, *clock.ends]
    if len(t["generate_s"]) != len(clock.ends):
        fail(f"TRL generated {len(t['generate_s'])} batches in {len(clock.ends)} steps: not one per step")
    steps = [
        {
            "step_s": b - a,
            "generate_s": t["generate_s"][i],
            "reward_s": t["reward_s"][i],
            "train_s": (b - a) - t["rollout_s"][i],
            "completion_tokens": t["completion_tokens"][i],
            "completions": t["completions"][i],
            "reward_mean": t["reward_mean"][i],
        }
        for i, (a, b) in enumerate(zip(ends, ends[1:]))
    ]
    return {
        "name": "TRL GRPOTrainer",
        "steps": steps,
        "threads": torch.get_num_threads(),
        "adapter": str(adapter),
        "note": (
            f"{prompts_check}; per_device_train_batch_size {trainer.args.per_device_train_batch_size} completions x "
            f"grad_accum {trainer.args.gradient_accumulation_steps}, generation_batch_size "
            f"{trainer.args.generation_batch_size}, num_generations {trainer.args.num_generations}"
        ),
    }


# ------------------------------------------------------------------------------------- held-out reward


def length_batches(prompt_ids: list[list[int]], size: int) -> list[list[int]]:
    """Indices of prompts grouped by token length, at most size each: batches that need no padding."""
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        by_length.setdefault(len(ids), []).append(i)
    return [group[k : k + size] for _, group in sorted(by_length.items()) for k in range(0, len(group), size)]


def greedy_completions(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, size: int = 32):
    """Each prompt's greedy completion (text, special tokens dropped), generated in unpadded same-length batches."""
    import torch

    texts = [""] * len(prompt_ids)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    with torch.no_grad():
        for batch in length_batches(prompt_ids, size):
            ids = torch.tensor([prompt_ids[i] for i in batch], dtype=torch.long)
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
            )
            for i, row in zip(batch, out):
                texts[i] = tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True)
    return texts


def exact_match_mean(texts: list[str], answers: list[str], rewards) -> float:
    """The mean of the reward set's total over (completion, answer) pairs: the held-out reward."""
    scores = rewards.score([t.strip() for t in texts], [{"output": a} for a in answers]).total
    return sum(scores) / len(scores) if scores else 0.0


def heldout_reward(params, project: Path, adapters: dict) -> dict:
    """{name: held-out reward} of the start model (name "start", no adapter) and each adapter loaded on it with peft:
    greedy completions of every eval row's prompt scored by the GRPO run's rewards (exact match)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fineflow.rewards import build_rewards

    base = str(project / MERGED)
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = prompt_rows(read_rows(project / "data/validated/eval.jsonl"))
    prompt_ids = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]
    answers = [r["output"] for r in rows]
    length = params.train.grpo.max_completion_tokens
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    scores = {}
    with build_rewards([spec.as_dict() for spec in params.train.grpo.rewards]) as rewards:
        scores["start"] = exact_match_mean(greedy_completions(model, tokenizer, prompt_ids, length), answers, rewards)
        for name, path in adapters.items():
            tuned = PeftModel.from_pretrained(model, str(path), is_trainable=False).eval()
            texts = greedy_completions(tuned, tokenizer, prompt_ids, length)
            scores[name] = exact_match_mean(texts, answers, rewards)
            model = tuned.unload()  # the next adapter goes on the plain start model again
    return scores


# ------------------------------------------------------------------------------------------------ table


def summarize(result: dict) -> dict:
    """One run's figures: median step wall over steps 2.. (the first holds warm-up), total wall, generation and
    reward seconds, generated tokens per generation second and per wall second, the mean train reward."""
    steps = result["steps"]
    later = steps[1:] or steps
    total = sum(s["step_s"] for s in steps)
    gen = sum(s["generate_s"] for s in steps)
    tokens = sum(s["completion_tokens"] for s in steps)
    completions = sum(s["completions"] for s in steps)
    return {
        "steps": len(steps),
        "step_median_s": median([s["step_s"] for s in later]),
        "total_s": total,
        "generate_s": gen,
        "reward_s": sum(s["reward_s"] for s in steps),
        "train_s": sum(s["train_s"] for s in steps),
        "tokens": tokens,
        "completions": completions,
        "gen_tok_s": tokens / gen if gen else 0.0,
        "wall_tok_s": tokens / total if total else 0.0,
        "train_reward": sum(s["reward_mean"] * s["completions"] for s in steps) / max(1, completions),
    }


def render_table(rounds: list[dict], heldout: dict) -> str:
    """The table: per side its median over rounds of each figure, the held-out reward of the median round's adapter
    (and the start model's), and the fineflow / TRL ratios; rounds[i] = {mode: summarize(...)}, heldout[(i, mode)]
    = the held-out reward, heldout["start"] = the start model's."""
    modes = [m for m in MODES if all(m in r for r in rounds)]
    keys = ("step_median_s", "total_s", "generate_s", "reward_s", "train_s", "gen_tok_s", "wall_tok_s", "train_reward")
    med = {m: {k: median([r[m][k] for r in rounds]) for k in keys} for m in modes}
    for m in modes:
        med[m]["tokens"] = median([r[m]["tokens"] for r in rounds])
        med[m]["steps"] = rounds[-1][m]["steps"]
        med[m]["heldout"] = median([heldout[(i, m)] for i in range(len(rounds))])
    header = (
        f"{'side':22} {'steps':>5} {'s/step':>7} {'total s':>8} {'gen s':>7} {'reward s':>8} {'train s':>8} "
        f"{'gen tok':>8} {'gen tok/s':>9} {'tok/wall-s':>10} {'train rwd':>9} {'held-out':>8}"
    )
    lines = [header, "-" * len(header)]
    for m in modes:
        x = med[m]
        lines.append(
            f"{m:22} {x['steps']:5d} {x['step_median_s']:7.3f} {x['total_s']:8.2f} {x['generate_s']:7.2f} "
            f"{x['reward_s']:8.3f} {x['train_s']:8.2f} {x['tokens']:8.0f} {x['gen_tok_s']:9.0f} "
            f"{x['wall_tok_s']:10.0f} {x['train_reward']:9.3f} {x['heldout']:8.3f}"
        )
    lines.append(
        f"{'start model (no GRPO)':22} {'':>5} {'':>7} {'':>8} {'':>7} {'':>8} {'':>8} {'':>8} {'':>9} "
        f"{'':>10} {'':>9} {heldout['start']:8.3f}"
    )
    if "fineflow" in med and "trl" in med:
        f, t = med["fineflow"], med["trl"]
        ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"  # noqa: E731
        lines.append(
            f"{'fineflow / TRL':22} {'':>5} {ratio(f['step_median_s'], t['step_median_s']):>7} "
            f"{ratio(f['total_s'], t['total_s']):>8} {ratio(f['generate_s'], t['generate_s']):>7} "
            f"{ratio(f['reward_s'], t['reward_s']):>8} {ratio(f['train_s'], t['train_s']):>8} "
            f"{ratio(f['tokens'], t['tokens']):>8} {ratio(f['gen_tok_s'], t['gen_tok_s']):>9} "
            f"{ratio(f['wall_tok_s'], t['wall_tok_s']):>10} {f['train_reward'] - t['train_reward']:+9.3f} "
            f"{f['heldout'] - t['heldout']:+8.3f}"
        )
        per_round = [r["fineflow"]["step_median_s"] / r["trl"]["step_median_s"] for r in rounds]
        lines.append(
            f"(medians of {len(rounds)} rounds; time ratios < 1x: fineflow faster; tok/s ratios > 1x: fineflow "
            f"faster; reward columns: fineflow - TRL) s/step ratio per round: "
            + ", ".join(f"{x:.2f}x" for x in per_round)
        )
    for m in modes:
        values = [heldout[(i, m)] for i in range(len(rounds))]
        same = "the same every round" if len(set(values)) == 1 else "per round " + ", ".join(f"{v:.3f}" for v in values)
        lines.append(f"  {m}: held-out reward {same}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main


def run_worker(mode: str, args, project: Path, run_tmp: Path) -> dict:
    """One side's run (or the SFT start) in a fresh interpreter: no inherited threads, allocator state or
    imports."""
    out = run_tmp / "result.json"
    command = [sys.executable, __file__, "--worker", mode, "--steps", str(args.steps), "--threads", str(args.threads)]
    command += ["--sft-steps", str(args.sft_steps), "--project", str(project), "--tmp", str(run_tmp), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        fail(f"{mode} run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def worker_main(args) -> None:
    """--worker MODE: one side (or the SFT start, "sft") on the project; its result JSON to --out."""
    from fineflow.core.threads import apply_threads, plan_threads

    apply_threads(plan_threads(1, args.threads))  # before torch loads: OpenMP reads the variables then
    import datasets
    import torch
    import transformers

    from fineflow.core.config import load_params

    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    if args.worker == "sft":
        result = sft_start(load_params(args.project / "params.yaml"), args.project, args.tmp, args.sft_steps)
    else:
        params = with_steps(load_params(args.project / GRPO_PARAMS_FILE), args.steps)
        run = run_fineflow if args.worker == "fineflow" else run_trl
        result = run(params, args.project, args.tmp)
    args.out.write_text(json.dumps({**result, "mode": args.worker}))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="GRPO optimizer steps for both sides (default 30)")
    parser.add_argument("--sft-steps", type=int, default=300, help="SFT steps of the start model (default 300)")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads of every run (fineflow.core.threads; default 2)"
    )
    parser.add_argument(
        "--project", type=Path, help="build the inputs here and keep them, or reuse them (default: a temp dir)"
    )
    parser.add_argument("--only", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians reported (default 3)")
    for hidden in ("--worker", "--tmp", "--out"):  # internal: one run in a fresh process (run_worker)
        parser.add_argument(hidden, type=str if hidden == "--worker" else Path, help=argparse.SUPPRESS)
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
    warnings.filterwarnings("ignore", category=FutureWarning)  # peft's unload() calls a renamed transformers API
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fineflow-grpo-bench-") as tmp_name:
        tmp = Path(tmp_name)
        project, how = prepare_project(args.project.resolve() if args.project else None, tmp, args)
        params = with_steps(load_params(project / GRPO_PARAMS_FILE), args.steps)
        shard = PackedShard(project / "data/shards/train")
        if shard.meta["examples"] != len(shard):
            fail(f"the train shard packs {shard.meta['examples']} examples in {len(shard)} rows: one per row needed")
        print_setup(args, how, params, load_before, trl.__version__, transformers, torch)
        rounds, results = [], []
        for round_index in range(args.repeats):
            rounds.append({})
            for mode in modes:
                print(f"--- round {round_index + 1}/{args.repeats}: running {mode} ...", flush=True)
                run_tmp = tmp / f"round{round_index}-{mode}"
                run_tmp.mkdir()
                result = run_worker(mode, args, project, run_tmp)
                results.append((round_index, result))
                rounds[-1][mode] = summarize(result)
        print("scoring every adapter on the eval prompts (greedy, exact match) ...", flush=True)
        heldout = heldout_reward(params, project, {(i, r["mode"]): Path(r["adapter"]) for i, r in results})
    print(
        f"\nload average after: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs; "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    print(render_table(rounds, heldout))
    print()
    for i, r in results:
        if i == len(rounds) - 1:
            print(f"{r['name']} (threads {r['threads']}): {r['note']}")
    print(
        "s/step = median step wall over steps 2..; total s = every step; gen s = generation (fineflow: the step "
        "log's rollout_s; TRL: GRPOTrainer._generate); reward s = scoring (fineflow: reward_s incl. decoding; TRL: "
        "_calculate_rewards); train s = fineflow compute_s + optimizer_s, TRL the step less its generate-and-score; "
        "gen tok = completion tokens generated (to and with EOS); train rwd = mean reward of the run's completions; "
        "held-out = greedy exact match on the eval prompts (the median round's figure), one scorer for both."
    )


def print_setup(args, how, params, load_before, trl_version, transformers, torch) -> None:
    s = fineflow_settings(params)
    print(
        f"trl {trl_version}, transformers {transformers.__version__}, torch {torch.__version__}; "
        f"threads {args.threads} in every run; {args.steps} GRPO steps each; load average {load_before:.2f} on "
        f"{os.cpu_count()} CPUs"
    )
    print(f"project: {how}")
    print(
        f"GRPO: {s['prompts_per_step']:.0f} prompts x G {s['group_size']} per step, {s['grad_accum']} micro-step(s); "
        f"max {s['max_completion_tokens']} completion tokens, temperature {s['temperature']}, top_p {s['top_p']}, "
        f"top_k off; beta {s['beta']}, epsilon {s['epsilon']}/{s['epsilon_high']}, loss {s['loss']}; lr {s['lr']} "
        f"{params.train.schedule}, warmup {params.train.warmup_steps}; LoRA r={s['lora'][0]} alpha={s['lora'][1]} on "
        f"{','.join(s['lora'][3])}; reward {[r.name for r in params.train.grpo.rewards]}",
        flush=True,
    )


if __name__ == "__main__":
    main()
