"""fineflow: a reproducible, observable LLM fine-tuning pipeline.

The package is pure logic (no argv, no hard-coded paths, no work at import). Each DVC stage has a thin
entry in ``fineflow.stages``; the Prefect tasks in ``tasks/`` and the commands in ``dvc.yaml`` call those.
"""

__version__ = "0.1.0"
