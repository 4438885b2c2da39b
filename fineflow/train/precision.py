"""Which precision a run trains in, and the dtypes that follows for the weights a rank holds.

One source, one rule (``resolve_precision``): ``train.precision`` decides. Its default, ``auto``, takes the
accelerate profile's ``mixed_precision`` when a profile is given, else bf16 on a GPU that supports it, else
fp32 (``"no"``). An explicit ``no | bf16 | fp16`` wins over the profile; when the profile says otherwise the
conflict is reported (logged by the launcher and kept in the train report), never silently overridden.

From the resolved precision follow (pure functions, no torch import, so the launcher, every rank and the
memory planner reach the same answer):

- ``base_dtype``: the dtype the model is loaded in. LoRA on a 16-bit precision loads the frozen base in that
  dtype (half the memory of fp32; peft keeps the adapters, hence their gradients and optimizer states, in
  fp32). Full fine-tuning loads fp32 (autocast computes in 16 bits, the optimizer updates fp32 weights).
  FSDP2 (``fully_shard``, the shipped fsdp_lora profile) keeps the LoRA base in the compute dtype too: each
  parameter is its own DTensor shard, and torch's FSDPParamGroup._init_mp_dtypes requires one original dtype
  among a group's *trainable* parameters only (the fp32 adapters; accelerate 1.15's fsdp2_prepare_model
  upcasts any 16-bit trainable parameter to fp32 itself), while the frozen bf16 base beside them is allowed;
  the MixedPrecisionPolicy's param_dtype casts the gathered unit to the compute dtype. A 70B base is then
  141 GB on rank 0's host, not 282 GB. FSDP1 (``fsdp_version: 1``) flattens a unit's parameters into one
  tensor of one dtype, so a 16-bit base beside fp32 adapters cannot share a unit: the base stays fp32 there
  and FSDP's mixed precision casts each gathered unit.
- ``weight_storage``: the same decision in the planner's terms.
- QLoRA: ``quantization_kwargs`` (bitsandbytes' compute dtype follows the precision: fp16 GPUs get fp16)
  and ``kbit_preparation_kwargs`` (peft re-enables gradient checkpointing; non-reentrant, as everywhere
  else in fineflow). QLoRA with fsdp/zero3 sharding is refused (``check_qlora_sharding``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from fineflow.errors import FineflowError
from fineflow.train.profile import MIXED_PRECISIONS, Profile

AUTO = "auto"
TORCH_DTYPE_OF = {"no": "float32", "bf16": "bfloat16", "fp16": "float16"}
PLANNER_PRECISION_OF = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


@dataclass(frozen=True)
class PrecisionChoice:
    """The resolved precision, where it came from, and the conflict with the profile it overrode (if any)."""

    mixed_precision: str  # no | bf16 | fp16
    source: str  # "train.precision", "profile <file>" or "device (...)"
    conflict: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def resolve_precision(
    param: str, profile_value: str | None, profile_path: Path | str | None, gpu_bf16: bool, has_gpu: bool
) -> PrecisionChoice:
    """The precision to train in. param: train.precision; profile_value: the profile's mixed_precision
    (None: no profile, or one that sets none); gpu_bf16: the GPU supports bf16 (Ampere or newer).

    auto -> the profile's value, else bf16 on a bf16-capable GPU, else "no" (fp32: CPUs, and fp16-only GPUs,
    where fp16 needs loss scaling and is better chosen explicitly). An explicit value always wins."""
    if param != AUTO:
        if param not in MIXED_PRECISIONS:
            raise FineflowError(
                f"params.yaml: train.precision must be auto or one of {MIXED_PRECISIONS} (got {param!r})"
            )
        conflict = None
        if profile_value is not None and profile_value != param:
            conflict = (
                f"params.yaml train.precision {param!r} overrides mixed_precision {profile_value!r} of the "
                f"accelerate profile {profile_path}; set train.precision: auto to use the profile's, or "
                f"change the profile"
            )
        return PrecisionChoice(param, "train.precision", conflict)
    if profile_value is not None:
        return PrecisionChoice(profile_value, f"profile {profile_path}")
    if has_gpu and gpu_bf16:
        return PrecisionChoice("bf16", "device (GPU supports bf16)")
    return PrecisionChoice("no", "device (GPU without bf16)" if has_gpu else "device (no GPU)")


def gpu_supports_bf16(has_gpu: bool) -> bool:
    """Whether this machine's GPU computes in bf16 natively (imports torch only when there is a GPU)."""
    if not has_gpu:
        return False
    import torch

    return bool(torch.cuda.is_bf16_supported())


def fsdp_version(profile: Profile) -> int:
    """The FSDP generation of an FSDP profile (``fsdp_config.fsdp_version``; accelerate's default is 1)."""
    return int((profile.settings.get("fsdp_config") or {}).get("fsdp_version", 1))


def base_dtype(method: str, mixed_precision: str, sharding: str, fsdp_version: int = 2) -> str:
    """The torch dtype name (``torch.<name>``) the model is loaded in; see the module docstring.

    fsdp_version: under ``sharding == "fsdp"``, the profile's (``fsdp_version(profile)``); only FSDP1 needs an
    fp32 LoRA base. QLoRA: the dtype of the modules bitsandbytes leaves unquantized as loaded (peft's
    prepare_model_for_kbit_training then upcasts them to fp32)."""
    if method == "qlora":
        return TORCH_DTYPE_OF[mixed_precision]
    if method == "full" or (sharding == "fsdp" and fsdp_version < 2):
        return "float32"
    return TORCH_DTYPE_OF[mixed_precision]


def weight_storage(method: str, mixed_precision: str, sharding: str, fsdp_version: int = 2) -> str:
    """The planner's ``Setup.weight_storage`` for what this run really holds: "compute" (weights in the
    compute dtype; for full fine-tuning 16-bit working weights with fp32 masters, as DeepSpeed keeps them)
    or "fp32" (fp32 weights that autocast or FSDP cast as they run)."""
    if method == "full":
        # DeepSpeed's bf16/fp16 mode converts the module to 16 bits and keeps fp32 masters in its optimizer;
        # accelerate's DDP/FSDP keep the fp32 weights fineflow loaded
        return "compute" if sharding in ("zero2", "zero3") else "fp32"
    loaded = base_dtype(method, mixed_precision, sharding, fsdp_version)
    if method == "lora" and mixed_precision != "no" and loaded == "float32":
        return "fp32"
    return "compute"


def check_qlora_sharding(method: str, sharding: str, profile_path: Path | str | None) -> None:
    """QLoRA is refused under fsdp/zero3: sharding 4-bit weights needs bnb_4bit_quant_storage equal to the
    dtype of every other parameter of a unit, while peft's kbit preparation upcasts norms, embeddings and
    lm_head to fp32 beside them. Neither combination has been run by fineflow."""
    if method == "qlora" and sharding in ("fsdp", "zero3"):
        raise FineflowError(
            f"params.yaml: train.method qlora cannot run with the {sharding} accelerate profile "
            f"{profile_path}: 4-bit weights would have to be sharded alongside fp32 ones. Use train.method "
            f"lora with the same profile (the 16-bit base is sharded), or qlora with a data-parallel "
            f"profile (single_gpu, multi_gpu_ddp), which holds the 4-bit base on each GPU."
        )


def quantization_kwargs(mixed_precision: str) -> dict:
    """The BitsAndBytesConfig arguments of a QLoRA base: NF4 with double quantization (the QLoRA paper's
    setting), computing in the run's precision (fp16 on GPUs without bf16, fp32 when precision is "no")."""
    return {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": TORCH_DTYPE_OF[mixed_precision],
    }


def kbit_preparation_kwargs(gradient_checkpointing: bool) -> dict:
    """peft's prepare_model_for_kbit_training arguments. It (re-)enables gradient checkpointing itself and,
    without kwargs, with torch's reentrant variant (and a warning); fineflow uses the non-reentrant one
    everywhere (no input-grad hook needed, works with frozen inputs)."""
    return {
        "use_gradient_checkpointing": gradient_checkpointing,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
    }


def choose_precision(precision: str, profile: Profile, has_gpu: bool) -> PrecisionChoice:
    """resolve_precision for train params: train.precision against the run's Profile
    (fineflow.train.profile.load_profile, read once) and the GPU."""
    return resolve_precision(precision, profile.mixed_precision, profile.path, gpu_supports_bf16(has_gpu), has_gpu)
