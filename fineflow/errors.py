"""Errors a user can act on.

Every error that reaches a user is a ``FineflowError`` whose message names the file (and line/row/field,
or the params key) and says what to change. Stage entries print the message, write it to the stage's error
record (``fineflow.core.reports.write_error_record``) and exit 2 instead of showing a traceback from deep inside a
library. Anything else is a crash (exit 1, a traceback, no record): a retry may succeed, and resumes.
"""

# The exit code of a user error, at every layer: the stage entry, the train launcher (accelerate turns a
# rank's exit 2 into 1; the launcher reads the rank's error record and exits 2 again) and the Prefect task
# (`dvc repro` exits 255 for any failed stage; the task reads the record). Never retried: retrying cannot help.
USER_ERROR_EXIT = 2

# The exit code of a run stopped on request (SIGTERM: preemption, eviction; SIGINT: Ctrl-C) after it saved the
# step it was on (EX_TEMPFAIL: try again later). Retried like a crash; the retry resumes from that step. The
# stage's record (kind "preempted", fineflow.process.preempt) carries it through the layers that rewrite codes.
PREEMPTED_EXIT = 75

# The exit code of a promote stage whose candidate passed the gate and waits for a person's approval
# (promote.require_approval): nothing was logged or installed. The stage's record (kind "approval_needed") holds
# the gate's evidence; the flow pauses on it and runs the stage again with the answer (FINEFLOW_APPROVAL).
APPROVAL_NEEDED_EXIT = 3

# The exit code of `fineflow ci --fail-on-refusal` when the gate refused the candidate (fineflow.ci): the job
# went well (artefacts pushed, lock recorded), the model did not improve. Without the flag a refusal exits 0.
REFUSED_EXIT = 4


class FineflowError(Exception):
    """A problem the user can fix; the message is the whole story."""


class ConfigError(FineflowError):
    """params.yaml is invalid; the message lists every problem at once."""


class DataError(FineflowError):
    """Input data is unreadable or fails a blocking check; the message names file:line and field."""


class WorkspaceBusy(FineflowError):
    """Another run holds the workspace (fineflow.core.workspace) or a path in it (a live dvc in DVC's rwlock,
    fineflow.dvc_rwlock); the message names it."""


class ApprovalNeeded(FineflowError):
    """The candidate passed the gate and promote.require_approval asks a person first; evidence: what the
    stage's report would hold (decision, delta, CI, p-value, candidate id)."""

    def __init__(self, message: str, evidence: dict):
        super().__init__(message)
        self.evidence = evidence


class StoppedAndSaved(Exception):
    """A stage stopped on a signal (SIGTERM, Ctrl-C) after saving `step` of its work: its entry writes the record
    a re-run resumes from and exits PREEMPTED_EXIT. Not a FineflowError: nothing for the user to fix."""

    def __init__(self, message: str, step: int, signum: int | None):
        super().__init__(message)
        self.step, self.signum = step, signum
