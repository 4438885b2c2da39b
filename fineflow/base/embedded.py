"""The embedded default base model: a byte-level BPE tokenizer and a tiny Llama, built and briefly
pretrained locally so that the whole pipeline runs with no hub and no network.

The result is an ordinary Hugging Face model directory (``AutoModelForCausalLM`` / ``AutoTokenizer`` load
it), so every later stage treats it exactly like a real base model given by path or hub id.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from fineflow.core.model_config import BaseParams, ModelParams
from fineflow.errors import StoppedAndSaved
from fineflow.train.schedule import learning_rate

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
CHAT_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] | capitalize }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### Assistant:\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int):
    """A byte-level BPE tokenizer trained on texts, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS, UNK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=model_max_length,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(cfg: ModelParams, tokenizer, seed: int):
    """A randomly initialised Llama-architecture causal LM shaped by params.yaml's model section."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def _token_stream_windows(tokenizer, texts: list[str], seq_len: int):
    """Documents joined by EOS and cut into fixed windows (classic LM pretraining batches)."""
    import torch

    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


PROGRESS_S = 20.0  # a progress line at least this often, however slow the steps (the run page never looks stuck)
SAVE_EVERY_S = 30.0  # the resume state at least this often (the embedded model's is a few MB: milliseconds)
STATE_FILE = "pretrain_state.pt"


class PretrainStopped(StoppedAndSaved):
    """Pretraining stopped on a signal after `step` of `steps`, which is saved in the resume state."""

    def __init__(self, step: int, steps: int, signum: int | None, state_path: Path):
        import signal

        name = signal.Signals(signum).name if signum is not None else "a stop signal"
        super().__init__(
            f"pretraining stopped by {name} after step {step} of {steps}, saved in {state_path}", step, signum
        )


def state_identity(model_cfg: ModelParams, base_cfg: BaseParams, seed: int) -> str:
    """What a resume state must have been made from: the model's and the pretraining's params and the seed (the
    corpus, the tokenizer and the initial weights follow from them)."""
    settings = {"model": model_cfg.model_dump(mode="json"), "base": base_cfg.model_dump(mode="json"), "seed": seed}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _save_state(path: Path, identity: str, step: int, model, opt, gen, losses: list[float], spent_s: float) -> None:
    """The whole of pretraining's state after `step` steps, written atomically (a kill mid-write leaves the
    previous state)."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "identity": identity,
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "generator": gen.get_state(),
        "losses": losses,
        "spent_s": spent_s,
    }
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def _load_state(path: Path | None, identity: str, log) -> dict | None:
    """The saved state to resume from: None when there is none, or it was made from other params, or it cannot be
    read (said; pretraining then starts from step 0)."""
    import torch

    if path is None or not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a torn or corrupt file: start over, saying why
        log(f"pretrain: resume state {path} unreadable ({type(exc).__name__}): starting from step 0")
        return None
    if state.get("identity") != identity:
        log(f"pretrain: resume state {path} is of other model/base params or seed: starting from step 0")
        return None
    return state


def pretrain(
    model,
    tokenizer,
    texts: list[str],
    cfg: BaseParams,
    seed: int,
    log=print,
    state_path: Path | None = None,
    identity: str = "",
    stop_signal: Callable[[], int | None] = lambda: None,
) -> dict:
    """Full-parameter causal-LM pretraining for cfg.steps steps; returns loss and timing figures.

    With state_path: resumes from the state saved there (same params: exact, the same bytes as an uninterrupted
    run), saves it at least every SAVE_EVERY_S and when stop_signal() returns a signal (then PretrainStopped, after
    the step in progress), and removes it once pretraining is done."""
    import torch

    windows = _token_stream_windows(tokenizer, texts, cfg.seq_len)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    losses: list[float] = []
    first, spent = 0, 0.0
    state = _load_state(state_path, identity, log)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        first, losses, spent = state["step"], list(state["losses"]), float(state["spent_s"])
        log(f"pretrain: resuming from step {first} of {cfg.steps} ({state_path})")

    model.train()
    start = logged = saved = time.perf_counter()
    for step in range(first, cfg.steps):
        batch = windows[torch.randint(len(windows), (cfg.batch_size,), generator=gen)]
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, cfg.lr, cfg.warmup_steps, cfg.steps)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        now = time.perf_counter()
        if step % 50 == 0 or step == cfg.steps - 1 or now - logged >= PROGRESS_S:  # a busy machine: by time too
            logged = now
            eta = (now - start) / (step + 1 - first) * (cfg.steps - step - 1)
            log(f"pretrain step {step + 1}/{cfg.steps} loss {losses[-1]:.3f} ETA {eta:.0f}s")
        signum = stop_signal()
        if state_path is not None and (signum is not None or now - saved >= SAVE_EVERY_S) and step + 1 < cfg.steps:
            _save_state(state_path, identity, step + 1, model, opt, gen, losses, spent + now - start)
            saved = time.perf_counter()
        if signum is not None and state_path is not None and step + 1 < cfg.steps:
            raise PretrainStopped(step + 1, cfg.steps, signum, state_path)
    elapsed = time.perf_counter() - start
    model.eval()
    tokens = (cfg.steps - first) * cfg.batch_size * cfg.seq_len
    return {
        "pretrain_steps": cfg.steps,
        "pretrain_resumed_from_step": first,
        "pretrain_final_loss": losses[-1] if losses else None,
        "pretrain_tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
        "pretrain_s": round(elapsed, 3),
        "pretrain_s_before_resume": round(spent, 3),
        "pretrain_tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
    }


def build_embedded_base(
    model_cfg: ModelParams,
    base_cfg: BaseParams,
    seed: int,
    out_dir: Path,
    log=print,
    state_dir: Path | None = None,
    stop_signal: Callable[[], int | None] = lambda: None,
) -> dict:
    """Tokenizer + tiny Llama, pretrained on the bundled corpus and saved as a HF model directory. state_dir: where
    pretraining keeps its resume state (``pretrain``), removed once the model is saved."""
    import torch

    from fineflow.corpus import pretraining_corpus

    random.seed(seed)
    torch.manual_seed(seed)
    texts = list(pretraining_corpus(base_cfg.corpus_docs, seed))
    tokenizer = train_tokenizer(texts, model_cfg.vocab_size, model_cfg.max_position_embeddings)
    model = build_model(model_cfg, tokenizer, seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"embedded base: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    state_path = state_dir / STATE_FILE if state_dir is not None else None
    identity = state_identity(model_cfg, base_cfg, seed)
    figures = pretrain(model, tokenizer, texts, base_cfg, seed, log, state_path, identity, stop_signal)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if state_path is not None:
        state_path.unlink(missing_ok=True)  # done: a later run of other params starts from step 0 anyway
    return {"parameters": n_params, "vocab_size": len(tokenizer), "corpus_docs": len(texts), **figures}
