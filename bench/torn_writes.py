"""Torn-write harness: SIGKILL a process that saves checkpoints in a loop, at random (seeded) moments.

    python bench/torn_writes.py --trials 200 --seed 0

Each trial forks a child from this already-initialized process (so a trial costs milliseconds, not a
Python start), which creates a CheckpointManager on a shared directory (its startup cleanup is part of
what is tested), resumes the step count from the newest valid checkpoint (sometimes re-saving that very
step, to exercise the replace path) and saves small checkpoints as fast as it can, alternating synchronous
and async-thread saves between trials, with keep_last=2 / keep_best=1 retention deleting as it goes. The
child reports each step once its save has returned. The parent kills it after a random delay, notes what
the kill interrupted (a .tmp- dir: mid-write; .old-: mid-publish of a re-save; .trash-: mid-delete),
and then checks, before any cleanup:

- every step-* directory verifies fully (marker, manifest, hashes, loadable finite tensors): a torn
  checkpoint never appears under a name that could be picked;
- latest_valid() picks the newest published step: at least the last step reported, at most one more
  (a save can land between the rename and the report), never older than the previous trial's;
- that checkpoint loads and holds exactly the content written for its step.

``torn_picked`` counts the trials in which the checkpoint latest_valid() picked was not intact (fails deep
verification, does not load, or holds other content than its step's): measured, never assumed. The
checks in the list above raise at the first violation; a torn pick is counted and reported first.
"""

from __future__ import annotations

import argparse
import os
import random
import select
import signal
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

from fineflow.checkpoint import (
    STEP_DIR,
    CheckpointManager,
    CorruptCheckpoint,
    capture_rng,
    latest_valid,
    load_checkpoint,
    verify_checkpoint,
)

MODEL_FLOATS = 64 * 1024  # 256 KiB of model + 512 KiB of optimizer state: big enough to be mid-write often


def payload(step: int) -> dict:
    """The state saved at `step`: every tensor a function of the step, so a load can be checked exactly."""
    base = torch.arange(MODEL_FLOATS, dtype=torch.float32)
    return {
        "model_tensors": {"w": base + step, "b": torch.full((16,), float(step))},
        "optimizer_state_dict": {
            "state": {
                0: {"step": torch.tensor(float(step)), "exp_avg": base * 0.5 + step, "exp_avg_sq": base * 0.25 + step}
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "scheduler_state_dict": {"last_epoch": step, "_last_lr": [1e-3]},
        "state_json": {"step": step, "sampler": {"epoch": step // 10, "position": step % 10}},
        "metric": float((step * 7919) % 13),  # jumps around, so keep_best keeps some old step
    }


def check_content(ckpt, step: int) -> None:
    expected = payload(step)
    assert ckpt.step == step == ckpt.state["step"], (ckpt.path, ckpt.step, ckpt.state)
    for name, tensor in expected["model_tensors"].items():
        assert torch.equal(ckpt.model_tensors[name], tensor), f"{ckpt.path}: model tensor {name} differs"
    for key, tensor in expected["optimizer_state_dict"]["state"][0].items():
        assert torch.equal(ckpt.optimizer_state_dict["state"][0][key], tensor), f"{ckpt.path}: optimizer {key}"
    assert ckpt.optimizer_state_dict["param_groups"] == expected["optimizer_state_dict"]["param_groups"]
    assert ckpt.scheduler_state_dict == expected["scheduler_state_dict"]
    assert len(ckpt.rng_snapshots) == 1 and ckpt.rng_snapshots[0]["torch_cpu"].dtype == torch.uint8


def torn(path: Path, step: int) -> str | None:
    """Why the checkpoint latest_valid() picked is not exactly what was saved for its step; None if it is."""
    try:
        verify_checkpoint(path, deep=True)
        check_content(load_checkpoint(path), step)
    except Exception as exc:  # any failure to verify, load or match is a torn pick
        return f"{type(exc).__name__}: {exc}"
    return None


def child(root: Path, mode: str, resave: bool, report: int) -> None:
    """Save checkpoints until killed, writing 'ready' and then each step once its save has returned."""
    torch.set_num_threads(1)  # a forked child must not enter an OpenMP region the parent's pool owns
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager = CheckpointManager(root, keep_last=2, keep_best=1, mode=mode)
        latest = manager.latest_valid()
    step = 1 if latest is None else int(STEP_DIR.match(latest.name).group(1)) + (0 if resave else 1)
    os.write(report, b"ready\n")
    while True:
        data = payload(step)
        manager.save(
            step,
            data["model_tensors"],
            data["optimizer_state_dict"],
            data["scheduler_state_dict"],
            data["state_json"],
            [capture_rng()],
            metric=data["metric"],
        )
        manager.wait()
        os.write(report, f"{step}\n".encode())
        step += 1


def _read_lines(fd: int, timeout: float) -> list[str]:
    out = b""
    while select.select([fd], [], [], timeout)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
        timeout = 0
    return out.decode().split()


def save_seconds(scratch: Path, saves: int = 3) -> float:
    """Median time of one synchronous save here and now (the machine may be busy): kill delays are drawn
    over a few save lengths, so kills land in every phase of a save and some saves complete."""
    times = []
    manager = CheckpointManager(scratch, keep_last=1, mode="sync")
    for step in range(1, saves + 1):
        data = payload(step)
        started = time.perf_counter()
        manager.save(
            step,
            data["model_tensors"],
            data["optimizer_state_dict"],
            data["scheduler_state_dict"],
            data["state_json"],
            [capture_rng()],
            metric=data["metric"],
        )
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def run_trials(root: Path, trials: int, seed: int = 0, max_delay_s: float | None = None, log=print) -> dict:
    """Run `trials` kill trials on root; raises AssertionError on the first violation; returns counts.
    Kill delays are uniform in [0, max_delay_s] after the child is ready (default: 4 save lengths)."""
    root = Path(root)
    rng = random.Random(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if max_delay_s is None:
        max_delay_s = 4 * save_seconds(root.with_name(root.name + "-calibration"))
    counts: Counter = Counter(torn_picked=0)
    floor = 0  # the newest step known to be published
    started = time.perf_counter()
    try:
        for trial in range(trials):
            mode = rng.choice(["sync", "async"])
            resave = rng.random() < 0.2
            delay = rng.uniform(0, max_delay_s)
            reader, writer = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns
                os.close(reader)
                try:
                    child(root, mode, resave, writer)
                except BaseException:
                    os.write(writer, ("error " + traceback.format_exc().replace("\n", " | ")).encode())
                os._exit(1)
            os.close(writer)
            lines = _read_lines(reader, 30)
            assert lines[:1] == ["ready"], f"trial {trial}: the child did not start: {' '.join(lines)}"
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            lines += _read_lines(reader, 0.5)
            os.close(reader)
            assert not any(line.startswith("error") for line in lines), f"trial {trial}: {' '.join(lines)}"
            assert os.WIFSIGNALED(status), f"trial {trial}: the child exited by itself ({status})"
            reported = [int(x) for x in lines[1:]]
            counts["saves_published"] += len(reported)
            counts[f"mode_{mode}"] += 1

            names = [p.name for p in root.iterdir()]
            interrupted = (
                "mid_write"
                if any(n.startswith(".tmp-") for n in names)
                else "mid_publish"
                if any(n.startswith(".old-") for n in names)
                else "mid_delete"
                if any(n.startswith(".trash-") for n in names)
                else "between_saves"
            )
            counts[interrupted] += 1

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                latest = latest_valid(root)
            step = None if latest is None else int(latest.name.rsplit("-", 1)[1])
            problem = None if latest is None else torn(latest, step)
            if problem is not None:  # counted before any assertion below can end the run
                counts["torn_picked"] += 1
                log(f"trial {trial}: latest_valid picked a torn checkpoint {latest}: {problem}")
            for name in names:  # no torn checkpoint under a name latest_valid would consider
                if STEP_DIR.match(name):
                    try:
                        verify_checkpoint(root / name, deep=True)
                    except CorruptCheckpoint as exc:
                        raise AssertionError(f"trial {trial}: a torn checkpoint under a final name: {exc}") from None
            assert not caught, f"trial {trial}: latest_valid skipped something: {[str(w.message) for w in caught]}"
            floor = max([floor, *reported])
            assert latest is not None or floor == 0, f"trial {trial}: no valid checkpoint after step {floor}"
            if latest is None:
                counts["no_checkpoint_yet"] += 1
                continue
            assert floor <= step <= floor + 1, f"trial {trial}: picked step {step}, published up to {floor}"
            if step == floor + 1:
                counts["published_but_unreported"] += 1
            if latest.name.startswith(".old-"):
                counts["picked_moved_aside_original"] += 1
            if problem is None:
                counts["loads_verified"] += 1
            floor = step
    finally:
        torch.set_num_threads(threads)
    counts["trials"] = trials
    counts["kills_during_a_save"] = counts["mid_write"] + counts["mid_publish"] + counts["mid_delete"]
    counts["seconds"] = round(time.perf_counter() - started, 1)
    counts["max_kill_delay_ms"] = round(max_delay_s * 1000, 1)
    log("torn-write trials: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return dict(counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=None, help="directory to use (default: a fresh temp dir)")
    args = parser.parse_args(argv)
    import tempfile

    root = args.root or Path(tempfile.mkdtemp(prefix="fineflow-torn-"))
    root.mkdir(parents=True, exist_ok=True)
    counts = run_trials(root, args.trials, args.seed)
    return 1 if counts["torn_picked"] else 0


if __name__ == "__main__":
    sys.exit(main())
