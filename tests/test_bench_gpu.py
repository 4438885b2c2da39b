"""bench/gpu.py runs on a bare GPU image (torch, transformers and peft only) and reports every figure it
promises; its copies of fineflow's maths (bench/gpu_mirror.py) stay in step with the originals."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH_FILES = ("gpu.py", "gpu_mirror.py")
# what a GPU image with torch, transformers and peft provides (numpy comes with transformers), the optional
# accelerators, and the mirror beside the script
ALLOWED_IMPORTS = {"torch", "transformers", "peft", "numpy", "flash_attn", "bitsandbytes", "gpu_mirror"}
STACK_ONLY = ("fineflow", "pydantic", "accelerate")

CONFIG_FIELDS = {
    "tokens_per_s",
    "real_tokens_per_s",
    "mfu",
    "mfu_full_row_attention",
    "achieved_tflops",
    "attention_flops_share",
    "peak_memory_gib",
    "planned_tensors_gib",
    "planned_total_gib",
    "measured_over_planned",
    "data_wait_s",
    "data_wait_share",
    "step_ms",
    "loss_first",
    "finite_loss",
    "micro_batch",
}
CHECKPOINT_FIELDS = {"state_bytes", "stall_sync_s", "stall_async_s", "async_over_sync", "async_write_s"}
RATIOS = {
    "bf16_over_fp32_tokens_per_s",
    "bf16_over_fp32_peak_memory",
    "flash_over_varlen_tokens_per_s",
    "flash_over_varlen_peak_memory",
    "qlora_over_lora_tokens_per_s",
    "qlora_over_lora_peak_memory",
    "flash_vs_varlen_first_loss_abs_diff",
    "async_over_sync_checkpoint_stall",
}


def imported_roots(path: Path) -> set[str]:
    """Top-level names of every import statement in a file, at any depth (lazy imports included)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots - {"__future__"}


def load_mirror():
    """bench/gpu_mirror.py as a module (bench/ is no package)."""
    if "gpu_mirror" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_mirror", ROOT / "bench" / "gpu_mirror.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_mirror"] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules["gpu_mirror"]


@pytest.mark.parametrize("name", BENCH_FILES)
def test_bench_imports_only_torch_transformers_peft_and_stdlib(name):
    foreign = imported_roots(ROOT / "bench" / name) - ALLOWED_IMPORTS - set(sys.stdlib_module_names)
    assert not foreign, f"bench/{name} imports {sorted(foreign)}: a bare GPU image has only torch/transformers/peft"


def test_mirror_layout_matches_fineflow_attention():
    """bench/gpu_mirror.py's packed layout is fineflow.train.attention's, on rows like the loader's."""
    from fineflow.train import attention

    mirror = load_mirror()
    rng = np.random.default_rng(3)
    positions = np.concatenate([np.arange(n) for n in rng.integers(5, 90, size=40)])[: 2 * 256].reshape(2, 256)
    ours, theirs = mirror.packed_layout(positions), attention.packed_layout(positions)
    assert np.array_equal(ours.scatter, theirs.scatter)
    assert [(g.tolist(), e, n) for g, e, n in ours.groups] == [(g.tolist(), e, n) for g, e, n in theirs.groups]


def test_flash_cu_seqlens_bound_every_example_of_a_multi_row_batch():
    """A (2, 512) packed micro-batch: cu_seqlens over the flattened batch start at every example and at each
    row's start, so flash-attn never attends across examples or rows at micro-batch 2."""
    mirror = load_mirror()
    rows = [[100, 200, 150, 62], [300, 212]]
    positions = np.stack([np.concatenate([np.arange(n) for n in row]) for row in rows])
    cu_seqlens, longest = mirror.flash_varlen_kwargs(positions)
    expected = np.cumsum([0] + rows[0] + rows[1])
    assert cu_seqlens.tolist() == expected.tolist() and cu_seqlens.dtype == np.int32
    assert longest == 300


@pytest.mark.parametrize(
    "method, precision, packed", [("lora", "bf16", False), ("lora", "fp32", True), ("qlora", "bf16", False)]
)
def test_mirror_plan_matches_fineflow_planner(method, precision, packed):
    """The benchmark's memory estimate is fineflow's planner for the same run; if this fails, the planner
    changed: update bench/gpu_mirror.py to match."""
    from fineflow.train import planner

    mirror = load_mirror()
    known = planner.KNOWN_SHAPES["1B"]
    shape = mirror.Shape(
        known.hidden_size,
        known.intermediate_size,
        known.num_layers,
        known.num_heads,
        known.num_kv_heads,
        known.vocab_size,
        known.tie_word_embeddings,
    )
    ours = mirror.plan(shape, mirror.Setup(method, precision, 8, 2048, 16, packed=packed))
    theirs = planner.plan(
        known, planner.Setup(method=method, precision=precision, micro_batch_size=8, seq_len=2048, packed=packed)
    )
    for part in ("weights", "gradients", "optimizer_states", "activations", "logits", "optimizer_step", "total"):
        assert ours[part] == pytest.approx(getattr(theirs, part), rel=1e-9), part


def bare_environment(tmp_path: Path) -> dict:
    """Offline variables, and fineflow and pydantic made unimportable (shadow modules that raise), as on a
    GPU image that ships only torch, transformers and peft."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for name in ("fineflow", "pydantic"):
        (blocked / f"{name}.py").write_text(f"raise ImportError('bench/gpu.py must not import {name}')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(blocked)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # python3 = this venv's
    return env


@pytest.mark.slow
def test_importing_the_bench_pulls_no_pipeline_stack(tmp_path):
    code = (
        "import sys; sys.path.insert(0, 'bench'); import gpu; "
        f"print(sorted(m for m in {STACK_ONLY!r} if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_mirror_prices_match_fineflows_cost_table():
    from fineflow.core.config import DEFAULT_PRICES
    from fineflow.goodput.cost import price_per_device_hour

    mirror = load_mirror()
    assert mirror.PRICES == DEFAULT_PRICES
    cost = SimpleNamespace(device_hour_usd=None, prices={})
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA L40S", "NVIDIA L4", "Some New GPU"):
        assert mirror.price_per_hour(name) == price_per_device_hour(cost, {"type": "cuda", "name": name})[0], name


@pytest.mark.slow
def test_cpu_dry_run_reports_every_figure(tmp_path):
    """bench/gpu.sh --device cpu --tiny, from a copy of bench/ outside the project with fineflow and pydantic
    unimportable: every configuration is run or skipped with its reason, every figure is in the JSON."""
    (tmp_path / "bench").mkdir()
    for name in (*BENCH_FILES, "gpu.sh"):
        shutil.copy2(ROOT / "bench" / name, tmp_path / "bench" / name)
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        ["bash", "bench/gpu.sh", "--device", "cpu", "--tiny", "--out", str(out)],
        cwd=tmp_path,
        env=bare_environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    configs = report["configs"]
    assert set(configs) == {"lora_bf16_varlen", "lora_bf16_flash", "qlora_bf16_varlen", "lora_fp32_varlen"}
    for name in ("lora_bf16_varlen", "lora_fp32_varlen"):
        assert configs[name]["status"] == "ok", configs[name]
        assert CONFIG_FIELDS <= set(configs[name]), CONFIG_FIELDS - set(configs[name])
        assert configs[name]["finite_loss"] and configs[name]["tokens_per_s"] > 0
        assert configs[name]["planned_tensors_gib"] > 0 and 0 < configs[name]["attention_flops_share"] < 1
    for name in ("lora_bf16_flash", "qlora_bf16_varlen"):
        assert configs[name]["status"].startswith("skipped:"), configs[name]
    checkpoint = configs["lora_bf16_varlen"]["checkpoint"]
    assert CHECKPOINT_FIELDS <= set(checkpoint) and checkpoint["state_bytes"] > 0
    assert RATIOS == set(report["ratios"])
    assert isinstance(report["ratios"]["bf16_over_fp32_tokens_per_s"], float)
    assert report["dry_run"] is True and report["environment"]["transformers"]
    assert "bf16_over_fp32_tokens_per_s" in done.stdout  # the side-by-side table was printed
    ledger = report["ledger"]  # the bench run's own goodput ledger, in the pipeline's buckets
    assert abs(sum(ledger["buckets"].values()) + ledger["unaccounted_s"] - ledger["total_s"]) < 0.01
    assert ledger["buckets"]["compute"] > 0 and ledger["buckets"]["model_load"] > 0 and ledger["run_usd"] > 0
    assert "ledger: goodput" in done.stdout
