"""One entry module per DVC stage: parse args, load params, call the library, write outputs + a report.

Each module has ``run(params, ...) -> report`` (called by tests) and ``main(argv)`` (called by the
``dvc.yaml`` command, which the Prefect tasks run through ``dvc repro``). Which stages exist, and their
order, is ``dvc.yaml``'s to say (``fineflow.dag.stage_names``).
"""
