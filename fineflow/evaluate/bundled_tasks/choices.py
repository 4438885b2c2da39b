"""The options of fineflow_synth_mc: each row's output plus 3 distractors, other eval rows' outputs.

Distractors come from rows of the same task family where there are enough — the row's ``task`` (or
``family``, ``category``) field when the data has one, else its instruction, which names the family in
the bundled data ("Which number is larger?") — so the options look alike and only reading the input
tells them apart; the rest are drawn from any other distinct outputs. Each draw is seeded by the row's
index in the file: the same rows give the same options on every run and for every model.
"""

from __future__ import annotations

import random

N_DISTRACTORS = 3
FAMILY_FIELDS = ("task", "family", "category")


def family(row: dict) -> str:
    for field in FAMILY_FIELDS:
        if row.get(field):
            return str(row[field])
    return str(row.get("instruction") or "")


def _draw(rng: random.Random, pool: list[str], n: int, exclude: set[str]) -> list[str]:
    """n distinct items of pool not in exclude (fewer if pool runs out); pool is sorted and unique."""
    picked = rng.sample(pool, min(len(pool), n + len(exclude)))  # enough that n survive the exclusion
    return [x for x in picked if x not in exclude][:n]


def add_choices(rows: list[dict]) -> list[dict]:
    """Each row with ``choices`` (its output once, shuffled among the distractors) and ``gold`` (its index).

    Pools are built once (sorted, so set order never matters): O(rows) in total, not O(rows²).
    """
    by_family: dict[str, set[str]] = {}
    for row in rows:
        by_family.setdefault(family(row), set()).add(row["output"])
    pools = {key: sorted(values) for key, values in by_family.items()}
    everything = sorted({row["output"] for row in rows})
    out = []
    for index, row in enumerate(rows):
        rng = random.Random(index)
        answer = row["output"]
        distractors = _draw(rng, pools[family(row)], N_DISTRACTORS, {answer})
        if len(distractors) < N_DISTRACTORS:
            distractors += _draw(rng, everything, N_DISTRACTORS - len(distractors), {answer, *distractors})
        choices = [answer, *distractors]
        rng.shuffle(choices)
        out.append({**row, "choices": choices, "gold": choices.index(answer)})
    return out


def process_docs(dataset):
    """lm-eval's process_docs hook: a datasets.Dataset in, the same rows with choices and gold out. Each choice
    is scored as the response training saw: the row's response prefix, then the option (the task's
    target_delimiter is empty)."""
    import datasets

    from fineflow.tokenize.template import RESPONSE_PREFIX

    docs = add_choices(dataset.to_list())
    for doc in docs:
        prefix = RESPONSE_PREFIX if doc.get("response_prefix") is None else doc["response_prefix"]
        doc["choices"] = [prefix + choice for choice in doc["choices"]]
    return datasets.Dataset.from_list(docs)
