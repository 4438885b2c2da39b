"""The prompt template shared by training (tokenize stage) and evaluation (lm-eval task).

Training tokenizes the prompt and the response separately and concatenates them, so the prompt's tokens
at training time are exactly the tokens lm-eval feeds the model at evaluation time (it encodes the
rendered prompt alone). Only the response (and the EOS that ends it) is trained on.

Fields follow a space, never a newline, and the response is " " + output: byte-level BPE tokenizers
(GPT-2 style) learn words with their leading space, so " Paris" is the token the base model already
knows, while "Paris" after a newline would be split into rarer pieces it has to learn anew.
"""

from __future__ import annotations

import hashlib

PROMPT_WITH_INPUT = "### Instruction: {instruction}\n### Input: {input}\n### Response:"
PROMPT_NO_INPUT = "### Instruction: {instruction}\n### Response:"
RESPONSE_PREFIX = " "  # lm-eval's target_delimiter; stripped from generations before exact match


def render_prompt(instruction: str, input: str = "") -> str:
    if input:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def template_hash() -> str:
    """Changes whenever the template text changes, so shards built with another template are rebuilt."""
    text = "\0".join([PROMPT_WITH_INPUT, PROMPT_NO_INPUT, RESPONSE_PREFIX])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode_example(tokenizer, instruction: str, input: str, output: str) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 = trained on) for one example: prompt (masked) + response + EOS."""
    prompt = tokenizer.encode(render_prompt(instruction, input), add_special_tokens=False)
    response = tokenizer.encode(RESPONSE_PREFIX + output, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt + response, [0] * len(prompt) + [1] * len(response)


def encode_batch(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """encode_example for many rows at once through the fast tokenizer's batch call (same tokens)."""
    prompts = [render_prompt(r["instruction"], r.get("input") or "") for r in rows]
    responses = [RESPONSE_PREFIX + r["output"] for r in rows]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: call Rust directly, skipping BatchEncoding's conversions
        prompt_ids = [e.ids for e in backend.encode_batch(prompts, add_special_tokens=False)]
        response_ids = [e.ids for e in backend.encode_batch(responses, add_special_tokens=False)]
    else:
        prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(responses, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [(p + r + [eos], [0] * len(p) + [1] * (len(r) + 1)) for p, r in zip(prompt_ids, response_ids)]
