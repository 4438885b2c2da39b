"""Stage train. Entry: ``fineflow.stages.train``; checkpoint files are ``fineflow.checkpoint``.

recipe.py      the story, read in order: launcher (size, then ``accelerate launch``), then each rank
sizing.py      hardware checks and the memory planner's verdict for params (refuse or auto_fit)
planner.py     the memory planner's arithmetic (also ``fineflow plan``)
launch.py      accelerate profiles and launch commands
model.py       the model to train (LoRA / QLoRA / full) and saving it
schedule.py    the learning-rate schedule
loop.py        ``fit()``: the loop, step timing and logs, the checkpoint trigger, restoring a checkpoint
loader.py      batches prepared ahead on a thread from the shard sampler
attention.py   per-example (varlen) attention over packed rows
fused_lora.py  fused LoRA linears
resume.py      the run fingerprint and whether to resume
"""
