"""The embedded default base model: a byte-level BPE tokenizer and a tiny Llama, built and briefly
pretrained locally so that the whole pipeline runs with no hub and no network.

The result is an ordinary Hugging Face model directory (``AutoModelForCausalLM`` / ``AutoTokenizer`` load
it), so every later stage treats it exactly like a real base model given by path or hub id.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable
from pathlib import Path

from fineflow.core.config import BaseParams, ModelParams

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


def pretrain(model, tokenizer, texts: list[str], cfg: BaseParams, seed: int, log=print) -> dict:
    """Full-parameter causal-LM pretraining for cfg.steps steps; returns loss and timing figures."""
    import torch

    windows = _token_stream_windows(tokenizer, texts, cfg.seq_len)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    losses: list[float] = []
    start = logged = time.perf_counter()
    for step in range(cfg.steps):
        batch = windows[torch.randint(len(windows), (cfg.batch_size,), generator=gen)]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        now = time.perf_counter()
        if step % 50 == 0 or step == cfg.steps - 1 or now - logged >= PROGRESS_S:  # a busy machine: by time too
            logged = now
            eta = (now - start) / (step + 1) * (cfg.steps - step - 1)
            log(f"pretrain step {step + 1}/{cfg.steps} loss {losses[-1]:.3f} ETA {eta:.0f}s")
    elapsed = time.perf_counter() - start
    model.eval()
    tokens = cfg.steps * cfg.batch_size * cfg.seq_len
    return {
        "pretrain_steps": cfg.steps,
        "pretrain_final_loss": losses[-1] if losses else None,
        "pretrain_tokens": tokens,
        "pretrain_s": round(elapsed, 3),
        "pretrain_tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
    }


def build_embedded_base(model_cfg: ModelParams, base_cfg: BaseParams, seed: int, out_dir: Path, log=print) -> dict:
    """Tokenizer + tiny Llama, pretrained on the bundled corpus and saved as a HF model directory."""
    import torch

    from fineflow.corpus import pretraining_corpus

    random.seed(seed)
    torch.manual_seed(seed)
    texts = list(pretraining_corpus(base_cfg.corpus_docs, seed))
    tokenizer = train_tokenizer(texts, model_cfg.vocab_size, model_cfg.max_position_embeddings)
    model = build_model(model_cfg, tokenizer, seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"embedded base: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    figures = pretrain(model, tokenizer, texts, base_cfg, seed, log=log)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {"parameters": n_params, "vocab_size": len(tokenizer), "corpus_docs": len(texts), **figures}
