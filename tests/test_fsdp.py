"""The train stage on accelerate's real FSDP path: 2 CPU ranks over gloo (tests/fsdp_worker.py makes the CUDA-less
ranks take accelerate's FSDP path), LoRA on the tiny base, with an eval set that gives the ranks different
numbers of eval batches.

- FSDP2 trains like one process with the same global batch (losses, eval loss), shards the adapter's
  gradients and optimizer over the ranks (nothing for the frozen base) within the memory plan, and runs the
  fused LoRA op it reports;
- FSDP1 with bf16: every LoRA linear is its own unit (no gradient for the frozen base), rotary inv_freq stays
  fp32, and the report says 0 fused layers, which is what ran;
- sharded checkpoints: SIGKILLed twice, resumed, the final adapter is bit-exact; a node-local checkpoints dir
  is refused with a clear message. In process (fast): the checkpoint package publishes, verifies and retries
  a sharded save with the guarantees of a flat one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import (
    ROOT,
    TRAIN,
    checkpoint_being_saved,
    kill_when,
    last_logged_step,
    launch_with_free_port,
    ranks_overrides,
    train_project,
    venv_env,
)
from tests.faults import fault_env

RANKS = 2
slow = pytest.mark.slow  # the tests that run accelerate launch


def _staged(root, step):
    """What the ranks leave for rank 0's manager: a staging dir with one shard file per rank and DCP's metadata."""
    staging = root / f".tmp-shards-step-{step:07d}"
    staging.mkdir(parents=True)
    for name, data in ((".metadata", b"meta"), ("__0_0.distcp", b"rank 0 shard"), ("__1_0.distcp", b"rank 1")):
        (staging / name).write_bytes(data)
    return staging


def _save_sharded(manager, step, staging):
    from fineflow.checkpoint import capture_rng

    manager.save(step, {}, None, {"last_epoch": step}, {"step": step}, [capture_rng()] * 2, sharded_dir=staging)


def test_sharded_save_is_published_hashed_and_verified_like_a_flat_one(tmp_path):
    from fineflow.checkpoint import CheckpointManager, CorruptCheckpoint, latest_valid, load_checkpoint

    with CheckpointManager(tmp_path, mode="async", keep_last=1) as manager:
        for step in (1, 2):
            staging = _staged(tmp_path, step)
            _save_sharded(manager, step, staging)
            manager.wait()
            assert not staging.exists()  # moved into the checkpoint, not copied
    assert [p.name for p in tmp_path.iterdir()] == ["step-0000002"]  # retention as before
    loaded = load_checkpoint(latest_valid(tmp_path))
    assert loaded.sharded_dir == tmp_path / "step-0000002/sharded" and loaded.model_tensors == {}
    assert (loaded.sharded_dir / "__1_0.distcp").read_bytes() == b"rank 1"
    assert loaded.optimizer_state_dict is None and loaded.state == {"step": 2}
    (loaded.sharded_dir / "__1_0.distcp").write_bytes(b"rank 1!")  # one rank's shard damaged
    with pytest.raises(CorruptCheckpoint, match=r"sharded/__1_0\.distcp: truncated"):
        load_checkpoint(tmp_path / "step-0000002")


def test_sharded_save_retried_after_disk_full_keeps_the_ranks_shards(tmp_path, monkeypatch):
    import errno

    import fineflow.checkpoint.write as write_module
    from fineflow.checkpoint import CheckpointManager, verify_checkpoint

    real, calls = write_module.write_all, {"n": 0}

    def full_once(fd, data, path):
        if "state.json" in path and not calls["n"]:
            calls["n"] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, path)

    monkeypatch.setattr(write_module, "write_all", full_once)
    with CheckpointManager(tmp_path, mode="sync", on_write_error="retry", retries=1, retry_backoff_s=0.0) as manager:
        with pytest.warns(Warning, match="retrying"):
            _save_sharded(manager, 3, _staged(tmp_path, 3))
    assert calls["n"] == 1
    manifest = verify_checkpoint(tmp_path / "step-0000003", deep=True)
    assert manifest["layout"] == "sharded" and "sharded/__0_0.distcp" in manifest["files"]


def fsdp_profile(path, version: int, mixed_precision: str = "no"):
    """configs/accelerate/fsdp_lora.yaml (FSDP2) for 2 CPU ranks: no CUDA-only loading options, fp32 unless asked;
    version 1 as the profile's comment says to write it (the keys FSDP1 needs added)."""
    profile = yaml.safe_load((ROOT / "configs/accelerate/fsdp_lora.yaml").read_text())
    profile.update(num_processes=RANKS, mixed_precision=mixed_precision, main_process_port=0)
    fsdp = profile["fsdp_config"]
    assert fsdp["fsdp_version"] == 2  # the shipped profile
    fsdp.update(fsdp_version=version, fsdp_cpu_ram_efficient_loading=False)
    if version == 1:
        fsdp.update(fsdp_use_orig_params=True, fsdp_sync_module_states=False)
    path.write_text(yaml.safe_dump(profile), encoding="utf-8")
    return path


EVAL_ROWS = 13  # 7 rows on rank 0, 6 on rank 1: 4 and 3 eval batches of 2


def fsdp_project(built, path, version: int, precision: str = "no"):
    """A train project on the FSDP profile, the same global batch as tests/test_ddp.py, an uneven eval shard."""
    path.mkdir(parents=True, exist_ok=True)
    profile = fsdp_profile(path / "fsdp.yaml", version, "bf16" if precision == "bf16" else "no")
    overrides = {**ranks_overrides(RANKS), "train.accelerate_profile": str(profile), "train.precision": precision}
    project = train_project(built, path, overrides)
    keep_first_rows(project / "data/shards/eval", EVAL_ROWS)
    return project


def keep_first_rows(shard_dir, rows: int) -> None:
    """Cut a packed shard to its first rows (the training shard, and the run's fingerprint, stay as they are)."""
    import numpy as np

    meta = json.loads((shard_dir / "meta.json").read_text())
    assert meta["rows"] > rows
    for name, itemsize in (
        ("tokens.bin", np.dtype(meta["dtype"]).itemsize),
        ("loss_mask.bin", 1),
        ("positions.bin", 2),
    ):
        with open(shard_dir / name, "r+b") as fh:
            fh.truncate(rows * meta["seq_len"] * itemsize)
    examples = np.fromfile(shard_dir / "examples.idx", dtype=np.int64).reshape(-1, 3)
    examples[examples[:, 0] < rows].tofile(shard_dir / "examples.idx")
    (shard_dir / "meta.json").write_text(json.dumps({**meta, "rows": rows}))


class OneProcess:
    """What evaluate_loss needs of an Accelerator, for one process on the CPU."""

    process_index, num_processes, device = 0, 1, torch.device("cpu")

    @staticmethod
    def reduce(tensor, reduction):
        return tensor


def one_process_eval_loss(project) -> float:
    """The final adapter's eval loss computed by one plain process over the whole (unpadded) eval shard."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fineflow.core.config import load_params
    from fineflow.tokenize.shards import PackedShard
    from fineflow.train.loop import evaluate_loss
    from fineflow.train.model import attention_of

    cfg = load_params(project / "params.yaml").train
    base = AutoModelForCausalLM.from_pretrained(project / "models/base", attn_implementation=attention_of(cfg))
    model = PeftModel.from_pretrained(base, project / "models/candidate")
    shard = PackedShard(project / "data/shards/eval")
    return evaluate_loss(model, shard, cfg.micro_batch_size, OneProcess(), varlen=cfg.attention == "varlen")


def _env(project, extra=None):
    env = {**venv_env(), "FINEFLOW_TRAIN_WORKER": "1", "FINEFLOW_FSDP_PROBE": str(project / "probe"), **(extra or {})}
    env.pop("ACCELERATE_USE_CPU", None)  # with it, accelerate would pick DDP over gloo, not FSDP
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)  # tests.fsdp_worker
    return env


def _start(project, port, env):
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(project / "fsdp.yaml"),
        "--num_processes",
        str(RANKS),
        "--main_process_port",
        str(port),
        "-m",
        "tests.fsdp_worker",
        *TRAIN[3:],
    ]
    return subprocess.Popen(
        command,
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_fsdp(project, env=None, expect_ok=True, timeout=300) -> tuple[int, str]:
    """Launch the stage on 2 FSDP ranks to its end; (exit code, output)."""
    result = {}

    def launch(port):
        proc = _start(project, port, env or _env(project))
        try:
            output = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:  # a hang (e.g. ranks in different collectives): fail, not wait forever
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate()[0] + "\nTIMEOUT: the ranks hung"
        result.update(code=proc.returncode, output=output)
        return proc.returncode == 0, output

    launch_with_free_port(launch)
    if expect_ok:
        assert result["code"] == 0, result["output"][-4000:]
    return result["code"], result["output"]


def _steps(project):
    return [json.loads(line) for line in (project / "reports/train_steps.jsonl").read_text().splitlines()]


def _report(project):
    return json.loads((project / "reports/train.json").read_text())


def _probes(project):
    return [json.loads((project / f"probe/rank{r}.json").read_text()) for r in range(RANKS)]


def _eval_batches_per_rank(project) -> list[int]:
    from fineflow.tokenize.shards import PackedShard

    rows = len(PackedShard(project / "data/shards/eval"))
    micro = yaml.safe_load((project / "params.yaml").read_text())["train"]["micro_batch_size"]
    return [-(-len(range(rank, rows, RANKS)) // micro) for rank in range(RANKS)]


@pytest.fixture(scope="module")
def fsdp2_run(built, tmp_path_factory):
    """One uninterrupted FSDP2 fp32 run, shared by the tests here (they only read it). Its loss is chunked
    (train.loss_chunk_tokens 2, every micro-batch over it), so the comparisons with one plain process also show
    that chunking on sharded ranks trains what the plain path trains."""
    import numpy as np
    import yaml

    from fineflow.tokenize.shards import PackedShard

    project = fsdp_project(built, tmp_path_factory.mktemp("fsdp2"), version=2)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["loss_chunk_tokens"] = 2
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    shard = PackedShard(project / "data/shards/train")
    trained = [int((np.asarray(shard.batch([row])["labels"])[:, 1:] != -100).sum()) for row in range(len(shard))]
    assert min(trained) > 2  # every micro-batch takes the chunked path
    run_fsdp(project)
    return project


@slow
def test_fsdp2_trains_like_one_process_and_evaluates_an_uneven_eval_set(fsdp2_run, reference_run):
    """Eval batches differ per rank (4 and 3); every rank runs as many forwards (padding counted with weight 0),
    so the run completes; the chunked loss and gradient norm equal one plain process's with the same global
    batch (1e-4, as tests/test_ddp.py: the reduction order differs), and the eval loss equals one plain
    process's over the same eval rows (1e-5: float rounding between the fused and peft's LoRA forward)."""
    batches = _eval_batches_per_rank(fsdp2_run)
    assert len(set(batches)) > 1, f"the eval set must be uneven over the ranks for this test: {batches}"
    one, two = _steps(reference_run(1)), _steps(fsdp2_run)
    assert [s["step"] for s in two] == [s["step"] for s in one]
    assert [s["tokens"] for s in two] == [s["tokens"] for s in one]
    for key in ("loss", "grad_norm"):
        assert [s[key] for s in two] == pytest.approx([s[key] for s in one], rel=1e-4), key
    # the last evaluation ran after the last step, on the weights saved: padding forwards counted for nothing
    assert two[-1]["eval_loss"] == _report(fsdp2_run)["eval_loss"]
    assert _report(fsdp2_run)["eval_loss"] == pytest.approx(one_process_eval_loss(fsdp2_run), rel=1e-5)
    assert (fsdp2_run / "models/candidate/adapter_model.safetensors").is_file()


@slow
def test_fsdp2_shards_only_the_adapter_within_the_memory_plan(fsdp2_run):
    """Gradients exist for the adapter only, split over the ranks; what each rank holds (its parameter shards,
    gradients, optimizer states) is within the planner's per-device figures; the fused LoRA op ran."""
    report, probes = _report(fsdp2_run), _probes(fsdp2_run)
    trainable, plan = report["trainable_parameters"], report["plan"]["bytes"]
    assert sum(p["grad_elements"] for p in probes) == trainable  # each adapter element once, the base never
    for probe in probes:
        assert probe["frozen_with_grad"] == []
        assert probe["grad_elements"] <= 0.6 * trainable  # ~trainable / world: sharded, not replicated
        assert probe["grad_elements"] * 4 <= plan["gradients"] * 1.02, (probe, plan)  # fp32 adapter gradients
        assert probe["param_bytes"] <= plan["weights"], (probe, plan)
        # AdamW: exp_avg and exp_avg_sq (the planner's 8 bytes/param) plus a 4-byte step counter per tensor
        assert probe["optimizer_state_bytes"] <= plan["optimizer_states"] * 1.02, (probe, plan)
        assert probe["fused_calls"] > 0
    assert report["fused_lora_layers"] > 0  # what the report claims is what ran


@slow
@pytest.mark.nightly  # a 2-rank FSDP1 bf16 run (~20 s); make test keeps FSDP2 bf16 and FSDP1's fp32 wrap
def test_fsdp1_bf16_wraps_lora_apart_and_keeps_rotary_buffers_fp32(built, tmp_path):
    """FSDP1 with bf16 mixed precision: the decoder blocks' flat parameters are frozen (no gradient for the
    base: grad elements ~ trainable / world, where one flat parameter per block would carry the whole block),
    rotary inv_freq is fp32 after the forward (FSDP1 casts buffers to buffer_dtype at its lazy init), and
    the report's 0 fused layers is what ran."""
    project = fsdp_project(built, tmp_path, version=1, precision="bf16")
    run_fsdp(project)
    report, probes = _report(project), _probes(project)
    trainable = report["trainable_parameters"]
    for probe in probes:
        assert probe["fsdp1_flat_params"] > 0  # FSDP1 really ran
        assert 0 < probe["grad_elements"] <= 0.6 * trainable, (probe, trainable)
        rotary = {name: dtype for name, dtype in probe["buffer_dtypes"].items() if name.endswith("inv_freq")}
        assert rotary and set(rotary.values()) == {"torch.float32"}, probe["buffer_dtypes"]
        assert probe["fused_calls"] == 0
    assert report["fused_lora_layers"] == 0
    assert (project / "models/candidate/adapter_model.safetensors").is_file()


@slow
def test_fsdp2_bf16_trains_a_bf16_base_beside_fp32_adapters(built, tmp_path):
    """FSDP2 (the shipped fsdp_lora) with bf16 mixed precision holds the frozen base in bf16 (half of fp32: a 70B
    base is 141 GB on rank 0's host, not 282) beside fp32 adapters in one fully_shard group, and trains: torch
    requires one dtype among a group's trainable parameters only."""
    project = fsdp_project(built, tmp_path, version=2, precision="bf16")
    run_fsdp(project)
    report, probes = _report(project), _probes(project)
    for probe in probes:
        assert probe["param_dtypes"] == {"trainable": ["torch.float32"], "frozen": ["torch.bfloat16"]}, probe
        assert probe["fsdp1_flat_params"] == 0 and probe["grad_elements"] > 0
    assert report["plan"]["setup"]["weight_storage"] == "compute"
    assert (project / "models/candidate/adapter_model.safetensors").is_file()


@pytest.mark.scenario
@pytest.mark.nightly  # an FSDP2 run on 2 ranks, killed mid-save and resumed: CI keeps FSDP's training tests
@slow
def test_sharded_checkpoints_resume_bit_exact_and_refuse_node_local_dirs(built, fsdp2_run, tmp_path):
    project = fsdp_project(built, tmp_path / "resumed", version=2)
    env = fault_env(_env(project), write_delay_s=0.03)  # slow writes: the first kill lands mid-save
    assert kill_when(lambda port: _start(project, port, env), project, checkpoint_being_saved)
    assert kill_when(lambda port: _start(project, port, env), project, lambda p: last_logged_step(p) >= 7)
    [run_dir] = [p for p in (project / "checkpoints").iterdir() if p.is_dir()]
    manifest = json.loads((sorted(run_dir.glob("step-*"))[-1] / "manifest.json").read_text())
    assert manifest["layout"] == "sharded"  # each rank's own shards, hashed in the manifest
    assert {f"sharded/__{rank}_0.distcp" for rank in range(RANKS)} <= set(manifest["files"])
    assert "model.safetensors" not in manifest["files"]

    # rank 1 on "another node" whose checkpoints/ is its own: refused on every rank, before anything loads
    code, output = run_fsdp(project, env={**env, "FINEFLOW_TEST_NODE_LOCAL": "1"}, expect_ok=False)
    assert code != 0 and "must be shared storage" in output and "rank(s) [1] cannot see" in output, output[-3000:]

    output = run_fsdp(project, env=env)[1]
    assert "resuming from" in output
    steps, reference = _steps(project), _steps(fsdp2_run)
    assert [s["step"] for s in steps] == [s["step"] for s in reference]
    assert [s["rows"] for s in steps] == [s["rows"] for s in reference]
    assert [(s["loss"], s["grad_norm"]) for s in steps] == [(s["loss"], s["grad_norm"]) for s in reference]
    a = load_file(project / "models/candidate/adapter_model.safetensors")
    b = load_file(fsdp2_run / "models/candidate/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-exact
