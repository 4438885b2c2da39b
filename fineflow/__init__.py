"""fineflow: a reproducible, observable LLM fine-tuning pipeline.

The package is pure logic (no argv, no hard-coded paths, no work at import). Each DVC stage has a thin
entry in ``fineflow.stages``; the Prefect tasks in ``tasks/`` and the commands in ``dvc.yaml`` call those.
Every package's ``__init__.py`` maps its own files (tests/test_docs.py checks each map names them all).

errors.py      the user errors (each names its file, row or key) and the exit codes every layer shares
param_section.py the base of every params.yaml section model (unknown keys rejected, frozen)
reward_spec.py the shape of train.grpo.rewards (RewardSpec), a params field the objectives may hold
objectives/    train.objective: one module per objective (its rows, loss, reference, metric) behind one interface
rewards/       online RL's rewards: one module per reward behind one interface, the registry, the weighted sum
core/          what every stage imports: params, the entry wrapper, reports, the workspace, the journal
stages/        one thin entry per DVC stage
base/          stage base: the embedded default base model
data/          stages data and validate: the bundled data, input formats, the great-expectations gate, PII
tokenize/      stage tokenize: the template, parallel tokenization, packed shards
train/         stage train: the launcher, the loop, the planner, precision, FSDP/DeepSpeed, checkpoints of the loop
checkpoint/    atomic, verified, exactly resumable checkpoints
evaluate/      stage evaluate: lm-eval for the base, the candidate and the champion; the bundled tasks
registry/      stage promote: the gate, the registry, the champion, lineage, approval
export/        the champion as GGUF files for llama.cpp, each parity-checked against the trained model
goodput/       stage goodput: the ledger, cost, the charts, the doctor
process/       process supervision: stop signals through every layer, resumably, with no orphans
cli/           the ``fineflow`` command: its parser and entry, one module per area of subcommands
base_source.py which base model the stages load (the embedded one, a path or a hub id)
corpus.py      the bundled text of the synthetic data and the embedded base's pretraining
code_deps.py   ``fineflow dvc-deps``: each stage's code deps in dvc.yaml, from what its entry imports
overrides.py   param overrides with dotted keys, applied as ``dvc exp run -S`` applies them
recipes.py     ``fineflow recipe``: model-family recipes planned for their device, written into params.yaml
params_doc.py  ``fineflow params-doc``: the params reference (docs/reference/params.md) from the typed config
remote.py      the project's default DVC remote: pull at a run's start, push at its end
dvc_rwlock.py  DVC's read/write lock after a SIGKILL: a half-written file, entries of dead dvcs (PID reused)
ci.py          ``fineflow ci``: the CI retraining job as one command
"""

__version__ = "0.1.0"
