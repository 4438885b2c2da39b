"""Prefect tasks, which the flow (flows/pipeline.py) sequences.

stages.py     ``run_stage``: one DVC stage through ``dvc repro --single-item``, its output streamed to the log,
              retried unless it was a user error, stopped cleanly with the flow
artifacts.py  what a stage's run shows on the run page: its report as a table, promote's decision, the goodput
              ledger and doctor, the training charts and progress, a failure
approval.py   a person's answer at promotion (promote.require_approval), asked in the Prefect UI
runs.py       the run's own bookkeeping: its turn in the workspace, its name, dvc pull and push
"""
