"""The exports' layouts for other runtimes (fineflow.export.ollama, fineflow.export.vllm): the Ollama Modelfile's
template derived from the training chat template and verified against it (the embedded model, SmolLM2's ChatML,
real templates of other families, a template the derivation cannot reproduce), and the champion's adapter laid out
for vLLM's LoRA serving with every refusal vLLM's loader would make. Neither Ollama, Go nor vLLM runs here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from fineflow.errors import FineflowError
from fineflow.export.ollama import NotDerivable, derive_pieces, verify, write_modelfile
from fineflow.export.vllm import max_lora_rank, write_vllm_layout
from tests.families import TOKENS, build_tokenizer

# ---------------------------------------------------------------- Ollama


def ollama_commands(modelfile: str) -> list[tuple[str, str]]:
    """The Modelfile's commands as Ollama's parser (parser/parser.go ParseFile) reads them: a value ends at a
    newline once its quotes ("..." or \"\"\"...\"\"\") are closed, and is unquoted."""
    commands, name, value = [], None, ""
    for line in modelfile.splitlines(keepends=True):
        if name is None:
            name, _, value = line.partition(" ")
        else:
            value += line
        text = value.rstrip("\n").strip()
        quote = '"""' if text.startswith('"""') else '"' if text.startswith('"') else ""
        if not quote or (len(text) >= 2 * len(quote) and text.endswith(quote)):
            commands.append((name.lower(), text[len(quote) : len(text) - len(quote)] if quote else text))
            name, value = None, ""
    assert name is None, f"unclosed value for {name}"
    return commands


def eval_conversations(built: Path, tokenizer, work: Path) -> list[list[dict]]:
    from fineflow.export.trained import rendered_eval_docs

    return [doc.conversation for doc in rendered_eval_docs(built / "data/validated/eval.jsonl", tokenizer, work, 8)]


def test_the_embedded_models_modelfile_is_derived_verified_and_reads_back_as_ollama_parses_it(built, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built / "models/base")
    conversations = eval_conversations(built, tokenizer, tmp_path / "work")
    record = write_modelfile(tmp_path, "model-f16.gguf", tokenizer, [tokenizer.eos_token_id], conversations)
    # every eval conversation and the system one, each as a prompt and whole
    assert record["checks"] == {
        "derived": True,
        "compared": 2 * (len(conversations) + 1),
        "refused_by_training": 0,
        "limits": [],
        "bos": None,
    }
    assert record["stop"] == ["</s>", "### User:"]  # the EOS's text, and the turn that follows an answer
    commands = ollama_commands((tmp_path / "Modelfile").read_text(encoding="utf-8"))
    assert commands == [
        ("from", "./model-f16.gguf"),
        ("template", record["template"]),
        ("parameter", 'stop "</s>"'),
        ("parameter", 'stop "### User:"'),
    ]
    assert '{{ else if eq $m.Role "assistant" }}### Assistant:\n{{ $m.Content }}\n{{ end }}' in record["template"]
    assert "{%" not in record["template"]  # nothing of the Jinja text is carried over


def test_a_derivation_that_does_not_reproduce_training_is_caught_and_leaves_the_template_out(built, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built / "models/base")
    conversations = eval_conversations(built, tokenizer, tmp_path / "work")
    pieces = derive_pieces(tokenizer)
    before, after = pieces.turns["assistant"]
    pieces.turns["assistant"] = (before, after + "\n")  # one newline too many after an answer
    with pytest.raises(NotDerivable, match=r"conversation 0 \(generation prompt: False\) assembles differently"):
        verify(pieces, tokenizer, conversations)
    # a branch on the content itself: the sentinels are short, the eval answers' turns are not
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['content'] | length > 12 %}LONG {% endif %}{{ m['role'] }}: "
        "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    record = write_modelfile(tmp_path, "model-f16.gguf", tokenizer, [tokenizer.eos_token_id], conversations)
    assert record["template"] is None and record["checks"]["derived"] is False
    assert "assembles differently from training" in record["checks"]["reason"]
    assert "no TEMPLATE" in record["checks"]["reason"]
    modelfile = (tmp_path / "Modelfile").read_text(encoding="utf-8")
    assert "TEMPLATE" not in modelfile and 'PARAMETER stop "</s>"' in modelfile


def test_text_ollamas_parser_or_go_would_misread_is_written_as_an_escaped_go_string():
    from fineflow.export.ollama import Pieces, go_template

    awkward = 'say "hi"\u00a0{{ x }}\U0001f600'  # a quote, a no-break space (the parser drops it), braces, an emoji
    pieces = Pieces("", "", None, {"user": (awkward, "\n"), "assistant": ("A: ", "\n")}, "A: ")
    template = go_template(pieces)
    literal = template.split('{{ if eq $m.Role "user" }}{{ "', 1)[1].split('" }}', 1)[0]
    assert '"' not in literal and "\u00a0" not in literal  # nothing the Modelfile's quotes or parser would eat
    go_read = re.sub(r"\\u([0-9a-f]{4})|\\U([0-9a-f]{8})", lambda m: chr(int(m[1] or m[2], 16)), literal)
    assert go_read == awkward  # Go's string literal reads \uXXXX and \UXXXXXXXX back to the characters
    assert "A: {{ $m.Content }}\n" in template  # plain text stays as it is


# what each family's real template derives to, or why not (tests/families/templates: the texts the models ship)
FAMILY_OUTCOMES = {
    "llama3": (True, ["trims message contents", "tool calls", "after the first turn renders differently"]),
    "qwen2.5": (True, ["tool calls"]),
    "qwen3": (False, "depend on their position"),
    "mistral": (False, "conversation 1 (generation prompt: True) assembles differently"),  # system in the last turn
    "gemma2": (True, ["refused by the training template (System role not supported)", "trims message contents"]),
    "phi3": (True, ["dropped by the training template"]),
}


@pytest.mark.parametrize("family", sorted(FAMILY_OUTCOMES))
def test_real_family_templates_derive_or_say_why_not(family, tmp_path):
    derived, expected = FAMILY_OUTCOMES[family]
    texts = ["What is two plus two? Four. Name a colour. Blue. You answer in one short line."] * 20
    tokenizer = build_tokenizer(family, texts)
    eos = tokenizer.eos_token_id
    conversations = [[{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]]
    record = write_modelfile(tmp_path, "m.gguf", tokenizer, [eos], conversations)
    assert record["checks"]["derived"] is derived, record["checks"]
    assert record["stop"][0] == TOKENS[family].eos
    if not derived:
        assert expected in record["checks"]["reason"]
        assert record["template"] is None
        return
    for limit in expected:
        assert any(limit in recorded for recorded in record["checks"]["limits"]), (limit, record["checks"]["limits"])
    assert [name for name, _ in ollama_commands((tmp_path / "Modelfile").read_text())].count("template") == 1
    if TOKENS[family].bos and family != "mistral":  # the runtime adds the BOS: the template does not write it
        assert record["checks"]["bos"] and TOKENS[family].bos not in record["template"]


def _realmodel_missing() -> str | None:
    from tests.test_real_model import _realmodel_missing as missing

    return missing()


@pytest.mark.skipif(_realmodel_missing() is not None, reason=str(_realmodel_missing()))
def test_smollm2s_chatml_template_and_im_end_make_its_modelfile(tmp_path):
    from transformers import AutoTokenizer

    from fineflow.base.from_gguf import packaged_gguf

    gguf = packaged_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)  # the tokenizer alone: ~10 s
    conversations = [[{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]]
    record = write_modelfile(tmp_path, "model-q8_0.gguf", tokenizer, [tokenizer.eos_token_id], conversations)
    assert record["checks"]["derived"] and record["checks"]["limits"] == []
    assert record["stop"] == ["<|im_end|>"]
    # its BOS is <|im_start|>, which opens every turn: it stays in each turn, and the default system turn is its own
    assert record["template"].startswith('{{ range $i, $m := .Messages }}{{ if and (eq $i 0) (ne $m.Role "system") }}')
    assert "<|im_start|>system\nYou are a helpful AI assistant named SmolLM" in record["template"]
    assert '{{ if eq $m.Role "system" }}<|im_start|>system\n{{ $m.Content }}<|im_end|>\n' in record["template"]


# Go's text/template run as Ollama runs a .Messages template (template/template.go Execute: missingkey=zero, its
# "json" function, the messages as structs with Role and Content): the written template's own rendering
GO_RENDERER = """package main

import (
	"encoding/json"
	"os"
	"strings"
	"text/template"
)

type Message struct{ Role, Content string }

func main() {
	var in struct {
		Template      string
		Conversations [][]*Message
	}
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		panic(err)
	}
	funcs := template.FuncMap{"json": func(v any) string { b, _ := json.Marshal(v); return string(b) }}
	tmpl := template.Must(template.New("").Option("missingkey=zero").Funcs(funcs).Parse(in.Template))
	var out []string
	for _, messages := range in.Conversations {
		var b strings.Builder
		values := map[string]any{"System": "", "Messages": messages, "Tools": nil, "Response": ""}
		if err := tmpl.Execute(&b, values); err != nil {
			panic(err)
		}
		out = append(out, b.String())
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
"""


def go_render(template: str, conversations: list[list[dict]], work: Path) -> list[str]:
    import subprocess

    (work / "render.go").write_text(GO_RENDERER, encoding="utf-8")
    payload = json.dumps({"Template": template, "Conversations": conversations})
    done = subprocess.run(
        ["go", "run", "render.go"], cwd=work, input=payload, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout)


@pytest.mark.skipif(shutil.which("go") is None, reason="Go is not installed (apt-get install golang-go)")
def test_go_renders_each_derived_template_as_training_renders_the_conversation(built, tmp_path):
    from transformers import AutoTokenizer

    from fineflow.export.ollama import _forms
    from fineflow.export.parity import SYSTEM_CONVERSATION

    embedded = AutoTokenizer.from_pretrained(built / "models/base")
    conversations = eval_conversations(built, embedded, tmp_path / "work")[:4]
    conversations.append([*SYSTEM_CONVERSATION, {"role": "assistant", "content": "Green."}])
    texts = ["What is two plus two? Four. Name a colour. Blue. You answer in one short line."] * 20
    families = ("llama3", "qwen2.5", "gemma2", "phi3")
    tokenizers = {"embedded": embedded, **{family: build_tokenizer(family, texts) for family in families}}
    for name, tokenizer in tokenizers.items():
        record = write_modelfile(tmp_path / name, "m.gguf", tokenizer, [tokenizer.eos_token_id], conversations)
        forms = [form for conversation in conversations for form in _forms(conversation)]
        rendered = go_render(record["template"], [messages for messages, _ in forms], tmp_path)
        bos = tokenizer.bos_token if record["checks"]["bos"] else ""  # the runtime's, not the template's
        compared = 0
        for (messages, generation), text in zip(forms, rendered):
            try:
                trained = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
            except Exception:  # noqa: BLE001 - training refuses it (Gemma's system turn): nothing to match
                continue
            assert bos + text == trained, (name, messages)
            compared += 1
        assert compared >= len(forms) - 2, name


# ---------------------------------------------------------------- vLLM


def champion_with_adapter(base: Path, champion: Path, **lora) -> Path:
    """A champion folder as promote installs an adapter-only one: a real PEFT adapter on base, champion.json."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **lora})
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(champion)
    (champion / "champion.json").write_text(json.dumps({"candidate_id": "c1", "base_model": str(base)}))
    return champion


def test_the_exact_max_lora_rank_is_the_smallest_value_vllm_accepts_at_or_above_the_rank():
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 17, 300, 512, 513)] == [1, 8, 8, 16, 32, 320, 512, None]


def test_a_peft_adapter_is_laid_out_with_only_the_files_vllm_reads_and_the_serve_commands(built, tmp_path):
    base = built / "models/base"
    champion = champion_with_adapter(base, tmp_path / "champion", r=12)
    out = tmp_path / "export"
    record = write_vllm_layout(champion, out)
    assert record["problems"] == [] and record["max_lora_rank"] == 16
    adapter = out / "vllm/adapter"
    assert record["adapter"] == "vllm/adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # hard links, not copies
        assert os.stat(adapter / name).st_ino == os.stat(champion / name).st_ino
    assert record["commands"] == {
        "lora": f"vllm serve {base} --enable-lora --lora-modules champion={adapter} --max-lora-rank 16"
    }
    assert record["merged"] is None
    shutil.copytree(base, champion / "merged")  # promote stored a merged model too
    record = write_vllm_layout(champion, out)
    assert record["merged"] == "../champion/merged"
    assert record["commands"]["merged"] == f"vllm serve {champion / 'merged'}"


@pytest.mark.parametrize(
    "lora, reason",
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head']: vLLM loads only ['classifier', 'score']"),
        ({"use_dora": True}, "DoRA (use_dora): vLLM does not support DoRA"),
        ({"bias": "lora_only"}, "bias 'lora_only': vLLM does not support adapter biases"),
        ({"r": 600}, "rank 600 is above the largest --max-lora-rank vLLM accepts (512)"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights 'pissa': the init rewrites the base weights"),
    ],
)
def test_an_adapter_vllm_refuses_is_reported_with_its_reason(built, tmp_path, lora, reason):
    champion = champion_with_adapter(built / "models/base", tmp_path / "champion", **lora)
    record = write_vllm_layout(champion, tmp_path / "export")
    assert any(problem.startswith(reason) for problem in record["problems"]), record["problems"]
    if "r" in lora:  # no rank vLLM takes: no command to give
        assert "lora" not in record["commands"]


def test_a_fully_fine_tuned_champion_is_served_merged_and_no_champion_is_refused(built, tmp_path):
    champion = tmp_path / "champion"
    shutil.copytree(built / "models/base", champion)
    (champion / "champion.json").write_text(json.dumps({"candidate_id": "c1", "base_model": "unused"}))
    record = write_vllm_layout(champion, tmp_path / "export")
    assert record == {
        "adapter": None,
        "merged": "../champion",
        "commands": {"merged": f"vllm serve {champion}"},
        "problems": [],
    }
    with pytest.raises(FineflowError, match="no champion"):
        write_vllm_layout(tmp_path / "nothing", tmp_path / "export")
