"""Stage train. Entry: ``fineflow.stages.train``; checkpoint files are ``fineflow.checkpoint``.

procedure.py     the story, read in order: the launcher, then each rank's TrainProcedure (setup, train, cleanup)
profile.py       the accelerate profile, read once into a frozen Profile (engine, sharding, precision, ranks)
run_plan.py      hardware checks and the planner's RunPlan: the one train configuration every step reads
planner/         the memory planner (also ``fineflow plan``): shapes.py, memory.py, advice.py
launch.py        the ``accelerate launch`` command line, and DeepSpeed's batch keys from params
engines/         cluster launchers (train.launcher: ray, slurm): the stage as a driver that hands the ranks over
precision.py     which precision a run trains in, and the dtypes that follow
model.py         the model to train (LoRA / QLoRA / full) and saving it
architecture.py  what the loaded model is: its decoder-layer class, its linears, fused qkv / gate_up; LoRA targets
schedule.py      the learning-rate schedule
loop.py          ``fit()``: the loop, one optimizer step at a time (the loss: fineflow.objectives); evaluate_loss
rollouts.py      an online objective's rollouts: prompts from the shards, sampled groups, rewards, the batch
pair_shards.py   the pair objectives' shards: pair slots, the reference's log-probs beside them (and their writer)
reference_model.py what a preference run starts from (DPO's reference): the champion's identity, reference.json
steps.py         what the loop reports through: StepTimer (a span per phase), StepLog, Progress
checkpointing.py the loop's state saved (TrainStateSaver) and restored (restore), by the profile's engine
resume.py        the run fingerprint, whether to resume, and the checkpoint every rank loads
elastic.py       train.elastic: the global batch as the run's identity, grad_accum for the ranks there are
tracker.py       the experiment tracker (TensorBoard / MLflow), one tracker run per training run
report.py        the train report: figures, device facts, FLOPs and MFU
loader.py        batches prepared ahead on a thread from the shard sampler
attention.py     per-example (varlen) attention over packed rows
fused_lora.py    fused LoRA linears
fsdp.py          what FSDP needs beyond accelerate's defaults for LoRA (wrapping, buffers, sharded states)
zero.py          what DeepSpeed ZeRO-2/3 needs (its state in checkpoints, an adapter-only final save)
gradsync.py      DDP's gradient all-reduce, timed apart from backward
flops.py         model FLOPs per token, the device's peak FLOP/s, MFU/HFU
plots.py         the step log as DVC plot data and PNG charts
"""
