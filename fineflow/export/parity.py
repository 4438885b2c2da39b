"""The parity check that can refuse: a GGUF is shippable only when llama.cpp, reading it, answers like the model
that was trained and evaluated.

Four checks, each failing with its own reason (``Check.reason``):

- ``token_ids``: the GGUF's tokenizer (llama.cpp, the file loaded vocab-only) gives the training tokenizer's ids
  for every eval prompt and every full training text (prompt + response), each encoded as its runtime encodes a
  prompt (the training tokenizer's own special-token policy; llama.cpp's ``add_bos`` from the file), and for every
  eval conversation rendered by the chat template (what a served chat completion tokenizes);
- ``chat_template``: the template stored in the GGUF, rendered by llama-cpp-python's own renderer (the
  ``Jinja2ChatFormatter`` its chat completions use, with the file's BOS/EOS texts), gives the training
  tokenizer's ``apply_chat_template`` text for a set of conversations (each eval row's, a multi-turn one with a
  system message and, when the template renders tool calls, a tool call and its result with the tool's definition),
  with and without the generation prompt;
- ``stop_tokens``: the GGUF's EOS is the training tokenizer's, and every end-of-turn id the model was trained to
  stop on (the tokenizer's EOS, generation_config's ``eos_token_id``) ends generation in llama.cpp;
- ``scores``: the GGUF run by llama.cpp on CPU and the merged model run by transformers answer the eval docs
  greedily, as the evaluate stage's ``fineflow_synth`` task does (its prompt, its stop strings, max_gen_toks, the
  leading whitespace stripped), each answer scored by exact match; the paired bootstrap the gate uses
  (``fineflow.registry.gate.paired_bootstrap``) gives the export's exact-match difference and its CI: the
  difference must be within ±``export.tolerance[<type>]`` and the CI's lower end at least -tolerance (not worse
  by more than the tolerance, at the gate's confidence). A type without a tolerance is reported, not gated.

The first three need only the file's vocabulary and metadata; they run before any weights are loaded.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fineflow.errors import FineflowError
from fineflow.export import native_log
from fineflow.export.tooling import require_llama_cpp

# the fineflow_synth task's generation_kwargs.until (fineflow/evaluate/bundled_tasks/fineflow_synth.yaml; a test
# keeps the two equal): generation stops at the first of these, which is cut off
STOP_STRINGS = ("\n", "###")
SYSTEM_CONVERSATION = [
    {"role": "system", "content": "You answer in one short line."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And another one?"},
]

# a tool call and its result, rendered with the tool's definition, for a template that supports tools: what a
# served chat completion with `tools` sends (the arguments as a mapping, as the Hugging Face templates expect)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "name": "get_weather", "content": "18 C, clear"},
    {"role": "assistant", "content": "It is 18 C and clear in Paris."},
]


def supports_tools(template: str | None) -> bool:
    """Whether the chat template renders tool calls (it reads a message's tool_calls)."""
    return bool(template) and "tool_calls" in template


@dataclass
class Check:
    """One check's verdict: passed, why not (one line a person acts on), and its figures."""

    name: str
    passed: bool
    reason: str | None = None
    figures: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EvalDoc:
    """An eval row as the evaluate stage prompts it, with its target and its conversation."""

    prompt: str
    response: str  # the training text after the prompt (response prefix + output)
    target: str
    conversation: list[dict]


def eval_docs(rendered_rows: Path, limit: int | None = None) -> list[EvalDoc]:
    """EvalDocs from the evaluate stage's rendered eval rows (fineflow.evaluate.harness.render_eval_rows)."""
    docs = []
    for line in rendered_rows.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        conversation = row.get("messages") or [
            {"role": "user", "content": user},
            {"role": "assistant", "content": row["output"]},
        ]
        response = (row.get("response_prefix") or "") + row["output"]
        docs.append(EvalDoc(row["prompt"], response, row["output"], conversation))
    return docs[:limit] if limit else docs


def load_runtime(gguf_file: Path, vocab_only: bool, n_ctx: int = 512, threads: int | None = None):
    """llama.cpp (llama-cpp-python's Llama) on gguf_file, on CPU. n_ctx 0: the file's context length (not for a
    vocab-only load, which has no context length to take). Its loader's dump goes to the export's llama.cpp log
    when one is open (``fineflow.export.native_log``); ``verbose=False`` alone leaves llama.cpp's warnings on stderr."""
    llama_cpp = require_llama_cpp()
    start = native_log.mark()
    try:
        with native_log.native_output():
            return llama_cpp.Llama(
                model_path=str(gguf_file), vocab_only=vocab_only, n_ctx=n_ctx, n_threads=threads, verbose=False, seed=0
            )
    except ValueError as exc:  # llama-cpp-python's "Failed to load model from file", llama.cpp's reason in its log
        what = f"{gguf_file}: llama.cpp could not load it ({exc})"
        raise FineflowError(native_log.failure(what, native_log.output_since(start))) from None


# ---------------------------------------------------------------- the vocabulary and metadata checks


def runtime_ids(runtime, text: str) -> list[int]:
    """What llama.cpp feeds the model for a prompt: special tokens parsed, BOS as the file says."""
    return runtime.tokenize(text.encode("utf-8"), add_bos=True, special=True)


def first_difference(trained, served) -> int:
    """Where two sequences (ids, text) first differ; the shorter one's length when one is the other's prefix."""
    return next((k for k, (a, b) in enumerate(zip(trained, served)) if a != b), min(len(trained), len(served)))


def chat_texts(tokenizer, docs: list[EvalDoc]) -> list[str]:
    """Each eval conversation as the chat template renders it: what a chat completion feeds the model (the served
    path: `fineflow serve`, Ollama), where the eval prompts above are the evaluate stage's plain rendering."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    return [tokenizer.apply_chat_template(doc.conversation, tokenize=False) for doc in docs if doc.conversation]


def check_token_ids(runtime, tokenizer, docs: list[EvalDoc]) -> Check:
    prompts = [
        (f"eval text {i}", text, True) for i, doc in enumerate(docs) for text in (doc.prompt, doc.prompt + doc.response)
    ]
    # a rendered conversation carries its own special tokens (BOS too, where the template writes it): none added
    chats = [(f"chat-rendered conversation {i}", text, False) for i, text in enumerate(chat_texts(tokenizer, docs))]
    texts = prompts + chats
    for i, (name, text, add_special) in enumerate(texts):
        trained = tokenizer(text, add_special_tokens=add_special)["input_ids"]
        served = (
            runtime_ids(runtime, text) if add_special else runtime.tokenize(text.encode(), add_bos=False, special=True)
        )
        if trained != served:
            at = first_difference(trained, served)
            return Check(
                "token_ids",
                False,
                f"the GGUF's tokenizer differs from the training tokenizer on {name} ({text[:40]!r}...): "
                f"from token {at}, training {trained[at : at + 5]} vs llama.cpp {served[at : at + 5]} "
                f"({len(trained)} vs {len(served)} tokens)",
                {"texts": len(texts), "chat_texts": len(chats), "equal": i},
            )
    return Check("token_ids", True, figures={"texts": len(texts), "chat_texts": len(chats), "equal": len(texts)})


def _runtime_formatter(runtime, add_generation_prompt: bool):
    """llama-cpp-python's renderer of the file's chat template, built as its Llama builds it for chat completions."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    def text_of(token: int) -> str:
        return runtime._model.token_get_text(token) if token != -1 else ""

    return Jinja2ChatFormatter(
        template=runtime.metadata["tokenizer.chat_template"],
        eos_token=text_of(runtime.token_eos()),
        bos_token=text_of(runtime.token_bos()),
        add_generation_prompt=add_generation_prompt,
    )


def check_chat_template(runtime, tokenizer, docs: list[EvalDoc]) -> Check:
    trained_template = getattr(tokenizer, "chat_template", None)
    stored = runtime.metadata.get("tokenizer.chat_template")
    if not trained_template:
        return Check("chat_template", True, figures={"conversations": 0, "note": "the model has no chat template"})
    if not stored:
        return Check("chat_template", False, "the GGUF carries no chat template (tokenizer.chat_template)")
    conversations = [(doc.conversation, None) for doc in docs] + [(SYSTEM_CONVERSATION, None)]
    if supports_tools(trained_template):
        conversations.append((TOOL_CONVERSATION, TOOLS))
    rendered = 0
    for generation_prompt in (True, False):
        formatter = _runtime_formatter(runtime, generation_prompt)
        for i, (messages, tools) in enumerate(conversations):
            turns = messages[:-1] if generation_prompt and messages[-1]["role"] == "assistant" else messages
            trained = tokenizer.apply_chat_template(
                turns, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
            )
            served = formatter(messages=turns, tools=tools).prompt
            if trained != served:
                at = next(
                    (k for k, (a, b) in enumerate(zip(trained, served)) if a != b), min(len(trained), len(served))
                )
                return Check(
                    "chat_template",
                    False,
                    f"the GGUF's chat template renders conversation {i}{' (tool call)' if tools else ''} (generation "
                    f"prompt: {generation_prompt}) differently from training, from character {at}: "
                    f"{served[at : at + 60]!r} vs training {trained[at : at + 60]!r}",
                    {"conversations": len(conversations), "equal": rendered, "tool_calls": tools is not None},
                )
            rendered += 1
    figures = {"conversations": len(conversations), "equal": rendered, "tool_calls": bool(conversations[-1][1])}
    return Check("chat_template", True, figures=figures)


def trained_stop_ids(tokenizer, generation_eos: int | list[int] | None) -> list[int]:
    """The ids the model was trained and evaluated to stop on: its EOS and generation_config's eos_token_id."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    extra = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return sorted({*ids, *(i for i in extra if i is not None)})


def check_stop_tokens(runtime, tokenizer, generation_eos: int | list[int] | None) -> Check:
    import llama_cpp

    served_eos = runtime.token_eos()
    figures = {"training_eos": tokenizer.eos_token_id, "gguf_eos": served_eos}
    if served_eos != tokenizer.eos_token_id:
        name = runtime._model.token_get_text(served_eos) if served_eos != -1 else "none"
        return Check(
            "stop_tokens",
            False,
            f"the GGUF's EOS is {served_eos} ({name!r}), the training tokenizer's is {tokenizer.eos_token_id} "
            f"({tokenizer.eos_token!r}): llama.cpp would not stop where the model learned to",
            figures,
        )
    vocab = llama_cpp.llama_model_get_vocab(runtime._model.model)
    missing = [i for i in trained_stop_ids(tokenizer, generation_eos) if not llama_cpp.llama_vocab_is_eog(vocab, i)]
    if missing:
        return Check(
            "stop_tokens",
            False,
            f"token(s) {missing} end a turn in training (generation_config eos_token_id) but not in the GGUF",
            figures,
        )
    return Check("stop_tokens", True, figures=figures)


def vocabulary_checks(gguf_file: Path, tokenizer, generation_eos, docs: list[EvalDoc]) -> list[Check]:
    """token_ids, chat_template and stop_tokens of one GGUF, its vocabulary loaded alone."""
    runtime = load_runtime(gguf_file, vocab_only=True)
    try:
        return [
            check_token_ids(runtime, tokenizer, docs),
            check_chat_template(runtime, tokenizer, docs),
            check_stop_tokens(runtime, tokenizer, generation_eos),
        ]
    finally:
        runtime.close()


# ---------------------------------------------------------------- answering the eval docs


def cut_answer(text: str) -> str:
    """The task's post-processing: cut at the first stop string, strip the leading whitespace."""
    for stop in STOP_STRINGS:
        text = text.split(stop)[0]
    return text.lstrip()


def greedy_ids(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int):
    """transformers' greedy continuation of each prompt (token ids in), stopped at a stop id or max_new_tokens: the
    new ids of each. The one generation every PyTorch reference here uses (parity, the serve test, vLLM's bench)."""
    import torch

    answers = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stop_ids,
                pad_token_id=pad_id,
            )
            answers.append(out[0, ids.shape[1] :].tolist())
    return answers


def reference_answers(model_dir: Path, tokenizer, docs: list[EvalDoc], max_gen_toks: int, stop_ids: list[int]):
    """The merged model's greedy answers (transformers, float32 on CPU): what the evaluate stage generated."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    prompts = [tokenizer(doc.prompt)["input_ids"] for doc in docs]
    answers = greedy_ids(model, prompts, max_gen_toks, stop_ids, pad)
    return [cut_answer(tokenizer.decode(ids, skip_special_tokens=True)) for ids in answers]


def runtime_answer(runtime, prompt: str, max_gen_toks: int) -> str:
    """llama.cpp's greedy answer to one prompt, stopped at an end-of-generation token, a stop string or the limit."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(runtime._model.model)
    produced: list[int] = []
    for token in runtime.generate(runtime_ids(runtime, prompt), temp=0.0, top_k=1, top_p=1.0, min_p=0.0):
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            break
        produced.append(token)
        text = runtime.detokenize(produced).decode("utf-8", errors="replace")
        if len(produced) >= max_gen_toks or any(stop in text for stop in STOP_STRINGS):
            break
    return cut_answer(runtime.detokenize(produced).decode("utf-8", errors="replace"))


def runtime_answers(gguf_file: Path, docs: list[EvalDoc], max_gen_toks: int, threads: int | None) -> list[str]:
    runtime = load_runtime(gguf_file, vocab_only=False, n_ctx=0, threads=threads)  # the file's context length
    try:
        return [runtime_answer(runtime, doc.prompt, max_gen_toks) for doc in docs]
    finally:
        runtime.close()


def check_scores(
    answers: list[str], reference: list[str], docs: list[EvalDoc], tolerance: float | None, bootstrap: dict
) -> Check:
    """Exact match of the export's answers against the reference's, paired bootstrap; gated by tolerance."""
    from fineflow.registry.gate import paired_bootstrap

    exported = [float(a == d.target) for a, d in zip(answers, docs)]
    trained = [float(a == d.target) for a, d in zip(reference, docs)]
    result = paired_bootstrap(exported, trained, **bootstrap)
    figures = {
        "exact_match": round(sum(exported) / len(docs), 6),
        "reference_exact_match": round(sum(trained) / len(docs), 6),
        "same_answer": round(sum(a == b for a, b in zip(answers, reference)) / len(docs), 6),
        "delta": result.delta,
        "ci": [result.ci_low, result.ci_high],
        "docs": len(docs),
        "tolerance": tolerance,
    }
    if tolerance is None:
        return Check("scores", True, figures={**figures, "gated": False})
    # within tolerance both ways on the point difference (an export that scores far better answers differently
    # too), and, as the gate judges a candidate, not worse by more than tolerance at the CI's lower end
    if abs(result.delta) > tolerance or result.ci_low < -tolerance:
        return Check(
            "scores",
            False,
            f"exact match {figures['exact_match']:.3f} vs {figures['reference_exact_match']:.3f} (transformers): "
            f"delta {result.delta:+.3f}, CI [{result.ci_low:+.3f}, {result.ci_high:+.3f}]: the delta must be within "
            f"±{tolerance} and the CI's lower end at least -{tolerance} (export.tolerance)",
            {**figures, "gated": True},
        )
    return Check("scores", True, figures={**figures, "gated": True})


def verdict(kind: str, checks: list[Check]) -> dict:
    """One GGUF's parity report: shippable only when every check passed, with each failure's reason."""
    return {
        "type": kind,
        "shippable": all(check.passed for check in checks),
        "reasons": [f"{check.name}: {check.reason}" for check in checks if not check.passed],
        "checks": {check.name: asdict(check) for check in checks},
    }
