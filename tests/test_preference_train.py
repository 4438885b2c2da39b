"""Preference tuning's training side (issue 34 §2): the dpo and simpo losses over packed pair shards, the
train stage with train.objective dpo|simpo, the reference_logps stage and the champion's identity.

The pair shards are built here with numpy exactly as the shard contract says (fineflow.tokenize.pairs: each pair
two adjacent examples of one row, prompt+chosen then prompt+rejected; pair_slots.bin 2k / 2k+1 / -1; pairs.idx; meta
"objective": "preference"), from the tiny project's validated rows: chosen = the row's answer, rejected = another
row's answer to a different prompt.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fineflow.core.dvc_project import stage_command
from fineflow.objectives import FEEDBACK, objective_for
from fineflow.tokenize.shards import POSITION_DTYPE, PackedArrays, token_dtype, write_shard
from fineflow.tokenize.template import encode_pair, render_prompt
from fineflow.train.pair_shards import PAIR_SLOTS_FILE, PairShard, logps_file, write_shard_logps
from tests.conftest import (
    ROOT,
    TRAIN_OVERRIDES,
    copy_project,
    finish_train,
    kill_when,
    last_logged_step,
    ranks_overrides,
    start_train,
    train_env,
    venv_env,
    write_params,
)
from tests.faults import fault_env

SEQ_LEN = 256  # the tiny base's max_position_embeddings: a pair is up to ~170 tokens here


def encoded_pairs(rows: list[dict], tokenizer) -> list[tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]]:
    """((ids, mask) of prompt+chosen, (ids, mask) of prompt+rejected) per row: rejected is the next row's
    answer (a plausible wrong one), skipped where the two answers are the same text."""
    pairs = []
    for i, row in enumerate(rows):
        wrong = rows[(i + 1) % len(rows)]["output"]
        if wrong == row["output"]:
            continue
        prompt = render_prompt(row["instruction"], row.get("input") or "")
        pairs.append((encode_pair(tokenizer, prompt, " " + row["output"]), encode_pair(tokenizer, prompt, " " + wrong)))
    return pairs


def pack_pairs(pairs, seq_len: int) -> list[list[int]]:
    """Pair indices per row, in order: a pair goes into the current row if both its examples fit, else a new one."""
    rows, used = [[]], 0
    for k, ((chosen, _), (rejected, _)) in enumerate(pairs):
        need = len(chosen) + len(rejected)
        assert need <= seq_len, "a test pair longer than a row"
        if used + need > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(k)
        used += need
    return rows


def write_pair_shard(out: Path, pairs, seq_len: int, pad_id: int, vocab_size: int) -> dict:
    """A preference shard per the shard contract, the common files through the SFT shard writer."""
    layout = pack_pairs(pairs, seq_len)
    tokens = np.full((len(layout), seq_len), pad_id, dtype=token_dtype(vocab_size))
    mask = np.zeros((len(layout), seq_len), dtype=np.uint8)
    positions = np.zeros((len(layout), seq_len), dtype=POSITION_DTYPE)
    slots = np.full((len(layout), seq_len), -1, dtype=np.int16)
    examples, pair_index = [], []
    for r, members in enumerate(layout):
        offset = 0
        for k, pair in enumerate(members):
            pair_index.append([len(examples), len(examples) + 1])
            for side, (ids, trained) in enumerate(pairs[pair]):
                end = offset + len(ids)
                tokens[r, offset:end], mask[r, offset:end] = ids, trained
                positions[r, offset:end] = np.arange(len(ids))
                slots[r, offset:end] = 2 * k + side
                examples.append([r, offset, len(ids)])
                offset = end
        positions[r, offset:] = np.arange(seq_len - offset)  # padding: its own segment, as pack_examples writes it
    arrays = PackedArrays(tokens, mask, positions, np.asarray(examples, dtype=np.int64))
    key = f"pairs-{len(pairs)}-{seq_len}-{int(tokens.astype(np.int64).sum())}"
    meta = write_shard(out, arrays, {"vocab_size": vocab_size, "content_key": key, "objective": "preference"})
    slots.tofile(out / PAIR_SLOTS_FILE)
    np.asarray(pair_index, dtype=np.int64).tofile(out / "pairs.idx")
    meta["pairs"] = len(pairs)
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return meta


def write_pair_shards(built: Path, shards: Path, n_train: int | None = None) -> None:
    """data/shards/{train,eval} as preference shards from the built project's validated rows."""
    from fineflow.tokenize.tokenization import load_tokenizer

    tokenizer = load_tokenizer(str(built / "models/base"))
    for split in ("train", "eval"):
        rows = [json.loads(line) for line in (built / f"data/validated/{split}.jsonl").read_text().splitlines()]
        pairs = encoded_pairs(rows[:n_train] if split == "train" and n_train else rows, tokenizer)
        write_pair_shard(shards / split, pairs, SEQ_LEN, tokenizer.pad_token_id or 0, len(tokenizer))


def write_feedback_shards(built: Path, project: Path) -> None:
    """data/shards/{train,eval} as feedback shards (train.objective kto): the bundled rows unpaired and labelled,
    through the data, validate and tokenize stages in process, with the built base's tokenizer."""
    from fineflow.core.config import parse_params
    from fineflow.stages import data, tokenize, validate
    from tests.conftest import TINY_PARAMS, _merge

    params = parse_params(_merge(TINY_PARAMS, {"train": {"objective": "kto"}, "tokenize": {"seq_len": SEQ_LEN}}))
    raw, validated = project / "data/raw", project / "data/validated"
    data.run(params, raw / "train.jsonl", raw / "eval.jsonl")
    validate.run(params, raw / "train.jsonl", raw / "eval.jsonl", validated, project / "reports/validate.json")
    tokenize.run(params, validated, built / "models/base", project / "data/shards")


# ---- the losses: packed == each sequence through the model alone ------------------------------------------------


def _sequence_logp(model, ids: list[int], trained: list[int]) -> tuple[float, int]:
    """Sum of log p(token t | < t) over the answer's tokens, the sequence alone in the model; and their count."""
    with torch.no_grad():
        ids_t = torch.tensor([ids])
        logits = model(input_ids=ids_t, position_ids=torch.arange(len(ids))[None], use_cache=False).logits[0].double()
    logps = torch.log_softmax(logits, dim=-1)
    picked = [float(logps[t - 1, ids[t]]) for t in range(1, len(ids)) if trained[t]]
    return sum(picked), len(picked)


def _by_hand(policy, reference, pairs, beta: float, gamma: float) -> dict:
    """dpo's and simpo's summed loss, reward accuracy and margin over the pairs, one sequence at a time."""
    out = {"dpo": [0.0, 0, 0.0], "simpo": [0.0, 0, 0.0]}
    for (chosen, c_mask), (rejected, r_mask) in pairs:
        (pc, lc), (pr, lr) = _sequence_logp(policy, chosen, c_mask), _sequence_logp(policy, rejected, r_mask)
        (rc, _), (rr, _) = _sequence_logp(reference, chosen, c_mask), _sequence_logp(reference, rejected, r_mask)
        for objective, margin, shift in (
            ("dpo", beta * ((pc - rc) - (pr - rr)), 0.0),
            ("simpo", beta * (pc / lc - pr / lr), gamma),
        ):
            out[objective][0] += -math.log(1 / (1 + math.exp(-(margin - shift))))
            out[objective][1] += int(margin > 0)
            out[objective][2] += margin
    return out


def _load(base: Path, adapter: Path | None = None, attention: str = "varlen"):
    from transformers import AutoModelForCausalLM

    from fineflow.train.attention import register

    model = AutoModelForCausalLM.from_pretrained(
        base, attn_implementation=register() if attention == "varlen" else attention
    )
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
def test_packed_pair_losses_equal_each_sequence_run_alone(built, tmp_path, attention):
    """dpo and simpo over packed rows (several pairs a row, rows batched, the reference's log-probs from the
    shard-aligned file) == the DPO and SimPO formulas (fineflow.objectives.dpo, .simpo)
    computed pair by pair on each sequence run alone, unpacked.
    varlen: fineflow's per-example attention; sdpa: transformers' block-diagonal mask from the position ids."""
    from fineflow.core.train_config import TrainParams
    from fineflow.tokenize.shards import PackedShard
    from fineflow.tokenize.tokenization import load_tokenizer
    from fineflow.train.attention import layout_kwargs, layout_of
    from tests.conftest import random_adapter

    base = built / "models/base"
    tokenizer = load_tokenizer(str(base))
    rows = [json.loads(line) for line in (built / "data/validated/train.jsonl").read_text().splitlines()][:12]
    pairs = encoded_pairs(rows, tokenizer)
    write_pair_shard(tmp_path / "train", pairs, SEQ_LEN, tokenizer.pad_token_id or 0, len(tokenizer))
    shard = PairShard(PackedShard(tmp_path / "train"))
    assert len(shard) < len(pairs)  # several pairs share a row: the packing is under test
    varlen = attention == "varlen"
    policy = _load(base, random_adapter(base, tmp_path / "policy", seed=3), attention)
    reference = _load(base, random_adapter(base, tmp_path / "reference", seed=4), attention)
    write_shard_logps(reference, shard, tmp_path / logps_file("train"), 3, torch.device("cpu"), varlen=varlen)
    shard = PairShard(PackedShard(tmp_path / "train"), tmp_path / logps_file("train"))
    cfg = TrainParams(preference={"beta": 0.5}, simpo={"gamma": 0.3})
    expected = _by_hand(policy, reference, pairs, cfg.preference.beta, cfg.simpo.gamma)
    for objective in ("dpo", "simpo"):
        total, pairs_seen, correct, margin = 0.0, 0, 0.0, 0.0
        for start in range(0, len(shard), 2):
            arrays = shard.batch(list(range(start, min(start + 2, len(shard)))))
            batch = {key: torch.from_numpy(value) for key, value in arrays.items()}
            with torch.no_grad():
                got = objective_for(objective).loss(
                    policy, batch, cfg, **layout_kwargs(layout_of(arrays["position_ids"], varlen))
                )
            total, pairs_seen = total + float(got.loss_sum), pairs_seen + got.count
            correct, margin = correct + got.rewards[0], margin + got.rewards[1]
        loss, right, margin_by_hand = expected[objective]
        assert pairs_seen == len(pairs)
        assert total == pytest.approx(loss, rel=1e-5), objective
        assert margin == pytest.approx(margin_by_hand, rel=1e-4, abs=1e-6) and correct == right, objective


# ---- the train stage with a preference objective ----------------------------------------------------------------


def run_stage(project: Path, stage: str) -> str:
    """A stage's dvc.yaml command run in the project (asserting it succeeded); its output."""
    done = subprocess.run(
        stage_command(stage, ROOT, python=sys.executable), cwd=project, env=venv_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def preference_project(
    built: Path, path: Path, objective: str, overrides: dict | None = None, champion_seed: int | None = None
) -> Path:
    """A project with the tiny base, preference shards of the built rows and TRAIN_OVERRIDES (plus objective and
    overrides) as its params; the fingerprint and reference_logps stages run on it (dpo: the base's log-probs, or with
    champion_seed a random champion adapter installed first: base + that adapter's)."""
    shutil.copytree(built / "models/base", path / "models/base")
    if objective_for(objective).rows == FEEDBACK:
        write_feedback_shards(built, path)
    else:
        write_pair_shards(built, path / "data/shards")
    params = {**TRAIN_OVERRIDES, "tokenize.seq_len": SEQ_LEN, "train.objective": objective, **(overrides or {})}
    write_params(path / "params.yaml", params)
    run_stage(path, "fingerprint")
    if champion_seed is not None:
        install_champion(path, champion_seed)
        run_stage(path, "fingerprint")  # the champion's identity, as a pipeline run's fingerprint stage finds it
    run_stage(path, "reference_logps")
    return path


def steps_of(project: Path) -> list[dict]:
    return [json.loads(line) for line in (project / "reports/train_steps.jsonl").read_text().splitlines()]


# a batch of ~12 pairs a step (4 rows x 2 micro-batches), and a step size that moves the tiny model in 16 steps
LEARNS = {
    "train.steps": 16,
    "train.micro_batch_size": 4,
    "train.grad_accum": 2,
    "train.lr": 0.01,
    "train.preference.beta": 0.5,
    "checkpoint.every_steps": 4,
}


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["dpo", "simpo"])  # orpo: 16 tiny steps mostly train its NLL term
def test_preference_training_raises_reward_accuracy_and_margin(built, tmp_path, objective):
    """The train stage with train.objective dpo / simpo on the tiny base: the step log's reward accuracy and
    margin (over each step's pairs) rise from the first steps to the last, and the eval pair loss falls. dpo's
    first step scores the policy (a fresh adapter on the base) against the reference_logps stage's log-probs of the
    same base: every reward is 0, the loss exactly log 2, so the cached log-probs line up with the policy's."""
    project = preference_project(built, tmp_path, objective, LEARNS)
    finish_train(project, 1, train_env(1))
    steps = steps_of(project)
    first, last = steps[:4], steps[-4:]

    def mean(rows, key):
        return sum(row[key] for row in rows) / len(rows)

    assert mean(last, "reward_accuracy") >= 0.75 > mean(first, "reward_accuracy") + 0.2, steps
    assert mean(last, "reward_margin") > max(0.0, mean(first, "reward_margin")), steps
    evals = [row["eval_loss"] for row in steps if "eval_loss" in row]
    assert evals[-1] < evals[0], evals
    if objective == "dpo":
        assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and steps[0]["reward_margin"] == 0
    report = json.loads((project / "reports/train.json").read_text())
    assert report["steps"] == LEARNS["train.steps"] and report["objective"] == objective
    assert (report["final_reward_accuracy"], report["final_reward_margin"]) == (
        steps[-1]["reward_accuracy"],
        steps[-1]["reward_margin"],
    )


@pytest.mark.slow
def test_dpo_from_the_champion_starts_the_policy_at_its_adapter_and_anchors_to_it(built, tmp_path):
    """dpo with train.preference.reference champion and a champion installed: the reference is base + the
    champion's adapter, and the policy starts from that adapter (trainable): its first step's rewards are all 0
    and the loss exactly log 2, which a fresh adapter (the base's log-probs, not the champion's) would not give.
    The candidate keeps the champion's LoRA shape."""
    project = preference_project(built, tmp_path, "dpo", {"train.steps": 4}, champion_seed=5)
    record = json.loads((project / "models/reference_logps/reference.json").read_text())
    champion = json.loads((project / "models/champion/champion.json").read_text())
    assert record["champion"] == champion["candidate_id"] and record["adapter_sha256"]
    output = finish_train(project, 1, train_env(1))
    assert "dpo reference: the champion" in output
    steps = steps_of(project)
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-5) and steps[0]["reward_margin"] == 0, steps[0]
    assert steps[-1]["reward_margin"] != 0  # and it trains from there
    shape = json.loads((project / "models/champion/adapter_config.json").read_text())["target_modules"]
    assert json.loads((project / "models/candidate/adapter_config.json").read_text())["target_modules"] == sorted(shape)


@pytest.mark.slow
def test_a_reference_free_objective_from_the_champion_starts_at_its_adapter_and_computes_no_log_probs(built, tmp_path):
    """orpo (no reference model) with train.preference.reference champion and a champion installed: the
    reference_logps stage copies the champion's adapter and scores nothing; the policy starts from that adapter, so
    its first step's loss and rewards (computed before any update) differ from those of the same run with
    reference base (a fresh adapter: the base's log-probs). SFT then ORPO continues the SFT model."""
    started = {}
    for reference in ("champion", "base"):
        overrides = {"train.steps": 1, "train.preference.reference": reference}
        project = preference_project(built, tmp_path / reference, "orpo", overrides, champion_seed=5)
        out = project / "models/reference_logps"
        record = json.loads((out / "reference.json").read_text())
        assert record["needed"] is False and not list(out.glob("*.logps.bin")), record
        champion = json.loads((project / "models/champion/champion.json").read_text())["candidate_id"]
        assert record["champion"] == (champion if reference == "champion" else None), record
        assert (out / "adapter/adapter_model.safetensors").is_file() == (reference == "champion")
        output = finish_train(project, 1, train_env(1))
        assert f"orpo start: the {'champion' if reference == 'champion' else 'base'}" in output, output[-2000:]
        started[reference] = steps_of(project)[0]
    one, other = started["champion"], started["base"]
    assert one["loss"] != pytest.approx(other["loss"], abs=1e-4), (one, other)
    assert one["reward_margin"] != pytest.approx(other["reward_margin"], abs=1e-6), (one, other)


# ---- the reference_logps stage: computed once, re-run only by what it depends on ------------------------------


def _dvc_repro(project: Path) -> list[str]:
    """`dvc repro` in the project; the stages it ran, in order."""
    done = subprocess.run(
        [sys.executable, "-m", "dvc", "repro"], cwd=project, env=venv_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return re.findall(r"Running stage '(\w+)'", done.stdout)


def reference_only_project(built: Path, path: Path, overrides: dict) -> Path:
    """A git+DVC copy of the project whose dvc.yaml keeps the fingerprint and reference_logps stages, with the tiny base
    and preference shards in place (their producers left out)."""
    project = copy_project(path, {"tokenize.seq_len": SEQ_LEN, **overrides})
    pipeline = yaml.safe_load((project / "dvc.yaml").read_text(encoding="utf-8"))
    pipeline["stages"] = {name: pipeline["stages"][name] for name in ("fingerprint", "reference_logps")}
    for key in ("metrics", "plots"):
        pipeline.pop(key, None)
    (project / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False), encoding="utf-8")
    (project / "dvc.lock").unlink(missing_ok=True)
    shutil.copytree(built / "models/base", project / "models/base")
    write_pair_shards(built, project / "data/shards")
    return project


def install_champion(project: Path, seed: int) -> str:
    """A random adapter as models/champion (what promote installs: the adapter and champion.json); its id."""
    from fineflow.base_source import base_digest
    from fineflow.registry.store import candidate_id
    from tests.conftest import random_adapter

    champion = project / "models/champion"
    shutil.rmtree(champion, ignore_errors=True)
    random_adapter(project / "models/base", champion, seed=seed)
    cid = candidate_id(champion)
    digest = base_digest(json.loads((project / "models/base_fingerprint.json").read_text()))
    (champion / "champion.json").write_text(json.dumps({"candidate_id": cid, "base_digest": digest}))
    return cid


def _reference(project: Path) -> tuple[dict, bytes]:
    out = project / "models/reference_logps"
    return json.loads((out / "reference.json").read_text()), (out / logps_file("train")).read_bytes()


@pytest.mark.nightly  # six `dvc repro`s, four of them scoring the shards (~50 s); CI keeps the champion start
@pytest.mark.slow
def test_reference_logps_are_recomputed_for_the_data_base_or_champion_never_for_train_lr(built, tmp_path):
    """`dvc repro` of fingerprint + reference (dpo, reference champion): train.lr never re-runs the reference;
    a promotion (the champion's identity, through the fingerprint stage), new shards and new base weights do.
    With a champion the reference is base + its adapter (copied into models/reference_logps/adapter)."""
    project = reference_only_project(built, tmp_path / "project", {"train.objective": "dpo"})
    assert _dvc_repro(project) == ["fingerprint", "reference_logps"]
    record, logps = _reference(project)
    assert record["champion"] is None and record["adapter_sha256"] is None and len(logps) > 0
    write_params(project / "params.yaml", {"tokenize.seq_len": SEQ_LEN, "train.objective": "dpo", "train.lr": 1e-4})
    assert _dvc_repro(project) == ["fingerprint"]  # always runs; its files are unchanged: nothing after it
    cid = install_champion(project, seed=5)
    assert _dvc_repro(project) == ["fingerprint", "reference_logps"]
    with_champion, champion_logps = _reference(project)
    adapter = project / "models/reference_logps/adapter/adapter_config.json"
    assert with_champion["champion"] == cid and adapter.is_file()
    assert champion_logps != logps and with_champion["key"] != record["key"]
    assert _dvc_repro(project) == ["fingerprint"]
    write_pair_shards(built, project / "data/shards", n_train=40)  # other training pairs
    assert _dvc_repro(project) == ["fingerprint", "reference_logps"]
    assert _reference(project)[0]["shards"]["train"] != with_champion["shards"]["train"]
    weights = project / "models/base/model.safetensors"  # new base weights of the same shape, at the same path
    with safe_open(weights, "pt") as fh:
        metadata = fh.metadata()
    save_file({k: v * 1.01 for k, v in load_file(weights).items()}, weights, metadata=metadata)
    assert _dvc_repro(project) == ["fingerprint", "reference_logps"]
    # the champion was trained on the old base: the reference falls back to the new base, and says so
    assert _reference(project)[0]["champion"] is None and "another base" in _reference(project)[0]["note"]


# ---- exact resume: SIGKILL mid-run, then resume, bit-exact for each preference objective ----------------------


def _adapter(project: Path) -> dict:
    """Every tensor the candidate folder holds: the adapter's (and the reward model's head)."""
    files = sorted((project / "models/candidate").glob("*.safetensors"))
    return {f"{path.name}:{key}": value for path in files for key, value in load_file(path).items()}


def _writing(project: Path) -> bool:
    return any(project.glob("checkpoints/*/.tmp-step-*"))


DPO_KILL_POINTS = [
    lambda p: last_logged_step(p) >= 1,  # before any checkpoint
    _writing,  # during a checkpoint write
    lambda p: last_logged_step(p) >= 5,  # between checkpoints
    lambda p: last_logged_step(p) >= 9,
]


@pytest.mark.scenario
@pytest.mark.slow
# dpo in CI; the reward model (its head in the checkpoints too), kto (its feedback shards), simpo and orpo (no
# reference: the policy alone) nightly
@pytest.mark.parametrize(
    "objective",
    ["dpo", *(pytest.param(name, marks=pytest.mark.nightly) for name in ("reward_model", "kto", "simpo", "orpo"))],
)
def test_a_preference_objective_sigkilled_at_several_points_then_resumed_is_bit_exact(built, tmp_path, objective):
    """test_resume's kill sweep for train.objective dpo (the reward model, kto, simpo, orpo): SIGKILLs before any
    checkpoint, mid-write and between checkpoints, then a run to the end: the same rows, losses, rewards and gradient
    norms at every step as an uninterrupted run, and the candidate's tensors (adapter, reward head) torch.equal to
    its."""
    reference = preference_project(built, tmp_path / "reference", objective)
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)  # the same shards and reference log-probs, before either trains
    env = fault_env(train_env(1), write_delay_s=0.03)  # slowed checkpoint writes: kills land mid-write
    finish_train(reference, 1, env)
    kills = sum(kill_when(lambda port: start_train(resumed, 1, env), resumed, when) for when in DPO_KILL_POINTS)
    output = finish_train(resumed, 1, env)
    assert kills >= 3 and "resuming from" in output, (kills, output[-2000:])
    keys = ("step", "rows", "loss", "grad_norm", "reward_accuracy", "reward_margin", "eval_loss")
    assert [[s.get(k) for k in keys] for s in steps_of(resumed)] == [
        [s.get(k) for k in keys] for s in steps_of(reference)
    ]
    a, b = _adapter(resumed), _adapter(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (objective == "reward_model") == any(key.startswith("reward_head") for key in a), sorted(a)


# ---- DDP: 2 ranks == 1 process for each preference objective ---------------------------------------------------


@pytest.mark.nightly  # a 2-rank accelerate launch beside a 1-process run (~45 s); CI keeps SFT's 2 ranks vs 1
@pytest.mark.slow
# reward_model: the head used inside the forward; kto: its KL estimate gathered across the ranks; simpo and orpo:
# reference-free, each answer's log-prob over its length (orpo: its chosen answer's NLL term beside the odds ratio)
@pytest.mark.parametrize("objective", ["dpo", "reward_model", "kto", "simpo", "orpo"])
def test_a_preference_objective_on_two_ddp_ranks_matches_one_process_with_the_same_global_batch(
    built, tmp_path, objective
):
    """test_ddp's check for train.objective dpo (the reward model, kto, simpo, orpo): the same global batch (4 rows
    a step) on 1 process and on 2 accelerate ranks (2 rows each, pair counts summed over the ranks): every step's
    loss, gradient norm, reward accuracy and margin agree to 1e-4 (the ranks' gradient all-reduce sums in another
    order)."""
    one = preference_project(built, tmp_path / "one", objective, ranks_overrides(1))
    two = tmp_path / "two"
    shutil.copytree(one, two)  # the same shards and reference log-probs
    write_params(
        two / "params.yaml",
        {**TRAIN_OVERRIDES, "tokenize.seq_len": SEQ_LEN, "train.objective": objective, **ranks_overrides(2)},
    )
    finish_train(one, 1, train_env(1))
    finish_train(two, 2, train_env(2))
    one_steps, two_steps = steps_of(one), steps_of(two)
    assert json.loads((two / "reports/train.json").read_text())["world_size"] == 2
    assert [s["rows"] for s in one_steps] != [] and len(two_steps) == len(one_steps)
    for key in ("loss", "grad_norm", "reward_accuracy", "reward_margin"):
        assert [s[key] for s in two_steps] == pytest.approx([s[key] for s in one_steps], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_a_preference_objective_on_sft_shards_or_without_its_reference_is_one_clear_error(built, tmp_path):
    """simpo on SFT shards (no pair slots): exit 2 naming the shard's meta.json and the fix, no traceback. dpo
    whose reference stage has not run: exit 2 naming the stage to run."""
    from tests.conftest import train_project

    sft_shards = train_project(built, tmp_path / "sft", {"train.objective": "simpo"})
    run_stage(sft_shards, "fingerprint")  # the start simpo continues (no log-probs: it reads no shard)
    run_stage(sft_shards, "reference_logps")
    proc = start_train(sft_shards, 1, train_env(1))
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert "data/shards/train/meta.json: not a preference shard" in output and "re-run the tokenize stage" in output
    no_reference = tmp_path / "dpo"
    shutil.copytree(built / "models/base", no_reference / "models/base")
    write_pair_shards(built, no_reference / "data/shards")
    write_params(no_reference / "params.yaml", {**TRAIN_OVERRIDES, "train.objective": "dpo"})
    proc = start_train(no_reference, 1, train_env(1))
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert "models/reference_logps/reference.json: cannot read it" in output and "dvc repro reference_logps" in output
