"""Every validation check of the data gate, each declared once, in ``CHECKS``.

A ``Check`` carries everything the gate needs: the name reports and quarantine reasons show, the category
whose ``validate.checks.<category>`` knob sets its severity and max_share, the column it checks (and how
that column is derived from the rows when the rows do not have it), when it applies, its great-expectations
expectation and the detail its reason adds. The gate runs them a chunk of rows at a time; a check that
compares a row with the rows before it (duplicates) derives its column from ``CheckContext.seen``.
fineflow.data.validation builds the frame, the GX suite, the report and the reasons from these alone.

Adding a check means:
  1. one ``Check`` in ``CHECKS`` below; its position is its place in the suite, the Data Docs and the report;
  2. an existing category, which gives its default severity. A new category also needs its knob: a
     ``CheckParams`` field in ``ValidationChecks`` (fineflow/core/data_config.py) and its entry under
     ``validate.checks`` in params.yaml;
  3. its test in tests/test_validation.py: a row that fails it, its reason text, its report entry.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from fineflow.core.data_config import CheckParams, ValidateParams, ValidationChecks
from fineflow.data.conversations import empty_turn, role_order_problem, unanswered_tool_call
from fineflow.data.formats import ANSWERS, LABEL, Row, example_text
from fineflow.data.overlap import FirstSeen, LeakIndex, normalize, stable_hash
from fineflow.data.pii import pii_kinds, redacted_preview
from fineflow.objectives.interface import EXAMPLES, FEEDBACK, PAIRS

if TYPE_CHECKING:  # only their types are needed here
    from fineflow.data.tokens import Measure, PairMeasure, TokenView

Expectation = Any  # a great_expectations Expectation; GX is imported only when a suite is built (slow import)

SCHEMA = "schema"  # the schema checks' category: no knob, a required column missing from the file always blocks
SCHEMA_KNOBS = CheckParams(severity="error", max_share=0.0)
TRUNCATION = "truncation"  # the category whose share the report also shows as truncation_rate


@dataclass
class Seen:
    """What a split's earlier chunks held, for the checks that compare a row with every row before it:
    64-bit hashes of each distinct text and normalized text, with the line that had it first."""

    texts: FirstSeen = field(default_factory=FirstSeen)
    normalized: FirstSeen = field(default_factory=FirstSeen)
    labelled_texts: FirstSeen = field(default_factory=FirstSeen)  # feedback rows with a boolean label: each text
    labelled: FirstSeen = field(default_factory=FirstSeen)  # ... and each text with its label


@dataclass
class CheckContext:
    """What checks see of one chunk besides the rows' own columns: the gate's settings, the split's memory
    of earlier chunks, and the optional views."""

    rows: list[Row]  # the chunk's parsed rows only (data is not None), in file order
    cfg: ValidateParams
    seen: Seen = field(default_factory=Seen)  # updated as the chunk's duplicate columns are derived
    leak_index: LeakIndex | None = None  # train rows only: n-grams of the eval split
    tokens: TokenView | None = None  # with a base model: rows as the tokenize stage will see them
    schema: str = EXAMPLES  # the objective's row schema: PAIRS, each row a prompt, chosen and rejected; FEEDBACK ...

    @property
    def pairs(self) -> bool:
        return self.schema == PAIRS

    @cached_property
    def columns_in_rows(self) -> set[str]:
        return {key for row in self.rows for key in row.data}

    @cached_property
    def texts(self) -> list[str]:
        return [example_text(row.data) for row in self.rows]

    @cached_property
    def duplicate_lines(self) -> list[int | None]:
        """Per row, the line of the first earlier row with the same text (None: the first copy); once per chunk,
        since it records the chunk's texts as seen."""
        return self.seen.texts.first_lines([stable_hash(text) for text in self.texts], [row.line for row in self.rows])

    @cached_property
    def normalized(self) -> list[str]:
        return [normalize(text) for text in self.texts]

    @cached_property
    def measured(self) -> list[Measure] | list[PairMeasure]:
        """TokenView.measure_many (measure_pairs for pairs) of the rows, once: the token columns come from the
        same measurement."""
        data = [row.data for row in self.rows]
        return self.tokens.measure_pairs(data) if self.pairs else self.tokens.measure_many(data)


@dataclass(frozen=True, eq=False)  # never compared: it holds the whole frame
class FailedRow:
    """The frame row a check failed on, as its reason detail reads it: ``row["column"]``."""

    frame: Any  # the pandas frame the suite ran on, indexed by source line
    line: int

    def __getitem__(self, column: str) -> Any:
        return self.frame.at[self.line, column]


def always(ctx: CheckContext) -> bool:
    return True


def rows_have(column: str) -> Callable[[CheckContext], bool]:
    """Applies only when some row has the column (a column absent everywhere is column_exists' failure)."""
    return lambda ctx: column in ctx.columns_in_rows


def with_tokens(ctx: CheckContext) -> bool:
    return ctx.tokens is not None


def example_rows(ctx: CheckContext) -> bool:
    return not ctx.pairs


def pair_rows(ctx: CheckContext) -> bool:
    return ctx.pairs


def feedback_rows(ctx: CheckContext) -> bool:
    return ctx.schema == FEEDBACK


def examples_with_tokens(ctx: CheckContext) -> bool:
    return with_tokens(ctx) and not ctx.pairs


def pairs_with_tokens(ctx: CheckContext) -> bool:
    return with_tokens(ctx) and ctx.pairs


def with_leak_index(ctx: CheckContext) -> bool:
    return ctx.leak_index is not None


def pii_quarantined(ctx: CheckContext) -> bool:
    """With ``pii: redact`` the spans are already replaced before the checks run: scanning finds nothing."""
    return ctx.cfg.pii == "quarantine"


def no_detail(row: FailedRow) -> str:
    return ""


@dataclass(frozen=True)
class Check:
    """One validation check: what it checks, how, when, and how it acts and reads when it fails."""

    name: str  # as reports and reasons show it, e.g. "unique(row)"; also the GX suite's key for the check
    category: str  # the validate.checks.<category> knob: severity and max_share (SCHEMA: fixed, always blocks)
    column: str  # the frame column the expectation runs on
    expect: Callable[[str, CheckContext], Expectation]  # (column, context) -> the GX expectation
    derive: Callable[[CheckContext], list] | None = None  # the column's values, one per row; None: read from rows
    applies: Callable[[CheckContext], bool] = always  # whether the check runs on this chunk of the file
    detail: Callable[[FailedRow], str] = no_detail  # appended to "file:line: failed <name>"

    def knobs(self, checks: ValidationChecks) -> CheckParams:
        return SCHEMA_KNOBS if self.category == SCHEMA else getattr(checks, self.category)


def _gxe():
    """great_expectations.expectations, imported when a suite is built, not when this module is."""
    import great_expectations.expectations as gxe

    return gxe


# Derived columns. Checks that share a column share its derivation; the frame computes it once per chunk. None
# of them holds a row's text: the frame (and GX's results and Data Docs) carry lengths, lines, kinds, shares.


def _text_chars(ctx: CheckContext) -> list[int]:
    return [len(text) for text in ctx.texts]


def _duplicate_of(ctx: CheckContext) -> list[int | None]:
    """The line of the first earlier row with the same text; None for a first copy (it is kept)."""
    return ctx.duplicate_lines


def _near_duplicate_of(ctx: CheckContext) -> list[int | None]:
    """The same up to case, punctuation and spacing (fineflow.data.overlap.normalize)."""
    hashes = [stable_hash(norm) for norm in ctx.normalized]
    return ctx.seen.normalized.first_lines(hashes, [row.line for row in ctx.rows])


def _label_problems(ctx: CheckContext) -> list[str | None]:
    """A feedback row's label must be a JSON boolean: true (desirable) or false (undesirable), nothing that merely
    reads like one ("yes", 1), which would be a guess about what the user meant."""
    return [
        None
        if isinstance(row.data.get(LABEL), bool) or row.data.get(LABEL) is None
        else f"label is {row.data[LABEL]!r}, not true or false"
        for row in ctx.rows
    ]


def _labelled_both_ways(ctx: CheckContext) -> list[int | None]:
    """The line of an earlier row with the same prompt and answer and the other label; None otherwise. Only rows
    with a boolean label count (a missing or non-boolean one is the schema's failure), and a text seen before with
    the same label is a duplicate (duplicate_of's), not a conflict."""
    labelled = [(row, text) for row, text in zip(ctx.rows, ctx.texts) if isinstance(row.data.get(LABEL), bool)]
    lines = [row.line for row, _ in labelled]
    earlier_text = ctx.seen.labelled_texts.first_lines([stable_hash(text) for _, text in labelled], lines)
    earlier_same = ctx.seen.labelled.first_lines(
        [stable_hash(f"{row.data[LABEL]}\0{text}") for row, text in labelled], lines
    )
    conflicts = {row.line: text for (row, _), text, same in zip(labelled, earlier_text, earlier_same) if same is None}
    return [conflicts.get(row.line) for row in ctx.rows]


def _pii_kinds(ctx: CheckContext) -> list[str | None]:
    """The PII kinds found in each row, comma-joined; None when the row is clean."""
    return [",".join(sorted(pii_kinds(text))) or None for text in ctx.texts]


# Characters that show nothing: an output of only these is empty. Unicode whitespace (\s: spaces, tabs, line
# breaks, the no-break and ideographic spaces), controls, and the invisible format characters and fillers
# (zero-width space/joiners, word joiner, byte-order mark, soft hyphen, bidi marks, variation selectors,
# Hangul fillers, the braille blank, tags). Written as escapes: the suite (and its Data Docs) shows them.
INVISIBLE = (
    r"\s\x00-\x1f\x7f-\x9f\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f"
    r"\u202a-\u202e\u2060-\u206f\u2800\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff9-\ufffb"
    r"\U0001d173-\U0001d17a\U000e0000-\U000e007f\U000e0100-\U000e01ef"
)
VISIBLE = f"[^{INVISIBLE}]"  # a value with one such character is not empty
# C0 control characters but tab, newline and carriage return: not text (a NUL truncates C strings, an escape
# drives a terminal); quarantined in the fields the model sees, so they never reach training
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _control_chars(ctx: CheckContext) -> list[str | None]:
    """Which field of each row holds a control character, and which; None when none does."""
    return [_control_char(row.data) for row in ctx.rows]


def _control_char(data: dict) -> str | None:
    for name in ("instruction", "input", "output", *ANSWERS):
        value = data.get(name)
        found = CONTROL.search(value) if isinstance(value, str) else None
        if found:
            char = f"U+{ord(found.group()):04X}"
            what = f"a NUL byte ({char})" if char == "U+0000" else f"a control character ({char})"
            return f'field "{name}" contains {what}'
    return None


def _token_counts(ctx: CheckContext) -> list[int | None]:
    return [measure.n_tokens for measure in ctx.measured]


def _trained_token_counts(ctx: CheckContext) -> list[int | None]:
    return [measure.trained for measure in ctx.measured]


def _render_errors(ctx: CheckContext) -> list[str | None]:
    return [measure.render_error for measure in ctx.measured]


def _dropped_turns(ctx: CheckContext) -> list[str | None]:
    return [measure.dropped_turn for measure in ctx.measured]


def _cut_turns(ctx: CheckContext) -> list[str | None]:
    return [measure.cut_turn for measure in ctx.measured]


VISIBLE_TEXT = re.compile(VISIBLE)


def _conversation_problems(rule: Callable[[list[dict]], str | None]) -> Callable[[CheckContext], list[str | None]]:
    """A derived column of what `rule` (fineflow.data.conversations) finds wrong with each chat row's turns;
    None for a row without messages (instruction data in the same file is not a conversation)."""
    return lambda ctx: [rule(_conversation(row.data)) if row.data.get("messages") else None for row in ctx.rows]


def _conversation(data: dict) -> list[dict]:
    """A chat row's whole conversation: a pair's prompt ends before the answer, so its chosen answer closes it
    (the turn indices stay those of the row's messages)."""
    if "chosen" not in data:
        return data["messages"]
    return [*data["messages"], {"role": "assistant", "content": str(data["chosen"] or "")}]


def _identical_pairs(ctx: CheckContext) -> list[str | None]:
    """Whether each pair's answers are the same text (up to surrounding whitespace): nothing to prefer."""
    return [
        "chosen and rejected are the same text"
        if _same_text(row.data.get("chosen"), row.data.get("rejected"))
        else None
        for row in ctx.rows
    ]


def _same_text(chosen: object, rejected: object) -> bool:
    return isinstance(chosen, str) and isinstance(rejected, str) and chosen.strip() == rejected.strip()


def _pair_cuts(ctx: CheckContext) -> list[str | None]:
    return [measure.cut for measure in ctx.measured]


def _pairs_same_after_cut(ctx: CheckContext) -> list[str | None]:
    return [measure.same_after_cut for measure in ctx.measured]


def _trained_side(side: int) -> Callable[[CheckContext], list[int | None]]:
    return lambda ctx: [measure.trained_sides[side] for measure in ctx.measured]


HAVE_MESSAGES = rows_have("messages")


def _chat_check(name: str, category: str, column: str, derive, applies=HAVE_MESSAGES) -> Check:
    """A check of conversations whose column names the turn that fails it (its reason's detail)."""
    return Check(
        name, category, column, _expect_null, derive=derive, applies=applies, detail=lambda row: f" ({row[column]})"
    )


def _with_chat_tokens(ctx: CheckContext) -> bool:
    return with_tokens(ctx) and "messages" in ctx.columns_in_rows


def _eval_overlaps(ctx: CheckContext) -> list[float]:
    """The share of each row's word n-grams that the eval data already contains."""
    return ctx.leak_index.overlaps(ctx.normalized, normalized=True)


def _int(value: Any) -> int:
    return int(value)  # pandas stores an integer column with gaps (None) as floats


def _expect_str(column: str, ctx: CheckContext) -> Expectation:
    return _gxe().ExpectColumnValuesToBeOfType(column=column, type_="str")


def _expect_null(column: str, ctx: CheckContext) -> Expectation:
    """A derived column that is None where the row passes (the line it duplicates, the PII it holds ...)."""
    return _gxe().ExpectColumnValuesToBeNull(column=column)


# Which rows need each required field: instruction in every row, output in example rows, both answers in pairs.
FIELD_MODES: dict[str, Callable[[CheckContext], bool]] = {
    "instruction": always,
    "output": example_rows,
    **{answer: pair_rows for answer in ANSWERS},
    LABEL: feedback_rows,
}


def _both(first: Callable[[CheckContext], bool], second: Callable[[CheckContext], bool]):
    return lambda ctx: first(ctx) and second(ctx)


def schema_checks(columns: tuple[str, ...]) -> list[Check]:
    """The schema of the required columns: every column exists, then per column not_null and type_str; each
    where its rows need it (FIELD_MODES)."""
    exists = [
        Check(
            f"column_exists({column})",
            SCHEMA,
            column,
            lambda col, ctx: _gxe().ExpectColumnToExist(column=col),
            applies=FIELD_MODES[column],
        )
        for column in columns
    ]
    values = []
    for column in columns:
        present = _both(FIELD_MODES[column], rows_have(column))
        values += [
            Check(
                f"not_null({column})",
                "non_null",
                column,
                lambda col, ctx: _gxe().ExpectColumnValuesToNotBeNull(column=col),
                applies=present,
            ),
            _label_type(present)
            if column == LABEL
            else Check(f"type_str({column})", "types", column, _expect_str, applies=present),
        ]
    return exists + values


def _label_type(applies) -> Check:
    """The label's type check: a boolean, where type_str checks the text columns."""
    return Check(
        f"type_bool({LABEL})",
        "types",
        "label_problem",
        _expect_null,
        derive=_label_problems,
        applies=applies,
        detail=lambda row: f" ({row['label_problem']})",
    )


def _expect_visible(column: str, ctx: CheckContext) -> Expectation:
    """A value of only whitespace or invisible characters is empty too: an answer the model learns nothing from."""
    return _gxe().ExpectColumnValuesToMatchRegex(column=column, regex=VISIBLE)


def _pair_non_empty(answer: str) -> Check:
    return Check(f"pair_non_empty({answer})", "pair_empty", answer, _expect_visible, applies=rows_have(answer))


def _label_coverage(answer: str, side: int) -> Check:
    """A pair side whose answer the shared row's cut leaves no token of: that side would train on nothing."""
    return Check(
        f"label_coverage({answer})",
        "label_coverage",
        f"trained_{answer}",
        lambda col, ctx: _gxe().ExpectColumnValuesToBeBetween(column=col, min_value=1),
        derive=_trained_side(side),
        applies=pairs_with_tokens,
        # both sides write the prompt: a pair needs about twice an SFT row's tokens
        detail=lambda row: (
            f" (no {answer} token left to train on: the pair's two sides, each with the prompt, share "
            "one row of tokenize.seq_len; raise it)"
        ),
    )


CHECKS: list[Check] = [
    *schema_checks(("instruction", "output", *ANSWERS, LABEL)),
    # conversations (data.mapping.messages) first: a conversation out of order says so before its derived output
    _chat_check("chat_role_order(messages)", "chat_roles", "role_order", _conversation_problems(role_order_problem)),
    _chat_check(
        "chat_non_empty(turns)",
        "chat_empty_turn",
        "empty_turn",
        _conversation_problems(lambda messages: empty_turn(messages, VISIBLE_TEXT)),
    ),
    _chat_check(
        "chat_tool_results(messages)",
        "chat_tool_results",
        "unanswered_call",
        _conversation_problems(unanswered_tool_call),
    ),
    Check("non_empty(output)", "non_empty", "output", _expect_visible, applies=rows_have("output")),
    *(_pair_non_empty(answer) for answer in ANSWERS),
    Check(
        "pair_distinct(chosen, rejected)",
        "pair_identical",
        "pair_identical",
        _expect_null,
        derive=_identical_pairs,
        applies=pair_rows,
        detail=lambda row: f" ({row['pair_identical']})",
    ),
    Check(
        "feedback_consistent(label)",
        "feedback_conflict",
        "labelled_both_ways",
        _expect_null,
        derive=_labelled_both_ways,
        applies=feedback_rows,
        detail=lambda row: (
            f" (line {_int(row['labelled_both_ways'])} labels the same answer to this prompt the other way)"
        ),
    ),
    Check("type_str(input)", "types", "input", _expect_str),  # the frame always has input ("" where absent)
    Check(  # a string with a NUL or another control character is not text: the types knob sets its severity
        "no_control_chars(text)",
        "types",
        "control_char",
        _expect_null,
        derive=_control_chars,
        detail=lambda row: f" ({row['control_char']})",
    ),
    Check(
        "length_chars(text)",
        "length_chars",
        "text_chars",
        lambda col, ctx: _gxe().ExpectColumnValuesToBeBetween(
            column=col, min_value=ctx.cfg.min_chars, max_value=ctx.cfg.max_chars
        ),
        derive=_text_chars,
    ),
    Check(  # the first copy passes; every later copy fails, naming the line of the first
        "unique(row)",
        "duplicate",
        "duplicate_of",
        _expect_null,
        derive=_duplicate_of,
        detail=lambda row: f" (first seen at line {_int(row['duplicate_of'])})",
    ),
    Check(
        "near_unique(normalized)",
        "near_duplicate",
        "near_duplicate_of",
        _expect_null,
        derive=_near_duplicate_of,
        detail=lambda row: f" (same as line {_int(row['near_duplicate_of'])} up to case/punctuation)",
    ),
    Check(
        "no_pii(text)",
        "pii",
        "pii_kinds",
        _expect_null,
        derive=_pii_kinds,
        applies=pii_quarantined,
        detail=lambda row: f" ({row['pii_kinds']})",
    ),
    Check(
        "fits_seq_len(tokens)",
        TRUNCATION,
        "n_tokens",
        lambda col, ctx: _gxe().ExpectColumnValuesToBeBetween(column=col, max_value=ctx.tokens.seq_len),
        derive=_token_counts,
        applies=examples_with_tokens,
        detail=lambda row: f" ({_int(row['n_tokens'])} tokens, truncated to tokenize.seq_len)",
    ),
    Check(
        "label_coverage(tokens)",
        "label_coverage",
        "trained_tokens",
        lambda col, ctx: _gxe().ExpectColumnValuesToBeBetween(column=col, min_value=1),
        derive=_trained_token_counts,
        applies=examples_with_tokens,
        detail=lambda row: " (no response token left to train on after truncation)",
    ),
    Check(  # a pair is packed whole into one row: its two sides share tokenize.seq_len (fineflow.tokenize.pairs)
        "fits_seq_len(pair)",
        TRUNCATION,
        "pair_cut",
        _expect_null,
        derive=_pair_cuts,
        applies=pairs_with_tokens,
        detail=lambda row: f" ({row['pair_cut']})",
    ),
    *(_label_coverage(answer, side) for side, answer in enumerate(ANSWERS)),
    Check(
        "pair_distinct_after_cut(tokens)",
        "pair_truncation",
        "pair_same_after_cut",
        _expect_null,
        derive=_pairs_same_after_cut,
        applies=pairs_with_tokens,
        detail=lambda row: f" ({row['pair_same_after_cut']})",
    ),
    Check(
        "chat_template_renders(row)",
        "chat_template",
        "render_error",
        _expect_null,
        derive=_render_errors,
        applies=with_tokens,
        # a template's own error may quote the conversation (raise_exception): its PII and secrets are redacted
        detail=lambda row: f" ({redacted_preview(row['render_error'])})",
    ),
    _chat_check(
        "chat_turns_rendered(template)", "chat_dropped_turn", "dropped_turn", _dropped_turns, _with_chat_tokens
    ),
    _chat_check("chat_turns_fit(seq_len)", "chat_truncation", "cut_turn", _cut_turns, _with_chat_tokens),
    Check(
        "no_leakage(eval)",
        "leakage",
        "eval_overlap",
        lambda col, ctx: _gxe().ExpectColumnValuesToBeBetween(column=col, max_value=ctx.cfg.leakage_max_overlap),
        derive=_eval_overlaps,
        applies=with_leak_index,
        detail=lambda row: f" ({row['eval_overlap']:.0%} of its word n-grams are in the eval data)",
    ),
]
