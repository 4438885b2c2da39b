"""Prefect tasks, which the flow (flows/pipeline.py) sequences.

stages.py     ``run_stage``: one DVC stage through ``dvc repro --single-item``, its output streamed to the log,
              retried unless it was a user error, stopped cleanly with the flow
artifacts.py  what a stage's run shows on the run page: its report as a table (and a table per section of records,
              validate's checks), promote's decision, the goodput ledger and doctor, the training charts and progress,
              a failure
render.py     how they read: values rounded to what they mean (no JSON in a cell), a failure's fix on a line of its own
approval_pause.py a person's answer at promotion (promote.require_approval), asked in the Prefect UI
runs.py       the run's own bookkeeping: its turn in the workspace, its name (commit, edits, start), dvc pull and push
"""
