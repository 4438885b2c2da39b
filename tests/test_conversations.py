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
    """A 10-turn conversation trains all five replies, not only the last (the four before it as prompt)."""
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
    from fineflow.tokenize.conversation import dropped_turn
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
    assert dropped_turn(row["messages"], tokenizer.decode(ids)) is None  # every message is in the rendering
    prompt = tokenizer.encode(render_pair(tokenizer, row)[0], add_special_tokens=False)
    assert ids[: len(prompt)] == prompt and not any(mask[len(prompt) - 1 : len(prompt)])
    print(MASKS, json.dumps({"family": family, "tools": bool(tools), **_role_counts(tokenizer, row, ids, mask)}))


def _role_counts(tokenizer, row: dict, ids: list[int], mask: list[int]) -> dict:
    """Masked tokens by the role of the message whose prefix rendering first holds them (an assistant turn's
    header is "assistant"), "template" for what the template writes before the first message's text (its default
    system prompt, the tools block, the first header), and the trained tokens."""
    from fineflow.tokenize.conversation import render

    messages, tools = row["messages"], row.get("tools")
    ends = [_rendered_length(tokenizer, messages[:i], tools) for i in range(1, len(messages) + 1)]
    whole = render(tokenizer, messages, tools)
    preamble = whole.find(messages[0]["content"].strip())
    encoding = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    assert encoding["input_ids"] == ids[: len(encoding["input_ids"])]  # the pieces tokenize as the whole here
    counts = {"trained": sum(mask)}
    for (start, _), trained in zip(encoding["offset_mapping"], mask):
        if not trained:
            owner = messages[next(i for i, end in enumerate(ends) if start < end)]["role"]
            role = "template" if start < preamble else owner
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


# --- the gate: declared checks of conversations, each naming the row and the turn ---------------------------------


def _gate(tmp_path, conversations: list, tokens=None):
    from fineflow.core.data_config import FieldMapping, ValidateParams
    from fineflow.data.formats import apply_mapping, read_rows
    from fineflow.data.validation import validate_rows

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations), encoding="utf-8")
    rows = apply_mapping(read_rows(path), FieldMapping(messages="messages"), str(path))
    return path, validate_rows(rows, str(path), ValidateParams(max_bad_share=1.0), tokens=tokens)


def test_conversations_out_of_shape_are_quarantined_naming_the_row_and_the_turn(tmp_path):
    from fineflow.data.tokens import TokenView

    second_call = {**CALL, "id": "call_2", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    conversations = [
        {"messages": TOOL_CHAT, "tools": TOOLS},  # 1: good
        {"messages": [*CHAT[:2], {"role": "assistant", "content": "Green as well."}]},  # 2: two replies in a row
        {"messages": [CHAT[0], {"role": "assistant", "content": " "}, *CHAT[2:]]},  # 3: an empty turn
        {
            "messages": [
                *TOOL_CHAT[:2],
                {"role": "assistant", "content": "", "tool_calls": [CALL, second_call]},
                *TOOL_CHAT[3:],
            ]
        },
        {"messages": [CHAT[0], {"role": "tool", "content": "{}"}, CHAT[1]]},  # 5: a result nobody asked for
    ]
    path, outcome = _gate(tmp_path, conversations, TokenView(_tokenizer("qwen2.5"), 2048))
    assert [row.line for row in outcome.kept] == [1]
    found = {row.line: row.reasons for row in outcome.quarantined}
    assert found == {
        line: [f"{path}:{line}: failed {reason}"]
        for line, reason in [
            (2, "chat_role_order(messages) (messages[2]: the assistant turn cannot follow messages[1] (assistant))"),
            (3, "chat_non_empty(turns) (messages[1] (assistant): the message is empty)"),
            (4, "chat_tool_results(messages) (messages[2].tool_calls[1] (get_weather): no tool message answers it)"),
            (5, "chat_role_order(messages) (messages[1]: the tool turn cannot follow messages[0] (user))"),
        ]
    }
    report = outcome.report()["checks"]
    assert {name: report[name]["failed_rows"] for name in report if name.startswith("chat_")} == {
        "chat_role_order(messages)": 2,
        "chat_non_empty(turns)": 1,
        "chat_tool_results(messages)": 1,
        "chat_template_renders(row)": 0,
        "chat_turns_rendered(template)": 0,
        "chat_turns_fit(seq_len)": 0,
    }
    assert report["chat_turns_fit(seq_len)"]["category"] == "chat_truncation"


def test_a_turn_the_template_drops_is_quarantined(tmp_path):
    """Phi-3's template writes user and assistant messages only: a system message would silently not be trained
    with, so the row is refused, naming the message."""
    from fineflow.data.tokens import TokenView

    conversations = [{"messages": CHAT}, {"messages": [{"role": "system", "content": "Answer like a pirate."}, *CHAT]}]
    path, outcome = _gate(tmp_path, conversations, TokenView(_tokenizer("phi3"), 512))
    assert [row.line for row in outcome.kept] == [1]
    assert outcome.quarantined[0].reasons == [
        f"{path}:2: failed chat_turns_rendered(template) (messages[0] (system): the chat template drops this turn's "
        "text from the rendering)"
    ]


def test_a_conversation_truncation_would_cut_inside_an_assistant_turn_is_quarantined(tmp_path):
    """tokenize.seq_len falling inside the third reply: quarantined (a reply cut before its end would be trained
    as if it ended there). Falling between two turns: kept, its later turns lost to the truncation warning only."""
    from fineflow.data.tokens import TokenView

    tokenizer = _tokenizer("llama3")
    ids, mask = _encode(tokenizer, _row(TEN_TURNS))
    starts = [i for i in range(len(mask)) if mask[i] and not mask[i - 1]]
    ends = [i + 1 for i in range(len(mask)) if mask[i] and (i + 1 == len(mask) or not mask[i + 1])]
    inside, between = starts[2] + 2, ends[1]
    path, outcome = _gate(tmp_path, [{"messages": TEN_TURNS}], TokenView(tokenizer, inside))
    assert outcome.quarantined[0].reasons == [
        f"{path}:1: failed chat_turns_fit(seq_len) (messages[6] (assistant): tokenize.seq_len={inside} cuts this turn "
        f"after 2 of its {ends[2] - starts[2]} tokens (the conversation has {len(ids)}))"
    ]
    _, outcome = _gate(tmp_path, [{"messages": TEN_TURNS}], TokenView(tokenizer, between))
    assert not outcome.quarantined and outcome.kept[0].warnings[0].endswith("truncated to tokenize.seq_len)")


def test_pii_redaction_reaches_tool_call_arguments_and_tool_results(tmp_path):
    """validate.pii: redact replaces PII in every text the template renders: a tool call's arguments and a tool
    result too, not only the derived instruction and output."""
    from fineflow.core.config import parse_params
    from fineflow.data.formats import Row
    from fineflow.data.validation import validate_rows

    call = {**CALL, "function": {"name": "send_mail", "arguments": {"to": "ann@example.org", "body": "Hi"}}}
    messages = [
        {"role": "user", "content": "Mail Ann that I am late."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sent to ann@example.org"},
        {"role": "assistant", "content": "Done."},
    ]
    outcome = validate_rows(
        [Row(1, data=_row(messages))], "chat", parse_params({"validate": {"pii": "redact"}}).validate_
    )
    [row] = outcome.kept
    assert "ann@example.org" not in json.dumps(row.data)
    assert row.data["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"to": "[EMAIL]", "body": "Hi"}
    assert row.data["messages"][2]["content"] == "sent to [EMAIL]"


def test_a_template_without_tools_that_rejects_a_tool_conversation_is_quarantined(tmp_path):
    from fineflow.data.tokens import TokenView

    path, outcome = _gate(
        tmp_path, [{"messages": CHAT}, {"messages": TOOL_CHAT[1:]}], TokenView(_tokenizer("gemma2"), 512)
    )
    [reason] = outcome.quarantined[0].reasons
    assert reason.startswith(f"{path}:2: failed chat_template_renders(row)") and "must alternate" in reason


# --- shards: a conversation is one example, packed whole; the chat rule keys chat shards only ----------------------


def test_a_conversation_is_packed_whole_as_one_example_that_attends_only_to_itself(tmp_path):
    import numpy as np

    from fineflow.tokenize.shards import PackedShard
    from fineflow.tokenize.template import encode_batch
    from fineflow.tokenize.tokenization import tokenize_to_shard

    tokenizer = _tokenizer("qwen2.5")
    rows = [_row(CHAT), _row(TOOL_CHAT[1:]), _row(CHAT[:2]), _row(TEN_TURNS)]
    expected = encode_batch(tokenizer, rows)
    meta = tokenize_to_shard(rows, tokenizer, "unused", tmp_path / "s", 256, np.dtype(np.uint16), 1, 16, {})
    shard = PackedShard(tmp_path / "s")
    examples = np.fromfile(tmp_path / "s/examples.idx", dtype=np.int64).reshape(-1, 3)
    assert meta["examples"] == len(rows) == len(examples) and meta["truncated_examples"] == 0
    for i, (row, start, length) in enumerate(examples):
        assert (
            shard.tokens[row, start : start + length].tolist(),
            shard.loss_mask[row, start : start + length].tolist(),
        ) == expected.example(i)
        # positions restart at the conversation's first token: the block-diagonal attention ends at its edges
        assert shard.positions[row, start : start + length].tolist() == list(range(length))
    assert meta["trained_tokens"] == int(expected.mask.sum())


def test_the_chat_rule_keys_the_shards_of_chat_rows_only(tmp_path):
    """Instruction rows keep the template hash (and so the shards, and the model trained on them) they had; a
    split of conversations gets the chat-turn rule and tokenize.train_on in its hash, and a change of either
    rebuilds it."""
    from fineflow.core.tokenize_config import TokenizeParams
    from fineflow.tokenize.template import template_hash
    from fineflow.tokenize.tokenization import content_key, split_template_hash

    tokenizer = _tokenizer("llama3")
    instructions, chats = tmp_path / "instructions.jsonl", tmp_path / "chats.jsonl"
    instructions.write_text(json.dumps({"instruction": "Say hi.", "input": "", "output": "hi"}) + "\n")
    chats.write_text(json.dumps(_row(CHAT)) + "\n")
    every, last = TokenizeParams(), TokenizeParams(train_on="last_assistant")
    assert split_template_hash(instructions, tokenizer, every) == template_hash(tokenizer)
    assert content_key(instructions, tokenizer, every) == content_key(instructions, tokenizer, last)
    assert split_template_hash(chats, tokenizer, every) not in {
        template_hash(tokenizer),
        split_template_hash(chats, tokenizer, last),
    }
    assert content_key(chats, tokenizer, every) != content_key(chats, tokenizer, last)


# --- through the real stages ---------------------------------------------------------------------------------------

EXAMPLES = ("data/examples/chat_tools.jsonl", "data/examples/chat_tools_eval.jsonl")
UNANSWERED = {  # one more train row: a tool call that no tool message answers
    "messages": [
        {"role": "user", "content": "What is the weather in Berlin?"},
        {"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": "call99999"}]},
        {"role": "assistant", "content": "Probably grey."},
    ],
}


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _qwen_turn(message: dict) -> str:
    """Qwen2.5's rendering of an assistant turn, written out here from its template's text, not computed."""
    calls = [
        f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {json.dumps(c["function"]["arguments"])}}}\n'
        "</tool_call>"
        for c in message.get("tool_calls", [])
    ]
    return "\n".join(([message["content"]] if message["content"] else []) + calls) + "<|im_end|>\n"


@pytest.mark.scenario
@pytest.mark.slow
def test_the_bundled_chat_set_with_tool_calls_runs_every_stage(tmp_path):
    """`dvc repro` on data/examples/chat_tools.jsonl (multi-turn, tool calls and results, tools) with a tiny Qwen2.5
    and its real template: the gate quarantines an unanswered tool call naming row and turn; each conversation is
    one packed example whose trained tokens are exactly its assistant turns (text or tool calls, then <|im_end|>);
    training runs on them; evaluation prompts with the conversation up to the final reply, tools included."""
    import subprocess
    import sys
    import time

    import numpy as np
    from transformers import AutoTokenizer

    from fineflow.tokenize.shards import PackedShard
    from fineflow.tokenize.template import render_pair
    from tests.conftest import ROOT, copy_project, venv_env
    from tests.families import save_family

    began = time.monotonic()
    lines = [line for path in EXAMPLES for line in (ROOT / path).read_text(encoding="utf-8").splitlines()]
    base = save_family("qwen2.5", lines * 3, tmp_path / "base")
    overrides = {
        "model.base": str(base),
        "data.train_path": EXAMPLES[0],
        "data.eval_path": EXAMPLES[1],
        "data.mapping.messages": "messages",
        "tokenize.seq_len": 1024,
        "train.steps": 30,
        "train.lr": 0.01,
        "train.lora.target_modules": "all-linear",
        "checkpoint.every_steps": 30,
        "evaluate.max_gen_toks": 8,
    }
    project = copy_project(tmp_path / "project", overrides)
    with (project / EXAMPLES[0]).open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(UNANSWERED) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "repro"], cwd=project, env=venv_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    [quarantined] = _jsonl(project / "data/validated/quarantine.jsonl")
    assert quarantined["reasons"] == [  # in the suite's order: the turns' order, then the tool results
        f"{EXAMPLES[0]}:13: failed chat_role_order(messages) (messages[2]: the assistant turn cannot follow "
        "messages[1] (assistant))",
        f"{EXAMPLES[0]}:13: failed chat_tool_results(messages) (messages[1].tool_calls[0] (get_weather): no tool "
        "message answers it)",
    ]
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = _jsonl(project / "data/validated/train.jsonl")
    shard = PackedShard(project / "data/shards/train")
    examples = np.fromfile(project / "data/shards/train/examples.idx", dtype=np.int64).reshape(-1, 3)
    assert len(examples) == len(rows) == 12
    counts: dict[str, int] = {}
    for row, (packed, start, length) in zip(rows, examples):
        ids = shard.tokens[packed, start : start + length].tolist()
        mask = shard.loss_mask[packed, start : start + length].tolist()
        turns = [_qwen_turn(m) for m in row["messages"] if m["role"] == "assistant"]
        assert [tokenizer.decode(run) for run in _trained_runs(ids, mask)] == turns
        for role, n in _role_counts(tokenizer, row, ids, mask).items():
            counts[role] = counts.get(role, 0) + n
    evaluated = _jsonl(project / "data/validated/eval.jsonl")
    for task in ("fineflow_synth", "fineflow_synth_mc"):
        for sample in _jsonl(project / f"eval/samples/candidate/{task}.jsonl"):
            row = evaluated[sample["doc_id"]]
            prompt = render_pair(tokenizer, row)[0]
            assert ("# Tools" in prompt) == bool(row.get("tools")) and all(
                (r[0] if isinstance(r, list) else r["arg_0"]) == prompt for r in sample["arguments"]
            )
    losses = [s["loss"] for s in _jsonl(project / "reports/train_steps.jsonl") if "loss" in s]
    assert losses[-1] < losses[0]
    decision = json.loads((project / "reports/promote.json").read_text())["decision"]
    print(MASKS, json.dumps({"set": EXAMPLES[0], **counts, "loss": [round(losses[0], 3), round(losses[-1], 3)]}))
    print(f"chat scenario: gate {decision}, {time.monotonic() - began:.0f} s")


def test_the_tokenize_stage_names_the_file_and_row_a_template_cannot_mask(tmp_path):
    """A row the gate kept only as a warning (validate.checks.chat_template: warn) stops the tokenize stage with
    the rows file, the row and the turn, not a traceback from the renderer."""
    from fineflow.core.tokenize_config import TokenizeParams
    from fineflow.errors import FineflowError
    from fineflow.tokenize.tokenization import tokenize_split

    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps(_row(CHAT[:2])) + "\n" + json.dumps(_row(CHAT)) + "\n")
    with pytest.raises(FineflowError, match=rf"{rows}: row 2: messages\[1\] \(assistant\): the chat template renders"):
        tokenize_split(_tokenizer("qwen3"), "unused", rows, tmp_path / "shard", TokenizeParams())
    assert not (tmp_path / "shard").exists() and not (tmp_path / ".tmp-shard").exists()
