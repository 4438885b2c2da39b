"""The CI retraining job as one command (``fineflow ci``), so GitHub Actions, GitLab and Jenkins call the same.

In order:
1. params.yaml is checked, every error at once, and every input path it names (fineflow.core.preflight), before
   anything is pulled or run.
2. ``dvc pull`` from the default remote: what earlier runs pushed is reused, only what changed is rebuilt.
3. ``dvc repro``: the pipeline, the gate included (the promote stage).
4. ``dvc push``: the new artefacts go to the remote, refused candidates too (the next run finds them).
5. With ``commit``: ``dvc.lock``, the curated metrics (``reports/metrics``) and the plot data
   (``reports/plots/*.json``) are committed, marked ``[skip ci]``, and pushed to the branch the job runs on
   (rebased onto it when it moved meanwhile). The lock names the artefacts just pushed, so every
   clone of that commit pulls them and reproduces nothing; without it they would be unreachable from git.
6. A markdown summary: the outcome, what ran and what DVC skipped, the gate's evidence, ``dvc metrics diff``
   against the base (the PR's base branch, else the commit the job started from) and where the lock went.
   It goes to ``$GITHUB_STEP_SUMMARY`` when that is set, to a file otherwise; ``$GITHUB_OUTPUT`` gets the
   outcome for later steps.

Exit codes (``Outcome.exit_code``): 0 promoted, already up to date, or refused; ``REFUSED_EXIT`` (4) refused
under ``fail_on_refusal``; ``APPROVAL_NEEDED_EXIT`` (3) the candidate waits for a person
(promote.require_approval: answer in FINEFLOW_APPROVAL and run again, only promote re-runs); 2 bad params or
input (a missing input path included), or another run holds the workspace; 1 a crash (a stage's traceback, the
remote unreachable, a preempted stage): running again resumes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fineflow import remote
from fineflow.core import dvc_project, journal
from fineflow.core.preflight import preflight
from fineflow.core.reports import gate_evidence_table, read_approval_request, read_error_record, read_json
from fineflow.dvc_rwlock import repair_rwlock
from fineflow.errors import (
    APPROVAL_NEEDED_EXIT,
    PREEMPTED_EXIT,
    REFUSED_EXIT,
    USER_ERROR_EXIT,
    FineflowError,
)

# What a CI commit holds: the lock, and the figures `dvc metrics diff` compares the next run against.
COMMITTED = ("dvc.lock", "reports/metrics", "reports/plots")  # plots: their JSON (git ignores the PNGs)
# the goodput ledger's metrics and history change on every run: committed only beside a changed lock or metric
# (the summary's goodput and cost; a real change of its other figures changes their stage's file too)
LEDGER_FILES = ("reports/metrics/goodput.json", "reports/metrics/summary.json", "reports/plots/goodput_history.json")
PUSH_ATTEMPTS = 3  # a push refused because the branch moved is rebased and tried again
COMMIT_MARK = "[skip ci]"  # GitHub, GitLab and most CI systems start no run for a commit that says this

# DVC's own lines in `dvc repro`'s output (dvc/stage/run.py, dvc/stage/__init__.py, dvc/stage/cache.py,
# dvc/repo/reproduce.py, dvc/stage/exceptions.py).
_RAN = re.compile(r"^Running stage '([^']+)':")
_UNCHANGED = re.compile(r"^Stage '([^']+)' didn't change, skipping")
_RESTORED = re.compile(r"^Stage '([^']+)' is cached - skipping run, checking out outputs")
_FAILED = re.compile(r"failed to reproduce '([^']+)'")
_EXITED = re.compile(r"exited with (-?\d+)")


@dataclass
class Repro:
    """What `dvc repro` did, read from its output."""

    returncode: int = 0
    stages: list[tuple[str, str]] = field(default_factory=list)  # (stage, "ran"|"skipped"|"restored"), DVC's order
    failed: str | None = None  # the stage that failed
    stage_exit: int | None = None  # its command's exit code
    stage_message: str = ""  # its one-line error ("fineflow <stage>: error: ...")

    @property
    def ran(self) -> list[str]:
        return [stage for stage, what in self.stages if what == "ran"]

    def see(self, line: str) -> None:
        if match := _RAN.match(line):
            self.stages.append((match[1], "ran"))
        elif match := _UNCHANGED.match(line):
            self.stages.append((match[1], "skipped"))
        elif match := _RESTORED.match(line):  # from DVC's run cache (a failed job's finished stages)
            self.stages.append((match[1], "restored"))
        if match := _FAILED.search(line):
            self.failed = match[1]
            if exited := _EXITED.search(line):
                self.stage_exit = int(exited[1])
        if line.startswith("fineflow ") and ": error: " in line:
            self.stage_message = line.split(": error: ", 1)[1]


@dataclass
class Outcome:
    kind: str  # promoted | refused | up_to_date | approval_needed | bad_params | bad_input | crash
    exit_code: int
    message: str
    decision_report: dict | None = None  # reports/promote.json when promote ran


def check_params(project: Path) -> str | None:
    """Every problem in params.yaml at once, else every input path it names that is missing (None: all well)."""
    try:
        preflight(project)
    except FineflowError as exc:
        return str(exc)
    return None


def run_repro(project: Path, log: Callable[[str], None], pull: bool = False) -> Repro:
    """`dvc repro` of the whole pipeline, every line to log as it comes (the CI log is the stage's log). With
    pull, DVC fetches what a stage lacks from the remote first, its run cache included: a stage an earlier,
    failed job finished (its push carried the run cache, no commit names its outputs) is restored, not redone."""
    repro = Repro()
    with dvc_project.popen_dvc(project, "repro", *(["--pull"] if pull else [])) as proc:
        for line in proc.stdout:
            line = line.rstrip()
            if not dvc_project.is_hint(line):  # DVC's git/remote advice: this job commits and pushes itself
                log(line)
            repro.see(line)
    repro.returncode = proc.returncode
    return repro


def failure_outcome(project: Path, repro: Repro) -> Outcome:
    """What a failed `dvc repro` means for CI, from the failed stage's exit code and its record."""
    stage = repro.failed or "?"
    report = project / "reports" / f"{stage}.json"
    request = read_approval_request(report) if repro.stage_exit == APPROVAL_NEEDED_EXIT else None
    if request is not None:
        evidence = request.get("evidence") or {}
        cid = evidence.get("candidate_id", "?")
        answer = {"approved": True, "approver": "<you>", "comment": "...", "candidate_id": cid}
        return Outcome(
            "approval_needed",
            APPROVAL_NEEDED_EXIT,
            f"the gate passed candidate {cid} and promote.require_approval asks a person: run again with "
            f"FINEFLOW_APPROVAL='{json.dumps(answer)}' (the workflow's `approval` input; \"approved\": false "
            "rejects it); only promote re-runs, and an answer for another candidate is not taken",
            evidence,
        )
    record = read_error_record(report)
    if repro.stage_exit == USER_ERROR_EXIT:
        message = (record or {}).get("message") or repro.stage_message or "see the log"
        return Outcome("bad_input", USER_ERROR_EXIT, f"stage {stage}: {message}")
    if repro.stage_exit == PREEMPTED_EXIT:
        return Outcome("crash", 1, f"stage {stage} was stopped (preempted) after saving its step: run again")
    if repro.failed is None:
        return Outcome("crash", 1, f"dvc repro failed (exit {repro.returncode}) before any stage ran: see the log")
    if repro.stage_exit is None:
        return Outcome("crash", 1, f"dvc repro failed at stage {stage} (exit {repro.returncode}): see the log")
    return Outcome("crash", 1, f"stage {stage} crashed (exit {repro.stage_exit}): its traceback is in the log")


def success_outcome(project: Path, repro: Repro, fail_on_refusal: bool) -> Outcome:
    """Promoted, refused, or nothing for the gate to judge (promote did not run: nothing it reads changed)."""
    if "promote" not in repro.ran:
        ran = ", ".join(repro.ran) or "nothing"
        return Outcome("up_to_date", 0, f"the champion is up to date: promote had nothing new to judge (ran: {ran})")
    report = read_json(project / "reports" / "promote.json")
    reason = str(report.get("reason", ""))
    if report.get("decision") == "promoted":
        return Outcome("promoted", 0, f"promoted candidate {report.get('candidate_id')}: {reason}", report)
    code = REFUSED_EXIT if fail_on_refusal else 0
    return Outcome("refused", code, f"refused candidate {report.get('candidate_id')}: {reason}", report)


def git(project: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run(["git", *args], cwd=project, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout.strip()


def current_branch(project: Path) -> str | None:
    """The branch the job runs on: GitHub's GITHUB_REF_NAME (a push's, a dispatch's or a schedule's branch),
    GitLab's CI_COMMIT_BRANCH, Jenkins' BRANCH_NAME, else git's; None on a detached HEAD."""
    if os.environ.get("GITHUB_REF_TYPE", "branch") == "branch" and os.environ.get("GITHUB_REF_NAME"):
        return os.environ["GITHUB_REF_NAME"]
    for variable in ("CI_COMMIT_BRANCH", "BRANCH_NAME"):
        if os.environ.get(variable):
            return os.environ[variable]
    name = git(project, "rev-parse", "--abbrev-ref", "HEAD", check=False)
    return name if name and name != "HEAD" else None


def is_pull_request() -> bool:
    """A PR's job runs on a merge commit of the PR into its base: its lock belongs to no branch yet."""
    return os.environ.get("GITHUB_EVENT_NAME", "").startswith("pull_request") or bool(
        os.environ.get("CI_MERGE_REQUEST_IID")
    )


def commit_lock(project: Path, outcome: Outcome) -> str:
    """Commit COMMITTED when it changed and push the commit to the job's branch (rebased onto it, up to
    PUSH_ATTEMPTS times, when it moved during the run); what was done, in words, for the summary."""
    paths = [path for path in COMMITTED if (project / path).exists()]
    git(project, "add", "--", *paths)
    staged = git(project, "diff", "--cached", "--name-only", "--relative").split()
    if not [path for path in staged if path not in LEDGER_FILES]:  # every run has a ledger: not worth a commit
        if staged:
            git(project, "reset", "-q", "--", *staged)
        return "unchanged: nothing to commit"
    if is_pull_request():
        return "changed, not committed: a pull request's run; the run on the branch after the merge commits it"
    branch = current_branch(project)
    if branch is None:
        return "changed, not committed: the job runs on no branch (a detached HEAD; set CI_COMMIT_BRANCH)"
    identity = []
    if not git(project, "config", "user.name", check=False):
        identity = ["-c", "user.name=fineflow-ci", "-c", "user.email=fineflow-ci@users.noreply.github.com"]
    message = f"fineflow ci: dvc.lock and metrics after a retraining run ({outcome.kind}) {COMMIT_MARK}"
    git(project, *identity, "commit", "-q", "-m", message, "--", *paths)
    for attempt in range(1, PUSH_ATTEMPTS + 1):
        pushed = subprocess.run(["git", "push", "-q", "origin", f"HEAD:refs/heads/{branch}"], cwd=project)
        if pushed.returncode == 0:
            sha = git(project, "rev-parse", "--short", "HEAD")
            moved = f" (rebased onto `{branch}`, which moved during the run)" if attempt > 1 else ""
            return f"committed as `{sha}` and pushed to `{branch}`{moved}"
        # the branch moved while the job ran (a person's push): replay the lock commit on its tip
        git(project, "fetch", "-q", "origin", branch)
        rebase = ["git", *identity, "rebase", "-q", f"origin/{branch}"]  # rewrites the commit: needs a name too
        rebased = subprocess.run(rebase, cwd=project, capture_output=True)
        if rebased.returncode != 0:
            subprocess.run(["git", "rebase", "--abort"], cwd=project, capture_output=True)
            raise RuntimeError(
                f"`{branch}` moved during the run and its dvc.lock conflicts with this one (another run committed "
                "one): the artefacts are pushed; run the job again on the new tip, it reuses them"
            )
    raise RuntimeError(f"the push to `{branch}` was refused {PUSH_ATTEMPTS} times (branch protection?)")


def base_revision(project: Path, start_rev: str | None, base_ref: str | None) -> str | None:
    """What the metrics are compared against: base_ref if given, the PR's base branch (GITHUB_BASE_REF /
    CI_MERGE_REQUEST_TARGET_BRANCH_NAME, as origin/<branch>), else the commit the job started from."""
    if base_ref:
        return base_ref
    for variable in ("GITHUB_BASE_REF", "CI_MERGE_REQUEST_TARGET_BRANCH_NAME"):
        if os.environ.get(variable):
            return f"origin/{os.environ[variable]}"
    return start_rev


def metrics_diff(project: Path, rev: str | None) -> str:
    if rev is None:
        return "_no git revision to compare against_"
    try:
        table = remote.run_dvc(project, "metrics", "diff", "--md", rev)
    except RuntimeError as exc:
        return f"_`dvc metrics diff {rev}` failed: {str(exc).splitlines()[-1]}_"
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]  # below the header and its rule
    return table if rows else f"_no metric changed since `{rev}`_"


def stage_rows(project: Path, repro: Repro) -> list[str]:
    rows = ["| stage | this run |", "|---|---|"]
    for stage, what in repro.stages:
        if stage == repro.failed:
            rows.append(f"| {stage} | **failed**" + (f" (exit {repro.stage_exit}) |" if repro.stage_exit else " |"))
        elif what == "ran":
            report = project / "reports" / f"{stage}.json"
            wall = read_json(report).get("wall_s") if report.exists() else None
            rows.append(f"| {stage} | ran" + (f", {wall:.1f} s |" if wall is not None else " |"))
        elif what == "restored":
            rows.append(f"| {stage} | restored from DVC's run cache |")
        else:
            rows.append(f"| {stage} | skipped: unchanged |")
    return rows


def summary_markdown(project: Path, outcome: Outcome, repro: Repro | None, notes: dict[str, str], diff: str) -> str:
    """The job summary: outcome, stages, the gate's evidence, the metrics diff, and where things went."""
    lines = [f"## fineflow retraining: **{outcome.kind.replace('_', ' ')}** (exit {outcome.exit_code})", ""]
    first, _, rest = outcome.message.partition("\n")
    lines += [first, ""] + (["```", rest.strip("\n"), "```", ""] if rest.strip() else [])
    if repro is not None and repro.stages:
        lines += ["### Stages", "", *stage_rows(project, repro), ""]
    if outcome.decision_report is not None:
        lines += ["### Gate", "", *gate_evidence_table(outcome.decision_report), ""]
    if diff:
        lines += ["### Metrics", "", diff, ""]
    lines += ["### Artefacts", "", *(f"- {what}: {note}" for what, note in notes.items()), ""]
    return "\n".join(lines)


def write_summary(project: Path, markdown: str, summary_path: Path | None) -> list[Path]:
    """The summary to its file (summary_path, else reports/ci-summary.md: what a later step posts as a PR
    comment), and appended to $GITHUB_STEP_SUMMARY when set (each step of a job has its own)."""
    path = summary_path or project / "reports" / "ci-summary.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown + "\n", encoding="utf-8")
    written = [path]
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as out:
            out.write(markdown + "\n")
        written.append(Path(os.environ["GITHUB_STEP_SUMMARY"]))
    return written


def write_outputs(outcome: Outcome, repro: Repro | None, lock_note: str) -> None:
    """$GITHUB_OUTPUT (when set): what later steps of the job can test (steps.<id>.outputs.outcome, ...)."""
    target = os.environ.get("GITHUB_OUTPUT")
    if not target:
        return
    decision = (outcome.decision_report or {}).get("decision", "")
    values = {
        "outcome": outcome.kind,
        "exit_code": str(outcome.exit_code),
        "decision": decision,
        "ran": ",".join(repro.ran if repro else []),
        "lock_committed": str(lock_note.startswith("committed")).lower(),
    }
    with open(target, "a", encoding="utf-8") as out:
        out.writelines(f"{key}={value}\n" for key, value in values.items())


@dataclass
class Options:
    project: Path = Path(".")
    fail_on_refusal: bool = False
    commit: bool = False
    base_ref: str | None = None
    summary: Path | None = None


# What a job that committed a lock may leave behind: the outcomes after which the lock names finished work.
COMMITTABLE = ("promoted", "refused", "up_to_date", "approval_needed")


def run_ci(options: Options, log: Callable[[str], None] = print) -> Outcome:
    """The whole job (module docstring); its outcome, after the summary and outputs are written."""
    project = options.project.resolve()
    start_rev = git(project, "rev-parse", "--short", "HEAD", check=False) or None
    notes: dict[str, str] = {}
    repro = None
    # the job is one run in the goodput ledger, from its start (the pull's time is orchestration)
    run_env = journal.run_environment(None, time.time())
    os.environ.update(run_env)
    try:
        outcome, repro = _checked_job(project, options, notes, log)
    except Exception as exc:  # noqa: BLE001 - whatever broke, the job still says so in its summary
        outcome = Outcome("crash", 1, f"fineflow ci crashed: {type(exc).__name__}: {exc}")
    finally:
        for name in run_env:
            os.environ.pop(name, None)
    if "dvc.lock" not in notes:
        changed = git(project, "status", "--porcelain", "--", "dvc.lock", check=False)
        if not changed:
            notes["dvc.lock"] = "unchanged"
        elif options.commit:
            notes["dvc.lock"] = f"changed, not committed: the job ended {outcome.kind.replace('_', ' ')}"
        else:
            notes["dvc.lock"] = "changed, not committed (run with --commit to commit it)"
    rev = base_revision(project, start_rev, options.base_ref)
    diff = f"Against `{rev}`:\n\n{metrics_diff(project, rev)}" if outcome.kind != "bad_params" else ""
    markdown = summary_markdown(project, outcome, repro, notes, diff)
    where = write_summary(project, markdown, options.summary)
    write_outputs(outcome, repro, notes["dvc.lock"])
    log(markdown)
    log(f"fineflow ci: {outcome.kind}, exit {outcome.exit_code} (summary: {', '.join(map(str, where))})")
    return outcome


def _checked_job(project: Path, options: Options, notes: dict[str, str], log) -> tuple[Outcome, Repro | None]:
    problem = check_params(project)
    if problem is not None:
        return Outcome("bad_params", USER_ERROR_EXIT, f"nothing was pulled or run: {problem}"), None
    repaired = repair_rwlock(project)  # a runner that keeps its workspace after a killed job (clean: false)
    if repaired:
        log(f"fineflow ci: {repaired}")
    if options.commit and remote.default_remote(project) is None:
        message = (
            "nothing was pulled or run: --commit records a dvc.lock whose artefacts would exist only on this "
            "runner (every clone of that commit would rebuild them); configure a default DVC remote "
            "(`dvc remote add -d ...`, committed in .dvc/config), or run without --commit"
        )
        return Outcome("bad_params", USER_ERROR_EXIT, message), None
    outcome, repro = _pull_repro_push(project, options, notes, log)
    if options.commit and outcome.kind in COMMITTABLE:
        try:
            notes["dvc.lock"] = commit_lock(project, outcome)
        except RuntimeError as exc:
            notes["dvc.lock"] = f"**not committed**: {exc}"
            outcome = Outcome("crash", 1, f"{outcome.message}; but the lock could not be committed: {exc}")
    return outcome, repro


def missing_after_pull(project: Path) -> list[str]:
    """The persistent outputs (dvc.yaml's `persist: true`: the champion, the registry's append-only log) that
    the lock names but the pull did not bring: rebuilt from nothing, their history is not in this run."""
    lock_path = project / "dvc.lock"
    if not lock_path.exists():
        return []
    locked = (yaml.safe_load(lock_path.read_text(encoding="utf-8")) or {}).get("stages", {})
    return [
        path
        for name, paths in dvc_project.persistent_outputs(project).items()
        for path in paths
        if path in {out["path"] for out in (locked.get(name) or {}).get("outs", [])} and not (project / path).exists()
    ]


def _pull_repro_push(project: Path, options: Options, notes: dict[str, str], log) -> tuple[Outcome, Repro | None]:
    try:
        name = remote.pull(project, log)
    except RuntimeError as exc:  # unreachable, bad credentials: rebuilding everything instead would be wrong
        notes["remote"] = f"**pull failed**: {str(exc).splitlines()[0]}"
        return Outcome("crash", 1, f"the DVC remote failed, nothing was run: {exc}"), None
    notes["remote"] = f"pulled from `{name}`" if name else "no default DVC remote: nothing pulled or pushed"
    if name and (missing := missing_after_pull(project)):
        notes["not in the remote"] = (
            f"**{', '.join(missing)}**: dvc.lock names them but `{name}` lacks them (never pushed?); this run "
            "builds them anew, without the history the lock's version had"
        )
    repro = run_repro(project, log, pull=name is not None)
    if repro.returncode != 0:
        outcome = failure_outcome(project, repro)
    else:
        outcome = success_outcome(project, repro, options.fail_on_refusal)
    if name and repro.ran:
        # a failed run pushes too: with the run cache, the next job restores the stages that finished (train
        # after an evaluate that failed) instead of redoing them, although no commit names them
        try:
            remote.push(project, log)
            notes["remote"] += f", pushed to `{name}`"
        except RuntimeError as exc:
            notes["remote"] += f", **push failed**: {str(exc).splitlines()[0]}"
            outcome = Outcome("crash", 1, f"{outcome.message}; but the push to `{name}` failed")
    return outcome, repro
