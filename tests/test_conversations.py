"""Multi-turn conversations and tool calls in SFT: every assistant turn is trained, everything else masked, with
the masks taken from the model's own chat template. Real templates on tiny tokenizers (tests/families): Llama 3.1
and Qwen2.5 (both with tools) and Gemma 2 (no system role); Qwen3 and Phi-3 for what a template can do wrong.

Run with -s to see the masked-token counts per role on the three templates (MASKS lines; the issue's note).
"""

from __future__ import annotations

import json

import pytest

from tests.families import build_tokenizer

TEN_TURNS = [
    {"role": "system", "content": "You answer in one word."},
    *(
        m
        for i in range(5)
        for m in (
            {"role": "user", "content": f"Question number {i}: what comes after {i}?"},
            {"role": "assistant", "content": f"Answer {i + 1} follows."},
        )
    ),
]
CHAT = [
    {"role": "user", "content": "Name a primary colour."},
    {"role": "assistant", "content": "Red is one."},
    {"role": "user", "content": "And another one?"},
    {"role": "assistant", "content": "Blue, too."},
    {"role": "user", "content": "Which one is warmer?"},
    {"role": "assistant", "content": "Red feels warmer."},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CHAT = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 21 degrees and clear in Paris."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]
# how each template ends an assistant turn, and writes the tool call of TOOL_CHAT (its own format)
END_OF_TURN = {"llama3": "<|eot_id|>", "qwen2.5": "<|im_end|>\n", "gemma2": "<end_of_turn>\n"}
TOOL_CALL_TEXT = {
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "qwen2.5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
}
MASKS = "masked tokens per role:"


def _tokenizer(family: str, conversations: list[list[dict]] = (CHAT, TOOL_CHAT, TEN_TURNS)):
    texts = [str(m.get("content") or "") for c in conversations for m in c] * 4
    return build_tokenizer(family, texts + ["the quick brown fox jumps over the lazy dog"] * 20)


def _row(messages: list[dict], tools: list | None = None) -> dict:
    from fineflow.data.formats import chat_to_record

    record, problem = chat_to_record(messages, tools)
    assert problem is None, problem
    return record


def _trained_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The token ids of each maximal run of trained positions."""
    runs: list[list[int]] = []
    for i, (token, trained) in enumerate(zip(ids, mask)):
        if trained:
            if i == 0 or not mask[i - 1]:
                runs.append([])
            runs[-1].append(token)
    return runs


def _encode(tokenizer, row: dict, train_on: str = "all_assistant") -> tuple[list[int], list[int]]:
    from fineflow.tokenize.template import encode_batch

    return encode_batch(tokenizer, [row], train_on).example(0)


def test_every_assistant_turn_of_a_conversation_is_trained():
    """Seen on main: a 10-turn conversation taught one reply (the last); the four before it were prompt."""
    tokenizer = _tokenizer("llama3", [TEN_TURNS])
    ids, mask = _encode(tokenizer, _row(TEN_TURNS))
    turns = [tokenizer.decode(run) for run in _trained_runs(ids, mask)]
    assert turns == [f"Answer {i + 1} follows.<|eot_id|>" for i in range(5)]


def test_only_the_final_turn_gets_the_eos_the_template_does_not_write():
    """Gemma 2 ends every turn with <end_of_turn>, not the EOS: training appends the EOS after the final reply (so
    the model learns to stop where generation stops, as for a single reply), never inside the conversation."""
    tokenizer = _tokenizer("gemma2")
    ids, mask = _encode(tokenizer, _row(CHAT))
    assert [tokenizer.decode(run) for run in _trained_runs(ids, mask)] == [
        "Red is one.<end_of_turn>\n",
        "Blue, too.<end_of_turn>\n",
        "Red feels warmer.<end_of_turn>\n<eos>",
    ]


@pytest.mark.parametrize(
    "family, messages, tools",
    [
        ("llama3", [{"role": "system", "content": "Be brief."}, *CHAT], None),
        ("llama3", TOOL_CHAT, TOOLS),
        ("qwen2.5", [{"role": "system", "content": "Be brief."}, *CHAT], None),
        ("qwen2.5", TOOL_CHAT, TOOLS),
        ("gemma2", CHAT, None),  # Gemma 2 has no system role and no tools
    ],
    ids=["llama3", "llama3-tools", "qwen2.5", "qwen2.5-tools", "gemma2"],
)
def test_each_assistant_turn_trains_its_own_text_and_end_of_turn_and_nothing_else(family, messages, tools):
    """Decoded, the trained tokens of each turn are the turn's text (or the template's rendering of its tool
    call) and the template's end of turn; the whole example is the template's rendering; and the prompt of the
    final reply tokenizes as evaluation encodes it (render_pair's prompt, alone)."""
    from fineflow.tokenize.template import render_pair

    tokenizer = _tokenizer(family)
    row = _row(messages, tools)
    ids, mask = _encode(tokenizer, row)
    expected = [
        (TOOL_CALL_TEXT[family] if m.get("tool_calls") else m["content"]) + END_OF_TURN[family]
        for m in messages
        if m["role"] == "assistant"
    ]
    eos = "" if END_OF_TURN[family].rstrip().endswith(tokenizer.eos_token) else tokenizer.eos_token
    expected[-1] += eos  # the final reply ends with the EOS (Gemma's turns end with <end_of_turn>)
    assert [tokenizer.decode(run) for run in _trained_runs(ids, mask)] == expected
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(row["messages"], tools=tools, tokenize=False) + eos
    prompt = tokenizer.encode(render_pair(tokenizer, row)[0], add_special_tokens=False)
    assert ids[: len(prompt)] == prompt and not any(mask[len(prompt) - 1 : len(prompt)])
    print(MASKS, json.dumps({"family": family, "tools": bool(tools), **_role_counts(tokenizer, row, ids, mask)}))


def _role_counts(tokenizer, row: dict, ids: list[int], mask: list[int]) -> dict:
    """Masked tokens by the role of the message whose prefix rendering first holds them (what a template writes
    before the first message counts with it; an assistant turn's header is "assistant"), and trained tokens."""
    from fineflow.tokenize.conversation import render

    messages, tools = row["messages"], row.get("tools")
    ends = [_rendered_length(tokenizer, messages[:i], tools) for i in range(1, len(messages) + 1)]
    encoding = tokenizer(render(tokenizer, messages, tools), add_special_tokens=False, return_offsets_mapping=True)
    assert encoding["input_ids"] == ids[: len(encoding["input_ids"])]  # the pieces tokenize as the whole here
    counts = {"trained": sum(mask)}
    for (start, _), trained in zip(encoding["offset_mapping"], mask):
        if not trained:
            role = messages[next(i for i, end in enumerate(ends) if start < end)]["role"]
            counts[role] = counts.get(role, 0) + 1
    return counts


def _rendered_length(tokenizer, messages: list[dict], tools) -> int:
    """0 for a prefix the template cannot render alone (Llama 3.1 with tools wants a user message after the system
    message): its tokens count with the next message."""
    from fineflow.tokenize.conversation import RenderError, render

    try:
        return len(render(tokenizer, messages, tools))
    except RenderError:
        return 0


def test_last_assistant_trains_only_the_final_reply_as_before():
    tokenizer = _tokenizer("qwen2.5")
    ids, mask = _encode(tokenizer, _row(CHAT), "last_assistant")
    assert [tokenizer.decode(run) for run in _trained_runs(ids, mask)] == ["Red feels warmer.<|im_end|>\n"]


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "gemma2", "qwen3"])
def test_a_single_reply_is_the_same_example_either_way(family):
    tokenizer = _tokenizer(family)
    row = _row(CHAT[:2])
    assert _encode(tokenizer, row) == _encode(tokenizer, row, "last_assistant")


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_turn():
    """Qwen3 writes an empty think block into the last assistant turn only: the conversation through turn 1 is
    not the start of the whole, so its turns cannot be read off the rendering. Refused, not guessed; the final
    reply alone (last_assistant) renders consistently."""
    from fineflow.tokenize.template import RenderError

    tokenizer = _tokenizer("qwen3")
    with pytest.raises(RenderError, match=r"row 1: messages\[1\] \(assistant\): .*train_on: last_assistant"):
        _encode(tokenizer, _row(CHAT))
    ids, mask = _encode(tokenizer, _row(CHAT), "last_assistant")
    assert [tokenizer.decode(run) for run in _trained_runs(ids, mask)] == ["Red feels warmer.<|im_end|>\n"]


def test_tool_call_arguments_given_as_a_json_string_render_as_the_object():
    """OpenAI writes arguments as a JSON string; the templates write them with tojson, which would quote the
    string again. The normal form holds the object."""
    text_call = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*TOOL_CHAT[:2], {"role": "assistant", "content": None, "tool_calls": [text_call]}, *TOOL_CHAT[3:]]
    assert _row(messages, TOOLS) == _row(TOOL_CHAT, TOOLS)
