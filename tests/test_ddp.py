"""The train stage as DVC runs it, on real `accelerate launch` process groups over gloo on CPU:
2-process DDP matches 1 process with the same global batch, and a 2-"machine" run on loopback trains and
saves one adapter."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import (
    TRAIN,
    expected_lrs,
    launch_with_free_port,
    ranks_overrides,
    run_together,
    train_project,
    venv_env,
)

pytestmark = pytest.mark.slow  # every test here runs accelerate launch


def _steps(project):
    return [json.loads(line) for line in (project / "reports/train_steps.jsonl").read_text().splitlines()]


def test_two_process_ddp_matches_one_process_with_the_same_global_batch(reference_run):
    """Same global batch on 1 and 2 ranks: every step's loss, gradient norm and learning rate agree to 1e-4.

    1e-4 (not bit equality): the two layouts reduce gradients in a different order (all-reduce over ranks vs
    one process's sum over micro-batches), which moves float32 results at the 1e-7 relative level per step;
    1e-4 leaves room for that to grow over the steps while still failing on any real difference (a
    schedule run at another speed moves the lr by 20-90%, a wrong loss scaling moves the loss by 2x)."""
    two, one = reference_run(2), reference_run(1)  # each trained once per session, shared with test_resume
    two_steps, one_steps = _steps(two), _steps(one)
    report = json.loads((two / "reports/train.json").read_text())
    steps = yaml.safe_load((two / "params.yaml").read_text())["train"]["steps"]
    assert report["world_size"] == 2 and report["steps"] == steps
    assert (two / "models/candidate/adapter_model.safetensors").exists()
    # rank 0 alone writes: one step log line per step, not one per rank
    assert [s["step"] for s in two_steps] == list(range(1, steps + 1))
    # the sampler deals the same global batch to 2 ranks as to 1; token-weighted loss makes the steps equal
    assert [s["tokens"] for s in two_steps] == [s["tokens"] for s in one_steps]
    lrs = expected_lrs(yaml.safe_load((one / "params.yaml").read_text()))
    assert [s["lr"] for s in one_steps] == pytest.approx(lrs, rel=1e-9)
    assert [s["lr"] for s in two_steps] == pytest.approx(lrs, rel=1e-9)  # not compressed by the world size
    for key in ("loss", "grad_norm"):
        assert [s[key] for s in two_steps] == pytest.approx([s[key] for s in one_steps], rel=1e-4), key


def test_dvc_plots_show_has_points_for_every_declared_plot_and_the_run_has_png_charts(reference_run, tmp_path):
    """`dvc plots show` reads every plot dvc.yaml declares, with one point per step: the launcher writes the step
    log as JSON plot data (DVC reads JSON, YAML, CSV and TSV, not the JSONL step log) and as PNG charts
    (fineflow/train/plots.py)."""
    from tests.conftest import copy_project

    two = reference_run(2)  # through the launcher, as dvc.yaml runs it
    steps = _steps(two)
    plots = two / "reports/plots"
    assert [r["step"] for r in json.loads((plots / "train_steps.json").read_text())] == [s["step"] for s in steps]
    evals = json.loads((plots / "eval_loss.json").read_text())
    assert evals and [e["step"] for e in evals] == [s["step"] for s in steps if "eval_loss" in s]
    for chart in ("loss.png", "tokens_per_s.png", "memory.png"):
        assert (plots / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", chart
    project = copy_project(tmp_path / "project")
    shutil.copytree(plots, project / "reports/plots", dirs_exist_ok=True)  # over the committed ones
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=project, env=venv_env(), capture_output=True
    )
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert not shown.get("errors"), shown.get("errors")
    declared = [next(iter(plot)) for plot in yaml.safe_load((project / "dvc.yaml").read_text())["plots"]]
    for name in declared:
        [plot] = shown["data"][name]
        points = plot["content"]["data"]["values"]
        if name.endswith("_over_runs"):  # the goodput ledger's history (committed): a point per run
            assert points, name
        else:
            assert len(points) >= len(steps), (name, len(points))


def test_two_machines_on_loopback_train_one_adapter(built, reference_run, tmp_path):
    """num_machines 2, one process each, one rendezvous on 127.0.0.1: two launches of the same stage. It trains
    exactly what one process with the same global batch trains (same lr, loss and grad norm per step)."""
    # both "machines" are this host: one checkpoints dir that both see (the launcher refuses a node-local one)
    shared = {"checkpoint.shared": True}
    project = train_project(built, tmp_path, {**ranks_overrides(2), "train.num_machines": 2, **shared})
    one_steps = _steps(reference_run(1))
    logs = [tmp_path / f"machine{rank}.log" for rank in (0, 1)]

    def launch(port):
        place = ["--main-process-ip", "127.0.0.1", "--main-process-port", str(port)]
        commands = [(TRAIN + ["--machine-rank", str(rank)] + place, {}) for rank in (0, 1)]
        codes = run_together(commands, project, logs, timeout=600)
        return codes == [0, 0], "\n".join(log.read_text() for log in logs)

    ok, _ = launch_with_free_port(launch)
    assert ok, "\n".join(log.read_text()[-2000:] for log in logs)
    report = json.loads((project / "reports/train.json").read_text())
    assert report["world_size"] == 2
    assert (project / "models/candidate/adapter_model.safetensors").exists()
    steps = _steps(project)
    assert [s["step"] for s in steps] == list(range(1, report["steps"] + 1))  # machine 1's rank wrote nothing
    assert [s["lr"] for s in steps] == pytest.approx(
        expected_lrs(yaml.safe_load((project / "params.yaml").read_text())), rel=1e-9
    )
    for key in ("loss", "grad_norm"):
        assert [s[key] for s in steps] == pytest.approx([s[key] for s in one_steps], rel=1e-4), key


def test_a_user_error_in_the_ranks_is_exit_2_from_the_launcher(built, tmp_path):
    """The ranks meet a user error (a non-finite loss, from an absurd lr) and exit 2; accelerate launch exits 1
    whatever a rank exited with; the launcher reads the ranks' error record and exits 2 again, so no layer
    above retries it."""
    project = train_project(built, tmp_path, {**ranks_overrides(2), "train.lr": 1e30, "train.steps": 4})

    def launch(port):
        command = TRAIN + ["--main-process-port", str(port)]
        result = subprocess.run(command, cwd=project, env=venv_env(), capture_output=True, text=True, timeout=600)
        return result.returncode == 2, f"exit {result.returncode}\n" + result.stdout + result.stderr

    ok, output = launch_with_free_port(launch)
    assert ok, output[-4000:]
    record = json.loads((project / "reports/train.error.json").read_text())
    assert record["kind"] == "user_error" and "the loss is" in record["message"] and "train.lr" in record["message"]
