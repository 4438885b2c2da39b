"""Stage reference_logps: the model a preference run starts from and, for DPO and KTO, its reference
log-probabilities, computed once and cached as a DVC output.

    python -m fineflow.stages.reference_logps --shards data/shards --base-dir models/base --champion models/champion \
        --base-fingerprint models/base_fingerprint.json --out models/reference_logps

An anchored objective (fineflow.objectives: dpo, simpo, orpo, kto) starts from the model train.preference.reference
names. This stage writes ``<out>/adapter/`` (a copy of the champion's adapter, when train.preference.reference is
champion and there is one: the policy starts from it) and ``<out>/reference.json`` (what that model is:
fineflow.train.reference_model). dpo and kto also compare the policy with that model, frozen, on every row. The
reference's part never changes during training, so for them this stage scores every trained token of the train and
eval shards once and writes ``<out>/train.logps.bin`` and ``<out>/eval.logps.bin`` (rows x seq_len float32,
aligned with the shards: fineflow.train.pair_shards). Its DVC dependencies are the shards, the base, the
champion's identity (models/champion_fingerprint.json, from the fingerprint stage) and the params that decide the
numbers: train.lr and the rest of train never re-run it. For sft and the reward model it writes only reference.json
saying no model is continued (constant bytes: nothing downstream re-runs over it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fineflow.base_source import read_base_digest, resolve_base_model
from fineflow.core.config import Params
from fineflow.core.entry import log, run_entry, stage_parser
from fineflow.core.reports import write_json_atomic
from fineflow.tokenize.shards import PackedShard
from fineflow.train.pair_shards import PairShard, logps_file, write_shard_logps
from fineflow.train.reference_model import (
    ADAPTER_DIR,
    REFERENCE_FILE,
    anchored,
    anchors_to_champion,
    champion_adapter,
    champion_identity,
    needs_reference,
    reference_record,
)

SPLITS = ("train", "eval")


def run(
    params: Params, shards: Path, base_dir: Path, champion_dir: Path, out: Path, base_fingerprint: Path | None = None
) -> dict:
    cfg = params.train
    shutil.rmtree(out, ignore_errors=True)  # run by hand too: nothing of an earlier reference is left beside this one
    out.mkdir(parents=True)
    if not anchored(cfg):
        write_json_atomic(out / REFERENCE_FILE, reference_record(cfg, None, None, {}, "", ""))
        log(f"reference: train.objective {cfg.objective} continues no model and needs no reference")
        return {"objective": cfg.objective, "needed": False}
    base_ref = resolve_base_model(params.model, base_dir)
    base = read_base_digest(base_ref, base_fingerprint)
    adapter, note = reference_adapter(params, champion_dir, base)
    if adapter is not None:
        shutil.copytree(champion_adapter(champion_dir), out / ADAPTER_DIR)
    keys, compute = {}, ""
    if needs_reference(cfg):
        keys, compute = score_shards(params, shards, base_ref, out, note, adapter is not None)
    else:
        log(f"reference: train.objective {cfg.objective} needs no reference log-probs; it starts from {note}")
    record = reference_record(cfg, base, adapter, keys, compute, note)
    write_json_atomic(out / REFERENCE_FILE, record)  # last: its presence says the log-probs are complete
    return {"objective": cfg.objective, "needed": record["needed"], "key": record["key"], "note": note}


def score_shards(params: Params, shards: Path, base_ref: str, out: Path, note: str, with_adapter: bool):
    """The reference's per-token log-probs of each split's shard, written beside reference.json; (each split's
    content key, the dtype they were computed in)."""
    cfg = params.train
    model, device, compute, autocast = load_reference_model(
        params, base_ref, out / ADAPTER_DIR if with_adapter else None
    )
    keys = {}
    for split in SPLITS:
        shard = PairShard(PackedShard(shards / split))
        keys[split] = shard.meta.get("content_key")
        varlen = cfg.attention == "varlen"
        write_shard_logps(model, shard, out / logps_file(split), cfg.micro_batch_size, device, varlen, autocast)
        log(f"reference: {split}: {shard.meta.get('pairs', '?')} pairs in {len(shard)} rows scored ({note})")
    return keys, compute


def reference_adapter(params: Params, champion_dir: Path, base: str) -> tuple[dict | None, str]:
    """(the champion's identity when the reference is base + its adapter, else None; what the reference is)."""
    if not anchors_to_champion(params.train):
        return None, "the base (train.preference.reference: base), a fresh adapter"
    identity = champion_identity(champion_dir)
    if identity is None:
        return None, "the base: no champion adapter yet in models/champion, a fresh adapter"
    if identity["base_digest"] and identity["base_digest"] != base:
        return None, (
            f"the base: the champion {identity['champion']} was trained on another base ({identity['base_digest']}, "
            f"this run's is {base}), a fresh adapter"
        )
    return identity, f"the champion {identity['champion']} (its adapter on the base), which the policy starts from"


def load_reference_model(params: Params, base_ref: str, adapter: Path | None):
    """(the frozen reference model, its device, its compute dtype's name, an autocast factory or None): loaded
    as the train stage loads its base (the same dtype and attention), so with the same adapter it scores as the
    policy's first step does."""
    import torch
    from transformers import AutoModelForCausalLM

    from fineflow.train import precision
    from fineflow.train.attention import attention_of
    from fineflow.train.profile import load_profile

    cfg = params.train
    has_gpu = torch.cuda.is_available()
    profile = load_profile(cfg.accelerate_profile)
    mixed = precision.choose_precision(cfg.precision, profile, has_gpu).mixed_precision
    # a LoRA base's dtype without sharding (a plain forward, no gradients); QLoRA: the same 4-bit base as the policy's
    loaded = precision.base_dtype("qlora" if cfg.method == "qlora" else "lora", mixed, "none")
    kwargs = {"dtype": getattr(torch, loaded)}
    if cfg.method == "qlora":  # bitsandbytes places the quantized weights on the GPU itself
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(**precision.quantization_kwargs(mixed))
    device = torch.device("cuda" if has_gpu else "cpu")
    model = AutoModelForCausalLM.from_pretrained(base_ref, attn_implementation=attention_of(cfg), **kwargs)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    if cfg.method != "qlora":
        model.to(device)
    model.eval()
    autocast = None
    if mixed in ("bf16", "fp16"):
        dtype = torch.bfloat16 if mixed == "bf16" else torch.float16
        autocast = lambda: torch.autocast(device.type, dtype=dtype)  # noqa: E731 - a fresh context per forward
    return model, device, f"{loaded}/{mixed}" + ("/4-bit" if cfg.method == "qlora" else ""), autocast


def main(argv: list[str] | None = None) -> int:
    parser = stage_parser("reference_logps", __doc__)
    parser.add_argument("--shards", type=Path, required=True, help="the tokenize stage's output")
    parser.add_argument("--base-dir", type=Path, required=True, help="the base stage's output directory")
    parser.add_argument("--champion", type=Path, required=True, help="the promote stage's champion directory")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (models/reference_logps)")
    parser.add_argument("--base-fingerprint", type=Path, default=None, help="the fingerprint stage's base JSON")
    args = parser.parse_args(argv)
    return run_entry(
        "reference_logps",
        args,
        lambda params: run(params, args.shards, args.base_dir, args.champion, args.out, args.base_fingerprint),
    )


if __name__ == "__main__":
    raise SystemExit(main())
