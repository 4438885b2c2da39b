"""Stage promote: the statistical gate, the model registry on disk, the champion directory and its model
card, and lineage manifests. Entry: ``fineflow.stages.promote``; the ``fineflow registry`` CLI reads it."""
