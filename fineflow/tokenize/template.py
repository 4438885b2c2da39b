"""The prompt template shared by training (tokenize stage), validation and evaluation (lm-eval task).

Training tokenizes the prompt and the response separately and concatenates them, so the prompt's tokens
at training time are exactly the tokens lm-eval feeds the model at evaluation time (it encodes the
rendered prompt alone). Only the response (and the EOS that ends it, appended unless the chat template
already ended the turn with the EOS token) is trained on.

Fields follow a space, never a newline, and the response is " " + output: byte-level BPE tokenizers
(GPT-2 style) learn words with their leading space, so " Paris" is the token the base model already
knows, while "Paris" after a newline would be split into rarer pieces it has to learn anew.

Chat rows (validated rows that keep their ``messages``) are rendered with the tokenizer's own chat
template when it has one — the format an instruct model was trained on — as prompt = the conversation
up to the generation prompt, response = what the full conversation adds after it (text the template writes
before the answer, Qwen3's empty think block, counts as prompt). Tokenizers without a
chat template (the embedded one) render chat rows through the fineflow template like any other row.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import numpy as np

PROMPT_WITH_INPUT = "### Instruction: {instruction}\n### Input: {input}\n### Response:"
PROMPT_NO_INPUT = "### Instruction: {instruction}\n### Response:"
RESPONSE_PREFIX = " "  # lm-eval's target_delimiter; stripped from generations before exact match
# How chat rows are split and ended (in template_hash, so shards of an older rule are rebuilt): 2 = the template's
# lead before the answer goes to the prompt, and no second EOS after a turn the template ends with EOS.
CHAT_RENDERING = "chat-rendering 2"


class RenderError(ValueError):
    """A row the template cannot render (the chat template rejected the conversation)."""


def render_prompt(instruction: str, input: str = "") -> str:
    if input:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def chat_template_of(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template else None


def template_hash(tokenizer=None) -> str:
    """Changes whenever the template text (or the tokenizer's chat template) changes, so shards built
    with another template are rebuilt."""
    chat = chat_template_of(tokenizer) or "" if tokenizer is not None else ""
    text = "\0".join([PROMPT_WITH_INPUT, PROMPT_NO_INPUT, RESPONSE_PREFIX, CHAT_RENDERING, chat])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def render_chat(tokenizer, messages: list[dict]) -> tuple[str, str]:
    """(prompt, response) texts of a conversation through the tokenizer's chat template."""
    try:
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # jinja raises whatever the template author chose (raise_exception, TypeError)
        raise RenderError(
            f"the tokenizer's chat template cannot render this conversation: {type(exc).__name__}: {exc}"
        ) from None
    if not full.startswith(prompt) or len(full) == len(prompt):
        raise RenderError(_not_a_prefix(prompt, full))
    return _template_lead_into_prompt(prompt, full[len(prompt) :], messages[-1].get("content"))


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


def _template_lead_into_prompt(prompt: str, response: str, answer) -> tuple[str, str]:
    """Text the template writes between the generation prompt and the assistant's answer (Qwen3's empty
    "<think>\n\n</think>\n\n") belongs to the prompt: the model is not to learn it, and evaluation, which
    prompts with the prompt and stops generating at a newline, would otherwise read it instead of the answer.
    With it the prompt is Qwen3's own non-thinking prompt (enable_thinking=False). Whitespace alone (Mistral's
    " " + answer) stays with the answer: a prompt ending in a space tokenizes unlike what the model saw."""
    start = response.find(answer.strip()) if isinstance(answer, str) and answer.strip() else -1
    lead = response[:start] if start > 0 else ""
    if not lead.strip():
        return prompt, response
    return prompt + lead, response[start:]


def ends_with_eos(tokenizer, response: str) -> bool:
    """Whether the rendered response already ends the turn with the EOS token (Llama 3.1's <|eot_id|>, Qwen's
    <|im_end|>\n, Mistral's </s>): then training appends no second one."""
    eos = tokenizer.eos_token
    return bool(eos) and response.rstrip().endswith(eos)


def render_pair(tokenizer, row: dict) -> tuple[str, str]:
    """(prompt, response) texts of a validated row: the chat template for chat rows when the tokenizer has
    one, else the fineflow template. The EOS is appended as a token id, never as text."""
    if row.get("messages") and chat_template_of(tokenizer):
        return render_chat(tokenizer, row["messages"])
    return render_prompt(row["instruction"], row.get("input") or ""), RESPONSE_PREFIX + row["output"]


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

    def __len__(self) -> int:
        return len(self.lengths)

    def example(self, i: int) -> tuple[list[int], list[int]]:
        start = int(self.lengths[:i].sum())
        end = start + int(self.lengths[i])
        return self.ids[start:end].tolist(), self.mask[start:end].tolist()

    def split(self, n: int) -> tuple[EncodedBatch, EncodedBatch]:
        """The first n examples and the rest."""
        cut = int(self.lengths[:n].sum())
        return (
            EncodedBatch(self.ids[:cut], self.mask[:cut], self.lengths[:n]),
            EncodedBatch(self.ids[cut:], self.mask[cut:], self.lengths[n:]),
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
        return EncodedBatch(
            *(np.concatenate([getattr(b, name) for b in batches]) for name in ("ids", "mask", "lengths"))
        )


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: call Rust directly, skipping BatchEncoding's conversions
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def encode_batch(tokenizer, rows: list[dict]) -> EncodedBatch:
    """encode_example for many rows at once, into flat arrays (the same tokens as one by one).

    Rendering raises RenderError for a chat row the chat template rejects (validation quarantines those).
    The arrays are built without per-token Python work: ids are streamed into one buffer and the mask is
    one np.repeat of 0/1 over the (prompt, response) segment lengths.
    """
    pairs = [render_pair(tokenizer, row) for row in rows]
    prompt_ids = _ids(tokenizer, [p for p, _ in pairs])
    response_ids = _ids(tokenizer, [r for _, r in pairs])
    segments = np.empty(2 * len(rows), dtype=np.int64)
    segments[0::2] = [len(p) for p in prompt_ids]
    eos = [() if ends_with_eos(tokenizer, r) else (tokenizer.eos_token_id,) for _, r in pairs]
    segments[1::2] = [len(r) + len(e) for r, e in zip(response_ids, eos)]  # + EOS where the template has none
    ids = np.fromiter(
        itertools.chain.from_iterable(itertools.chain.from_iterable(zip(prompt_ids, response_ids, eos))),
        dtype=np.int64,
        count=int(segments.sum()),
    )
    mask = np.repeat(np.tile(np.array([0, 1], dtype=np.uint8), len(rows)), segments)
    return EncodedBatch(ids, mask, segments[0::2] + segments[1::2])
