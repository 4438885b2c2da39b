"""An Ollama Modelfile for a GGUF export, its TEMPLATE and stop parameters derived from the training tokenizer's own
chat template, never written per model.

How the template is derived: the training tokenizer's Jinja template is rendered (``apply_chat_template``) for
probe conversations whose contents are sentinels; the text around each sentinel gives, per role, the text before
and after a message's content, the text before the first message (a BOS, a default system turn), and the
generation prompt. From those pieces a Go text/template over Ollama's ``.Messages`` (``.Role``, ``.Content``) is
built: a range over the messages with one branch per role, the default system turn when the first message is not a
system one, and the generation prompt after the last message unless it is the assistant's.

What is verified here: the SAME pieces, assembled in Python exactly as the Go template assembles them, reproduce
``apply_chat_template``'s text for every given conversation (the eval docs') and a multi-turn one with a system
message, both as a prompt (the generation prompt after the last user turn) and as a full conversation (ending with
the assistant's turn, no generation prompt). A template the pieces cannot reproduce (tool-call logic, a system
message moved into the last user turn, content-dependent branches) gets no TEMPLATE: the record says why, and Ollama
falls back to the template it picks for the GGUF's own ``tokenizer.chat_template`` (its nearest built-in one,
unverified by fineflow). Go's own rendering of the written template is checked where Go is installed
(tests/test_export_layouts.py runs Go's text/template as Ollama's Execute does; skipped without Go). Ollama itself
is not run: not checked are its steps before the template: it merges consecutive messages of one role
(``"\\n\\n"``-joined) and tokenizes with the GGUF's ``add_bos_token`` (so a BOS the template writes is left to it).
A conversation ending with the assistant's turn is written closed, as training renders it (not left open for
Ollama's prefill).

Limits found while deriving are recorded, not hidden (``checks.limits``): a template that trims message contents
(Go templates in Ollama have no trim), roles the training template refuses or drops, tool messages (not derived).

The export format (``Ollama``): the Modelfile FROM the GGUF ``fineflow serve`` serves (else the float one), so it
comes after the GGUF format; export.json's "ollama" is ``write_modelfile``'s record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fineflow.export.interface import ExportFormat, ExportJob
from fineflow.export.parity import SYSTEM_CONVERSATION

ROLES = ("system", "user", "assistant")
# message contents the probes use: plain words no template rewrites, each findable in the rendered text
SENTINEL = "FFPROBE{}Q"


class NotDerivable(Exception):
    """The training template is not per-role prefix + content + suffix: why, in one line."""


@dataclass
class Pieces:
    """The training template cut into the texts the Go template writes around each message."""

    head: str  # before the first message, always (a BOS the runtime does not add itself)
    runtime_bos: str  # a BOS the template writes but the runtime adds (left out of the Go template)
    default_system: str | None  # written before a first message that is not a system one (a default system turn)
    turns: dict[str, tuple[str, str]]  # role -> (before its content, after its content)
    generation: str  # the generation prompt, after the last message when it is not the assistant's
    limits: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- deriving the pieces


def _render(tokenizer, messages: list[dict], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _probe(roles: list[str]) -> list[dict]:
    return [{"role": role, "content": SENTINEL.format(i)} for i, role in enumerate(roles)]


def _cut(text: str, messages: list[dict]) -> list[str]:
    """The texts between the messages' contents: [before the first, between 1st and 2nd, ..., after the last]."""
    parts, at = [], 0
    for message in messages:
        found = text.find(message["content"], at)
        if found < 0:
            raise NotDerivable(f"the template does not write a {message['role']} message's content where it stands")
        parts.append(text[at:found])
        at = found + len(message["content"])
    return [*parts, text[at:]]


def _strip_start(text: str, start: str, what: str) -> str:
    if not text.startswith(start):
        raise NotDerivable(f"{what}: {text!r} does not begin with {start!r}: the turns' texts depend on their position")
    return text[len(start) :]


def _strip_end(text: str, end: str, what: str) -> str:
    if end and not text.endswith(end):
        raise NotDerivable(f"{what}: {text!r} does not end with {end!r}: the turns' texts depend on their position")
    return text[: len(text) - len(end)]


def _chat_turns(tokenizer) -> tuple[str, dict[str, tuple[str, str]], str]:
    """The user's and assistant's texts around their contents, and what stands before the first user turn."""
    chat = _probe(["user", "assistant", "user", "assistant"])
    head, user_assistant, assistant_user, user_assistant_again, after_assistant = _cut(
        _render(tokenizer, chat, False), chat
    )
    if user_assistant_again != user_assistant:
        raise NotDerivable(
            "the second user/assistant exchange is written differently from the first (the turns' texts depend on "
            "their position, e.g. reasoning tags on the last turns only)"
        )
    after_user = _cut(_render(tokenizer, chat[:1], False), chat[:1])[1]
    before_user = _strip_start(assistant_user, after_assistant, "between an assistant and a user turn")
    before_assistant = _strip_start(user_assistant, after_user, "between a user and an assistant turn")
    before_first = _strip_end(head, before_user, "before the first user turn")
    return before_first, {"user": (before_user, after_user), "assistant": (before_assistant, after_assistant)}, head


def _system_turn(tokenizer, before_user: str) -> tuple[str, tuple[str, str]] | str:
    """(what stands before a system turn, its texts around the content), or why the template takes no system turn."""
    chat = _probe(["system", "user", "assistant"])
    try:
        text = _render(tokenizer, chat, False)
    except Exception as exc:  # noqa: BLE001 - a template refuses by raising (raise_exception), whatever the type
        return f"refused by the training template ({exc})"
    if chat[0]["content"] not in text:
        return "dropped by the training template (its content is not written)"
    head, between, *_ = _cut(text, chat)
    return head, ("", _strip_end(between, before_user, "between a system and a user turn"))


def _split_head(tokenizer, before_first: str, system_head: str, system: tuple[str, str]):
    """The common head (a BOS), the system turn's own opening, and the default system turn a template writes when
    the conversation has none (Qwen2.5's "You are Qwen...", Llama 3's dated header), as prefix + content + suffix."""
    bos = tokenizer.bos_token or ""
    # a BOS heads the text, not the system turn: when the runtime adds it, or when nothing else stands before a
    # first user turn (SmolLM2 calls <|im_start|> its BOS: there it opens every turn, so it is no head)
    real_bos = _runtime_adds_bos(tokenizer) or before_first == bos
    head = bos if bos and real_bos and before_first.startswith(bos) and system_head.startswith(bos) else ""
    opening, closing = system_head[len(head) :], system[1]
    default = before_first[len(head) :]
    if not default:
        return head, (opening, closing), None
    if not (default.startswith(opening) and default.endswith(closing)):
        raise NotDerivable(f"the template writes {default!r} before a conversation without a system message")
    return head, (opening, closing), default


def _runtime_adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts the BOS in front of encoded text itself (as llama.cpp and Ollama then do, from
    the GGUF's add_bos_token): a BOS the template writes is then the runtime's."""
    if tokenizer.bos_token_id is None:
        return False
    return tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]


def derive_pieces(tokenizer) -> Pieces:
    """The training template's pieces, or NotDerivable with the reason."""
    if not getattr(tokenizer, "chat_template", None):
        raise NotDerivable("the tokenizer has no chat template")
    limits = []
    before_first, turns, _ = _chat_turns(tokenizer)
    system = _system_turn(tokenizer, turns["user"][0])
    if isinstance(system, str):
        head, default = before_first, None
        limits.append(f"system messages: {system}; the Modelfile's template writes none")
    else:
        head, turns["system"], default = _split_head(tokenizer, before_first, *system)
    prompt = _probe(["user"])
    generation = _strip_start(_render(tokenizer, prompt, True), _render(tokenizer, prompt, False), "generation prompt")
    runtime_bos = ""
    if tokenizer.bos_token and head.startswith(tokenizer.bos_token) and _runtime_adds_bos(tokenizer):
        runtime_bos, head = tokenizer.bos_token, head[len(tokenizer.bos_token) :]
    limits += _content_limits(tokenizer)
    return Pieces(head, runtime_bos, default, turns, generation, limits)


def _content_limits(tokenizer) -> list[str]:
    """What Go's template cannot do that this training template does to contents: trimming; tools."""
    limits = []
    padded = [{"role": "user", "content": f"  {SENTINEL.format(9)} \n"}]
    if padded[0]["content"] not in _render(tokenizer, padded, True):
        limits.append(
            "the training template trims message contents; Ollama's Go template cannot: a message beginning or "
            "ending with whitespace renders with it"
        )
    if "tool" in tokenizer.chat_template:
        limits.append("tool calls and tool messages are not derived: the Modelfile's template writes no tool turn")
    return limits


# ---------------------------------------------------------------- assembling: in Python (checked) and in Go (written)


def assemble(pieces: Pieces, messages: list[dict]) -> str:
    """The text the Go template writes for messages (plus the BOS the runtime adds): what Ollama would prompt."""
    text = pieces.runtime_bos + pieces.head
    for i, message in enumerate(messages):
        if i == 0 and message["role"] != "system" and pieces.default_system is not None:
            text += pieces.default_system
        if message["role"] in pieces.turns:
            before, after = pieces.turns[message["role"]]
            text += before + message["content"] + after
    if messages and messages[-1]["role"] != "assistant":
        text += pieces.generation
    return text


def _go_text(text: str) -> str:
    """Literal text for the Go template inside the Modelfile's triple quotes: as is, unless it holds what the
    Modelfile parser or Go would read otherwise ("{{", a double quote, a character the parser drops); then a Go
    string literal action with those characters escaped."""
    if not text:
        return ""
    if "{{" not in text and '"' not in text and all(c.isprintable() or c in "\n\t" for c in text):
        return text
    escaped = "".join(c if c.isprintable() and c not in '"\\' else _go_escape(c) for c in text)
    return '{{ "' + escaped + '" }}'


def _go_escape(char: str) -> str:
    return f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else f"\\U{ord(char):08x}"


def go_template(pieces: Pieces) -> str:
    """The Go text/template Ollama renders over .Messages (no whitespace trimming: every character is a piece's)."""
    branches = "".join(
        f'{{{{ {"if" if not i else "else if"} eq $m.Role "{role}" }}}}'
        f"{_go_text(before)}{{{{ $m.Content }}}}{_go_text(after)}"
        for i, (role, (before, after)) in enumerate((r, pieces.turns[r]) for r in ROLES if r in pieces.turns)
    )
    default = ""
    if pieces.default_system is not None:
        default = f'{{{{ if and (eq $i 0) (ne $m.Role "system") }}}}{_go_text(pieces.default_system)}{{{{ end }}}}'
    generation = ""
    if pieces.generation:
        last = '(eq (len (slice $.Messages $i)) 1) (ne $m.Role "assistant")'
        generation = f"{{{{ if and {last} }}}}{_go_text(pieces.generation)}{{{{ end }}}}"
    return (
        f"{_go_text(pieces.head)}{{{{ range $i, $m := .Messages }}}}{default}{branches}{{{{ end }}}}"
        f"{generation}{{{{ end }}}}"
    )


# ---------------------------------------------------------------- verifying and writing


def _forms(conversation: list[dict]) -> list[tuple[list[dict], bool]]:
    """A conversation as Ollama sends it: the prompt (up to the last user turn, generation prompt) and, when it
    ends with the assistant's turn, the whole of it (no generation prompt)."""
    turns = conversation[:-1] if conversation[-1]["role"] == "assistant" else conversation
    forms = [(turns, True)]
    if conversation[-1]["role"] == "assistant":
        forms.append((conversation, False))
    return forms


def later_system_limit(pieces: Pieces, tokenizer) -> list[str]:
    """A system message after the first turn (Ollama keeps it where it stands): recorded when training writes it
    otherwise than the template (Llama 3 writes its dated header for the first one only), or refuses it."""
    if "system" not in pieces.turns:
        return []  # the template writes no system message at all (recorded with the reason)
    messages = _probe(["user", "assistant", "system", "user"])
    try:
        trained = _render(tokenizer, messages, True)
    except Exception:  # noqa: BLE001 - refused by training: the template writes it as a first one
        return ["a system message after the first turn is refused by the training template; the Modelfile's writes it"]
    if assemble(pieces, messages) != trained:
        return ["a system message after the first turn renders differently from training (send it first)"]
    return []


def verify(pieces: Pieces, tokenizer, conversations: list[list[dict]]) -> dict:
    """The pieces assembled against apply_chat_template for every form of every conversation."""
    compared, refused = 0, 0
    for i, conversation in enumerate(conversations):
        for messages, generation in _forms(conversation):
            try:
                trained = _render(tokenizer, messages, generation)
            except Exception:  # noqa: BLE001 - training would refuse it too (e.g. a system turn Gemma refuses)
                refused += 1
                continue
            served = assemble(pieces, messages)
            if served != trained:
                shorter = min(len(served), len(trained))
                at = next((k for k, (a, b) in enumerate(zip(served, trained)) if a != b), shorter)
                raise NotDerivable(
                    f"conversation {i} (generation prompt: {generation}) assembles differently from training from "
                    f"character {at}: {served[at : at + 40]!r} vs training {trained[at : at + 40]!r}"
                )
            compared += 1
    return {"compared": compared, "refused_by_training": refused}


def stop_texts(tokenizer, stop_ids: list[int], pieces: Pieces | None) -> list[str]:
    """Every end-of-turn token's text, and the template's turn terminator (the text after an assistant turn, or
    else the start of the next user turn, stripped): where generation must end."""
    stops = [tokenizer.decode([i], skip_special_tokens=False) for i in stop_ids]
    if pieces is not None:
        stops.append(pieces.turns["assistant"][1].strip() or pieces.turns["user"][0].strip())
    return [stop for stop in dict.fromkeys(stops) if stop.strip()]


def _quoted(value: str) -> str | None:
    """A Modelfile value as Ollama's parser reads it back (a value ends at a newline once its quotes close)."""
    if '"""' in value:
        return None
    return f'"""{value}"""' if ("\n" in value or '"' in value) else f'"{value}"'


def modelfile_text(gguf_name: str, template: str | None, stops: list[str]) -> str:
    lines = [f"FROM ./{gguf_name}"]
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f"PARAMETER stop {_quoted(stop)}" for stop in stops if _quoted(stop)]
    return "\n".join(lines) + "\n"


def write_modelfile(out_dir: Path, gguf_name: str, tokenizer, stop_ids: list[int], conversations: list[list[dict]]):
    """<out_dir>/Modelfile for the GGUF gguf_name (in out_dir): the derived TEMPLATE when verified, the stops; the
    record of what was derived, verified and left out."""
    checks: dict = {"derived": False}
    pieces = None
    try:
        pieces = derive_pieces(tokenizer)
        system_chat = [*SYSTEM_CONVERSATION, {"role": "assistant", "content": "Green."}]
        limits = pieces.limits + later_system_limit(pieces, tokenizer)
        checks.update(verify(pieces, tokenizer, [*conversations, system_chat]), derived=True, limits=limits)
        checks["bos"] = "added by the runtime (the GGUF's add_bos_token)" if pieces.runtime_bos else None
    except NotDerivable as exc:
        pieces = None
        checks["reason"] = (
            f"{exc}: the Modelfile has no TEMPLATE (Ollama then picks one for the GGUF's tokenizer.chat_template, "
            "if any: unverified)"
        )
    template = go_template(pieces) if pieces is not None else None
    stops = stop_texts(tokenizer, stop_ids, pieces)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "Modelfile").write_text(modelfile_text(gguf_name, template, stops), encoding="utf-8")
    return {
        "file": "Modelfile",
        "gguf": gguf_name,
        "template": template,
        "stop": stops,
        "checks": json.loads(json.dumps(checks)),
        "command": "ollama create <name> -f Modelfile && ollama run <name>",
    }


class Ollama(ExportFormat):
    """An Ollama Modelfile FROM the served GGUF (else the float one), its TEMPLATE derived from the training chat
    template and verified on the eval conversations, its stops the ids the model was trained to stop on."""

    name = "ollama"
    summary = "an Ollama Modelfile for the served GGUF, its TEMPLATE derived from the training chat template"
    needs = ("gguf",)

    def write(self, job: ExportJob, report: dict) -> dict:
        gguf = report["exports"][report["serve"] or job.params.export.float_type]["file"]
        trained = job.trained
        conversations = [doc.conversation for doc in trained.docs]
        return {self.name: write_modelfile(job.out_dir, gguf, trained.tokenizer, trained.stop_ids, conversations)}

    def serving(self, report: dict, out_dir: Path) -> list[str]:
        """`ollama create` and `ollama run`, when a GGUF is served (else the Modelfile is FROM a file the parity
        check refused or did not gate, which the card does not offer)."""
        record = report.get(self.name)
        if not record or report.get("serve") is None:
            return []
        return [
            "Ollama (the Modelfile beside this card):",
            "",
            "```bash",
            f"cd {out_dir} && {record['command']}",
            "```",
            "",
        ]
