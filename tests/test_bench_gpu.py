"""bench/gpu.sh, the GPU acceptance run: it starts the project's own interpreter, and its CPU dry run trains
through the real stages (`dvc repro`, the train launcher, accelerate) and records every figure it promises,
the SIGTERM + bit-exact resume included."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fineflow.train.profile import load_profile

ROOT = Path(__file__).resolve().parent.parent


def gpu_bench():
    """bench/gpu.py as a module (bench/ is no package)."""
    if "gpu_bench" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "bench" / "gpu.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_bench"] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules["gpu_bench"]


def _fake_interpreter(path: Path, name: str) -> Path:
    """An executable that records which interpreter ran and with what, instead of running anything."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{name} $*" >> "$CALLS"\n')
    path.chmod(0o755)
    return path


def _gpu_sh(tmp_path: Path, with_venv: bool, python: str | None):
    """bench/gpu.sh from a checkout at tmp_path, python3 on PATH being a fake that must not be the one run."""
    (tmp_path / "bench").mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / "bench/gpu.sh", tmp_path / "bench/gpu.sh")
    if with_venv:
        _fake_interpreter(tmp_path / ".venv/bin/python", "venv")
    fake_bin = tmp_path / "fake_bin"
    _fake_interpreter(fake_bin / "python3", "python3")
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "CALLS": str(calls)}
    env.pop("PYTHON", None)
    if python:
        env["PYTHON"] = python
    done = subprocess.run(["bash", "bench/gpu.sh", "--out", "x.json"], cwd=tmp_path, env=env, capture_output=True)
    return done, (calls.read_text() if calls.exists() else "")


def test_gpu_sh_runs_the_venv_that_make_venv_builds_and_says_so(tmp_path):
    """After the README's install (make venv) the interpreter with fineflow is .venv/bin/python: gpu.sh runs
    that, not python3 (on main it ran python3, which has none of the stack, and stopped at once)."""
    done, calls = _gpu_sh(tmp_path, with_venv=True, python=None)
    assert done.returncode == 0, done.stderr
    assert calls == "venv bench/gpu.py --out x.json\n"
    assert b"interpreter .venv/bin/python" in done.stderr


def test_gpu_sh_falls_back_to_python_only_without_a_venv(tmp_path):
    fallback = _fake_interpreter(tmp_path / "other/python", "fallback")
    done, calls = _gpu_sh(tmp_path, with_venv=False, python=str(fallback))
    assert done.returncode == 0 and calls == "fallback bench/gpu.py --out x.json\n"
    assert f"interpreter {fallback}".encode() in done.stderr

    done, calls = _gpu_sh(tmp_path / "bare", with_venv=False, python=None)
    assert done.returncode == 2 and calls == ""
    assert b"make venv" in done.stderr


def test_a_multi_gpu_profile_runs_as_a_copy_with_the_gpu_count(tmp_path):
    """What require_enough_gpus tells a user with fewer than the profile's 8 GPUs: a copy with num_processes set
    to the count; everything else the profile says stays."""
    bench = gpu_bench()
    shutil.copytree(ROOT / "configs/accelerate", tmp_path / "configs/accelerate")
    for profile in ("multi_gpu_ddp", "fsdp_lora", "deepspeed_zero3"):
        name = bench.multi_profile(tmp_path, profile, 4)
        original = load_profile(profile, tmp_path / "configs/accelerate")
        copy = load_profile(name, tmp_path / "configs/accelerate")
        assert copy.processes == 4 and original.processes == 8
        assert {**copy.settings, "num_processes": 8} == dict(original.settings)


def test_what_the_machine_cannot_host_is_skipped_with_its_reason():
    bench = gpu_bench()
    configs = {config.name: config for config in bench.GPU_CONFIGS}
    assert bench.skip_reason(configs["single_gpu"], 1) is None
    assert bench.skip_reason(configs["multi_gpu_ddp"], 1) == "needs 2 or more GPUs, this machine has 1"
    assert bench.skip_reason(configs["fsdp_lora"], 8) is None
    absent = bench.Config("x", "single_gpu", needs_module="no_such_module_here")
    assert bench.skip_reason(absent, 8) == "no_such_module_here is not installed"


@pytest.mark.slow
@pytest.mark.nightly  # ~100 s on 2 cores: a dvc repro, three trainings of one process and one of two ranks
def test_the_cpu_dry_run_trains_through_the_stages_and_resumes_bit_exact(tmp_path):
    """`bash bench/gpu.sh --device cpu --tiny`: the configurations' entries come from the stages' own reports
    (train report, step log, goodput ledger), and the SIGTERMed run resumes to the uninterrupted run's adapter."""
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHON": sys.executable}
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "bench/gpu.sh", "--device", "cpu", "--tiny", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(f"gpu.sh --device cpu --tiny: {time.monotonic() - started:.0f} s")  # shown with -s: the README's figure
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["size"] == "tiny"
    assert set(result["configs"]) == {"cpu", "cpu_ddp_2proc"}
    for name, ranks in (("cpu", 1), ("cpu_ddp_2proc", 2)):
        entry = result["configs"][name]
        assert entry["status"] == "ok" and entry["world_size"] == ranks and entry["steps"] == 40
        assert entry["tokens_per_s"] > 0 and 0 < entry["mfu"] < 1 and entry["fused_lora_layers"] > 0
        assert entry["memory"]["peak_gib"] > 0 and entry["memory"]["planned_total_gib"] > 0
        ledger = entry["goodput"]
        assert ledger["buckets"]["compute"] > 0 and 0 < ledger["goodput"] < 1
        assert abs(sum(ledger["buckets"].values()) - ledger["total_s"]) < 0.05 * ledger["total_s"]
        assert entry["checkpoint"]["stall_s"] > 0 and entry["checkpoint"]["write_s"] > 0
    stop = result["configs"]["cpu"]["preemption"]
    assert stop["status"] == "ok" and stop["exit"] == 75
    assert stop["signalled_at_step"] <= stop["saved_step"] == stop["resumed_from_step"] < 40
    assert stop["bit_exact"] and stop["adapter_sha256"] == stop["reference_sha256"]
    assert stop["goodput"]["buckets"]["restart_loss"] > 0


def test_a_working_tree_without_git_is_copied_as_git_would_list_it(tmp_path, monkeypatch):
    """A machine may receive the working tree without .git: the files .gitignore does not ignore are copied."""
    bench = gpu_bench()
    (tmp_path / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    for rel in ("dvc.yaml", "fineflow/x.py", "reports/metrics/train.json", ".dvc/config", "data/README.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("kept")
    for rel in (
        ".venv/bin/python",
        "fineflow/__pycache__/x.pyc",
        "models/base/config.json",
        "data/raw/train.jsonl",
        "reports/train.json",
        ".dvc/cache/ab/cd",
        ".dvc/tmp/lock",
        "checkpoints/run/step-1/x",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("ignored")
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    assert bench.project_files() == sorted(
        [".gitignore", ".dvc/config", "data/README.md", "dvc.yaml", "fineflow/x.py", "reports/metrics/train.json"]
    )


def test_the_budget_skips_what_would_not_finish_and_the_json_is_written_after_each(monkeypatch, tmp_path):
    """--budget-s: after the first training (100 s here) a configuration starts only if its estimate fits in what
    is left; the preemption needs two more trainings. The JSON is rewritten after every configuration."""
    bench = gpu_bench()
    trained = []

    def fake_train(run, config):
        trained.append(config.name)
        return {
            "status": "ok",
            "wall_s": 100.0,
            "tokens_per_s": 1,
            "mfu": 0.5,
            "memory": {"peak_gib": 1, "planned_total_gib": 2},
            "goodput": {},
        }

    monkeypatch.setattr(bench, "train_config", fake_train)
    monkeypatch.setattr(bench, "skip_reason", lambda config, ranks: None)
    run = bench.Bench(tmp_path, Path(sys.executable), bench.Budget(150), tmp_path, 8, 20, {})
    results, writes = {"configs": {}}, []
    bench.run_all(run, bench.GPU_CONFIGS, results, lambda: writes.append(json.dumps(results)))
    assert trained == ["single_gpu", "single_gpu_flash"]  # 150 s budget: the first, then one more of ~100 s
    entries = results["configs"]
    assert entries["single_gpu"]["preemption"]["status"].startswith("skipped: budget: ")
    assert entries["single_gpu_qlora"]["status"].startswith("skipped: budget: ")  # ~150 s: QLoRA loads slower
    assert all(entries[name]["status"].startswith("skipped: budget") for name in ("fsdp_lora", "deepspeed_zero3"))
    assert len(writes) == len(bench.GPU_CONFIGS) + 1  # each configuration, and the preemption's entry


def test_each_configuration_starts_from_the_prepared_params_not_the_previous_ones(tmp_path):
    """QLoRA after flash trains with the prepared attention (varlen), not flash's; a multi-GPU one on its copy."""
    bench = gpu_bench()
    shutil.copytree(ROOT / "configs/accelerate", tmp_path / "configs/accelerate")
    prepared = bench.read_yaml(ROOT / "params.yaml")
    run = bench.Bench(tmp_path, Path(sys.executable), bench.Budget(60), tmp_path, 4, 20, prepared)
    configs = {config.name: config for config in bench.GPU_CONFIGS}
    written = {}
    for name in ("single_gpu_flash", "single_gpu_qlora", "fsdp_lora", "single_gpu"):
        run.configure(configs[name])
        written[name] = bench.read_yaml(tmp_path / "params.yaml")["train"]
    assert written["single_gpu_flash"]["attention"] == "flash_attention_2"
    assert (written["single_gpu_qlora"]["method"], written["single_gpu_qlora"]["attention"]) == ("qlora", "varlen")
    assert written["fsdp_lora"]["accelerate_profile"] == "fsdp_lora_4ranks"
    assert written["fsdp_lora"]["num_processes"] == 4 and written["fsdp_lora"]["method"] == "lora"
    assert written["single_gpu"] == {**prepared["train"], "accelerate_profile": "single_gpu", "num_processes": None}


def test_without_dvc_the_stages_run_by_their_commands_from_dvc_yaml_in_order(tmp_path, monkeypatch):
    """An image without dvc (or --no-dvc): prepare runs base..tokenize, then each configuration only train, each
    by its own command line from dvc.yaml."""
    bench = gpu_bench()
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy2(ROOT / name, tmp_path / name)
    ran = []
    monkeypatch.setattr(bench, "run", lambda argv, *rest: ran.append(argv[:3]) or 0)
    assert bench.reproduce("tokenize", tmp_path, {}, bench.Budget(60), tmp_path / "log", use_dvc=False) == 0
    modules = [argv[2] for argv in ran]
    assert modules == [f"fineflow.stages.{n}" for n in ("base", "fingerprint", "data", "validate", "tokenize")]
    assert all(argv[0] == sys.executable for argv in ran)
    (tmp_path / "data/shards").mkdir(parents=True)
    ran.clear()
    bench.reproduce("train", tmp_path, {}, bench.Budget(60), tmp_path / "log", use_dvc=False)
    assert ran == [[sys.executable, "-m", "fineflow.stages.train"]]
    ran.clear()
    bench.reproduce("train", tmp_path, {}, bench.Budget(60), tmp_path / "log", use_dvc=True)
    assert ran == [[sys.executable, "-m", "dvc"]]
