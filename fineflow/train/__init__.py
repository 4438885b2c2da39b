"""Stage train: the training recipe a rank runs (``recipe``), the ``fit()`` loop and LR schedule (``loop``),
model building (``model``), the batch loader (``loader``), per-example attention (``attention``), fused
LoRA linears (``fused_lora``), the memory planner (``planner``) and sizing a run with it (``sizing``),
accelerate launch commands (``launch``) and when to resume (``resume``). Entry: ``fineflow.stages.train``.
Checkpoint files themselves are ``fineflow.checkpoint``."""
