"""GPU acceptance run: the real train stage on every configuration this machine can host, in one command.

    bash bench/gpu.sh --out gpu.json               # on a machine with >= 1 GPU, after `make venv` (~10 min cap)
    bash bench/gpu.sh --device cpu --tiny          # the same plumbing on the CPU: tiny model, few steps (~1-2 min)
    .venv/bin/python bench/gpu.py --only single_gpu --keep /tmp/gpu-run   # one configuration, workspace kept

What runs. The project is copied to a temporary folder (git ls-files, as bench/chat_quality.py does; without a
.git, the files .gitignore does not ignore) and its own stages run there, nothing reimplemented: `dvc repro
tokenize` (base, fingerprint, data, validate, tokenize), then per configuration `dvc repro train` (the launcher,
the memory planner, `accelerate launch`, the ranks, fused LoRA, checkpoints; DVC re-runs only train, whose params
changed) and the goodput stage's command (from dvc.yaml: fineflow.core.dvc_project) for that configuration's
ledger. Where dvc does not import (an image with torch but not the whole stack), or with --no-dvc, each stage
runs by its command from dvc.yaml in dvc.yaml's order instead: the same processes, without DVC's bookkeeping.

The base model is a real architecture with random weights (nothing is downloaded): Llama-3.2-1B's shape (hidden
2048, 16 layers, 32 heads, 8 KV heads, vocab 128,256, tied embeddings) or, with --tiny, a 2-layer one; it is
saved as a local model folder with a byte-level BPE tokenizer trained on the bundled corpus (its ids < the
model's vocab), and model.base points at it. Rows are the bundled synthetic dataset (4,000 train rows) packed to
tokenize.seq_len 2048; each training is 40 steps of micro-batch 4 per rank, LoRA r=16 on every projection, lr
2e-4, a checkpoint every 20 steps (async), the eval loss at the end (--tiny: 400 rows packed to 256, micro-batch 2).

Configurations, in this order (each one's JSON entry is written as soon as it ends):

    single_gpu        profile single_gpu: LoRA, bf16, train.attention varlen (packed examples attend to
                      themselves), fused LoRA. Then a preemption: the same configuration trained again from
                      scratch, SIGTERM to the train launcher mid-training (exit 75 after saving the step), run
                      again (it resumes), and the adapter's sha256 compared with the uninterrupted run's.
    single_gpu_flash  the same with train.attention flash_attention_2   (skipped: flash_attn does not import)
    single_gpu_qlora  train.method qlora, NF4 base                      (skipped: bitsandbytes does not import)
    multi_gpu_ddp     DDP over every GPU                                 (skipped: fewer than 2 GPUs)
    fsdp_lora         FSDP2 over every GPU                               (skipped: fewer than 2 GPUs)
    deepspeed_zero2   DeepSpeed ZeRO-2 over every GPU                    (skipped: < 2 GPUs, or no deepspeed)
    deepspeed_zero3   DeepSpeed ZeRO-3 over every GPU                    (skipped: < 2 GPUs, or no deepspeed)

A multi-GPU profile runs as the project tells a user to: a copy of configs/accelerate/<profile>.yaml with
num_processes set to the GPU count, train.accelerate_profile pointing at the copy, train.num_processes the
same count (micro-batch per rank unchanged: the global batch grows with the ranks). With --device cpu the first
configuration is `cpu` (profile auto, one process) and the multi-process one is cpu_ddp_2proc (2 ranks, gloo).

Recorded per configuration, from the stage's own outputs (reports/train.json, reports/goodput.json,
reports/train_steps.jsonl): tokens/s (real, non-pad tokens over all ranks, over the loop) and the median step; MFU and
HFU (fineflow.train.flops, in the train report); the peak memory (CUDA allocator peak; RSS on the CPU) against the
planner's per-device total and tensors; the goodput ledger (goodput, train goodput, its buckets, the doctor's
findings); the checkpoint stall (the loop's blocked seconds on saves, the background write's seconds, and the step
time while a write runs against the others). The preemption adds: the step the stop saved, exit codes, seconds
from SIGTERM to exit, the step resumed from, both adapters' sha256 and whether they are equal, and that run's
ledger (its restart loss).

The budget: --budget-s (default 540) is the whole run's; a configuration starts only when the time left
exceeds an estimate (the first training's wall time; x1.5 for QLoRA and for multi-process starts; the
preemption is two more trainings) and each stage process is stopped when the time left runs out (recorded as
"timed out"). gpu.sh's timeout (600 s) is the backstop.

Not covered: the evaluate and promote stages (the tiny model's tests cover them, a random base scores
nothing), full fine-tuning, fp16, gradient checkpointing, CPU/NVMe offload, torch.compile, more than one
machine, and a preemption of a multi-GPU run (tests/test_interrupts.py does that with 2 CPU ranks).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from chat_quality import OFFLINE  # noqa: E402  (bench/ is no package: the script beside this one)

from fineflow.core.dvc_project import stage_command, stage_names  # noqa: E402

# Llama-3.2-1B's config.json shape (as fineflow.train.planner's known shapes); --tiny: seconds on a CPU
SHAPES = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
    ),
}
TOKENIZER_VOCAB = {"1b": 8192, "tiny": 512}  # BPE targets; the bundled corpus runs out of merges at ~1,600
# params.yaml overrides per size: rows packed to seq_len, micro-batch per rank, steps; one checkpoint mid-run and
# one at the end, the eval loss at the end only
RUN_PARAMS = {
    "1b": {
        "data": {"n_train": 4000, "n_eval": 64},
        "tokenize": {"seq_len": 2048},
        "train": {"steps": 40, "micro_batch_size": 4, "eval_every": 40, "log_every": 10, "lr": 2.0e-4},
        "checkpoint": {"every_steps": 20},
    },
    "tiny": {
        "data": {"n_train": 400, "n_eval": 16},
        "tokenize": {"seq_len": 256},
        "train": {"steps": 40, "micro_batch_size": 2, "eval_every": 40, "log_every": 10, "lr": 2.0e-4},
        "checkpoint": {"every_steps": 20},
    },
}
PREEMPT_AFTER_STEP = 25  # SIGTERM once the step log reaches it: past the step-20 checkpoint, before the end
# how long the SIGTERMed run may take to save its step and exit (checkpoint.preempt_grace_s, 15 s, bounds it in the
# stage; the rest is slack), and the budget a SIGTERM needs left to be sent at all
GRACE_S = 60


@dataclass(frozen=True)
class Config:
    """One training configuration: what params.yaml gets, and what it needs to run."""

    name: str
    profile: str  # a file in configs/accelerate, or "auto"
    train: dict = field(default_factory=dict)  # further train.* overrides
    needs_module: str | None = None  # a package that must import
    multi: bool = False  # runs on every GPU (a copy of the profile with num_processes = the count)
    preempt: bool = False  # followed by the SIGTERM + resume check


GPU_CONFIGS = [
    Config("single_gpu", "single_gpu", preempt=True),
    Config("single_gpu_flash", "single_gpu", {"attention": "flash_attention_2"}, needs_module="flash_attn"),
    Config("single_gpu_qlora", "single_gpu", {"method": "qlora"}, needs_module="bitsandbytes"),
    Config("multi_gpu_ddp", "multi_gpu_ddp", multi=True),
    Config("fsdp_lora", "fsdp_lora", multi=True),
    Config("deepspeed_zero2", "deepspeed_zero2", needs_module="deepspeed", multi=True),
    Config("deepspeed_zero3", "deepspeed_zero3", needs_module="deepspeed", multi=True),
]
CPU_CONFIGS = [
    Config("cpu", "auto", preempt=True),
    Config("cpu_ddp_2proc", "cpu_ddp_2proc", multi=True),
]


# --- the machine and what it can host ------------------------------------------------------------------


def devices(device: str) -> tuple[str, int]:
    """(cuda | cpu, how many ranks a multi-process configuration takes: the GPU count; 2 on the CPU)."""
    import torch

    if device == "cpu":
        return "cpu", 2
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py: torch sees no GPU (torch.cuda.is_available() is False); use --device cpu --tiny")
    return "cuda", torch.cuda.device_count()


def versions() -> dict:
    """The stack's versions as installed (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "peft", "accelerate", "dvc", "flash-attn", "bitsandbytes", "deepspeed"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def skip_reason(config: Config, ranks: int) -> str | None:
    """Why this machine cannot run config (None: it can)."""
    if config.needs_module and importlib.util.find_spec(config.needs_module) is None:
        return f"{config.needs_module} is not installed"
    if config.multi and ranks < 2:
        return f"needs 2 or more GPUs, this machine has {ranks}"
    return None


# --- the base model and the project copy ------------------------------------------------------------------


def build_base(dest: Path, size: str, device: str, seed: int = 1234) -> dict:
    """A Llama with random weights in `size`'s shape and a BPE tokenizer trained on the bundled corpus, saved as
    a local model folder (bf16 on a GPU, as a released base would be; fp32 on the CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fineflow.base.embedded import train_tokenizer
    from fineflow.corpus import pretraining_corpus

    shape = SHAPES[size]
    tokenizer = train_tokenizer(pretraining_corpus(2000, seed), TOKENIZER_VOCAB[size], shape["max_position_embeddings"])
    torch.manual_seed(seed)
    config = LlamaConfig(
        **shape,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="bfloat16" if device == "cuda" else "float32",
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialized in its dtype on the CPU: this process never holds a GPU
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return {"parameters": sum(p.numel() for p in model.parameters()), **shape, "tokenizer_vocab": len(tokenizer)}


def project_files() -> list[str]:
    """The files git would hand on (tracked, and untracked but not ignored); in a working tree copied without its
    .git (as a machine may receive it), every file that .gitignore and .dvc/.gitignore do not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0:
        return listed.stdout.split()
    import pathspec

    # the project's .gitignore, .dvc/.gitignore's lines, and ruff's cache (it ignores itself)
    rules = [".git", ".dvc/cache/", ".dvc/tmp/", ".dvc/config.local", ".ruff_cache/"]
    rules += (ROOT / ".gitignore").read_text().splitlines()
    ignored = pathspec.GitIgnoreSpec.from_lines(rules)
    files = []
    for folder, dirs, names in os.walk(ROOT):
        rel = Path(folder).relative_to(ROOT)
        dirs[:] = [d for d in dirs if not ignored.match_file(f"{rel / d}/")]
        files += [str(rel / name) for name in names if not ignored.match_file(str(rel / name))]
    return sorted(files)


def copy_project(dest: Path) -> None:
    """The project's files (project_files) at dest, committed as a git repository of its own (DVC needs one)."""
    for rel in project_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(git + ["add", "-A"], cwd=dest, check=True)
    subprocess.run(git + ["commit", "-qm", "bench"], cwd=dest, check=True)


def merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def read_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def write_yaml(path: Path, data: dict) -> None:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def multi_profile(project: Path, profile: str, ranks: int) -> str:
    """A copy of configs/accelerate/<profile>.yaml with num_processes = ranks (what require_enough_gpus tells a
    user with fewer GPUs than the profile's 8 to do); returns its name for train.accelerate_profile."""
    source = project / "configs/accelerate" / f"{profile}.yaml"
    name = f"{profile}_{ranks}ranks"
    text = re.sub(r"(?m)^num_processes:\s*\d+", f"num_processes: {ranks}", source.read_text(encoding="utf-8"))
    (source.parent / f"{name}.yaml").write_text(text, encoding="utf-8")
    return name


# --- running the stages --------------------------------------------------------------------------------


class Budget:
    """The run's wall-time budget: what is left, and a process timeout that never outlives it."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def stage_env(python: Path, project: Path, run_id: str) -> dict:
    """Offline, this interpreter's bin first on PATH (dvc.yaml runs `python`), and a run id of its own: each
    configuration's stages are one run of the goodput ledger (fineflow.core.journal)."""
    from fineflow.core.journal import run_environment

    return {
        **os.environ,
        **OFFLINE,
        "HF_HOME": str(project / ".cache/huggingface"),
        "PATH": str(python.parent) + os.pathsep + os.environ["PATH"],
        **run_environment(run_id),
    }


def start(argv: list[str], project: Path, env: dict, log: Path) -> subprocess.Popen:
    """argv in the project, in a process group of its own, its output appended to log."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        return subprocess.Popen(
            argv, cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def run(argv: list[str], project: Path, env: dict, budget: Budget, log: Path) -> int:
    """argv to its end; stopped (SIGTERM, then SIGKILL to its process group) when the budget runs out: 124 then."""
    proc = start(argv, project, env, log)
    try:
        return proc.wait(timeout=max(1.0, budget.left()))
    except subprocess.TimeoutExpired:
        stop_group(proc)
        return 124


def stop_group(proc: subprocess.Popen, grace_s: float = 20) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:]


def reproduce(target: str, project: Path, env: dict, budget: Budget, log: Path, use_dvc: bool) -> int:
    """`dvc repro <target>`: DVC runs what changed up to target. Without DVC (not installed, or --no-dvc), the
    stages up to target that have not run yet, each by its command from dvc.yaml (dvc_project.stage_command):
    the same processes, in dvc.yaml's order, with no cache, lock or change detection."""
    if use_dvc:
        return run([sys.executable, "-m", "dvc", "repro", target], project, env, budget, log)
    names = stage_names(project)
    done = (project / "data/shards").exists()  # prepare ran the stages before train; each configuration trains
    for name in [target] if done else names[: names.index(target) + 1]:
        code = run(stage_command(name, project, python=sys.executable), project, env, budget, log)
        if code != 0:
            return code
    return 0


def goodput(project: Path, env: dict, budget: Budget, log: Path) -> dict | None:
    """The goodput stage's command from dvc.yaml: this run's ledger (reports/goodput.json)."""
    code = run(stage_command("goodput", project, python=sys.executable), project, env, budget, log)
    return json.loads((project / "reports/goodput.json").read_text()) if code == 0 else None


# --- what a configuration's outputs say ----------------------------------------------------------------


def read_steps(project: Path) -> list[dict]:
    path = project / "reports/train_steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def checkpoint_figures(report: dict, steps: list[dict], every: int) -> dict:
    """The loop's blocked time on saves, the background write's time, and the step time while a write runs
    (the steps right after a save) against the others."""
    saved_after = {s["step"] for s in steps if s["step"] % every == 0}
    during = [s["step_s"] for s in steps if s["step"] - 1 in saved_after and "step_s" in s]
    others = [s["step_s"] for s in steps[1:] if s["step"] - 1 not in saved_after and "step_s" in s]
    return {
        "stall_s": report.get("loop_totals", {}).get("checkpoint_s"),
        "write_s": report.get("checkpoint_write_s"),
        "step_s_after_save_median": round(statistics.median(during), 5) if during else None,
        "step_s_other_median": round(statistics.median(others), 5) if others else None,
    }


def summary(project: Path, ledger: dict | None, every: int) -> dict:
    """One configuration's figures from reports/train.json, the step log and the ledger."""
    report = json.loads((project / "reports/train.json").read_text())
    steps = read_steps(project)
    flops = report.get("flops") or {}
    return {
        **{key: report.get(key) for key in REPORT_KEYS},
        "tokens_per_s_per_device": report["tokens_per_s"] and round(report["tokens_per_s"] / report["world_size"], 1),
        "step_s_median": round(statistics.median([s["step_s"] for s in steps[1:]]), 5) if len(steps) > 1 else None,
        "mfu": flops.get("mfu"),
        "hfu": flops.get("hfu"),
        "flops": flops,
        "memory": memory_figures(report),
        "checkpoint": checkpoint_figures(report, steps, every),
        "goodput": ledger_figures(ledger),
    }


# what a configuration's entry takes from reports/train.json as it is
REPORT_KEYS = (
    "steps",
    "world_size",
    "method",
    "precision",
    "attention",
    "fused_lora_layers",
    "micro_batch_size",
    "device",
    "tokens",
    "tokens_per_s",
    "loop_s",
    "final_loss",
    "eval_loss",
    "data_wait_share",
)


def memory_figures(report: dict) -> dict:
    """The measured peak (CUDA allocator peak per device; peak RSS on the CPU) against the planner's figures:
    its total (tensors + CUDA context + fragmentation margin) and its tensors alone."""
    memory = report.get("plan") or {}
    gib = memory.get("gib") or {}
    peak_gib = report["peak_mem_mb"] / 1024
    tensors = (gib["total"] - gib.get("overhead", 0.0)) if gib.get("total") else None
    return {
        "peak_gib": round(peak_gib, 3),
        "planned_total_gib": gib.get("total"),
        "planned_tensors_gib": round(tensors, 3) if tensors else None,
        "peak_over_planned_total": round(peak_gib / gib["total"], 3) if gib.get("total") else None,
        "peak_over_planned_tensors": round(peak_gib / tensors, 3) if tensors else None,
        "planned_gib": gib,
        "plan_changes": memory.get("changes"),
        "plan_warnings": memory.get("warnings"),
    }


def ledger_figures(ledger: dict | None) -> dict | None:
    """The goodput stage's ledger, without its per-attempt rows and per-bucket dollars."""
    if ledger is None:
        return None
    keep = ("goodput", "train_goodput", "total_s", "buckets", "unaccounted_s", "biggest_badput", "restart")
    return {
        **{key: ledger.get(key) for key in keep},
        "run_usd": (ledger.get("cost") or {}).get("run_usd"),
        "usd_per_1m_tokens": (ledger.get("cost") or {}).get("usd_per_1m_tokens"),
        "findings": [f"{f['cause']}: {f['evidence']}" for f in ledger.get("findings") or []],
    }


ADAPTER = "models/candidate/adapter_model.safetensors"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def adapter_sha256(project: Path) -> str:
    return sha256(project / ADAPTER)


def max_abs_diff(a: Path, b: Path) -> float | None:
    """The largest elementwise difference of two adapters' tensors (None: their tensor names differ)."""
    from safetensors.torch import load_file

    left, right = load_file(a), load_file(b)
    if left.keys() != right.keys():
        return None
    return max(float((left[k].float() - right[k].float()).abs().max()) for k in left)


# --- one configuration, the preemption, the whole run --------------------------------------------------


@dataclass
class Bench:
    """The run's fixed parts: the project copy, its interpreter, the budget, the logs' folder, the sizes."""

    project: Path
    python: Path
    budget: Budget
    logs: Path
    ranks: int
    every: int  # checkpoint.every_steps
    base_params: dict  # params.yaml as prepare() left it: every configuration starts from these
    use_dvc: bool = True  # `dvc repro train`, else the train stage's command (reproduce)

    def configure(self, config: Config) -> None:
        """params.yaml: the prepared params with config's train settings (none left over from the previous one)."""
        profile = multi_profile(self.project, config.profile, self.ranks) if config.multi else config.profile
        processes = self.ranks if config.multi else None  # null: the profile's (1 for single_gpu and auto)
        train = {"accelerate_profile": profile, "num_processes": processes, **config.train}
        write_yaml(self.project / "params.yaml", merge(self.base_params, {"train": train}))


def train_config(bench: Bench, config: Config) -> dict:
    """`dvc repro train` with config's params (DVC re-runs only what they change), then its ledger."""
    bench.configure(config)
    env = stage_env(bench.python, bench.project, f"bench-{config.name}")
    log = bench.logs / f"{config.name}.log"
    started = time.monotonic()
    code = reproduce("train", bench.project, env, bench.budget, log, bench.use_dvc)
    wall = round(time.monotonic() - started, 1)
    if code != 0:
        return {"status": "timed out" if code == 124 else f"failed (exit {code})", "wall_s": wall, "log": tail(log)}
    ledger = goodput(bench.project, env, bench.budget, log)
    return {"status": "ok", "wall_s": wall, **summary(bench.project, ledger, bench.every)}


def preempt_and_resume(bench: Bench, config: Config, reference: Path) -> dict:
    """The same configuration trained again from scratch through the stage's own command: SIGTERM to the
    launcher once the step log reaches PREEMPT_AFTER_STEP (it saves the step it is on, exits 75), run again (it
    resumes), and the adapter compared with the uninterrupted run's, byte for byte."""
    project = bench.project
    for run_dir in (p for p in (project / "checkpoints").iterdir() if p.is_dir()):
        shutil.rmtree(run_dir)  # the reference's checkpoints: the new run starts from step 0
    shutil.rmtree(project / "models/candidate", ignore_errors=True)
    (project / "reports/train_steps.jsonl").unlink(missing_ok=True)
    env = stage_env(bench.python, project, f"bench-{config.name}-preempt")
    log = bench.logs / f"{config.name}_preempt.log"
    train = stage_command("train", project, python=str(bench.python))
    stopped = sigterm_mid_training(train, project, env, bench.budget, log)
    if stopped.get("exit") != 75:
        return {"status": "failed: the SIGTERMed run did not exit 75", **stopped, "log": tail(log)}
    code = run(train, project, env, bench.budget, log)
    if code != 0:
        return {"status": f"failed: the resumed run exited {code}", **stopped, "log": tail(log)}
    report = json.loads((project / "reports/train.json").read_text())
    ledger = goodput(project, env, bench.budget, log)
    sha, reference_sha = adapter_sha256(project), sha256(reference)
    return {
        "status": "ok",
        **stopped,
        "resumed_from_step": report["resumed_from_step"],
        "steps": report["steps"],
        "adapter_sha256": sha,
        "reference_sha256": reference_sha,
        "bit_exact": sha == reference_sha,
        "max_abs_diff": 0.0 if sha == reference_sha else max_abs_diff(project / ADAPTER, reference),
        "goodput": ledger_figures(ledger),
    }


def sigterm_mid_training(argv: list[str], project: Path, env: dict, budget: Budget, log: Path) -> dict:
    """Start the train stage; SIGTERM its launcher (its PID alone, as Kubernetes does) at PREEMPT_AFTER_STEP."""
    proc = start(argv, project, env, log)
    while proc.poll() is None and last_step(project) < PREEMPT_AFTER_STEP and budget.left() > GRACE_S:
        time.sleep(0.002)
    if proc.poll() is not None:
        return {"exit": proc.returncode, "signalled_at_step": None}
    at_step = last_step(project)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=GRACE_S + 30)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        code = 124
    saved = [int(p.name.split("-")[1]) for p in project.glob("checkpoints/*/step-*")]
    return {
        "exit": code,
        "signalled_at_step": at_step,
        "sigterm_to_exit_s": round(time.monotonic() - signalled, 2),
        "saved_step": max(saved) if saved else None,
    }


def last_step(project: Path) -> int:
    """The last step in the step log (0 before the first, or while a line is half written)."""
    try:
        lines = (project / "reports/train_steps.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def preemption(bench: Bench, config: Config, needed_s: float) -> dict:
    """The SIGTERM + resume check when the budget fits two more trainings, else why it was skipped."""
    if bench.budget.left() < needed_s:
        return {"status": f"skipped: budget: {bench.budget.left():.0f} s left, it would take ~{needed_s:.0f} s"}
    print(f"gpu bench: {config.name}: SIGTERM + resume ...", flush=True)
    reference = bench.logs.parent / f"{config.name}_reference_adapter.safetensors"
    shutil.copy2(bench.project / "models/candidate/adapter_model.safetensors", reference)
    return preempt_and_resume(bench, config, reference)


def estimate_s(config: Config, first_wall: float | None) -> float:
    """How long a configuration should take: the first training's wall time, more for QLoRA (the base
    quantized at load) and multi-process starts; the preemption is two more trainings."""
    if first_wall is None:
        return 0.0
    factor = 1.5 if config.train.get("method") == "qlora" else 1.0
    factor *= 1.5 if config.multi else 1.0
    return first_wall * factor * (3 if config.preempt else 1)


def prepare(work: Path, size: str, device: str, budget: Budget, logs: Path, use_dvc: bool) -> tuple[Path, dict]:
    """The project copied to work/project, the random-weight base at work/base, the stages before train run
    (dvc repro tokenize) with their own ledger; returns (project, what was prepared)."""
    project = work / "project"
    copy_project(project)
    started = time.monotonic()
    base = build_base(work / "base", size, device)
    base_s = time.monotonic() - started
    overrides = merge(RUN_PARAMS[size], {"model": {"base": str(work / "base")}})
    write_yaml(project / "params.yaml", merge(read_yaml(project / "params.yaml"), overrides))
    python = Path(sys.executable)
    env = stage_env(python, project, "bench-prepare")
    log = logs / "prepare.log"
    started = time.monotonic()
    code = reproduce("tokenize", project, env, budget, log, use_dvc)
    if code != 0:
        return project, {"status": f"failed: the stages up to tokenize: exit {code}", "base": base, "log": tail(log)}
    ledger = goodput(project, env, budget, log)
    return project, {
        "status": "ok",
        "base": base,
        "base_build_s": round(base_s, 1),
        "stages_s": round(time.monotonic() - started, 1),
        "ledger": ledger_figures(ledger),
        "tokenize": json.loads((project / "reports/tokenize.json").read_text()),
    }


def run_all(bench: Bench, configs: list[Config], results: dict, write) -> None:
    """Each configuration in order, skipped when the machine cannot host it or the budget cannot fit it; the
    JSON is rewritten after each."""
    first_wall = None
    for config in configs:
        reason = skip_reason(config, bench.ranks)
        needed = estimate_s(config, first_wall)
        if reason is None and bench.budget.left() < needed:
            reason = f"budget: {bench.budget.left():.0f} s left, it would take ~{needed:.0f} s"
        if reason is not None:
            results["configs"][config.name] = {"status": f"skipped: {reason}"}
            write()
            continue
        print(f"gpu bench: {config.name} ...", flush=True)
        entry = train_config(bench, config)
        first_wall = first_wall or (entry["wall_s"] if entry["status"] == "ok" else None)
        results["configs"][config.name] = entry
        write()
        if config.preempt and entry["status"] == "ok":
            entry["preemption"] = preemption(bench, config, 2 * entry["wall_s"])
            write()
        print(f"gpu bench: {config.name}: {one_line(entry)}", flush=True)


def one_line(entry: dict) -> str:
    if entry["status"] != "ok":
        return entry["status"]
    preemption = entry.get("preemption") or {}
    return (
        f"{entry['tokens_per_s']} tokens/s, MFU {entry['mfu']}, peak {entry['memory']['peak_gib']} GiB "
        f"(planned {entry['memory']['planned_total_gib']}), goodput {(entry['goodput'] or {}).get('goodput')}"
        + (f", preemption bit-exact: {preemption.get('bit_exact')}" if preemption else "")
    )


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu.json"), help="the JSON, rewritten after each step")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the 2-layer model instead of Llama-3.2-1B's shape")
    parser.add_argument("--budget-s", type=float, default=540.0, help="the whole run's wall-time budget")
    parser.add_argument("--only", nargs="+", help="these configurations only (names as in the docstring)")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    parser.add_argument(
        "--no-dvc", action="store_true", help="run each stage's command from dvc.yaml (the default without dvc)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    budget = Budget(args.budget_s)
    device, ranks = devices(args.device)
    size = "tiny" if args.tiny else "1b"
    use_dvc = not args.no_dvc and importlib.util.find_spec("dvc") is not None
    configs = [c for c in (CPU_CONFIGS if device == "cpu" else GPU_CONFIGS) if not args.only or c.name in args.only]
    work = args.keep or Path(tempfile.mkdtemp(prefix="fineflow-gpu-bench-"))
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results = {
        "command": " ".join(sys.argv),
        "python": sys.executable,
        "versions": versions(),
        "orchestration": "dvc repro" if use_dvc else "each stage's command from dvc.yaml (no DVC)",
        "device": device,
        "devices": ranks if device == "cuda" else 0,
        "size": size,
        "budget_s": args.budget_s,
        "work_dir": str(work),
        "configs": {},
    }

    def write():
        results["wall_s"] = round(time.monotonic() - started, 1)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        tmp.replace(args.out)

    write()
    project, results["prepare"] = prepare(work, size, device, budget, logs, use_dvc)
    write()
    if results["prepare"]["status"] != "ok":
        print(f"gpu bench: {results['prepare']['status']}; {args.out}\n{results['prepare']['log']}", file=sys.stderr)
        return 1
    every = RUN_PARAMS[size]["checkpoint"]["every_steps"]
    params = read_yaml(project / "params.yaml")
    bench = Bench(project, Path(sys.executable), budget, logs, ranks, every, params, use_dvc)
    run_all(bench, configs, results, write)
    write()
    print(f"gpu bench: {results['wall_s']} s; {args.out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(not c["status"].startswith(("failed", "timed")) for c in results["configs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
