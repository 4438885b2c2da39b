"""An online objective's rollout phase (fineflow.objectives.grpo): each optimizer step's prompts turned into its
training batch, before the loop's forward and backward.

For the step's sampled shard rows (fineflow.train.loader.StepBatch) on this rank: every packed example's prompt
(fineflow.objectives.grpo.prompts_of) gets a group of completions sampled with transformers' ``generate`` on the
policy as it stands (no gradient, its own seed per group), the rewards score them (fineflow.rewards), the group's
advantages follow, the reference model scores the completions' tokens when train.grpo.beta > 0, and the
completions become exactly train.grad_accum micro-batches of one completion per row (prompt + completion,
right-padded): every rank runs the same number of forwards, whatever its prompt count. Time goes to the step's
``rollout_s`` (generation), ``reward_s`` and ``reference_s`` spans (the goodput ledger's rollout, reward and
reference buckets).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from fineflow.errors import FineflowError
from fineflow.objectives.grpo import STATS, group_advantages, group_seed, prompts_of


@dataclass
class RolloutContext:
    """What the rollouts need beside the model, built once per rank: the tokenizer (decoding the completions for
    the rewards), the ids generation stops on, the rewards and the reference model (None: the policy with its
    adapter off, or no reference at all when beta is 0)."""

    tokenizer: object
    stop_ids: list[int]
    pad_id: int
    rewards: object  # fineflow.rewards.RewardSet
    reference: object | None
    seed: int

    @classmethod
    def build(cls, base_source: str, start_adapter, cfg, seed: int, device=None) -> RolloutContext:
        from transformers import AutoTokenizer

        from fineflow.rewards import build_rewards

        tokenizer = AutoTokenizer.from_pretrained(base_source)
        stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids or [0])[0]
        reference = None
        if cfg.grpo.beta > 0 and start_adapter is not None:  # the run starts from the champion: a frozen copy of it
            reference = frozen_start(base_source, start_adapter)
            if device is not None:
                reference.to(device)
        return cls(tokenizer, stop_ids, pad_id, build_rewards(cfg.grpo.rewards), reference, seed)


def frozen_start(base_source: str, adapter) -> object:
    """The model the run started from (base + its start adapter), frozen: the KL penalty's reference."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_source, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def rollout_step(model, prepared, cfg, step: int, accelerator, timer, context: RolloutContext):
    """The StepBatch of this step's completions (replacing prepared's packed rows): grad_accum micro-batches,
    ``targets`` what the loss is a sum over (completions, or for dapo completion tokens), ``stats`` the rollout's
    sums (fineflow.objectives.grpo.STATS)."""
    from dataclasses import replace

    import torch

    settings = cfg.grpo
    policy = accelerator.unwrap_model(model)
    with timer.span("rollout_s"):  # the prompts read back, their groups sampled
        prompts = step_prompts(prepared, step)
        completions = [sample_group(policy, p, settings, step, accelerator.device, context) for p in prompts]
    with timer.span("reward_s"):
        texts = [context.tokenizer.decode(c, skip_special_tokens=True).strip() for g in completions for c in g]
        answers = [context.tokenizer.decode(p.answer_ids, skip_special_tokens=True).strip() for p in prompts]
        rows = [{"output": answer} for answer in answers for _ in range(settings.group_size)]
        scored = context.rewards.score(texts, rows)
        rewards = torch.tensor(np.asarray(scored.total, dtype=np.float64)).reshape(len(prompts), settings.group_size)
        advantages = group_advantages(rewards, settings.normalization)
    with timer.span("rollout_s"):  # the completions as the step's micro-batches
        sequences = [
            (p.prompt_ids, c, float(a))
            for p, group, adv in zip(prompts, completions, advantages)
            for c, a in zip(group, adv)
        ]
        micro = micro_batches(sequences, cfg.grad_accum, context.pad_id)
    if settings.beta > 0:
        with timer.span("reference_s"):
            for batch in micro:
                batch["ref_logps"] = reference_logps(policy, context.reference, batch, accelerator.device)
    completion_tokens = sum(len(c) for _, c, _ in sequences)
    targets = completion_tokens if settings.normalization == "dapo" else len(sequences)
    stats = rollout_stats(rewards, completion_tokens, sum(scored.errors.values()))
    real = sum(len(p) + len(c) for p, c, _ in sequences)
    return replace(prepared, micro=micro, targets=targets, real_tokens=real, layouts=None, stats=stats)


def step_prompts(prepared, step: int) -> list:
    """Every packed example of the step's sampled shard rows on this rank, in order (fineflow.objectives.grpo)."""
    prompts = [
        prompt
        for micro, rows in zip(prepared.micro, prepared.rows)
        for i, row in enumerate(rows)
        for prompt in prompts_of(
            micro["input_ids"][i].numpy(), micro["labels"][i].numpy(), micro["position_ids"][i].numpy(), row
        )
    ]
    if not prompts:
        raise FineflowError(
            f"step {step}: the sampled shard rows hold no example with a prompt and an answer: train.objective grpo "
            "generates from the prompts of SFT rows (re-run the tokenize stage)"
        )
    return prompts


def rollout_stats(rewards, completion_tokens: int, errors: int) -> dict:
    """This rank's rollout sums (fineflow.objectives.grpo.STATS): rewards is groups x G."""
    spread = rewards.max(dim=1).values - rewards.min(dim=1).values
    stats = {
        "reward_sum": float(rewards.sum()),
        "completions": float(rewards.numel()),
        "groups": float(rewards.shape[0]),
        "flat_groups": float((spread == 0).sum()),
        "flat_solved": float(((spread == 0) & (rewards.min(dim=1).values > 0)).sum()),
        "completion_tokens": float(completion_tokens),
        "reward_errors": float(errors),
    }
    assert tuple(stats) == STATS
    return stats


def sample_group(policy, prompt, settings, step: int, device, context: RolloutContext) -> list[list[int]]:
    """G completions of one prompt (token ids, cut after the first stop id), sampled under the group's own seed
    in a forked RNG: the training RNG's state is left as it was."""
    import torch

    ids = torch.tensor([prompt.prompt_ids] * settings.group_size, dtype=torch.long, device=device)
    devices = [device] if device.type == "cuda" else []
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), cached_attention(policy):
            torch.manual_seed(group_seed(context.seed, step, prompt.row, prompt.example))
            out = policy.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=0,
                max_new_tokens=settings.max_completion_tokens,
                eos_token_id=context.stop_ids or None,
                pad_token_id=context.pad_id,
                use_cache=True,
            )
    finally:
        policy.train(was_training)
    return [cut_at_stop(row[len(prompt.prompt_ids) :].tolist(), context.stop_ids) for row in out]


@contextmanager
def cached_attention(policy):
    """The policy's attention as generation needs it: fineflow's varlen kernel (train.attention varlen) runs whole
    packed rows and cannot attend from one new token to a KV cache, so generation runs on sdpa (the same
    attention: the block-diagonal mask of one example is the causal mask); switched back after."""
    from fineflow.train.attention import VARLEN

    model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    trained_with = getattr(model.config, "_attn_implementation", None)
    if trained_with != VARLEN:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(VARLEN)


def cut_at_stop(tokens: list[int], stop_ids: list[int]) -> list[int]:
    """A completion up to and with its first stop id (what generate padded after it dropped); all of it if none."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens


def micro_batches(sequences: list[tuple[list[int], list[int], float]], count: int, pad_id: int) -> list[dict]:
    """(prompt, completion, advantage) triples as ``count`` micro-batches of as equal size as can be, in order,
    one sequence per row, right-padded: input_ids, labels (the completion's tokens, -100 elsewhere), position_ids,
    advantages (the sequence's on its completion tokens)."""
    import torch

    if len(sequences) < count:
        raise FineflowError(
            f"{len(sequences)} completions cannot fill train.grad_accum = {count} micro-batches: raise "
            "train.micro_batch_size or train.grpo.group_size"
        )
    bounds = np.linspace(0, len(sequences), count + 1).round().astype(int)
    batches = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        part = sequences[lo:hi]
        width = max(len(p) + len(c) for p, c, _ in part)
        ids = np.full((len(part), width), pad_id, dtype=np.int64)
        labels = np.full((len(part), width), -100, dtype=np.int64)
        advantages = np.zeros((len(part), width), dtype=np.float32)
        for r, (prompt, completion, advantage) in enumerate(part):
            n = len(prompt) + len(completion)
            ids[r, :n] = prompt + completion
            labels[r, len(prompt) : n] = completion
            advantages[r, len(prompt) : n] = advantage
        positions = np.broadcast_to(np.arange(width, dtype=np.int64), ids.shape).copy()
        batches.append(
            {
                "input_ids": torch.from_numpy(ids),
                "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions),
                "advantages": torch.from_numpy(advantages),
            }
        )
    return batches


def reference_logps(policy, reference, batch: dict, device):
    """The reference model's log-prob of every completion token of a micro-batch, as a rows x seq array aligned
    with its labels (0 elsewhere): the frozen start model, or the policy with its adapter switched off."""
    import torch

    from fineflow.objectives.pair_logps import token_logps, trained_positions

    on_device = {key: value.to(device) for key, value in batch.items() if key != "advantages"}
    _, at = trained_positions(on_device["labels"])
    with torch.no_grad():
        if reference is not None:
            values = token_logps(reference, on_device)
        else:
            with policy.disable_adapter():
                values = token_logps(policy, on_device)
    full = torch.zeros(at.shape, dtype=torch.float32, device=device)
    full[at] = values
    return full.cpu()
