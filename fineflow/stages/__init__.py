"""One entry module per DVC stage: parse args, load params, call the library, write outputs + a report.

Each module's ``main(argv)`` is the ``dvc.yaml`` command (the Prefect tasks run it through ``dvc repro``): it
parses the paths and hands ``fineflow.core.entry.run_entry`` the body to run on the loaded params. The body
calls the library: directly where one library function is the stage (promote:
``fineflow.registry.champion.promote``, evaluate: ``fineflow.evaluate.scoring.evaluate_models``), else through
the module's own ``run(params, ...) -> report``, which wires a few library calls. Tests call those same
functions. Which stages exist, and their order, is ``dvc.yaml``'s to say (``fineflow.core.dvc_project.stage_names``).

base.py         build the embedded default base model, or record the real one params.yaml names
fingerprint.py  the base model every later stage uses, by content (always run)
data.py         generate the bundled synthetic dataset
validate.py     the great-expectations gate over the raw train and eval rows
tokenize.py     validated rows -> packed, memory-mapped shards
reference_logps.py DPO's reference log-probabilities, computed once per data, base and champion
train.py        fine-tuning under accelerate (the launcher, then each rank)
evaluate.py     lm-eval for the base, the candidate and the champion
promote.py      the gate between a candidate and the champion
export.py       the champion as parity-checked GGUF files, an Ollama Modelfile and vLLM's adapter layout
goodput.py      the run's ledger: where its wall time and money went
"""
