"""Stage evaluate: lm-eval on the held-out split for the base model, the candidate and the champion (and, for
preference data, each model's ranking of every held-out pair).

scoring.py      the stage's procedure: load the base once, score each model, write scores.json and the report
harness.py      the lm-eval adapter: task folders and names, the model scorer, samples and raw results
sizing.py       before loading: the compute dtype, the memory plan, one device or a device map, or a refusal
pair_ranking.py preference eval pairs (train.objective dpo/simpo): each model's log-probs of chosen and rejected,
                preference accuracy and reward margin (rewards anchored to the base) as task fineflow_preference
reward_ranking.py a model that scores text (the reward model): its rewards of each held-out pair's answers,
                pairwise accuracy as its objective's task (fineflow_reward), the base as chance
bundled_tasks/  the tasks shipped with fineflow (fineflow_synth, fineflow_synth_mc: YAMLs and their helpers)

A project's own tasks go in folders under its ``eval_tasks/``, each listed in ``evaluate.task_dirs`` (names in
``evaluate.tasks``). dvc.yaml declares ``eval_tasks/`` as the stage's dependency, so an edited task re-runs
evaluation, and the stage refuses a ``task_dirs`` folder outside it (``--task-root``): DVC would not see its
edits. Entry: ``fineflow.stages.evaluate``.
"""
