"""The bundled synthetic instruction dataset.

Four task families a tiny model can learn on CPU in minutes — field extraction, date formatting, picking
the larger number, reversing a word list — all copy-and-reorder skills, so held-out rows are new
combinations of the same vocabulary (fineflow.corpus). The base model's pretraining corpus states the same
facts as prose (no instruction template), which gives it the vocabulary and copying ability that LoRA then
adapts to the instruction format.

Everything is a pure function of a seed: the same seed gives byte-identical files.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from fineflow.corpus import FIELDS, NAMES, WORDS, date_parts, record, record_text
from fineflow.objectives.interface import EXAMPLES, FEEDBACK, PAIRS


@dataclass(frozen=True)
class Example:
    instruction: str
    input: str
    output: str
    family: str


def extract_field(rng: random.Random) -> Example:
    rec, field = record(rng), rng.choice(FIELDS)
    return Example(f"Extract the {field} from the record.", record_text(rec, rng), rec[field], "extract")


def format_date(rng: random.Random) -> Example:
    y, m, d = date_parts(rng)
    return Example("Rewrite the date as DD/MM/YYYY.", f"{y:04d}-{m:02d}-{d:02d}", f"{d:02d}/{m:02d}/{y:04d}", "date")


def larger_number(rng: random.Random) -> Example:
    a, b = rng.sample(range(10, 1000), 2)
    return Example("Which number is larger?", f"{a} or {b}", str(max(a, b)), "compare")


def reverse_words(rng: random.Random) -> Example:
    words = rng.sample(WORDS, 3)
    return Example("Reverse the order of the words.", " ".join(words), " ".join(reversed(words)), "reverse")


FAMILIES: list[Callable[[random.Random], Example]] = [extract_field, format_date, larger_number, reverse_words]


def generate_examples(n: int, seed: int) -> list[Example]:
    """n well-formed examples, families interleaved, deterministic in seed."""
    rng = random.Random(seed)
    return [FAMILIES[i % len(FAMILIES)](rng) for i in range(n)]


def as_row(ex: Example) -> dict[str, str]:
    return {"instruction": ex.instruction, "input": ex.input, "output": ex.output}


def split_examples(n_train: int, n_eval: int, seed: int) -> tuple[list[Example], list[Example]]:
    """Disjoint train/eval examples: an eval prompt never appears (instruction+input) in train."""
    pool = generate_examples(4 * (n_train + n_eval), seed)
    seen: set[tuple[str, str]] = set()
    unique: list[Example] = []
    for ex in pool:
        key = (ex.instruction, ex.input)
        if key not in seen:
            seen.add(key)
            unique.append(ex)
        if len(unique) == n_train + n_eval:
            break
    return unique[:n_train], unique[n_train:]


def split_train_eval(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train/eval rows: an eval row never appears (instruction+input) in train."""
    train, evaluation = split_examples(n_train, n_eval, seed)
    return [as_row(ex) for ex in train], [as_row(ex) for ex in evaluation]


# Preference pairs (train.objective dpo or simpo): the same prompts, the right answer as chosen and a plausible
# wrong one of the same family as rejected: the family's answer to a perturbed input, or its typical mistake.


def _wrong_extract(ex: Example, rng: random.Random) -> str:
    """The asked field of another record: a real name (city, age, job), just not this record's."""
    field = ex.instruction.split()[2]  # "Extract the <field> from the record."
    while (other := record(rng)[field]) == ex.output:
        pass
    return other


def _wrong_date(ex: Example, rng: random.Random) -> str:
    """Month and day swapped (MM/DD/YYYY, the classic slip); a day moved when both are the same number."""
    day, month, year = ex.output.split("/")
    if day != month:
        return f"{month}/{day}/{year}"
    return f"{int(day) % 28 + 1:02d}/{month}/{year}"


def _wrong_compare(ex: Example, rng: random.Random) -> str:
    """The smaller number."""
    a, b = (int(n) for n in ex.input.split(" or "))
    return str(min(a, b))


def _wrong_reverse(ex: Example, rng: random.Random) -> str:
    """The words in their original order, or (rarely, when that reads the same) rotated."""
    words = ex.input.split()
    return " ".join(words) if words != ex.output.split() else " ".join(words[1:] + words[:1])


WRONG_ANSWERS: dict[str, Callable[[Example, random.Random], str]] = {
    "extract": _wrong_extract,
    "date": _wrong_date,
    "compare": _wrong_compare,
    "reverse": _wrong_reverse,
}


def as_pair(ex: Example, rng: random.Random) -> dict[str, str]:
    """The example as a preference pair: its answer chosen, a plausible wrong one rejected."""
    return {
        "instruction": ex.instruction,
        "input": ex.input,
        "chosen": ex.output,
        "rejected": WRONG_ANSWERS[ex.family](ex, rng),
    }


def split_train_eval_pairs(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """split_train_eval's prompts (the same seed gives the same prompts) as preference pairs, seeded."""
    train, evaluation = split_examples(n_train, n_eval, seed)
    rng = random.Random(seed + 2)  # apart from the prompts' generator: the prompts stay SFT's
    return [as_pair(ex, rng) for ex in train], [as_pair(ex, rng) for ex in evaluation]


def unpaired(pairs: list[dict]) -> list[dict]:
    """Preference pairs as feedback rows (KTO's): each pair's prompt with its chosen answer labelled true, then with
    its rejected answer labelled false (TRL's unpair_preference_dataset)."""
    rows = []
    for pair in pairs:
        prompt = {key: value for key, value in pair.items() if key not in ("chosen", "rejected")}
        rows += [
            {**prompt, "output": pair["chosen"], "label": True},
            {**prompt, "output": pair["rejected"], "label": False},
        ]
    return rows


def split_train_eval_feedback(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """split_train_eval_pairs' pairs as feedback rows: two rows per prompt, one answer labelled each way."""
    train, evaluation = split_train_eval_pairs(n_train, n_eval, seed)
    return unpaired(train), unpaired(evaluation)


BAD_KINDS = (
    "missing_field",
    "empty_output",
    "over_long",
    "duplicate",
    "email",
    "phone",
    "card",
    "near_duplicate",
    "eval_leak",
)
PAIR_BAD_KINDS = (*BAD_KINDS, "identical_pair")  # preference pairs: missing/empty act on the rejected answer
# feedback rows: an answer without its label, one labelled "yes" (not a boolean), one labelled both ways
FEEDBACK_BAD_KINDS = (*BAD_KINDS, "missing_label", "label_not_boolean", "labelled_both_ways")


def inject_bad_rows(
    rows: list[dict], share: float, seed: int, eval_rows: list[dict] | None = None, schema: str = EXAMPLES
) -> list[dict]:
    """Return rows with ~share deliberately bad rows mixed in, one of each kind before repeating.

    Kinds (BAD_KINDS): a missing field, an empty output, an over-long input, an exact duplicate, PII (an
    e-mail address, a phone number, a Luhn-valid card number), a near-duplicate (same text up to case and
    punctuation; a warning by default) and a row copied from the eval split (leakage). Preference pairs
    (``schema`` PAIRS, PAIR_BAD_KINDS): the missing field and the empty answer are the rejected one, and a pair whose
    answers are the same is added. Feedback rows (FEEDBACK, FEEDBACK_BAD_KINDS): also a row without its label, one
    whose label is not a boolean, and a copy of a row with the other label.
    """
    rng = random.Random(seed + 1)
    answer = "rejected" if schema == PAIRS else "output"
    every = {EXAMPLES: BAD_KINDS, PAIRS: PAIR_BAD_KINDS, FEEDBACK: FEEDBACK_BAD_KINDS}[schema]
    kinds = [k for k in every if k != "eval_leak" or eval_rows]
    n_bad = max(len(kinds), round(len(rows) * share)) if share > 0 else 0
    out = [dict(r) for r in rows]
    for i in range(n_bad):
        victim = dict(rng.choice(rows))
        kind = kinds[i % len(kinds)]
        if kind == "missing_field":
            victim.pop(answer)
        elif kind == "empty_output":
            victim[answer] = ""
        elif kind == "missing_label":
            victim.pop("label")
        elif kind == "label_not_boolean":
            victim["label"] = "yes"
        elif kind == "labelled_both_ways":
            victim["label"] = not victim["label"]
        elif kind == "identical_pair":
            victim["rejected"] = victim["chosen"]
        elif kind == "over_long":
            victim["input"] = " ".join(rng.choice(WORDS) for _ in range(800))
        elif kind == "email":
            victim["input"] = f"contact {rng.choice(NAMES).lower()}@example.com; " + victim["input"]
        elif kind == "phone":
            victim["input"] = f"call +1 415 555 {rng.randint(1000, 9999)}; " + victim["input"]
        elif kind == "card":
            victim["input"] = "paid with 4111 1111 1111 1111; " + victim["input"]
        elif kind == "near_duplicate":
            victim["instruction"] = victim["instruction"].upper().rstrip(".?") + "!"
        elif kind == "eval_leak":
            victim = dict(rng.choice(eval_rows))
        out.insert(rng.randrange(len(out) + 1), victim)  # "duplicate": the victim unchanged
    return out
