"""``fineflow data add``: new training data for the on-new-data deployment (dvc add, then a Prefect event)."""

from __future__ import annotations

from fineflow.errors import FineflowError


def add_parser(sub) -> None:
    p = sub.add_parser("data", help="register new training data")
    actions = p.add_subparsers(dest="action", required=True)
    add = actions.add_parser(
        "add",
        help="track a data file with DVC and emit the fineflow.data.added event",
        description="`dvc add FILE`, then the Prefect event fineflow.data.added (resource fineflow.data.<FILE>, "
        "payload: path, md5, bytes) to the server PREFECT_API_URL names: prefect.yaml's on-new-data deployment "
        "runs the pipeline on it. Point data.train_path (or eval_path) at FILE in params.yaml.",
    )
    add.add_argument("file", help="the data file, inside the project")
    add.set_defaults(run=_run_data_add)


def _run_data_add(args) -> int:
    import os
    from pathlib import Path

    import yaml

    from fineflow.core.dvc_project import run_dvc

    path = Path(args.file)
    if not path.is_file():
        raise FineflowError(f"{path}: no such file")
    done = run_dvc(".", "add", str(path), env=dict(os.environ))
    if done.returncode != 0:  # e.g. the file is a stage's output (the embedded data stage's): DVC says so
        raise FineflowError(f"dvc add {path} failed: {(done.stdout + done.stderr).strip()[-1500:]}")
    [out] = yaml.safe_load(Path(f"{path}.dvc").read_text(encoding="utf-8"))["outs"]
    payload = {"path": path.as_posix(), "md5": out["md5"], "bytes": out.get("size")}
    print(f"tracked {path} (md5 {out['md5']}): commit {path}.dvc, and `dvc push` if you use a remote")
    if not os.environ.get("PREFECT_API_URL"):
        print("no PREFECT_API_URL: no event sent (run the flow yourself: make run)")
        return 0
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    resource = {"prefect.resource.id": f"fineflow.data.{path.as_posix()}"}
    event = emit_event(event="fineflow.data.added", resource=resource, payload=payload)
    EventsWorker.drain_all(timeout=30)  # sent before this process exits
    print(f"sent fineflow.data.added ({event.id if event else 'not sent: events are off'})")
    return 0
