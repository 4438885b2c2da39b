"""Checkpoint stall: how long the training loop is blocked per checkpoint, synchronous vs async (thread and
process backends) on the same >= 100 MB state; how much the next steps slow down while an async save is
in flight; and what a resume costs next to a fresh start.

    python bench/checkpoint_stall.py

The state is full fine-tuning of a ~58M-parameter Llama (hidden 512, intermediate 1408, 8 layers, 8 heads,
vocab 32000, fp32) with AdamW's state after real steps: ~3x the parameter bytes. Blocked time is the time
from building the state dicts to save() returning — what the loop waits for. Steps are real
forward/backward/AdamW steps on a small batch. The backends take turns, twice (the machine is shared, so
its load hits all three alike): 3 steps without a save in flight, a save, 5 steps while it is written. The
first save of each backend allocates its host buffer; the second is steady state.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fineflow.checkpoint import CheckpointManager, capture_rng, restore_rng

CONFIG = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 512,
}
BATCH, SEQ = 2, 64


def build():
    """Model, AdamW and a warmup+decay LambdaLR, as the train stage builds them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, use_cache=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, batch) -> tuple[float, float]:
    """One real optimizer step; returns (seconds, loss)."""
    started = time.perf_counter()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started, loss.item()


def checkpoint(manager, step, model, optimizer, scheduler) -> float:
    """Blocked time of one save, including building the state dicts the loop hands over."""
    started = time.perf_counter()
    manager.save(
        step,
        model.state_dict(),
        optimizer.state_dict(),
        scheduler.state_dict(),
        {"step": step, "fingerprint": {"model": "llama-58m", "method": "full"}},
        [capture_rng()],
        metric=1.0 / step,
    )
    return time.perf_counter() - started


BACKENDS = (("sync", "sync", "thread"), ("async-thread", "async", "thread"), ("async-process", "async", "process"))


def measure(managers: dict, model, optimizer, scheduler, batch, rounds: int = 2) -> dict:
    """Round-robin over the backends, `rounds` times: 3 steps with no save in flight (this moment's
    speed on a shared machine), a save, 5 steps while it is written, then wait() for what is left."""
    results = {name: {"baseline": [], "saves": []} for name in managers}
    step = 1
    for _ in range(rounds):
        for name, manager in managers.items():
            results[name]["baseline"] += [train_step(model, optimizer, scheduler, batch)[0] for _ in range(3)]
            step += 4
            blocked = checkpoint(manager, step, model, optimizer, scheduler)
            after, losses = zip(*(train_step(model, optimizer, scheduler, batch) for _ in range(5)))
            started = time.perf_counter()
            manager.wait()
            results[name]["saves"].append(
                {
                    "blocked": blocked,
                    "after": list(after),
                    "left": time.perf_counter() - started,
                    "write": manager.last_result["write_s"],
                    "first_loss": losses[0],
                    "files": manager.last_result["files_s"],
                    "verify": manager.last_result["verify_s"],
                }
            )
            results[name]["bytes"], results[name]["path"] = manager.last_result["bytes"], manager.last_result["path"]
            step += 5
    return results


def restore_cost(path: str, batch, expected_loss: float) -> dict:
    """Fresh start vs resume, each up to the end of its first step."""
    started = time.perf_counter()
    model, optimizer, scheduler = build()
    build_s = time.perf_counter() - started
    fresh_step_s, _ = train_step(model, optimizer, scheduler, batch)
    del model, optimizer, scheduler

    started = time.perf_counter()
    model, optimizer, scheduler = build()
    built = time.perf_counter()
    manager = CheckpointManager(Path(path).parent, keep_last=1, mode="sync")
    found = manager.latest_valid(expected_fingerprint={"model": "llama-58m", "method": "full"})
    verified = time.perf_counter()
    ckpt = manager.load(found)
    loaded = time.perf_counter()
    model.load_state_dict(ckpt.model_tensors)
    optimizer.load_state_dict(ckpt.optimizer_state_dict)
    scheduler.load_state_dict(ckpt.scheduler_state_dict)
    restore_rng(ckpt.rng_snapshots[0])
    restored = time.perf_counter()
    resume_step_s, loss = train_step(model, optimizer, scheduler, batch)
    return {
        "build": build_s,
        "fresh_first_step": fresh_step_s,
        "fresh_total": build_s + fresh_step_s,
        "resume_build": built - started,
        "latest_valid": verified - built,
        "load": loaded - verified,
        "load_state_dict": restored - loaded,
        "resume_first_step": resume_step_s,
        "resume_total": time.perf_counter() - started,
        "loss_matches": loss == expected_loss,
    }


def main() -> int:
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="fineflow-stall-", dir=os.environ.get("STALL_DIR")))
    # the process backend's writer starts now, so its start overlaps building the model (as in training)
    managers = {
        name: CheckpointManager(root / name, keep_last=1, keep_best=0, mode=mode, async_backend=backend)
        for name, mode, backend in BACKENDS
    }
    model, optimizer, scheduler = build()
    batch = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    train_step(model, optimizer, scheduler, batch)  # AdamW state exists from here on
    params = sum(p.numel() for p in model.parameters())
    try:
        measured = measure(managers, model, optimizer, scheduler, batch)
        for manager in managers.values():
            manager.close()
        del managers
        last = measured["async-process"]["saves"][-1]
        restore = restore_cost(measured["async-process"]["path"], batch, last["first_loss"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = [{"name": name, **measured[name]} for name, _, _ in BACKENDS]

    state_mb = results[0]["bytes"] / 1e6
    print(
        f"state: {params / 1e6:.1f}M parameters, fp32, model + AdamW = {state_mb:.0f} MB per checkpoint; "
        f"batch {BATCH}x{SEQ}; torch threads {torch.get_num_threads()}; load avg {load_before:.1f} at start"
    )
    print(
        f"{'backend':14s} {'blocked 1st':>11s} {'blocked 2nd':>11s} {'bg write':>9s} {'step no save':>12s} "
        f"{'5 steps after':>13s} {'slowdown':>8s} {'wait left':>9s}"
    )
    sync_blocked = statistics.mean(s["blocked"] for s in results[0]["saves"])
    for r in results:
        base = statistics.median(r["baseline"])  # 6 steps, 3 right before each save
        after = statistics.mean(t for s in r["saves"] for t in s["after"])
        print(
            f"{r['name']:14s} {r['saves'][0]['blocked']:10.3f}s {r['saves'][1]['blocked']:10.3f}s "
            f"{statistics.mean(s['write'] for s in r['saves']):8.2f}s {base:11.3f}s {after:12.3f}s "
            f"{(after / base - 1) * 100:+7.1f}% {max(s['left'] for s in r['saves']):8.3f}s"
        )
    print(
        "background save (mean of 2): "
        + "; ".join(
            f"{r['name']} write+fsync {statistics.mean(s['files'] for s in r['saves']):.2f}s, verify (re-hash, "
            f"load, finite) {statistics.mean(s['verify'] for s in r['saves']):.2f}s"
            for r in results
        )
    )
    for r in results[1:]:
        blocked = [s["blocked"] for s in r["saves"]]
        print(
            f"blocked ratio {r['name']} / sync: first save {blocked[0] / results[0]['saves'][0]['blocked']:.3f}, "
            f"steady {blocked[1] / results[0]['saves'][1]['blocked']:.3f}, "
            f"mean {statistics.mean(blocked) / sync_blocked:.3f}"
        )
    for r in results[1:]:
        per_step = [statistics.mean(s["after"][i] for s in r["saves"]) for i in range(5)]
        print(
            f"{r['name']} step times after a save (mean of 2 saves): "
            + " ".join(f"{t:.3f}" for t in per_step)
            + f" s vs {statistics.median(r['baseline']):.3f} s without"
        )
    print(
        "losses of the steps right after each save: "
        + ", ".join(f"{r['name']} {[round(s['first_loss'], 4) for s in r['saves']]}" for r in results)
    )
    print(
        f"restore: fresh start {restore['fresh_total']:.2f}s (build {restore['build']:.2f}s + first step "
        f"{restore['fresh_first_step']:.2f}s); resume {restore['resume_total']:.2f}s "
        f"(build {restore['resume_build']:.2f}s "
        f"+ latest_valid/hash {restore['latest_valid']:.2f}s + load/verify {restore['load']:.2f}s + "
        f"load_state_dict/rng {restore['load_state_dict']:.2f}s + first step {restore['resume_first_step']:.2f}s); "
        f"overhead {restore['resume_total'] - restore['fresh_total']:+.2f}s"
    )
    print(f"resumed first-step loss == uninterrupted run's: {restore['loss_matches']}")
    print(f"total {time.perf_counter() - started:.0f}s, load avg {os.getloadavg()[0]:.1f} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
