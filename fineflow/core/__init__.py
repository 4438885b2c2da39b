"""What every stage runs, whatever it does (each stage's code deps in ``dvc.yaml`` list these files).

config.py      params.yaml validated into typed models (all errors at once), assembled from the sections:
model_config.py  ``model`` and ``base``    data_config.py      ``data`` and ``validate``
tokenize_config.py ``tokenize``           train_config.py     ``train`` and ``checkpoint``
launch_config.py ``train.ray``, ``train.slurm``  evaluate_config.py ``evaluate``
promote_config.py ``promote``            export_config.py    ``export``
cost_config.py   ``cost``
preflight.py   before the first stage: valid params, and every input path they name there
entry.py       what every stage entry does around its ``run``: params, reports, clean errors, the workspace turn
reports.py     atomic JSON/text writes, the error record and the approval request
runtime.py     the offline/telemetry environment every stage and the flow set
metrics.py     the curated metrics files ``dvc metrics`` compares
workspace.py   one run at a time in a project (the workspace lock)
journal.py     each stage process's start, end, spans and heartbeat for the goodput ledger
threads.py     the threads each process computes with: its share of the CPUs it may really use
dvc_project.py dvc.yaml read in one place (stages, commands, edges, outputs) and ``dvc`` run in one place
"""
