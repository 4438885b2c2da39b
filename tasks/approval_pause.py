"""A person's approval at promotion (``promote.require_approval``), asked in the Prefect UI.

The promote stage returns the gate's evidence instead of promoting (fineflow.registry.approval); the flow then
publishes it (``fineflow-promotion-approval``), pauses the run (Paused in the UI, with a Resume form: approve,
approver, comment) and waits up to ``promote.approval_timeout_h``. The run keeps the workspace while it waits,
so nothing else trains or promotes meanwhile. The answer goes to the stage's second run as FINEFLOW_APPROVAL.
A paused run can only be resumed through a Prefect server's API or UI: with Prefect's temporary server (a
plain ``make run`` with no PREFECT_API_URL) no one could answer, so the flow says so at once.
"""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, pause_flow_run
from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import FlowPauseTimeout
from prefect.input import RunInput
from pydantic import Field

from fineflow.core.config import load_params
from fineflow.core.reports import gate_evidence_table
from fineflow.errors import FineflowError
from fineflow.registry.approval import APPROVAL_ENV


class PromotionApproval(RunInput):
    approve: bool = Field(False, description="promote this candidate (leave unticked to reject it)")
    approver: str = Field(min_length=1, description="who decides: goes into the registry log")
    comment: str = Field("", description="why: goes into the registry log")


def api_is_a_server() -> bool:
    """Whether the run talks to a Prefect server someone can open (PREFECT_API_URL), not the temporary one."""
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


def approval_markdown(evidence: dict) -> str:
    cid = evidence.get("candidate_id")
    return "\n".join(
        [
            f"### Promotion waits for your approval: candidate `{cid}`",
            "",
            f"The gate would promote it: {evidence.get('reason', '')}",
            "",
            *gate_evidence_table(evidence),
            "",
            "Resume the run to answer: tick **approve** (or leave it to reject), name the **approver**, add a "
            "**comment**. Both go into the registry log.",
        ]
    )


def ask_for_approval(evidence: dict, project_dir: str) -> dict:
    """Pause the flow run with the gate's evidence until a person answers; the answer, as FINEFLOW_APPROVAL
    carries it to the promote stage (for this candidate only)."""
    cid = evidence.get("candidate_id")
    hours = load_params(Path(project_dir) / "params.yaml").promote.approval_timeout_h
    if not api_is_a_server():
        raise FineflowError(
            f"promote.require_approval: candidate {cid} passed the gate and waits for a person, but this run uses "
            f"Prefect's temporary server, where no one can answer. Run the flow against a Prefect server "
            f"(prefect server start; PREFECT_API_URL=http://127.0.0.1:4200/api) and answer in its UI, or give "
            f'the answer up front: {APPROVAL_ENV}=\'{{"approved": true, "approver": "<you>", "comment": '
            f'"..."}}\' make run'
        )
    markdown = approval_markdown(evidence)
    create_markdown_artifact(key="fineflow-promotion-approval", markdown=markdown, description="approve or reject")
    get_run_logger().info(
        f"candidate {cid} passed the gate; promotion waits for a person: resume this run in the Prefect UI and "
        f"answer (approve / reject, approver, comment) within {hours:g} h"
    )
    try:
        answer = pause_flow_run(
            wait_for_input=PromotionApproval.with_initial_data(description=markdown),
            timeout=int(hours * 3600),
            poll_interval=5,
        )
    except FlowPauseTimeout:
        raise FineflowError(
            f"no answer on candidate {cid} within promote.approval_timeout_h ({hours:g} h): nothing was promoted "
            f"or logged; the next run asks again"
        ) from None
    return {"approved": answer.approve, "approver": answer.approver, "comment": answer.comment, "candidate_id": cid}


def answered_task_name(stage: str, approval: dict) -> str:
    verdict = "approved" if approval["approved"] else "rejected"
    approver = approval["approver"].replace("{", "(").replace("}", ")")  # Prefect formats task run names
    return f"{stage} ({verdict} by {approver})"
