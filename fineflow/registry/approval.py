"""A person's approval of what the gate would promote (``promote.require_approval``).

The gate still decides first: a candidate it refuses is refused, and no one is asked. One it would promote
waits for an answer: the promote stage stops before it logs or installs anything (``ApprovalNeeded``, exit
``APPROVAL_NEEDED_EXIT``, the gate's evidence in its record). The Prefect flow pauses on that record, shows the
evidence, and runs the stage again with the answer in ``FINEFLOW_APPROVAL``; from a shell, a person sets it::

    FINEFLOW_APPROVAL='{"approved": true, "approver": "alice", "comment": "samples checked"}' dvc repro promote

The answer goes into the decision's context, so the registry log, the stage's report and the model card's
lineage carry who decided and why. A rejection turns the gate's promotion into a refusal with the approver's
reason; an answer given for another candidate (``candidate_id``) is not used.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

from fineflow.errors import ApprovalNeeded, FineflowError
from fineflow.registry.gate import Decision

APPROVAL_ENV = "FINEFLOW_APPROVAL"


@dataclasses.dataclass(frozen=True)
class Approval:
    approved: bool
    approver: str
    comment: str = ""
    candidate_id: str | None = None  # the candidate it answers for; None: whichever the gate judges now

    def as_record(self) -> dict:
        return {"approved": self.approved, "approver": self.approver, "comment": self.comment}


def approval_from_env(environ: Mapping[str, str] = os.environ) -> Approval | None:
    """The answer in FINEFLOW_APPROVAL, or None when it is unset; a malformed one is a user error naming it."""
    text = environ.get(APPROVAL_ENV, "").strip()
    if not text:
        return None
    example = '{"approved": true, "approver": "alice", "comment": "samples checked"}'
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise FineflowError(f"{APPROVAL_ENV}: not JSON ({exc}); expected e.g. {example}") from None
    problems = []
    if not isinstance(raw, dict):
        raise FineflowError(f"{APPROVAL_ENV}: expected a JSON object such as {example}, got {text!r}")
    if not isinstance(raw.get("approved"), bool):
        problems.append("approved: must be true or false")
    if not isinstance(raw.get("approver"), str) or not raw["approver"].strip():
        problems.append("approver: must name who decides (it goes into the registry log)")
    if not isinstance(raw.get("comment", ""), str):
        problems.append("comment: must be text")
    if raw.get("candidate_id") is not None and not isinstance(raw["candidate_id"], str):
        problems.append("candidate_id: must be a candidate id")
    unknown = sorted(set(raw) - {"approved", "approver", "comment", "candidate_id"})
    if unknown:
        problems.append(f"unknown keys {unknown}")
    if problems:
        raise FineflowError(f"{APPROVAL_ENV}: " + "; ".join(problems))
    return Approval(raw["approved"], raw["approver"].strip(), raw.get("comment", ""), raw.get("candidate_id"))


def apply_approval(decision: Decision, candidate_id: str, approval: Approval | None, evidence: dict) -> Decision:
    """The gate's decision once a person has answered (the gate's promotion only: a refusal is returned as it
    is). No answer for this candidate: ApprovalNeeded with the evidence, before anything is logged."""
    if not decision.promote:
        return decision
    if approval is None or approval.candidate_id not in (None, candidate_id):
        raise ApprovalNeeded(
            f"candidate {candidate_id} passed the gate ({decision.reason}) and promote.require_approval asks a "
            f"person first; nothing was promoted or logged. In a Prefect flow run the run pauses for the answer "
            f"(resume it in the UI: approve or reject, with a comment). From a shell: "
            f'{APPROVAL_ENV}=\'{{"approved": true, "approver": "<you>", "comment": "..."}}\' '
            f"dvc repro promote",
            evidence,
        )
    context = {**decision.context, "approval": approval.as_record()}
    if approval.approved:
        reason = f"{decision.reason}; approved by {approval.approver}" + (
            f": {approval.comment}" if approval.comment else ""
        )
        return dataclasses.replace(decision, reason=reason, context=context)
    reason = f"rejected by {approval.approver}" + (f": {approval.comment}" if approval.comment else "")
    return dataclasses.replace(
        decision, promote=False, reason=f"{reason} (the gate alone: {decision.reason})", context=context
    )
