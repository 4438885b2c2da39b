"""An online objective's rollouts (Objective.online: GRPO, fineflow.objectives.grpo): each optimizer step's prompts
turned into its training batch, before the loop's forward and backward. The runtime is here; the objective says how
to sample (``online_settings``: group size, length, temperature, top_p, beta, the rewards), how rewards become
advantages and what the loss is a sum over.

For the step's sampled shard rows (fineflow.train.loader.StepBatch) on this rank: every packed example's prompt
(``prompts_of``) gets a group of completions sampled with transformers' ``generate`` on the policy as it stands (no
gradient, its own seed per group: ``group_seed``), the rewards score them (fineflow.rewards), the objective's
advantages follow, the reference model scores the completions' tokens when its beta > 0, and the
completions become exactly train.grad_accum micro-batches of one completion per row (prompt + completion,
right-padded): every rank runs the same number of forwards, whatever its prompt count. Time goes to the step's
``rollout_s`` (generation), ``reward_s`` and ``reference_s`` spans (the goodput ledger's rollout, reward and
reference buckets).
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from fineflow.errors import FineflowError
from fineflow.objectives import objective_for
from fineflow.rewards import build_rewards

STATS = ("reward_sum", "completions", "groups", "flat_groups", "flat_solved", "completion_tokens", "reward_errors")


def group_seed(seed: int, step: int, row: int, example: int) -> int:
    """The sampling seed of one prompt's group: a function of the run's seed, the step and the example's place in
    the shard alone (not of the rank or the batch), so a resume and any world size sample the same completions."""
    digest = hashlib.sha256(f"rollout:{seed}:{step}:{row}:{example}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def step_fields(totals: dict) -> dict:
    """The step log's rollout figures from the global batch's sums (STATS)."""
    completions, groups = max(1.0, totals["completions"]), max(1.0, totals["groups"])
    return {
        "reward_mean": round(totals["reward_sum"] / completions, 5),
        # groups whose completions all scored alike have no advantage: no learning signal; of them, the share of
        # all groups where every completion was rewarded (too easy) - the rest scored nothing (too hard)
        "zero_advantage_share": round(totals["flat_groups"] / groups, 5),
        "zero_advantage_solved_share": round(totals["flat_solved"] / groups, 5),
        "completion_tokens_mean": round(totals["completion_tokens"] / completions, 3),
        "reward_errors": int(totals["reward_errors"]),
    }


@dataclass(frozen=True)
class Prompt:
    """One example of a packed SFT row: its prompt tokens, its reference answer's tokens, where it sits."""

    prompt_ids: list[int]
    answer_ids: list[int]
    row: int
    example: int


def prompts_of(input_ids, labels, position_ids, row: int) -> list[Prompt]:
    """The examples packed in one shard row (numpy 1-D arrays): each starts where position_ids restart at 0 (the
    padding after them too: a segment without trained tokens); its answer is its last run of trained tokens
    (labels != -100), its prompt every token before that run."""
    import numpy as np

    starts = [int(i) for i in np.flatnonzero(position_ids == 0)]
    found = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(position_ids)
        trained = np.flatnonzero(labels[start:end] != -100)
        if len(trained) == 0:
            continue  # padding, or an example whose answer was cut away
        last = int(trained[-1])
        first = last
        while first > 0 and labels[start + first - 1] != -100:
            first -= 1
        if first == 0:
            continue  # no prompt left to generate from
        found.append(
            Prompt(
                input_ids[start : start + first].tolist(),
                input_ids[start + first : start + last + 1].tolist(),
                row,
                k,
            )
        )
    return found


def built_rewards(cfg):
    """The online objective's rewards built (fineflow.rewards.build_rewards: a ConfigError naming every bad entry)
    and checked against what the rollouts hand them; the caller closes the set."""
    objective = objective_for(cfg.objective)
    rewards = build_rewards(objective.online_settings(cfg).rewards, where=rewards_key(cfg))
    try:
        refuse_fields_beyond_the_answer(rewards, rewards_key(cfg))
    except FineflowError:
        rewards.close()
        raise
    return rewards


def rewards_key(cfg) -> str:
    """Where params hold the rewards: train.<objective>.rewards."""
    return f"train.{cfg.objective}.rewards"


# what the rollouts hand the rewards of each completion: its prompt's reference answer, from the packed shard
ROLLOUT_FIELDS = ("output",)


def refuse_fields_beyond_the_answer(rewards, where: str) -> None:
    """The rollouts give each reward the prompt's reference answer (``output``) alone: a reward that reads another
    field of the row is refused by name, not scored against nothing."""
    for reward in rewards:
        beyond = [need for need in reward.needs if not set(need.split("|")) & set(ROLLOUT_FIELDS)]
        if beyond:
            raise FineflowError(
                f"{where}: reward {reward.name} reads the row's {', '.join(beyond)}, but the rollouts "
                f"give the rewards each prompt's reference answer only ({', '.join(ROLLOUT_FIELDS)}): read it from "
                "there"
            )


def check_kept_rows(kept: dict, cfg) -> None:
    """Every kept row (the validate stage's train and eval rows files) holds what the rewards read (its reference
    answer): a DataError naming the file, the line and the field."""
    import json

    from fineflow.errors import DataError
    from fineflow.rewards import missing_fields

    with built_rewards(cfg) as rewards:
        for path in kept.values():
            with open(path, encoding="utf-8") as fh:
                for line, text in enumerate(fh, start=1):
                    problems = missing_fields(rewards, json.loads(text)) if text.strip() else []
                    if problems:
                        raise DataError(f"{path}:{line}: {'; '.join(problems)} ({rewards_key(cfg)})")


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

        settings = objective_for(cfg.objective).online_settings(cfg)
        tokenizer = AutoTokenizer.from_pretrained(base_source)
        stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids or [0])[0]
        reference = None
        if settings.beta > 0 and start_adapter is not None:  # the run starts from the champion: a frozen copy of it
            reference = frozen_start(base_source, start_adapter)
            if device is not None:
                reference.to(device)
        return cls(tokenizer, stop_ids, pad_id, built_rewards(cfg), reference, seed)


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
    ``targets`` what the loss is a sum over (the objective's loss_targets), ``stats`` the rollout's sums (STATS)."""
    from dataclasses import replace

    import torch

    objective = objective_for(cfg.objective)
    settings = objective.online_settings(cfg)
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
        advantages = objective.advantages(rewards, cfg)
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
    targets = objective.loss_targets(len(sequences), completion_tokens, cfg)
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
            f"step {step}: the sampled shard rows hold no example with a prompt and an answer: an online objective "
            "generates from the prompts of instruction rows (re-run the tokenize stage)"
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
            "train.micro_batch_size or the objective's group_size"
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
