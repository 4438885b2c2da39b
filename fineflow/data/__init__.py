"""Stages data and validate: the bundled synthetic dataset (``synth``), reading user files (``formats``),
the checks (``checks``: each declared once), the great-expectations gate (``validation``), PII (``pii``, its
secrets from ``secrets``) and train/eval leakage (``overlap``). Entries: ``fineflow.stages.data``,
``fineflow.stages.validate``."""
