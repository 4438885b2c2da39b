"""A reward model: the base with LoRA adapters and a trainable scalar head, trained on preference pairs with the
Bradley-Terry pairwise loss (Stiennon et al. 2020, Ouyang et al. 2022 eq. 1):

    r(x, y) = w . h(x, y)                       h: the final hidden state at the answer's last token (its EOS)
    loss    = -logsigmoid(r(x, chosen) - r(x, rejected))

summed over the batch's pairs (the loop divides by the global batch's pair count, as for every pair objective). No
reference model runs. The model is not a generator: ``model_kind`` REWARD, so evaluate scores its held-out pairwise
accuracy (fineflow.evaluate.reward_ranking) instead of evaluate.tasks, the registry keeps its own champion, export
skips it, and ``fineflow reward score`` scores rows with that champion.

Choices, and why:
- The head is ``Linear(hidden, 1, bias=False)`` set on the model as ``reward_head``, fp32 like the adapters. No
  bias: Bradley-Terry sees only reward differences, where a bias cancels. Zero-initialised: the untrained model
  ties every pair (its first loss is exactly log 2, as DPO's first step against its reference), and its start
  does not depend on the RNG. A trainable parameter of the model, it is in the optimizer and in every checkpoint
  (the train stage saves and restores all trainable tensors), so resume restores it bit-exact with the adapter.
- Pooling: a packed pair row holds chosen then rejected side by side with positions restarting per side, so the
  "last non-pad token of the row" of transformers' sequence-classification models would read one token per row.
  Each side's own last token comes from ``pair_slots`` (fineflow.objectives.pair_logps) instead.
- The head runs inside the model's forward, in place of the output projection (the chunked loss's way,
  fineflow.objectives.token_loss): ``logits_to_keep`` selects the sides' last tokens, so the vocabulary projection
  never runs, and DDP, FSDP and ZeRO-3, which act around the wrapped forward, see the head's weight used there. A
  causal LM that post-processes its logits applies that to the reward too (Gemma 2's soft-capping: a monotone
  squash, which keeps every ranking).
- Saved beside the adapter: ``reward_head.safetensors`` (the head's weight) and ``reward_model.json`` (what the
  folder is: the kind, the hidden size, the pooling), so the candidate folder alone scores text on its base; the
  candidate id (the sha256 of the folder's files) covers the head.
"""

from __future__ import annotations

import json
from pathlib import Path

from fineflow.errors import DataError, FineflowError
from fineflow.objectives.interface import PAIRS, BatchLoss, Objective

REWARD = "reward"  # the model kind: the registry's champion of reward models, apart from the language models'
TASK = "fineflow_reward"  # evaluate's held-out pairwise accuracy of the reward (fineflow.evaluate.reward_ranking)
HEAD = "reward_head"  # the head's attribute on the model (and its tensors' prefix in a state dict)
HEAD_FILE = "reward_head.safetensors"
CONFIG_FILE = "reward_model.json"
POOLING = "the final hidden state at the last token of each answer (its EOS)"


class RewardModel(Objective):
    name = "reward_model"
    summary = "preference pairs: a reward model (LoRA and a scalar head, Bradley-Terry loss), not a generator"
    rows = PAIRS
    eval_task = TASK
    model_kind = REWARD

    def loss(self, model, batch: dict, cfg=None, **forward_kwargs) -> BatchLoss:
        rewards = side_rewards(model, batch, **forward_kwargs)
        return bradley_terry(rewards[0::2], rewards[1::2])

    def prepare_model(self, model, cfg=None):
        """The reward head on the adapted model (LoRA or QLoRA: the base stays frozen)."""
        if cfg is not None and cfg.method == "full":
            raise FineflowError(
                f"train.objective {self.name} trains LoRA adapters and a reward head: train.method full is not "
                "supported for it; set train.method lora (or qlora)"
            )
        return add_head(model)

    def save_extra(self, model, out_dir, state_dict: dict | None = None) -> None:
        save_head(model, Path(out_dir), state_dict)

    def load_trained(self, model, model_dir):
        return load_reward_model(model, Path(model_dir))

    def score_examples(self, model, encoded, batch_size: int, seq_len: int):
        return example_rewards(model, encoded, batch_size, seq_len)


def bradley_terry(chosen, rejected) -> BatchLoss:
    """The summed pairwise loss of rewards (1-D, one per pair) and the step log's statistics: pairs ranked right,
    summed margin. In float64, as the other pair objectives' sums."""
    import torch.nn.functional as F

    margin = chosen.double() - rejected.double()
    loss_sum = -F.logsigmoid(margin).sum()
    return BatchLoss(loss_sum, int(margin.numel()), (float((margin > 0).sum()), float(margin.detach().sum())))


# ---- the head --------------------------------------------------------------------------------------------------


def _unwrapped(model):
    """The model under DDP's (or DeepSpeed's) ``.module``."""
    import torch

    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def hidden_size(model) -> int:
    config = _unwrapped(model).config
    return int(getattr(config, "hidden_size", None) or config.get_text_config().hidden_size)


def add_head(model, weight=None):
    """Set a reward head on model (zero-initialised, or ``weight``: (1, hidden)); returns the model."""
    import torch

    head = torch.nn.Linear(hidden_size(model), 1, bias=False, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(weight if weight is not None else torch.zeros_like(head.weight))
    device = next(_unwrapped(model).parameters()).device
    setattr(_unwrapped(model), HEAD, head.to(device))
    return model


def reward_head(model):
    head = getattr(_unwrapped(model), HEAD, None)
    if head is None:
        raise FineflowError("the model has no reward head: build it with the reward_model objective's prepare_model")
    return head


def side_ends(pair_slots):
    """bool (rows, seq): True at each side's last token, the ends in row-major order alternating chosen (slot 2k)
    and rejected (2k+1) pair by pair; a DataError when the slots are not laid out so."""
    import torch

    after = torch.full_like(pair_slots, -1)
    after[:, :-1] = pair_slots[:, 1:]
    ends = (pair_slots >= 0) & (pair_slots != after)
    per_row = ends.sum(dim=1).tolist()
    expected = torch.cat([torch.arange(n, device=pair_slots.device) for n in per_row])
    if any(n % 2 for n in per_row) or not torch.equal(pair_slots[ends].to(expected.dtype), expected):
        raise DataError("pair_slots.bin: a row's pair slots do not run 0, 1, 2, ... side by side: re-run tokenize")
    return ends


def head_forward(model, keep, input_ids, position_ids=None, attention_mask=None, **forward_kwargs):
    """The reward at each True cell of ``keep`` (rows x seq), row-major, float32: the model's forward with the
    reward head in place of its output projection (see the module docstring)."""
    head, output = reward_head(model), _unwrapped(model).get_output_embeddings()
    output.forward = lambda hidden: head(hidden.to(head.weight.dtype))
    try:
        logits = model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            logits_to_keep=keep,
            **forward_kwargs,
        ).logits
    finally:
        del output.forward
    return logits.reshape(-1).float()


def side_rewards(model, batch: dict, **forward_kwargs):
    """Each side's reward of a packed pair batch: (2 x pairs,), chosen then rejected pair by pair."""
    keep = side_ends(batch["pair_slots"])
    return head_forward(model, keep, batch["input_ids"], batch["position_ids"], **forward_kwargs)


# ---- scoring rows ----------------------------------------------------------------------------------------------


def example_rewards(model, encoded, batch_size: int, seq_len: int):
    """The reward of every example of an EncodedBatch, each alone (right-padded in batches of batch_size, cut at
    seq_len as packing cuts it): float64 numpy, one per example."""
    import numpy as np
    import torch

    starts = np.concatenate([[0], np.cumsum(encoded.lengths)])
    out = np.empty(len(encoded.lengths), dtype=np.float64)
    device = next(_unwrapped(model).parameters()).device
    for first in range(0, len(out), batch_size):
        lengths = [min(int(n), seq_len) for n in encoded.lengths[first : first + batch_size]]
        ids = torch.zeros((len(lengths), max(lengths)), dtype=torch.long)  # pads after the tokens: never attended
        attention = torch.zeros_like(ids)
        keep = torch.zeros_like(ids, dtype=torch.bool)
        for k, n in enumerate(lengths):
            start = int(starts[first + k])
            ids[k, :n] = torch.from_numpy(encoded.ids[start : start + n])
            attention[k, :n] = 1
            keep[k, n - 1] = True
        with torch.inference_mode():
            rewards = head_forward(model, keep.to(device), ids.to(device), attention_mask=attention.to(device))
        out[first : first + len(lengths)] = rewards.double().cpu().numpy()
    return out


# ---- saving and loading ----------------------------------------------------------------------------------------


def head_weight(model, state_dict: dict | None = None):
    """The head's weight, from the gathered state dict when it holds it (its key ends in reward_head.weight)."""
    for key, value in (state_dict or {}).items():
        if key.endswith(f"{HEAD}.weight"):
            return value
    return reward_head(model).weight


def save_head(model, out_dir: Path, state_dict: dict | None = None) -> None:
    """reward_head.safetensors and reward_model.json in out_dir, beside the adapter."""
    from safetensors.torch import save_file

    weight = head_weight(model, state_dict).detach().float().cpu().contiguous()
    save_file({"weight": weight}, str(out_dir / HEAD_FILE))
    config = {"kind": REWARD, "objective": RewardModel.name, "hidden_size": int(weight.shape[1]), "pooling": POOLING}
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def is_reward_model(model_dir: Path) -> bool:
    return (Path(model_dir) / CONFIG_FILE).is_file() and (Path(model_dir) / HEAD_FILE).is_file()


def load_reward_model(model, model_dir: Path):
    """model_dir's adapter on the loaded base ``model``, with its reward head; in eval mode."""
    from peft import PeftModel
    from safetensors.torch import load_file

    if not is_reward_model(model_dir):
        raise FineflowError(f"{model_dir}: not a reward model (no {CONFIG_FILE} and {HEAD_FILE} beside the adapter)")
    weight = load_file(str(model_dir / HEAD_FILE))["weight"]
    if weight.shape != (1, hidden_size(model)):
        raise FineflowError(
            f"{model_dir / HEAD_FILE}: a head of shape {tuple(weight.shape)}, but the base's hidden size is "
            f"{hidden_size(model)}: the reward model was trained on another base"
        )
    scorer = PeftModel.from_pretrained(model, str(model_dir), is_trainable=False)
    return add_head(scorer, weight).eval()
