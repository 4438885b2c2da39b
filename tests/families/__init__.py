"""Tiny random-initialised models of the real families, saved as local model directories with a tokenizer that
carries the family's special tokens and its real chat template (templates/<family>.jinja, each naming where its
text came from). Shared by tests/test_architectures.py (the architecture alone) and tests/test_families.py (the
whole pipeline on each family).

A family is the same transformers classes as the real models (GQA, sliding windows, tied embeddings, qk-norm,
soft-capping, fused qkv) at a width of 64, two layers; the tokenizer is a byte-level BPE trained on the texts it
will see, plus the family's special tokens, so every control token of the template is one token as in the real
vocabulary, and (for the families whose real tokenizer does) encode() adds the BOS unless told not to: training
must not double the BOS the template writes, nor lm-eval when it encodes that prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
LLAMA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# family -> (config class, its features beyond TINY, decoder-layer class, linears of one decoder layer)
FAMILIES = {
    "llama3": ("LlamaConfig", dict(rope_theta=5e5), "LlamaDecoderLayer", LLAMA_NAMES),
    "qwen2.5": ("Qwen2Config", dict(tie_word_embeddings=True), "Qwen2DecoderLayer", LLAMA_NAMES),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True), "Qwen3DecoderLayer", LLAMA_NAMES),
    "mistral": ("MistralConfig", dict(sliding_window=32), "MistralDecoderLayer", LLAMA_NAMES),
    "gemma2": (
        "Gemma2Config",
        dict(head_dim=16, sliding_window=32, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        "Gemma2DecoderLayer",
        LLAMA_NAMES,
    ),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=32), "Gemma3DecoderLayer", LLAMA_NAMES),
    "phi3": ("Phi3Config", dict(), "Phi3DecoderLayer", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
}


@dataclass(frozen=True)
class Tokens:
    """A family's special tokens as its instruct tokenizer_config.json names them (None: the real one has none)."""

    bos: str | None
    eos: str
    pad: str | None
    unk: str | None
    extra: tuple[str, ...]  # the template's other control tokens, each one token in the real vocabulary


TOKENS = {
    "llama3": Tokens(
        "<|begin_of_text|>",
        "<|eot_id|>",
        None,
        None,
        ("<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"),
    ),
    "qwen2.5": Tokens(None, "<|im_end|>", "<|endoftext|>", None, ("<|im_start|>", "<tool_call>", "</tool_call>")),
    "qwen3": Tokens(
        None,
        "<|im_end|>",
        "<|endoftext|>",
        None,
        ("<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    ),
    "mistral": Tokens(
        "<s>", "</s>", None, "<unk>", ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]")
    ),
    "gemma2": Tokens("<bos>", "<eos>", "<pad>", "<unk>", ("<start_of_turn>", "<end_of_turn>")),
    "phi3": Tokens("<s>", "<|endoftext|>", "<|endoftext|>", "<unk>", ("<|user|>", "<|assistant|>", "<|end|>")),
}


def chat_template(family: str) -> str:
    """The family's real template text: its .jinja file without the header comment that names the source."""
    text = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    return text.split("#}\n", 1)[1]


def tiny_model(family: str, seed: int = 0, **overrides):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    config_class, extra, _, _ = FAMILIES[family]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**{**TINY, **extra, **overrides}))


def build_tokenizer(family: str, texts: list[str], vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on texts, with the family's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokens = TOKENS[family]
    named = [t for t in (tokens.pad, tokens.bos, tokens.eos, tokens.unk) if t]
    specials = list(dict.fromkeys(named + list(tokens.extra)))
    bpe = Tokenizer(models.BPE(unk_token=tokens.unk))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    if tokens.bos:  # as the real ones (Llama 3, Mistral, Gemma, Phi-3) do: encode() adds BOS unless told not to
        bos = (tokens.bos, bpe.token_to_id(tokens.bos))
        bpe.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A $B", special_tokens=[bos]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=tokens.bos,
        eos_token=tokens.eos,
        pad_token=tokens.pad,
        unk_token=tokens.unk,
        model_max_length=TINY["max_position_embeddings"],
    )
    fast.chat_template = chat_template(family)
    return fast


def save_family(family: str, texts: list[str], out: Path, seed: int = 0) -> Path:
    """The family's tiny model and tokenizer saved as a local model directory (what model.base points at)."""
    tokenizer = build_tokenizer(family, texts)
    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    tiny_model(family, seed, **ids).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
