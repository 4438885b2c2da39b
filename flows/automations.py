"""The server-side automation that marks a fineflow run Crashed when its process dies (Prefect's zombie detection).

    python -m flows.automations          # create it on the server PREFECT_API_URL names (make deploy runs this)

A flow run's process sends a heartbeat event every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds (Prefect's
default: 180) while it runs, paused for an approval included. A process killed with SIGKILL, by the OOM killer or
with its machine sends nothing more, and the server would show the run Running forever. This automation
(https://docs.prefect.io/v3/advanced/detect-zombie-flows) sets such a run Crashed once no heartbeat and no final
state has come for ``MISSED_BEATS`` heartbeat periods. It covers what fineflow's own reconciling cannot: the next
run of a workspace marks its dead predecessors Crashed (tasks/runs.py reconcile_runs), but only when a next run
comes, and only for runs that lived long enough to be tagged.

Idempotent: an automation of the same name is updated, not duplicated. Only flow runs of the ``fineflow`` flow are
watched.
"""

from __future__ import annotations

import sys
from datetime import timedelta

AUTOMATION_NAME = "fineflow: a run whose process stopped sending heartbeats is Crashed"
MISSED_BEATS = 3  # heartbeats a run may miss (a busy machine delays them) before it counts as dead
FLOW_NAME = "fineflow"


def heartbeat_s() -> int:
    """The heartbeat period flow runs use (the setting the flow engine reads)."""
    from prefect.settings import get_current_settings

    return get_current_settings().flows.heartbeat_frequency or 180


def crash_automation(period_s: int):
    """The automation: after a fineflow run's heartbeat, expect another heartbeat or a final state within
    MISSED_BEATS periods; otherwise set the run Crashed, saying why."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    within = MISSED_BEATS * period_s
    final = ("Completed", "Failed", "Cancelled", "Crashed")
    return Automation(
        name=AUTOMATION_NAME,
        description=f"set by `python -m flows.automations` (heartbeat every {period_s} s)",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{state}" for state in final)},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "flow", "prefect.resource.name": FLOW_NAME}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {within} s: its process died without reporting (marked by the server)",
            )
        ],
    )


def ensure_crash_automation(period_s: int | None = None) -> str:
    """Create the automation, or update the one of the same name; what was done."""
    from prefect.client.orchestration import get_client

    wanted = crash_automation(period_s or heartbeat_s())
    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(AUTOMATION_NAME)
    if not existing:
        wanted.create()
        return f"created the automation {AUTOMATION_NAME!r}"
    wanted.id = existing[0].id
    wanted.update()
    return f"updated the automation {AUTOMATION_NAME!r}"


def main() -> int:
    print(ensure_crash_automation(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
