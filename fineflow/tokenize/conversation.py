"""Which text of a conversation's real rendering each assistant turn is, so that every turn is trained.

The model's own chat template renders the whole conversation once, then the prefixes that end at each
assistant turn: the conversation before turn k with the generation prompt (where the model starts to
answer) and the conversation through turn k. Turn k's trained text is the whole rendering between the two
(the answer, its tool calls, and the template's end-of-turn token, e.g. Llama 3's ``<|eot_id|>``); everything
else is masked: system, user and tool messages and the template's scaffolding (headers, generation prompts,
Qwen3's empty think block). No offset is guessed: this is TRL's and torchtune's incremental-prefix rule.

It needs each prefix's rendering to be a prefix of the whole. A template that renders earlier turns
differently once the conversation goes on (Qwen3 drops the think block of all but the last turn; Mistral
v0.3 moves the system message into the last user turn) breaks it: such a conversation is refused with a
``RenderError`` naming the turn, never masked by guesswork (``tokenize.train_on: last_assistant`` trains
only the final reply, which such templates render consistently).
"""

from __future__ import annotations

import json
from typing import NamedTuple


class RenderError(ValueError):
    """A row the template cannot render (the chat template rejected the conversation, or its rendering of a
    prefix is not a prefix of the whole conversation)."""


class Segment(NamedTuple):
    """A piece of an example: text (None: the EOS token, appended as an id) and whether it is trained on.
    ``turn``: the index in ``messages`` of the assistant turn a trained piece of a conversation renders."""

    text: str | None
    trained: bool
    turn: int | None = None


def render(tokenizer, messages: list[dict], tools: list | None = None, generation: bool = False) -> str:
    """The conversation through the tokenizer's chat template, as text."""
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation, tokenize=False
        )
    except Exception as exc:  # jinja raises whatever the template author chose (raise_exception, TypeError)
        raise RenderError(
            f"the tokenizer's chat template cannot render this conversation: {type(exc).__name__}: {exc}"
        ) from None


def split_lead(prompt: str, response: str, answer: object) -> tuple[str, str]:
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


def chat_segments(tokenizer, messages: list[dict], tools: list | None = None) -> list[Segment]:
    """The whole rendering of a conversation cut into masked and trained pieces: one trained piece per
    assistant turn (its answer or tool calls and the template's end of turn), masked pieces between them.
    Joined, the pieces are the template's rendering of the whole conversation, byte for byte."""
    whole = render(tokenizer, messages, tools)
    segments: list[Segment] = []
    done = 0
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = _prefix_length(tokenizer, messages[:k], tools, whole, k, generation=True)
        end = _prefix_length(tokenizer, messages[: k + 1], tools, whole, k, generation=False)
        if start < done or end <= start:
            raise RenderError(f"messages[{k}] (assistant): the chat template renders this turn as nothing")
        masked, trained = split_lead(whole[done:start], whole[start:end], message.get("content"))
        segments += [Segment(masked, False), Segment(trained, True, k)]
        done = end
    if done < len(whole):
        segments.append(Segment(whole[done:], False))  # whatever a template writes after the last turn
    return [s for s in segments if s.text]


def _prefix_length(tokenizer, prefix: list[dict], tools, whole: str, k: int, generation: bool) -> int:
    """Where the rendering of the conversation's first messages ends in the whole rendering; refused when it
    is not a prefix of it."""
    try:
        text = render(tokenizer, prefix, tools, generation)
    except RenderError as exc:
        raise RenderError(f"messages[{k}] (assistant): rendering the conversation before this turn: {exc}") from None
    if whole.startswith(text):
        return len(text)
    at = next(i for i, (a, b) in enumerate(zip(text + "\0", whole + "\0")) if a != b)
    what = "before this turn, with the generation prompt," if generation else "through this turn"
    raise RenderError(
        f"messages[{k}] (assistant): the chat template renders the conversation {what} unlike the start of the "
        f"whole conversation: they part at character {at} ({text[at : at + 30]!r} against {whole[at : at + 30]!r}), "
        "so the turn's tokens cannot be read off the real rendering. Templates that rewrite earlier turns (Qwen3 "
        "drops the think block of all but the last) or place the system message by position (Mistral v0.3) do "
        "this; tokenize.train_on: last_assistant trains only the final reply"
    )


def dropped_turn(messages: list[dict], rendering: str) -> str | None:
    """The first message whose text the template's rendering leaves out (Phi-3's template drops system and
    tool messages; a template without tool support drops tool calls), or None. Messages are looked for in
    order, but a system message anywhere (templates move it: Llama 3.1 to the top, Mistral v0.3 into the last
    user turn); a tool call by its function's name."""
    position = 0
    for i, message in enumerate(messages):
        role = message.get("role")
        for needle in _needles(message):
            found = _find(rendering, needle, 0 if role == "system" else position)
            if found < 0:
                what = "tool call" if needle not in _texts(message) else "text"
                return f"messages[{i}] ({role}): the chat template drops this turn's {what} from the rendering"
            if role != "system":
                position = found + 1
    return None


def _texts(message: dict) -> list[str]:
    content = message.get("content")
    return [content.strip()] if isinstance(content, str) and content.strip() else []


def _needles(message: dict) -> list[str]:
    calls = message.get("tool_calls") or []
    return _texts(message) + [str(call.get("function", {}).get("name", "")) for call in calls]


def _find(rendering: str, needle: str, start: int) -> int:
    """The needle as written, or as a JSON string's inside (Llama 3.1 writes a tool result with tojson)."""
    for form in (needle, json.dumps(needle)[1:-1], json.dumps(needle, ensure_ascii=False)[1:-1]):
        found = rendering.find(form, start)
        if found >= 0:
            return found
    return -1
