"""Stage evaluate: the lm-eval adapter (``harness``) and the bundled task folders (``evaltasks/``; add a
task by dropping its YAML there or under a directory named in ``evaluate.task_dirs``).
Entry: ``fineflow.stages.evaluate``."""
