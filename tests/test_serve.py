"""`fineflow serve` (fineflow.export.serve): which GGUF it serves and what it refuses, and, nightly, the served
model answering an OpenAI client exactly as the PyTorch model answers greedily, for the embedded model and SmolLM2.

The refusals need no llama.cpp. The served answers need the `export` extra (llama-cpp-python with its server's
packages, the converter: tests/test_export.py's needs_llama_cpp) and the `openai` client.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fineflow.errors import FineflowError
from fineflow.export.serve import (
    CHAT_FORMAT,
    REPORT_FILE,
    chosen_gguf,
    default_kind,
    serve_command,
    serving_banner,
)
from tests.conftest import free_port, stop_by_pid, venv_env
from tests.test_export import _realmodel_missing, _tiny_params, needs_llama_cpp

# ---------------------------------------------------------------- which GGUF (no llama.cpp needed)


def _export(kind: str, size: int, shippable: bool = True, gated: bool = True, reasons=()) -> dict:
    scores = {"figures": {"gated": gated}}
    return {
        "file": f"model-{kind}.gguf",
        "bytes": size,
        "sha256": "0" * 64,
        "type": kind,
        "shippable": shippable,
        "reasons": list(reasons),
        "checks": {"scores": scores},
    }


def _export_dir(folder: Path, exports: dict, serve: str | None = None) -> Path:
    folder.mkdir(parents=True)
    for export in exports.values():
        (folder / export["file"]).write_bytes(b"g" * export["bytes"])
    report = {"champion": "c-7", "exports": exports, **({"serve": serve} if serve else {})}
    (folder / REPORT_FILE).write_text(json.dumps(report), encoding="utf-8")
    return folder


def test_the_default_is_the_reports_serve_else_the_smallest_shippable_gated_export(tmp_path):
    exports = {
        "f16": _export("f16", 300),
        "q8_0": _export("q8_0", 200),
        "q4_k_m": _export("q4_k_m", 100, gated=False),  # 4-bit: reported, not gated: not a default
        "q4_0": _export("q4_0", 50, shippable=False, reasons=["scores: delta -0.2"]),
    }
    folder = _export_dir(tmp_path / "export", exports)
    assert default_kind(json.loads((folder / REPORT_FILE).read_text())) == "q8_0"
    assert chosen_gguf(folder) == ("q8_0", folder / "model-q8_0.gguf")
    untemplated = _export("f16", 30)
    untemplated["checks"]["chat_template"] = {"figures": {"conversations": 0, "note": "the model has no chat template"}}
    bare = _export_dir(tmp_path / "bare", {"f16": untemplated})
    assert "--chat_format" not in serve_command(bare, None, "127.0.0.1", 8123)  # llama-cpp-python's fallback
    named = _export_dir(tmp_path / "named", exports, serve="f16")
    assert chosen_gguf(named) == ("f16", named / "model-f16.gguf")
    assert chosen_gguf(named, "q4_k_m") == ("q4_k_m", named / "model-q4_k_m.gguf")
    command = serve_command(folder, None, "127.0.0.1", 8123, threads=2)
    assert command[:3] == ["python", "-m", "fineflow.export.serve"]
    options = dict(zip(command[3::2], command[4::2]))
    assert options == {
        "--model": str(folder / "model-q8_0.gguf"),
        "--model_alias": "fineflow-c-7",
        "--chat_format": CHAT_FORMAT,
        "--n_ctx": "0",
        "--host": "127.0.0.1",
        "--port": "8123",
        "--n_threads": "2",
        "--n_threads_batch": "2",
    }


def test_an_export_the_parity_check_refused_is_served_only_when_allowed(tmp_path):
    reason = "chat_template: the GGUF's chat template renders conversation 0 differently"
    folder = _export_dir(tmp_path / "export", {"f16": _export("f16", 30, shippable=False, reasons=[reason])})
    with pytest.raises(FineflowError, match=r"no export is shippable with a gated score check .*chat_template"):
        chosen_gguf(folder)
    with pytest.raises(FineflowError) as info:
        chosen_gguf(folder, "f16")
    assert "export.json: the f16 export is not shippable" in str(info.value) and reason in str(info.value)
    assert "--allow-unshippable" in str(info.value)
    assert chosen_gguf(folder, "f16", allow_unshippable=True) == ("f16", folder / "model-f16.gguf")
    assert f"(f16, NOT shippable: {reason})" in serving_banner(folder, "f16", "127.0.0.1", 8000)
    with pytest.raises(FineflowError, match=r"no 'q8_0' export \(exported: \['f16'\]\)"):
        chosen_gguf(folder, "q8_0", allow_unshippable=True)


def test_a_missing_or_unreadable_report_and_a_gguf_of_another_size_are_refused(tmp_path):
    with pytest.raises(FineflowError, match=r"nowhere/export.json: no readable export report .*export stage"):
        chosen_gguf(tmp_path / "nowhere")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / REPORT_FILE).write_text("{not json", encoding="utf-8")
    with pytest.raises(FineflowError, match="broken/export.json: no readable export report"):
        chosen_gguf(broken)
    (broken / REPORT_FILE).write_text(json.dumps({"champion": None, "exports": {}}), encoding="utf-8")
    with pytest.raises(FineflowError, match=r"no GGUF exported \(champion: None\)"):
        chosen_gguf(broken)
    skipped = {"champion": "c-1", "exports": {}, "skipped": "export.enabled is false"}
    (broken / REPORT_FILE).write_text(json.dumps(skipped), encoding="utf-8")
    with pytest.raises(FineflowError, match=r"no GGUF exported \(export.enabled is false\): nothing to serve"):
        chosen_gguf(broken)
    folder = _export_dir(tmp_path / "export", {"f16": _export("f16", 30)})
    (folder / "model-f16.gguf").write_bytes(b"g" * 29)  # cut short after the check
    with pytest.raises(FineflowError, match=r"model-f16.gguf: 29 bytes, but .*export.json recorded 30 bytes"):
        chosen_gguf(folder)
    (folder / "model-f16.gguf").unlink()
    with pytest.raises(FineflowError, match=r"model-f16.gguf: missing, but"):
        chosen_gguf(folder)


def test_fineflow_serve_refuses_with_exit_2_and_one_line_naming_export_json(tmp_path, capsys):
    from fineflow.cli import main

    folder = _export_dir(tmp_path / "export", {"q8_0": _export("q8_0", 30, shippable=False, reasons=["x: y"])})
    assert main(["serve", "--export-dir", str(folder), "--type", "q8_0"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("fineflow serve: error: ") and "export.json" in error and "x: y" in error
    assert len(error.splitlines()) == 1


def test_without_the_servers_packages_fineflow_serve_says_how_to_install_them(tmp_path, monkeypatch, capsys):
    import importlib.util as util

    from fineflow.cli import main

    find_spec = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "sse_starlette" else find_spec(name, *a))
    folder = _export_dir(tmp_path / "export", {"f16": _export("f16", 30)})
    assert main(["serve", "--export-dir", str(folder)]) == 2
    error = capsys.readouterr().err  # without llama-cpp-python (the CI venv) it names that instead
    assert "make export-tools" in error and ("sse_starlette" in error or "llama-cpp-python==" in error), error


# ---------------------------------------------------------------- served answers (the export extra, nightly)

needs_server = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("sse_starlette", "starlette_context", "openai")),
    reason="llama-cpp-python's server packages or the openai client are missing (pip install -e '.[export]')",
)


def _wait_ready(server: subprocess.Popen, url: str, log: Path, timeout: float = 180) -> bool:
    """True once /v1/models answers; False when the server exited (its log says why)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/models", timeout=2) as response:
                if response.status == 200:
                    return True
        time.sleep(0.3)
    pytest.fail(f"fineflow serve was not ready after {timeout} s: {log.read_text()[-3000:]}")


@contextlib.contextmanager
def served(export_dir: Path, log: Path, threads: int = 1):
    """`fineflow serve` on 127.0.0.1 (a free port, another one if it was taken meanwhile); (base URL, seconds to
    ready); stopped by its PID."""
    for _ in range(3):
        port = free_port()
        argv = [sys.executable, "-m", "fineflow.cli", "serve", "--export-dir", str(export_dir), "--port", str(port)]
        argv += ["--threads", str(threads)]
        env = {**venv_env(), "OMP_NUM_THREADS": str(threads)}
        started = time.monotonic()
        with log.open("w") as out:
            server = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}/v1"
            if _wait_ready(server, url, log):
                yield url, time.monotonic() - started
                return
            assert "address already in use" in log.read_text().lower(), log.read_text()[-3000:]
        finally:
            stop_by_pid(server)
    pytest.fail(f"no free port for fineflow serve in 3 tries: {log.read_text()[-3000:]}")


def _user_turns(docs) -> list[list[dict]]:
    """Each eval doc's conversation up to the answer the model is to give."""
    return [doc.conversation[:-1] if doc.conversation[-1]["role"] == "assistant" else doc.conversation for doc in docs]


def torch_answers(model_dir: Path, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
    """The PyTorch model's greedy chat answers: its chat template with the generation prompt, stopped at its
    end-of-turn ids (the tokenizer's EOS and generation_config's) or max_new_tokens, special tokens dropped."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from fineflow.export.parity import greedy_ids, trained_stop_ids
    from fineflow.export.trained import _generation_eos

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stop_ids = trained_stop_ids(tokenizer, _generation_eos(model_dir, GenerationConfig))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in conversations]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    answers = greedy_ids(model, prompts, max_new_tokens, stop_ids, stop_ids[0])
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in answers]


def served_answers(url: str, conversations: list[list[dict]], max_tokens: int, stop=None) -> tuple[list[str], dict]:
    """The served model's answers to an OpenAI client at temperature 0; the model's name and tokens per second."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    name = client.models.list().data[0].id
    answers, tokens, seconds = [], 0, 0.0
    for messages in conversations:
        started = time.monotonic()
        options = {"stop": stop} if stop else {}
        reply = client.chat.completions.create(
            model=name, messages=messages, temperature=0, max_tokens=max_tokens, **options
        )
        seconds += time.monotonic() - started
        tokens += reply.usage.completion_tokens
        answers.append(reply.choices[0].message.content)
    return answers, {"model": name, "tokens_per_s": round(tokens / seconds, 1)}


def assert_same_prompt_ids(gguf: Path, model_dir: Path, conversations: list[list[dict]]) -> None:
    """The precondition of comparing answers: llama.cpp (as the server tokenizes a rendered chat prompt: no BOS added,
    special tokens parsed) and the training tokenizer (as apply_chat_template does) give the same ids."""
    from transformers import AutoTokenizer

    from fineflow.export.parity import load_runtime

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runtime = load_runtime(gguf, vocab_only=True)
    try:
        for i, messages in enumerate(conversations):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            served = runtime.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            assert served == tokenizer(text, add_special_tokens=False)["input_ids"], f"conversation {i}: {text!r}"
    finally:
        runtime.close()


def _assert_served_like_torch(export_dir: Path, model_dir: Path, docs, max_gen_toks: int, log: Path) -> dict:
    from fineflow.export.parity import STOP_STRINGS, cut_answer

    conversations = _user_turns(docs)
    assert_same_prompt_ids(chosen_gguf(export_dir)[1], model_dir, conversations)
    reference = torch_answers(model_dir, conversations, max_gen_toks)
    with served(export_dir, log) as (url, ready_s):
        answers, figures = served_answers(url, conversations, max_gen_toks)
        # the evaluate task's stop strings, as a client sends them: the answer the eval scored
        cut, _ = served_answers(url, conversations, max_gen_toks, stop=list(STOP_STRINGS))
    assert answers == reference
    assert [answer.lstrip() for answer in cut] == [cut_answer(answer) for answer in reference]
    assert any(answer.strip() for answer in answers), answers  # something was generated and compared
    equal = f"{len(answers)}/{len(reference)}"
    return {**figures, "equal": equal, "ready_s": round(ready_s, 1), "answers": answers[:2], "cut": cut[:2]}


@pytest.mark.nightly  # llama.cpp's converter, the parity check and a server: ~1 min on 2 cores; the export extra
@needs_llama_cpp
@needs_server
def test_the_served_embedded_champion_answers_an_openai_client_as_pytorch_does(built, tmp_path):
    from transformers import AutoTokenizer

    from fineflow.export.exporter import champion_model_dir
    from fineflow.export.trained import rendered_eval_docs
    from fineflow.stages.export import run
    from tests.conftest import random_adapter

    # an adapter-only champion, as promote installs one: the base alone answers the chat prompts with newlines only
    champion = random_adapter(built / "models/base", tmp_path / "models/champion", seed=5)
    record = {"candidate_id": "c-adapter", "base_model": str(built / "models/base")}
    (champion / "champion.json").write_text(json.dumps(record), encoding="utf-8")
    out = tmp_path / "models/export"
    params = _tiny_params(quantized=[], parity_docs=8)
    assert run(params, champion, built / "data/validated/eval.jsonl", out)["shippable"] == ["f16"]
    model_dir = champion_model_dir(champion, tmp_path / "work", log=lambda line: None)  # the merge the stage made
    docs = rendered_eval_docs(
        built / "data/validated/eval.jsonl", AutoTokenizer.from_pretrained(model_dir), tmp_path / "work", 6
    )
    figures = _assert_served_like_torch(out, model_dir, docs, params.evaluate.max_gen_toks, tmp_path / "serve.log")
    assert figures["model"] == "fineflow-c-adapter"
    print(json.dumps(figures))


@pytest.mark.nightly  # SmolLM2-135M converted (GGUF -> HF -> GGUF), parity-checked and served: ~3 min
@needs_llama_cpp
@needs_server
@pytest.mark.skipif(_realmodel_missing() is not None, reason=str(_realmodel_missing()))
def test_served_smollm2_answers_an_openai_client_as_pytorch_does(built, tmp_path):
    from transformers import AutoTokenizer

    from fineflow.base.from_gguf import model_dir_from_gguf, packaged_gguf
    from fineflow.core.reports import write_json_atomic
    from fineflow.export.gguf import export_model
    from fineflow.export.trained import rendered_eval_docs

    model_dir = model_dir_from_gguf(packaged_gguf(), tmp_path / "smollm2")  # its digit split kept (smollm)
    params = _tiny_params(quantized=[], parity_docs=4)
    out = tmp_path / "export"
    report = export_model(model_dir, built / "data/validated/eval.jsonl", out, tmp_path / "work", params)
    assert report["exports"]["f16"]["shippable"], report["exports"]["f16"]["reasons"]
    write_json_atomic(out / REPORT_FILE, {"champion": "smollm2", **report})
    docs = rendered_eval_docs(
        built / "data/validated/eval.jsonl", AutoTokenizer.from_pretrained(model_dir), tmp_path / "work", 4
    )
    max_gen_toks = 24  # params.yaml's evaluate.max_gen_toks: a sentence, where a repeat penalty would show
    figures = _assert_served_like_torch(out, model_dir, docs, max_gen_toks, tmp_path / "serve.log")
    assert figures["model"] == "fineflow-smollm2"
    print(json.dumps(figures))


def test_make_serve_model_runs_fineflow_serve_on_loopback_whatever_the_shells_host_and_port(tmp_path):
    import os

    env = {**os.environ, "HOST": "example.com", "PORT": "1"}  # a shell's own: never where the model is served
    make = ["make", "-n", "serve-model", "SERVE_TYPE=q8_0", "SERVE_THREADS=2"]
    dry = subprocess.run(make, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "fineflow serve --host 127.0.0.1 --port 8000 --type q8_0" in dry.stdout and "--threads 2" in dry.stdout
