"""The merged model of an adapter-only champion, built when asked, one safetensors shard of the base at a time.

    python -m fineflow.registry.merge --champion models/champion --out models/champion_merged [--base PATH]

A champion promoted without ``merged/`` (``promote.merged``) is its LoRA adapter plus a pointer to its base (the
``base_model`` and ``base_digest`` of its champion.json). ``build_merged`` checks that the base found is that base
by content (``fineflow.base_source.base_digest``), then ``merge_streamed`` writes base + adapter: for each shard of
the base it reads only that shard's tensors (``safe_open``), adds the LoRA delta to the weights the adapter
targets, writes the shard, and lets it go; the index is copied (same tensors, same dtypes, same sizes). Peak memory
is about one shard (its tensors and their serialized bytes), never the whole model.

The delta is peft's (``LoraLayer.get_delta_weight``): ``scaling * B @ A`` in fp32, with ``scaling = lora_alpha /
r`` (``/ sqrt(r)`` under ``use_rslora``), transposed for ``fan_in_fan_out`` layers, added to the weight in fp32
and cast back to its dtype (what ``merge_and_unload`` does). A fused target (Phi-3's ``qkv_proj``, ``gate_up_proj``)
is one linear to peft, and so here. ``r`` is read from each A matrix, so a ``rank_pattern`` is honoured; DoRA,
``alpha_pattern``, LoRA biases and embedding adapters are refused (peft's merge_and_unload covers them: promote
with ``promote.merged: always`` on a base that fits in memory).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

from fineflow.errors import FineflowError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def lora_scaling(config: dict, r: int) -> float:
    """peft's scaling of an adapter of rank r under config (adapter_config.json)."""
    alpha = float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def check_mergeable(config: dict, where: Path) -> None:
    """Refuse adapter settings the streamed merge does not reproduce, naming them."""
    unsupported = [
        name
        for name, value in (
            ("use_dora", config.get("use_dora")),
            ("alpha_pattern", config.get("alpha_pattern")),
            ("lora_bias", config.get("lora_bias")),
        )
        if value
    ]
    if config.get("peft_type", "LORA") != "LORA":
        unsupported.append(f"peft_type {config.get('peft_type')}")
    if unsupported:
        raise FineflowError(
            f"{where}: the streamed merge does not support {', '.join(unsupported)}; build the merged model with "
            "peft's merge_and_unload (promote.merged: always) on a machine that holds the base"
        )


def adapter_deltas(adapter_dir: Path) -> tuple[dict, dict]:
    """({base weight name: (A, B, scaling, fan_in_fan_out)}, {base weight name: tensor that replaces it}) from
    the adapter's files; the adapter is small (megabytes), so it is read whole."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    check_mergeable(config, adapter_dir)
    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    deltas, replaced = {}, {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        if "lora_embedding_" in name:
            raise FineflowError(f"{adapter_dir}: an embedding adapter ({key}) is not supported by the streamed merge")
        if ".lora_A." in name:
            module = name.split(".lora_A.")[0]
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            r = tensor.shape[0]
            deltas[f"{module}.weight"] = (tensor, b, lora_scaling(config, r), bool(config.get("fan_in_fan_out")))
        elif ".lora_B." not in name:  # modules_to_save: trained whole, they replace the base's tensor
            replaced[name] = tensor
    return deltas, replaced


def merged_tensor(weight, delta):
    """weight + scaling * B @ A, computed in fp32 and cast back to the weight's dtype (peft's merge)."""
    a, b, scaling, fan_in_fan_out = delta
    update = (b.float() @ a.float()) * scaling
    if fan_in_fan_out:
        update = update.T
    return (weight.float() + update).to(weight.dtype)


def base_shards(base_dir: Path) -> tuple[list[str], dict | None]:
    """(the safetensors shard file names of the base, its index or None for a single file)."""
    if (base_dir / INDEX).is_file():
        index = json.loads((base_dir / INDEX).read_text(encoding="utf-8"))
        return sorted(set(index["weight_map"].values())), index
    if (base_dir / SINGLE).is_file():
        return [SINGLE], None
    raise FineflowError(
        f"{base_dir}: no {SINGLE} or {INDEX}: the streamed merge reads safetensors bases only (load and re-save "
        "the base with transformers, which writes safetensors)"
    )


def merge_streamed(adapter_dir: Path, base_dir: Path, out_dir: Path) -> dict:
    """Write base + adapter to out_dir shard by shard; returns {"shards", "merged", "replaced"} counts."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    deltas, replaced = adapter_deltas(adapter_dir)
    shards, _ = base_shards(base_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    left_deltas, left_replaced = set(deltas), set(replaced)
    for shard in shards:
        tensors = {}
        with safe_open(str(base_dir / shard), framework="pt") as reader, torch.no_grad():
            metadata = reader.metadata() or {"format": "pt"}
            for name in reader.keys():
                tensor = reader.get_tensor(name)
                if name in deltas:
                    tensor = merged_tensor(tensor, deltas[name])
                    left_deltas.discard(name)
                elif name in replaced:
                    tensor = replaced[name].to(tensor.dtype)
                    left_replaced.discard(name)
                tensors[name] = tensor
        save_file(tensors, str(out_dir / shard), metadata=metadata)
        del tensors  # this shard's memory goes before the next one is read
    if left_deltas or left_replaced:
        missing = sorted(left_deltas | left_replaced)
        raise FineflowError(f"{adapter_dir}: the base {base_dir} has no weight(s) {missing[:5]} the adapter adapts")
    _copy_non_weights(base_dir, out_dir)
    return {"shards": len(shards), "merged": len(deltas), "replaced": len(replaced)}


def _copy_non_weights(base_dir: Path, out_dir: Path) -> None:
    """The base's config, generation config, index and tokenizer files beside the merged shards."""
    for path in base_dir.iterdir():
        if path.is_file() and not path.name.startswith(".") and not path.name.endswith(WEIGHT_FILES):
            shutil.copy2(path, out_dir / path.name)


def local_base(base: str) -> Path:
    """The base's directory: reference itself, or its hub snapshot in the local cache (nothing is downloaded)."""
    if Path(base).is_dir():
        return Path(base)
    try:
        from huggingface_hub import snapshot_download

        from fineflow.base_source import hub_cache_dir

        return Path(snapshot_download(base, local_files_only=True, cache_dir=hub_cache_dir()))
    except Exception as exc:  # noqa: BLE001 — not a dir and not cached: say what to pass
        raise FineflowError(
            f"the champion's base {base!r} is neither a directory nor in the local hub cache ({exc}); pass "
            "--base with its directory"
        ) from None


def build_merged(champion_dir: Path, out_dir: Path, base: str | None = None) -> dict:
    """The merged model of the champion at champion_dir, written to out_dir (outside the champion directory:
    the registry's verify binds every file in it). The base used must be the one its champion.json names by
    content (base_digest), wherever it lies now."""
    from fineflow.base_source import read_base_digest
    from fineflow.registry.install import read_champion

    record = read_champion(champion_dir) or {}
    if not (champion_dir / "adapter_config.json").is_file():
        raise FineflowError(f"{champion_dir}: no adapter (adapter_config.json): nothing to merge")
    reference = base or record.get("base_model")
    if not reference:
        raise FineflowError(f"{champion_dir}/champion.json names no base_model; pass --base")
    base_dir = local_base(reference)
    recorded = record.get("base_digest")
    if recorded and read_base_digest(str(base_dir)) != recorded:
        raise FineflowError(
            f"{base_dir} is not the base this champion was trained on (its content digest differs from "
            f"{recorded}, champion.json's base_digest); pass --base with that base"
        )
    if out_dir.resolve().is_relative_to(champion_dir.resolve()):
        raise FineflowError(f"{out_dir}: write the merged model outside {champion_dir} (verify binds its files)")
    return merge_streamed(champion_dir, base_dir, out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fineflow.registry.merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--champion", type=Path, default=Path("models/champion"))
    parser.add_argument("--out", type=Path, required=True, help="where the merged model goes (outside the champion)")
    parser.add_argument("--base", help="the base's directory, when champion.json's base_model is not where it lies")
    args = parser.parse_args(argv)
    try:
        done = build_merged(args.champion, args.out, args.base)
    except FineflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {done['shards']} shard(s) written, {done['merged']} weight(s) merged")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
