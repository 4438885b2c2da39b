"""The training engine's options on CPU: full fine-tuning, bf16 autocast and gradient checkpointing (observed inside
the model while it trains), the stop on a non-finite loss, hardware gates, and the memory planner's refuse /
auto_fit verdicts before launch."""

import json
import math
import re
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.conftest import TINY_PARAMS, _merge, venv_env, write_params


def _params(**train):
    from fineflow.core.config import parse_params

    return parse_params(_merge(TINY_PARAMS, {"train": {"steps": 2, **train}}))


def _train(built, tmp_path, params):
    from accelerate.state import AcceleratorState

    from fineflow.train import procedure

    AcceleratorState._reset_state(reset_partial_state=True)  # a launched rank is a fresh process; here, reset

    return procedure.train_rank(
        params,
        built / "data/shards",
        built / "models/base",
        tmp_path / "checkpoints",
        tmp_path / "candidate",
        tmp_path / "steps.jsonl",
        tmp_path / "logs",
    )


def test_full_fine_tuning_saves_a_whole_model_that_evaluate_loads(built, tmp_path, tiny_params):
    from fineflow.evaluate.scoring import evaluate_models

    report = _train(built, tmp_path, _params(method="full", tracker="none"))
    weights = load_file(tmp_path / "candidate/model.safetensors")
    assert report["method"] == "full" and not any("lora_" in name for name in weights)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(built / "models/base")
    assert report["trainable_parameters"] == sum(p.numel() for p in base.parameters())  # every weight trains
    scores = evaluate_models(
        tiny_params,
        built / "models/base",
        tmp_path / "candidate",
        built / "data/validated/eval.jsonl",
        tmp_path / "eval",
        tmp_path / "raw",
    )
    assert "fineflow_synth/exact_match" in scores["candidate"]


def _train_watching_one_attention(built, tmp_path, monkeypatch, **train):
    """Train through train_rank with a forward hook on the first decoder layer's attention; returns the report and
    the dtype of the attention's output (o_proj's) on every call made in training mode (evaluation is left out).

    The attention, not the MLP: PyTorch's non-reentrant checkpoint stops a layer's recomputation as soon as the
    last activation backward needs is rebuilt, which is inside the MLP, so the MLP's forward never returns there."""
    from fineflow.train import procedure

    outputs = []

    def record(module, args, output):
        if module.training:
            outputs.append(output[0].dtype)

    def build_and_watch(*args, **kwargs):
        model = build_model(*args, **kwargs)
        layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
        layer.self_attn.register_forward_hook(record)
        return model

    build_model = procedure.build_model
    monkeypatch.setattr(procedure, "build_model", build_and_watch)
    return _train(built, tmp_path, _params(tracker="none", **train)), outputs


@pytest.mark.parametrize("precision, checkpointing", [("no", False), ("bf16", True)], ids=["fp32", "bf16-checkpointed"])
def test_precision_and_gradient_checkpointing_change_what_training_runs(
    built, tmp_path, monkeypatch, precision, checkpointing
):
    """bf16 runs the layers under autocast (a projection's output is bfloat16); gradient checkpointing drops a
    layer's activations in forward and recomputes them in backward: its attention runs twice per micro-batch."""
    import torch

    report, outputs = _train_watching_one_attention(
        built, tmp_path, monkeypatch, precision=precision, gradient_checkpointing=checkpointing
    )
    micro_batches = report["steps"] * report["grad_accum"]
    assert len(outputs) == micro_batches * (2 if checkpointing else 1)
    assert set(outputs) == {torch.bfloat16 if precision == "bf16" else torch.float32}
    assert math.isfinite(report["final_loss"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_loss_stops_training_with_a_clear_error(built, tmp_path, monkeypatch, bad):
    """fit() checks math.isfinite on every step's loss: NaN and an overflow to +inf both stop the run."""
    from fineflow.errors import FineflowError
    from fineflow.objectives import token_loss

    real = token_loss.token_loss_sum

    def poisoned(model, batch, **kwargs):
        loss, count = real(model, batch, **kwargs)
        return loss * bad, count  # the sum of positive cross-entropies times nan / +inf

    monkeypatch.setattr(token_loss, "token_loss_sum", poisoned)
    params = _params(tracker="none")
    expected = (
        f"training stopped at step 1: the loss is {bad}. Lower train.lr (now {params.train.lr}) or check "
        f"the data for empty responses."
    )
    with pytest.raises(FineflowError, match=re.escape(expected)):
        _train(built, tmp_path, params)
    assert not (tmp_path / "candidate").exists()  # nothing was saved as if the run had succeeded


def test_per_example_attention_and_fused_lora_train_like_the_reference_path(built, tmp_path):
    """The fast path (varlen attention, fused LoRA) and the reference (transformers' masked sdpa, peft's
    forward) give the same per-step losses on the same batches."""
    runs = {}
    for name, options in (("fast", {}), ("reference", {"attention": "sdpa", "fused_lora": False})):
        (tmp_path / name).mkdir()
        report = _train(built, tmp_path / name, _params(steps=4, tracker="none", **options))
        steps = [json.loads(line) for line in (tmp_path / name / "steps.jsonl").read_text().splitlines()]
        runs[name] = report, steps
    (fast, fast_steps), (reference, reference_steps) = runs["fast"], runs["reference"]
    assert fast["attention"] == "varlen" and fast["fused_lora_layers"] == 2 * 7  # 2 layers x 7 projections
    assert reference["attention"] == "sdpa" and reference["fused_lora_layers"] == 0
    assert [s["rows"] for s in fast_steps] == [s["rows"] for s in reference_steps]
    assert [s["loss"] for s in fast_steps] == pytest.approx([s["loss"] for s in reference_steps], rel=1e-4)
    assert fast["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-4)


def _train_cli(tmp_path, overrides):
    write_params(tmp_path / "params.yaml", overrides)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "fineflow.stages.train",
            "--shards",
            "data/shards",
            "--base-dir",
            "models/base",
            "--checkpoints",
            "ck",
            "--out",
            "candidate",
            "--steps-log",
            "s.jsonl",
        ],
        cwd=tmp_path,
        env=venv_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture
def project(built, tmp_path):
    import shutil

    shutil.copytree(built / "data/shards", tmp_path / "data/shards")
    shutil.copytree(built / "models/base", tmp_path / "models/base")
    return tmp_path


@pytest.mark.slow
def test_qlora_on_cpu_is_refused_with_what_to_do(project):
    result = _train_cli(project, {"train.method": "qlora"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "train.method is qlora" in result.stderr and "needs a CUDA GPU" in result.stderr
    assert "train.method: lora" in result.stderr


@pytest.mark.slow
def test_plan_that_does_not_fit_is_refused_before_launch(project):
    result = _train_cli(project, {"train.device_memory_gib": 0.01})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "needs 0.5 GiB per device, device has 0.0 GiB" in result.stderr
    assert "launching" not in result.stdout  # refused by the launcher, no rank was started


def test_auto_fit_adapts_the_plan_and_keeps_the_global_batch(built, tmp_path):
    from fineflow.train import planner
    from fineflow.train.profile import load_profile
    from fineflow.train.run_plan import fit_plan

    def plan(params):
        return fit_plan(params, load_profile(params.train.accelerate_profile), reference, has_gpu=False)

    params = _params(micro_batch_size=4, grad_accum=1, tracker="none")
    reference = str(built / "models/base")
    roomy = plan(params).memory
    setup = planner.Setup(
        **{
            **roomy["setup"],
            "micro_batch_size": 1,
            "gradient_checkpointing": True,
            "lora_targets": tuple(roomy["setup"]["lora_targets"]),
        }
    )
    smallest = planner.plan(planner.load_shape(reference), setup).total
    assert smallest < roomy["bytes"]["total"]
    budget = smallest * 1.000001 / 2**30  # only micro-batch 1 with checkpointing fits
    with pytest.raises(planner.DoesNotFit, match="train.micro_batch_size"):
        plan(_params(micro_batch_size=4, device_memory_gib=budget))
    adapted_params = _params(micro_batch_size=4, grad_accum=1, device_memory_gib=budget, auto_fit=True, tracker="none")
    run = plan(adapted_params)
    adapted = run.train
    assert run.changes and adapted.gradient_checkpointing is True
    assert (adapted.micro_batch_size, adapted.grad_accum) == (1, 4)  # the global batch is unchanged
    assert run.memory["bytes"]["total"] <= budget * 2**30
    report = _train(built, tmp_path, adapted_params)  # and the ranks run with the adapted settings
    assert (report["micro_batch_size"], report["grad_accum"]) == (adapted.micro_batch_size, adapted.grad_accum)
    assert json.loads((tmp_path / "steps.jsonl").read_text().splitlines()[0])["tokens"] > 0


def test_a_step_timer_span_files_its_block_under_one_bucket_and_a_redone_step_under_redo_too():
    """StepTimer.span adds the block's wall time to the step's and the run's bucket; move re-files seconds (DDP's
    all-reduce inside backward) without changing the step's sum; a step a resume trains again counts in redo."""
    import time

    from fineflow.train.steps import StepTimer

    timer = StepTimer()
    timer.start_step()
    with timer.span("compute_s"):
        time.sleep(0.01)
    assert timer.current["compute_s"] >= 0.01 and timer.totals["compute_s"] == timer.current["compute_s"]
    before = sum(timer.current.values())
    timer.move("compute_s", "grad_sync_s", 0.004)
    assert timer.current["grad_sync_s"] == 0.004 and sum(timer.current.values()) == pytest.approx(before)
    with pytest.raises(RuntimeError), timer.span("optimizer_s"):
        raise RuntimeError("a block that raises adds nothing")
    assert timer.totals["optimizer_s"] == 0.0 and timer.redo == {}
    timer.start_step(redo=True)
    with timer.span("data_wait_s"):
        pass
    assert timer.redo_steps == 1 and set(timer.redo) == {"data_wait_s"}
