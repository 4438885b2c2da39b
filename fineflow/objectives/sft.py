"""SFT: next-token cross-entropy on the answers' tokens (the prompt side is context, never a target)."""

from __future__ import annotations

from fineflow.objectives.interface import EXAMPLES, BatchLoss, Objective


class SFT(Objective):
    name = "sft"
    summary = "next-token loss on the answers"
    rows = EXAMPLES

    def loss(self, model, batch: dict, cfg=None, **forward_kwargs) -> BatchLoss:
        from fineflow.objectives.token_loss import token_loss_sum

        chunk = cfg.loss_chunk_tokens if cfg is not None else 0
        loss_sum, count = token_loss_sum(model, batch, loss_chunk_tokens=chunk, **forward_kwargs)
        return BatchLoss(loss_sum, count)
