"""The prompt template shared by training (tokenize stage), validation and evaluation (lm-eval task).

Training tokenizes the prompt and the response separately and concatenates them, so the prompt's tokens
at training time are exactly the tokens lm-eval feeds the model at evaluation time (it encodes the
rendered prompt alone). Only the response (and the EOS that ends it, appended unless the chat template
already ended the turn with the EOS token) is trained on.

Fields follow a space, never a newline, and the response is " " + output: byte-level BPE tokenizers
(GPT-2 style) learn words with their leading space, so " Paris" is the token the base model already
knows, while "Paris" after a newline would be split into rarer pieces it has to learn anew.

Chat rows (validated rows that keep their ``messages``) are rendered with the tokenizer's own chat
template when it has one — the format an instruct model was trained on. With ``tokenize.train_on:
all_assistant`` (the default) every assistant turn is trained and everything else is masked, the turns read
off the template's real rendering (fineflow.tokenize.conversation); with ``last_assistant`` only the final
reply is: prompt = the conversation up to the generation prompt, response = what the full conversation adds
after it (text the template writes before the answer, Qwen3's empty think block, counts as prompt). That
split is also what evaluation prompts with (``render_pair``). A conversation of one reply is the same
tokens either way. Tokenizers without a chat template (the embedded one) render chat rows through the
fineflow template like any other row.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import numpy as np

from fineflow.tokenize.conversation import RenderError, Segment, chat_segments, render, split_lead

__all__ = ["RenderError"]  # raised here for rows the chat template rejects; defined with the conversation rules


class WrongObjective(RenderError):
    """A validated row of another train.objective: an SFT row where pairs are trained, or a pair in an SFT run."""


PROMPT_WITH_INPUT = "### Instruction: {instruction}\n### Input: {input}\n### Response:"
PROMPT_NO_INPUT = "### Instruction: {instruction}\n### Response:"
RESPONSE_PREFIX = " "  # lm-eval's target_delimiter; stripped from generations before exact match
# How chat rows are split and ended (in template_hash, so shards of an older rule are rebuilt): 2 = the template's
# lead before the answer goes to the prompt, and no second EOS after a turn the template ends with EOS.
CHAT_RENDERING = "chat-rendering 2"
# How conversations are cut into trained turns (fineflow.tokenize.conversation), with tokenize.train_on: hashed
# only into the shards of splits that hold chat rows, so instruction data keeps its shards (and its trained
# model) while chat shards of an older rule are rebuilt. 1 = every assistant turn from the real rendering.
CHAT_TURNS = "chat-turns 1"


def render_prompt(instruction: str, input: str = "") -> str:
    if input:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def chat_template_of(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template else None


def template_hash(tokenizer=None, chat_turns: str | None = None) -> str:
    """Changes whenever the template text (or the tokenizer's chat template) changes, so shards built
    with another template are rebuilt; chat_turns (``chat_turns_rule``) for a split with chat rows."""
    chat = chat_template_of(tokenizer) or "" if tokenizer is not None else ""
    parts = [PROMPT_WITH_INPUT, PROMPT_NO_INPUT, RESPONSE_PREFIX, CHAT_RENDERING, chat]
    text = "\0".join(parts + ([chat_turns] if chat_turns else []))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def chat_turns_rule(tokenizer, train_on: str) -> str | None:
    """What decides a chat row's trained tokens besides the template text: None without a chat template
    (chat rows then render through the fineflow template, untouched by the rule)."""
    return f"{CHAT_TURNS}; train_on={train_on}" if chat_template_of(tokenizer) else None


def render_chat(tokenizer, messages: list[dict], tools: list | None = None) -> tuple[str, str]:
    """(prompt, response) texts of a conversation through the tokenizer's chat template: the final reply."""
    prompt = render(tokenizer, messages[:-1], tools, generation=True)
    full = render(tokenizer, messages, tools)
    if not full.startswith(prompt) or len(full) == len(prompt):
        raise RenderError(_not_a_prefix(prompt, full))
    return split_lead(prompt, full[len(prompt) :], messages[-1].get("content"))


def _not_a_prefix(prompt: str, full: str) -> str:
    """Why a conversation has no (prompt, response) split: where the prompt's rendering and the whole
    conversation's part, and what to change."""
    base = (
        "the tokenizer's chat template does not render the conversation as the prompt "
        "(with the generation prompt) followed by the assistant's response"
    )
    if full.startswith(prompt):
        return base + ": the assistant's turn renders as nothing"
    at = next(i for i, (a, b) in enumerate(zip(prompt + "\0", full + "\0")) if a != b)
    return (
        f"{base}; the two renderings part at character {at}: the prompt has {prompt[at : at + 40]!r} where the "
        f"whole conversation has {full[at : at + 40]!r} (a template that places the system message by position, "
        "as Mistral v0.3's puts it in the last user turn only, does this: put the system text into the first user "
        "message)"
    )


def ends_with_eos(tokenizer, response: str) -> bool:
    """Whether the rendered response already ends the turn with the EOS token (Llama 3.1's <|eot_id|>, Qwen's
    <|im_end|>\n, Mistral's </s>): then training appends no second one."""
    eos = tokenizer.eos_token
    return bool(eos) and response.rstrip().endswith(eos)


def render_pair(tokenizer, row: dict) -> tuple[str, str]:
    """(prompt, response) texts of a validated row: the chat template for chat rows when the tokenizer has
    one (the final reply), else the fineflow template. The EOS is appended as a token id, never as text.
    Evaluation prompts with this prompt."""
    if row.get("messages") and chat_template_of(tokenizer):
        return render_chat(tokenizer, row["messages"], row.get("tools"))
    return render_prompt(row["instruction"], row.get("input") or ""), RESPONSE_PREFIX + row["output"]


def render_segments(tokenizer, row: dict, train_on: str = "all_assistant") -> list[Segment]:
    """A validated row as masked and trained pieces: every assistant turn of a chat row (train_on
    all_assistant, with a chat template), else render_pair's prompt and response. The last trained piece
    ends with the EOS unless the template already wrote it (ends_with_eos), so the model learns to stop where
    generation stops; earlier turns end as the template ends them (Gemma's <end_of_turn>: no EOS inside a
    conversation the model would never see at inference)."""
    chat = bool(row.get("messages")) and chat_template_of(tokenizer) is not None
    if chat and train_on == "all_assistant":
        segments = chat_segments(tokenizer, row["messages"], row.get("tools"))
    else:
        prompt, response = render_pair(tokenizer, row)
        segments = [Segment(prompt, False), Segment(response, True, len(row["messages"]) - 1 if chat else None)]
    last = max((i for i, s in enumerate(segments) if s.trained), default=None)
    if last is None:
        raise RenderError("the conversation has no assistant turn to train on")
    if ends_with_eos(tokenizer, segments[last].text):
        return segments
    return [*segments[: last + 1], Segment(None, True, segments[last].turn), *segments[last + 1 :]]


def encode_example(tokenizer, instruction: str, input: str, output: str) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 = trained on) for one example: prompt (masked) + response + EOS."""
    return encode_pair(tokenizer, render_prompt(instruction, input), RESPONSE_PREFIX + output)


def encode_pair(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    eos = [] if ends_with_eos(tokenizer, response) else [tokenizer.eos_token_id]
    response_ids = tokenizer.encode(response, add_special_tokens=False) + eos
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


@dataclass
class EncodedBatch:
    """Many encoded examples as flat arrays (cheap to pickle between processes, cheap to pack)."""

    ids: np.ndarray  # all examples' token ids back to back (int64)
    mask: np.ndarray  # uint8, 1 = trained on
    lengths: np.ndarray  # tokens per example (int64)
    tags: np.ndarray | None = None  # per example, uint8: feedback rows' label (1: desirable), else None

    def __len__(self) -> int:
        return len(self.lengths)

    def example(self, i: int) -> tuple[list[int], list[int]]:
        start = int(self.lengths[:i].sum())
        end = start + int(self.lengths[i])
        return self.ids[start:end].tolist(), self.mask[start:end].tolist()

    def split(self, n: int) -> tuple[EncodedBatch, EncodedBatch]:
        """The first n examples and the rest."""
        cut = int(self.lengths[:n].sum())
        tags = (None, None) if self.tags is None else (self.tags[:n], self.tags[n:])
        return (
            EncodedBatch(self.ids[:cut], self.mask[:cut], self.lengths[:n], tags[0]),
            EncodedBatch(self.ids[cut:], self.mask[cut:], self.lengths[n:], tags[1]),
        )

    @staticmethod
    def from_pairs(pairs: list[tuple[list[int], list[int]]]) -> EncodedBatch:
        """From (ids, mask) lists, e.g. encode_example's results (tests, small data)."""
        lengths = np.array([len(ids) for ids, _ in pairs], dtype=np.int64)
        ids = np.array([t for ids, _ in pairs for t in ids], dtype=np.int64)
        mask = np.array([m for _, mask in pairs for m in mask], dtype=np.uint8)
        return EncodedBatch(ids, mask, lengths)

    @staticmethod
    def concat(batches: list[EncodedBatch]) -> EncodedBatch:
        if len(batches) == 1:
            return batches[0]
        tags = None if batches[0].tags is None else np.concatenate([b.tags for b in batches])
        return EncodedBatch(
            *(np.concatenate([getattr(b, name) for b in batches]) for name in ("ids", "mask", "lengths")), tags
        )


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: call Rust directly, skipping BatchEncoding's conversions
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def encode_batch(tokenizer, rows: list[dict], train_on: str = "all_assistant", first_row: int = 1) -> EncodedBatch:
    """Many rows at once, into flat arrays: each row's pieces (render_segments) tokenized separately and
    concatenated, so a prompt's tokens are those lm-eval gets when it encodes the prompt alone.

    Rendering raises RenderError for a chat row the chat template rejects (validation quarantines those),
    naming the row by its number in the rows file (``first_row``: the number of rows[0]).
    The arrays are built without per-token Python work: ids are streamed into one buffer and the mask is
    one np.repeat of 0/1 over the pieces' lengths.
    """
    return encode_segments(tokenizer, _rendered(tokenizer, rows, train_on, first_row))


def encode_segments(tokenizer, examples: list[list[Segment]]) -> EncodedBatch:
    """Rendered examples (render_segments' pieces) into flat arrays, each piece tokenized on its own."""
    texts = iter(_ids(tokenizer, [s.text for segments in examples for s in segments if s.text is not None]))
    eos = (tokenizer.eos_token_id,)
    pieces = [next(texts) if s.text is not None else eos for segments in examples for s in segments]
    sizes = np.array([len(piece) for piece in pieces], dtype=np.int64)
    ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64, count=int(sizes.sum()))
    trained = np.array([s.trained for segments in examples for s in segments], dtype=np.uint8)
    owner = np.repeat(np.arange(len(examples)), [len(segments) for segments in examples])
    lengths = np.bincount(owner, weights=sizes, minlength=len(examples)).astype(np.int64)
    return EncodedBatch(ids, np.repeat(trained, sizes), lengths)


def _rendered(tokenizer, rows: list[dict], train_on: str, first_row: int) -> list[list[Segment]]:
    examples = []
    for number, row in enumerate(rows, start=first_row):
        try:
            examples.append(render_segments(tokenizer, row, train_on))
        except RenderError as exc:
            raise RenderError(f"row {number}: {exc}") from None
        except KeyError as exc:  # a preference pair (no output) given to an SFT run
            raise WrongObjective(f"row {number}: field {exc} is missing") from None
    return examples
