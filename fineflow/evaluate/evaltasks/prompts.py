"""Prompt rendering for fineflow's lm-eval tasks: the one template training uses (fineflow.tokenize.template)."""

from fineflow.tokenize.template import render_prompt


def doc_to_text(doc: dict) -> str:
    return render_prompt(doc["instruction"], doc.get("input") or "")
