"""Stage base: build the embedded default base model, or record the real one params.yaml names.

python -m fineflow.stages.base --out models/base --state-dir checkpoints/base

SIGTERM or Ctrl-C during the embedded base's pretraining: the step in progress ends, pretraining's state is saved
under --state-dir and the stage exits 75 (PREEMPTED_EXIT); run again (same params), it resumes from that step
and writes the same bytes as an uninterrupted run (fineflow.base.embedded.pretrain).
"""

from __future__ import annotations

from pathlib import Path

from fineflow.base.embedded import build_embedded_base
from fineflow.base_source import base_source, download_hub_base, write_external_marker
from fineflow.core.config import Params
from fineflow.core.entry import log, run_entry, stage_parser
from fineflow.process import preempt


def run(params: Params, out_dir: Path, state_dir: Path | None = None) -> dict:
    if not params.model.is_embedded:
        source = base_source(params.model.base)
        if source == "download":  # a hub id, the hub online: into the user's own HF cache, once
            download_hub_base(params.model.base, log)
        where = {"dir": "a local directory", "cache": "in the Hugging Face cache", "download": "downloaded"}
        log(f"model.base is {params.model.base!r} ({where[source]}): using it as the base, nothing to build")
        return write_external_marker(out_dir, params.model.base)
    if state_dir is None:
        return {"skipped": False, **build_embedded_base(params.model, params.base, params.seed, out_dir, log=log)}
    preempt.install(params.checkpoint.preempt_grace_s)  # a signal is noted; pretraining saves at the step's end
    try:
        figures = build_embedded_base(
            params.model, params.base, params.seed, out_dir, log, state_dir, stop_signal=preempt.stop_signal
        )
    finally:
        preempt.uninstall()
    return {"skipped": False, **figures}


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("base", __doc__)
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="where pretraining keeps its resume state (none: no resume)"
    )
    args = parser.parse_args(argv)
    return run_entry("base", args, lambda params: run(params, args.out, args.state_dir))


if __name__ == "__main__":
    raise SystemExit(main())
