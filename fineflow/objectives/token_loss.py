"""The next-token loss, plain or chunked so the logits never exist whole (``train.loss_chunk_tokens``).

The plain path projects every trained position onto the vocabulary at once: tokens x vocab logits, plus their
fp32 copy and gradient (5.9 GiB of 25 at 8B / 4k tokens; more at 128k vocabularies). The chunked path
(``ChunkedLinearCrossEntropy``, the approach of Liger's fused linear cross-entropy, in plain torch) projects
``chunk_tokens`` positions at a time and computes their gradients in the same forward, keeping only the
gradients of the hidden states (tokens x hidden) and of the head's weight (when it trains): the peak extra is
chunk_tokens x vocab x (the compute dtype + fp32 logits + fp32 gradient) instead of tokens x vocab x the same.

Why inside the model's own forward: DDP, FSDP and ZeRO-3 act around the wrapped module's forward (the gradient
sync is armed there; FSDP and ZeRO-3 gather the head's weight only while its module runs). So the loop still
calls the wrapped model, and ``head_computes_loss`` swaps the output head's ``forward`` for that call: the
causal LM's forward hands the head the trained positions' hidden states (``logits_to_keep`` as a boolean mask)
and returns whatever the head returns as ``.logits`` -- here the summed loss. The weight is used only inside
that forward, so nothing is re-gathered in backward. This holds only where the causal LM does nothing to the
logits after the head: the model types in ``PLAIN_HEAD_MODELS`` (checked in transformers' source), with an
``nn.Linear`` head without bias. Others (Gemma 2's soft-capping, Cohere's logit scale, a LoRA-wrapped head)
take the plain path.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

# causal LMs whose forward returns lm_head(hidden_states[logits_to_keep]) unchanged as .logits
PLAIN_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "olmo2", "smollm3"})


def plain_cross_entropy(logits, targets):
    """Summed cross-entropy of (tokens, vocab) logits in fp32: the reference the chunked path must equal."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), reduction="sum")


def _chunk_loss_and_grads(hidden, weight, targets, need_hidden_grad: bool, need_weight_grad: bool):
    """One chunk: summed CE, and d(loss)/d(hidden), d(loss)/d(weight) (None where not needed).
    d(CE)/d(logits) = softmax - onehot, in fp32 like the plain path's upcast; cast back for the matmuls."""
    import torch

    logits = (hidden @ weight.t()).float()
    log_probs = torch.log_softmax(logits, dim=-1)
    loss = -log_probs.gather(1, targets.unsqueeze(1)).sum()
    if not (need_hidden_grad or need_weight_grad):
        return loss, None, None
    grad_logits = log_probs.exp_()
    grad_logits[torch.arange(len(targets), device=targets.device), targets] -= 1.0
    grad_logits = grad_logits.to(hidden.dtype)
    grad_hidden = grad_logits @ weight if need_hidden_grad else None
    grad_weight = grad_logits.t() @ hidden if need_weight_grad else None
    return loss, grad_hidden, grad_weight


def _chunked_forward(hidden, weight, targets, chunk_tokens: int, need_hidden: bool, need_weight: bool):
    import torch

    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
    for start in range(0, len(targets), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        chunk_loss, g_hidden, g_weight = _chunk_loss_and_grads(
            hidden[part], weight, targets[part], need_hidden, need_weight
        )
        loss += chunk_loss
        if need_hidden:
            grad_hidden[part] = g_hidden
        if need_weight:
            grad_weight += g_weight
    return loss, grad_hidden, grad_weight


def chunked_cross_entropy(hidden, weight, targets, chunk_tokens: int):
    """Summed cross-entropy of ``hidden @ weight.T`` against ``targets`` (hidden: (tokens, d), weight:
    (vocab, d), targets: (tokens,), every one trained on), ``chunk_tokens`` rows of logits at a time."""
    import torch

    # autograd.Function.forward runs with grad mode off: what needs gradients is decided out here
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    return _linear_cross_entropy().apply(hidden, weight, targets, chunk_tokens, needs)


def _linear_cross_entropy():
    import torch

    global _FUNCTION
    if _FUNCTION is None:

        class ChunkedLinearCrossEntropy(torch.autograd.Function):
            # gradients are computed in forward (no second projection in backward), scaled in backward
            @staticmethod
            def forward(ctx, hidden, weight, targets, chunk_tokens, needs):
                loss, grad_hidden, grad_weight = _chunked_forward(hidden, weight, targets, chunk_tokens, *needs)
                ctx.grads, ctx.weight_dtype = (grad_hidden, grad_weight), weight.dtype
                return loss

            @staticmethod
            def backward(ctx, grad_loss):
                grad_hidden, grad_weight = ctx.grads
                ctx.grads = None
                if grad_hidden is not None:
                    grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
                if grad_weight is not None:
                    grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
                return grad_hidden, grad_weight, None, None, None

        _FUNCTION = ChunkedLinearCrossEntropy
    return _FUNCTION


_FUNCTION = None


def output_head(model):
    """The causal LM's output projection under any wrapper (DDP/DeepSpeed's .module, peft's base model), or
    None where the chunked path does not apply (see the module docstring)."""
    import torch

    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plain = type(head) is torch.nn.Linear and head.bias is None
    return head if plain and getattr(config, "model_type", None) in PLAIN_HEAD_MODELS else None


@contextmanager
def head_computes_loss(head, targets, chunk_tokens: int):
    """For the forward inside: ``head(hidden)`` returns the chunked summed loss against ``targets``."""
    head.forward = lambda hidden: chunked_cross_entropy(hidden, head.weight, targets, chunk_tokens)
    try:
        yield
    finally:
        del head.forward


def logits_peak_bytes(trained_tokens: int, vocab: int, chunk_tokens: int, compute_bytes: int) -> int:
    """What the loss adds at its peak, for the planner: rows x vocab x (logits in the compute dtype + fp32
    log-probabilities + their fp32 gradient), rows = chunk_tokens when chunking applies, else every trained token."""
    rows = chunk_tokens if 0 < chunk_tokens < trained_tokens else trained_tokens
    return rows * vocab * (compute_bytes + 4 + 4)


def token_loss_sum(model, batch: dict, loss_chunk_tokens: int = 0, **forward_kwargs):
    """Summed next-token cross-entropy over trained tokens, and how many there were.

    No attention_mask is passed: position_ids restart per example, and packed examples never attend to each
    other only if the attention gets that layout. sdpa/eager: transformers builds a block-diagonal causal
    mask from the position ids (any batch size). flash_attention_2: transformers infers packing from
    position ids only for a batch of one row, so ``forward_kwargs`` must carry flash-attn's cu_seqlens;
    varlen: its groups (both from fineflow.train.attention.layout_kwargs). Logits are computed only at
    positions whose next token is trained on (``logits_to_keep`` as a boolean mask): in instruction data
    that is a small share of the row (6% on the bundled data), and the vocabulary projection and its fp32
    loss are the largest per-token cost after the layers. With more trained tokens than ``loss_chunk_tokens``
    (> 0) the head projects them that many at a time inside the model's forward (below); at or
    below it, or for a head the chunked path does not cover, all at once.
    """
    import torch

    targets = batch["labels"][:, 1:]
    keep = torch.zeros_like(batch["labels"], dtype=torch.bool)
    keep[:, :-1] = targets != -100
    trained, count = targets[keep[:, :-1]], int(keep.sum())
    head = output_head(model) if 0 < loss_chunk_tokens < count else None
    with head_computes_loss(head, trained, loss_chunk_tokens) if head is not None else nullcontext():
        out = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            use_cache=False,
            logits_to_keep=keep,
            **forward_kwargs,
        ).logits  # (trained positions, vocab); chunked: the summed loss
    return (out if head is not None else plain_cross_entropy(out, trained)), count
