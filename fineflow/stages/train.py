"""Stage train: fine-tuning (LoRA, QLoRA or full) of the base model on the packed shards, under accelerate.

    python -m fineflow.stages.train --shards data/shards --base-dir models/base \
        --checkpoints checkpoints --out models/candidate --steps-log reports/train_steps.jsonl \
        --reference-logps models/reference_logps

Run plainly, this process is the launcher: it sizes the run with the memory planner and re-executes this
module under ``accelerate launch`` with ``train.accelerate_profile`` / ``train.num_processes`` ranks. Each
rank then trains; only rank 0 writes the model, checkpoints, step log and report. The recipe is
``fineflow.train.procedure``. On a cluster (``train.num_machines`` > 1) with ``train.launcher: local``, run it once per
machine with ``--machine-rank N --main-process-ip <machine 0> [--main-process-port P]``; machine 0's launcher, not
started by DVC, then records the run in dvc.lock (``dvc commit --force train``: ``record_manual_run``). Its
checkpoints must be on storage every machine sees (a shared directory or ``checkpoint.store``), checked before any
rank starts (``fineflow.train.launch.check_checkpoint_storage``).

SIGTERM or Ctrl-C: the ranks save the step they are on and the stage exits 75 (PREEMPTED_EXIT) within
checkpoint.preempt_grace_s; run again, it resumes from that step (``fineflow.process.preempt``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from fineflow.core.config import load_params
from fineflow.core.dvc_project import output_paths, read_stages, run_dvc
from fineflow.core.entry import (
    journal_attempt,
    log,
    run_entry,
    stage_parser,
    user_error,
    workspace_busy,
    workspace_turn,
)
from fineflow.core.reports import clear_error_record, read_error_record, read_json
from fineflow.core.runtime import apply_offline_environment, is_train_worker
from fineflow.core.threads import ThreadPlan, process_plan
from fineflow.core.train_config import CheckpointSettings
from fineflow.errors import PREEMPTED_EXIT, USER_ERROR_EXIT, FineflowError, WorkspaceBusy
from fineflow.process import preempt
from fineflow.train.launch import check_checkpoint_storage
from fineflow.train.plots import write_run_plots
from fineflow.train.procedure import launch_ranks, train_rank


def parse_args(argv: list[str]):
    parser = stage_parser("train", __doc__)
    parser.add_argument("--shards", type=Path, required=True)
    parser.add_argument("--base-dir", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps-log", type=Path, required=True)
    parser.add_argument("--logs-dir", type=Path, default=Path("logs"), help="tracker logs (TensorBoard, MLflow)")
    parser.add_argument(
        "--plots",
        type=Path,
        default=Path("reports/plots"),
        help="the step log as DVC plot data and PNG charts (fineflow.train.plots; default: reports/plots)",
    )
    # not under --checkpoints: a DVC output, whose hash must not depend on this checkout's paths and mtimes
    parser.add_argument("--hash-cache", type=Path, default=None, help="cache of the base weights' content hashes")
    parser.add_argument(
        "--reference-logps",
        type=Path,
        default=None,
        help="the reference_logps stage's output (read when train.objective needs a reference model)",
    )
    parser.add_argument("--machine-rank", type=int, default=None, help="this machine's rank (num_machines > 1)")
    parser.add_argument("--main-process-ip", default=None, help="machine 0's address (num_machines > 1)")
    parser.add_argument("--main-process-port", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not is_train_worker():  # the launcher: accelerate launch runs this module again per rank
        attempt = journal_attempt("train", args.report)
        spans: dict[str, float] = {}
        code = 1  # an exception that escapes is a crash
        try:
            code = launch(args, argv, spans)
            return code
        finally:
            if attempt is not None:
                attempt.end_quietly(code, spans)
    return train_worker(args)


def launch(args, argv: list[str], spans: dict) -> int:
    """The launcher's part: plan, run the ranks, write the charts; its time goes into spans (the journal's),
    with rank 0's phases from its report when the training finished."""
    started = time.perf_counter()
    launched = time.time()
    ranks_started = ranks_ended = None
    code = 1
    try:
        # machine 0's launcher holds it for every rank; another machine's may share its folder (a shared
        # file system) and is part of the same run
        with workspace_turn("train") if not args.machine_rank else contextlib.nullcontext():
            spans["workspace_wait"] = time.perf_counter() - started
            clear_error_record(args.report)
            params = load_params(args.params)
            apply_offline_environment(model_base=params.model.base)  # the launcher's, and its ranks'
            # a multi-machine run's checkpoints on storage every machine sees, checked before any rank starts
            check_checkpoint_storage(params, args.checkpoints)
            launched = time.time()
            spans["params"] = time.perf_counter() - started - spans["workspace_wait"]
            ranks_started = launched
            code = launch_ranks(
                params,
                "fineflow.stages.train",
                argv,
                {
                    "base_dir": args.base_dir,
                    "machine_rank": args.machine_rank,
                    "main_process_ip": args.main_process_ip,
                    "main_process_port": args.main_process_port,
                },
                log=log,
                spans=spans,
            )
            ranks_ended = time.time()
            spans.update(rank_spans(args.report, launched, ranks_ended) if code == 0 else {})
            if code == 0 and not args.machine_rank:  # rank 0 wrote the step log on this machine
                plotting = time.perf_counter()
                write_plots(args)
                spans["plots"] = time.perf_counter() - plotting
    except WorkspaceBusy as exc:
        workspace_busy("train", exc)
        spans["discard"] = 1.0  # another run's workspace: this attempt is not part of its ledger
        return USER_ERROR_EXIT
    except FineflowError as exc:
        user_error("train", args.report, exc)
        return USER_ERROR_EXIT
    finally:
        if ranks_started is not None and "launch" not in spans:  # no finished rank's report: one span
            spans["ranks"] = (ranks_ended or time.time()) - ranks_started
    # accelerate exits 1 whatever a rank exited with: the ranks' record says a user error or a saved stop
    if code and read_error_record(args.report):
        return USER_ERROR_EXIT
    preempted = preempt.read_preempted_record(args.report)
    if code and preempted:
        log(f"train: {preempted['message']} (exit {PREEMPTED_EXIT})")
        return PREEMPTED_EXIT
    if code == 0 and not args.machine_rank and DVC_STAGE_ENV not in os.environ:
        recording = time.perf_counter()
        if record_manual_run(args.out):
            spans["dvc_commit"] = time.perf_counter() - recording  # the journal's: bookkeeping DVC would have done
    return code


DVC_STAGE_ENV = "DVC_STAGE"  # set by DVC (dvc.stage.run) for every stage command it runs: `dvc repro`, `dvc exp run`
RECORD_COMMAND = "dvc commit --force train"


def record_manual_run(out: Path, project: Path | None = None) -> bool:
    """A training launched by hand (not by `dvc repro`: on a cluster, the per-machine commands) that succeeded on
    machine 0: record it in dvc.lock (`dvc commit --force train`, which takes DVC's own lock), so that the next `dvc
    repro` does not train again. Only where this directory's dvc.yaml has a train stage whose output is `out`; a
    failed commit is said with the exact command to run. Whether the run was recorded."""
    project = Path.cwd() if project is None else project
    if not _is_the_train_stage(project, out):
        return False
    done = run_dvc(project, "commit", "--force", "train", env=dict(os.environ))
    if done.returncode == 0:
        log(f"train: launched outside `dvc repro`: the run is recorded in dvc.lock ({RECORD_COMMAND})")
        return True
    said = (done.stderr or done.stdout).strip().splitlines()
    log(
        f"train: WARNING: launched outside `dvc repro`, and recording the run in dvc.lock failed "
        f"({said[-1] if said else f'exit {done.returncode}'}): run `{RECORD_COMMAND}` in {project}; until then "
        f"dvc.lock does not describe models/candidate and the next `dvc repro` trains again"
    )
    return False


def _is_the_train_stage(project: Path, out: Path) -> bool:
    """Whether project's dvc.yaml has a train stage with out among its outputs (this launch is that stage's)."""
    try:
        stage = read_stages(project).get("train")
    except FineflowError:
        return False
    return isinstance(stage, dict) and Path(out) in {Path(path) for path in output_paths(stage)}


def rank_spans(report_path: Path | str, launched: float, returned: float) -> dict:
    """The ranks' time, split by rank 0's report of this attempt: planning and `accelerate launch` up to rank 0's
    process, its start-up, its phases and the loop's buckets, and its exit (empty when the report is an older
    attempt's)."""
    try:
        report = read_json(report_path)
        timeline, phases, totals = report["timeline"], report["phases"], report["loop_totals"]
        if timeline["proc_start"] < launched - 1:  # not this attempt's ranks
            return {}
        spans = {
            "launch": timeline["proc_start"] - launched,
            "rank_startup": timeline["entry"] - timeline["proc_start"],
            **{key.removesuffix("_s"): value for key, value in phases.items()},
            **{f"loop_{key.removesuffix('_s')}": value for key, value in totals.items()},
            "loop_other": report["loop_s"] - sum(totals.values()),
            "rank_exit": returned - timeline["done"],
        }
        return {key: round(float(value), 4) for key, value in spans.items()}
    except Exception:  # noqa: BLE001 - a finished training's accounting never fails it: one "ranks" span then
        return {}


def write_plots(args) -> None:
    """The step log as DVC plot data and PNG charts; a failure there is a warning, never a failed training."""
    try:
        written = write_run_plots(args.steps_log, args.plots)
    except Exception as exc:  # noqa: BLE001 - the candidate and the step log are written: the charts are extra
        log(f"train: warning: the charts in {args.plots} were not written: {type(exc).__name__}: {exc}")
        return
    if written:
        log(f"train: plots written to {args.plots} ({', '.join(path.name for path in written)})")


def train_worker(args) -> int:
    """One rank. It dies with its launcher, and stops on SIGINT/SIGTERM after saving its step (exit 75)."""
    preempt.die_with_parent()
    # from the first moment: a signal while the model loads is acted on at the first step's end
    stop = preempt.install(CheckpointSettings().preempt_grace_s)

    def body(params):
        stop.grace_s = params.checkpoint.preempt_grace_s
        return train_rank(
            params,
            args.shards,
            args.base_dir,
            args.checkpoints,
            args.out,
            args.steps_log,
            args.logs_dir,
            log=log,
            hash_cache=args.hash_cache,
            reference=args.reference_logps,
        )

    try:
        code = run_entry("train", args, body, threads=rank_threads)
    except preempt.Preempted as stopped:
        if os.environ.get("RANK", "0") == "0":  # one record, written after rank 0's checkpoint is published
            preempt.write_preempted_record(args.report, "train", stopped.step, stopped.signum)
            log(f"train: {stopped} (exit {PREEMPTED_EXIT})")
        # saved, recorded, trackers and logs closed: skip the interpreter's teardown, which with torch loaded
        # takes seconds of garbage collection on a busy machine (the grace is for saving, not for tidying up)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PREEMPTED_EXIT)
    return exit_without_teardown(code)


def rank_threads(params) -> ThreadPlan:
    """A rank's threads: its launcher's plan (fineflow.core.threads), or, placed by a cluster engine, its share of
    its node's CPUs among that node's ranks."""
    return process_plan(int(os.environ.get("LOCAL_WORLD_SIZE") or 1), params.train.threads)


def exit_without_teardown(code: int) -> int:
    """End a rank that finished its training: its model saved, its checkpoints closed, rank 0's report written.
    Its other threads are joined and Python's exit handlers run while the interpreter is whole, then the process
    exits without the interpreter's teardown. In that teardown what a distributed backend left behind (gloo
    work objects holding tensors, DeepSpeed's groups) is destroyed with half the interpreter gone, and a rank can
    abort after a successful run (SIGABRT, "terminate called without an active exception"; seen in CI: a
    DeepSpeed ZeRO-2 rank after its final save, which failed the stage and so would have re-run a finished
    training). A failed rank exits as usual (returns its code): there a checkpoint writer thread may still be
    finishing a save, which the normal exit waits for."""
    if code != 0:
        return code
    import atexit
    import threading

    for thread in threading.enumerate():  # what the normal exit does first (threading._shutdown)
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
