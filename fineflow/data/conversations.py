"""Conversations (OpenAI-style ``messages``, tool calls included): their normal form, and the checks of their shape.

A message is ``{role, content}`` with role system, user, assistant or tool; an assistant message may carry
``tool_calls`` (``[{id, type: "function", function: {name, arguments}}]``) and a tool message answers one
(``tool_call_id``, optionally ``name``). ``normal_message`` keeps exactly those keys, so every chat template
sees the same shape (Llama 3.1's branches on whether ``tool_calls`` is there at all), with ``arguments`` as an
object: templates write it with ``tojson``, and a JSON string would be written twice-encoded.

The shape checks (fineflow.data.checks: ``chat_roles``, ``chat_empty_turn``, ``chat_tool_results``) each say
what is wrong with a conversation as one short sentence naming the turn, ``messages[i]``, or None when
nothing is; what the model's template makes of it is checked with the tokenizer (fineflow.data.tokens).
"""

from __future__ import annotations

import json
import re

ROLES = ("system", "user", "assistant", "tool")
# What may come right before each role. Two user messages in a row are a valid conversation (a template that
# wants strict alternation says so: the chat_template check); two assistant turns in a row are two replies to
# one message, and a user turn after a tool result leaves the result unanswered.
FOLLOWS = {
    "user": (None, "system", "user", "assistant"),
    "assistant": ("user", "tool"),
    "tool": ("assistant", "tool"),
}


def normal_message(i: int, message: object) -> tuple[dict | None, str | None]:
    """(the message in normal form, None) or (None, why it is not a message)."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        return None, f"messages[{i}].role must be one of {list(ROLES)}"
    role, content = message["role"], message.get("content")
    calls = message.get("tool_calls") if role == "assistant" else None
    if content is None and calls:
        content = ""  # an assistant turn that only calls tools
    if not isinstance(content, str):
        return None, f"messages[{i}].content must be a string"
    out = {"role": role, "content": content}
    if calls:
        out["tool_calls"], problem = _normal_calls(i, calls)
        if problem:
            return None, problem
    if role == "tool":
        out.update({key: str(message[key]) for key in ("tool_call_id", "name") if message.get(key) is not None})
    return out, None


def _normal_calls(i: int, calls: object) -> tuple[list[dict], str | None]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        return [], f"{where} must be a list of {{id, type, function: {{name, arguments}}}} objects"
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            return [], f"{where}[{j}].function.name must be a non-empty string"
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return [], f"{where}[{j}].function.arguments is not JSON"
        if not isinstance(arguments, dict):
            return [], f"{where}[{j}].function.arguments must be a JSON object"
        normal = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        out.append({"id": str(call["id"]), **normal} if call.get("id") is not None else normal)
    return out, None


def call_text(call: dict) -> str:
    """A tool call as text for the checks that read a row's text (duplicates, PII, leakage)."""
    return f"[call {call['function']['name']}({json.dumps(call['function']['arguments'], ensure_ascii=False)})]"


def role_order_problem(messages: list[dict]) -> str | None:
    """System first if at all, then a user turn; an assistant turn after a user turn or tool results, tool
    results right after the assistant's tool calls, and the assistant last."""
    previous = None
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "system":
            if i:
                return f"messages[{i}]: a system message must come first"
        elif previous not in FOLLOWS[role]:
            after = f"follow messages[{i - 1}] ({previous})" if previous else "come first"
            return f"messages[{i}]: the {role} turn cannot {after}"
        elif role == "tool" and previous == "assistant" and not messages[i - 1].get("tool_calls"):
            return f"messages[{i}]: a tool result must follow an assistant turn that calls a tool"
        previous = role
    if previous != "assistant":
        return f"messages[{len(messages) - 1}]: the last message must be the assistant's response"
    return None


def empty_turn(messages: list[dict], visible: re.Pattern) -> str | None:
    """A message without a visible character (``visible``: fineflow.data.checks' rule for an empty output); an
    assistant turn's tool calls count as its text. The final message is the row's output: non_empty(output)
    reports it, once."""
    for i, message in enumerate(messages[:-1]):
        if not visible.search(message["content"]) and not message.get("tool_calls"):
            return f"messages[{i}] ({message['role']}): the message is empty"
    return None


def unanswered_tool_call(messages: list[dict]) -> str | None:
    """A tool call that the tool messages right after its turn do not answer: by ``tool_call_id`` when the
    call has an id, else one result per call, in order; and a result that answers no call."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") or []
        if not calls:
            continue
        results = []
        for later in messages[i + 1 :]:
            if later["role"] != "tool":
                break
            results.append(later)
        ids = [call.get("id") for call in calls]
        answered = [r.get("tool_call_id") for r in results]
        for j, call in enumerate(calls):
            if (call.get("id") in answered) if call.get("id") is not None else j < len(results):
                continue
            name = call["function"]["name"]
            return f"messages[{i}].tool_calls[{j}] ({name}): no tool message answers it"
        stray = [a for a in answered if a is not None and a not in ids]
        if stray:
            return f"messages[{i + 1 + answered.index(stray[0])}] (tool): answers no call of messages[{i}]"
    return None
