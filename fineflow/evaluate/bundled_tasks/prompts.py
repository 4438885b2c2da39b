"""Prompt rendering for fineflow's lm-eval tasks: the prompt training rendered for the row.

The evaluate stage hands the tasks a copy of the eval rows with ``prompt`` filled in by the tokenize stage's own
rendering (fineflow.evaluate.harness.render_eval_rows): the fineflow template, or the tokenizer's chat template
for chat rows. Rows without it (the tasks used on their own) get the fineflow template.
"""

from fineflow.tokenize.template import render_prompt


def doc_to_text(doc: dict) -> str:
    if doc.get("prompt") is not None:
        return doc["prompt"]
    return render_prompt(doc["instruction"], doc.get("input") or "")
