"""The planner's model shapes: what a model is made of (``ModelShape``), from a config.json, a model directory, a
hub id (``HUB_CONFIGS``: the real config.json values of the recipes' models, so nothing is downloaded; else its
cached config), a size ("7B": ``KNOWN_SHAPES``) or a parameter count.

The linears of a decoder layer come from the model itself: ``shape_from_config`` builds one decoder layer of the
config's transformers class on the meta device (``fineflow.train.architecture.describe_config``: no weights, no
memory, ~1 s with the import) and keeps their names and shapes, so Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` are counted as the one linear each is. The known sizes are Llama's layout. Nothing heavy is
imported at import time (torch and transformers only when a config is described)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from fineflow.errors import FineflowError


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-architecture decoder (RMSNorm, rotary attention, SwiGLU MLP)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads: grouped-query attention
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # None: hidden_size // num_heads
    attention_bias: bool = False
    mlp_bias: bool = False
    # (name, in_features, out_features) of one decoder layer's linears, as the model has them; () = Llama's layout
    # (q/k/v/o_proj, gate/up/down_proj), which is what the known sizes are
    linears: tuple[tuple[str, int, int], ...] = ()
    # the loss may project a chunk of tokens at a time (fineflow.objectives.token_loss.PLAIN_HEAD_MODELS: a plain
    # head); False:
    # soft-capped or scaled logits (Gemma 2/3, Cohere) take the plain path, all tokens x vocab at once
    chunked_loss: bool = True

    @property
    def q_dim(self) -> int:
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * (self.head_dim or self.hidden_size // self.num_heads)

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear of one decoder layer, by the model's own names."""
        if self.linears:
            return {name: (d_in, d_out) for name, d_in, d_out in self.linears}
        return self.llama_linear_dims()

    def llama_linear_dims(self) -> dict[str, tuple[int, int]]:
        """What a Llama-layout layer of these dimensions has: q/k/v/o_proj and gate/up/down_proj."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def linear_params_per_layer(self) -> int:
        """Weights (and biases) of one layer's linears: what QLoRA quantizes (biases aside, ignored). A fused
        linear holds exactly the weights of the separate ones it stands for, so the count is layout-independent."""
        total = sum(d_in * d_out for d_in, d_out in self.linear_dims().values())
        if self.attention_bias:
            total += self.q_dim + 2 * self.kv_dim + self.hidden_size
        if self.mlp_bias:
            total += 2 * self.intermediate_size + self.hidden_size
        return total

    @property
    def embedding_params(self) -> int:
        """Input embeddings plus lm_head when it is a separate matrix."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def params(self) -> int:
        """Total parameter count (matches ``sum(p.numel() for p in model.parameters())``)."""
        per_layer = self.linear_params_per_layer + 2 * self.hidden_size  # two RMSNorm weights
        return self.embedding_params + self.num_layers * per_layer + self.hidden_size  # final norm

    @property
    def max_linear_params(self) -> int:
        return max(d_in * d_out for d_in, d_out in self.linear_dims().values())


# The real shapes behind the common sizes, from each model's config.json on the Hugging Face hub.
KNOWN_SHAPES = {
    "1B": ModelShape("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 128256, tie_word_embeddings=True),
    "7B": ModelShape("Llama-2-7B", 4096, 11008, 32, 32, 32, 32000),
    "8B": ModelShape("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256),
    "13B": ModelShape("Llama-2-13B", 5120, 13824, 40, 40, 40, 32000),
    "70B": ModelShape("Llama-3-70B", 8192, 28672, 80, 64, 8, 128256),
}


# The config.json values (those the planner reads) of the models the recipes (recipes/) name, as published on the
# Hugging Face hub at huggingface.co/<id>/blob/main/config.json, so a hub id is sized without downloading anything.
HUB_CONFIGS = {
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
    ),
    "meta-llama/Llama-3.1-70B-Instruct": dict(
        model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
    ),
    "Qwen/Qwen2.5-7B-Instruct": dict(  # q/k/v biases (Qwen2's attention always has them): not counted, 0.3M
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-8B": dict(  # head_dim 128 (not hidden/heads); q/k norms not counted (a few thousand params)
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    ),
    "mistralai/Mistral-7B-Instruct-v0.3": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32768, tie_word_embeddings=False,
    ),
    "google/gemma-2-9b-it": dict(  # head_dim 256 (q width 4096 > hidden 3584); logits soft-capped at 30
        model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000, tie_word_embeddings=True,
        final_logit_softcapping=30.0,
    ),
    "microsoft/Phi-3-mini-4k-instruct": dict(  # fused qkv_proj and gate_up_proj
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, tie_word_embeddings=False,
    ),
}  # fmt: skip


def shape_from_config(config: dict, name: str = "") -> ModelShape:
    """A ModelShape from a transformers config (the dict of a ``config.json``).

    Multimodal configs are read through their ``text_config``. Absent keys take the Llama defaults
    (``num_key_value_heads`` = heads, untied embeddings, no biases)."""
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    label = name or str(config.get("_name_or_path") or config.get("model_type") or "config")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [key for key in required if config.get(key) is None]
    if missing:
        raise FineflowError(
            f"{label}: not a Llama-like decoder config (missing {', '.join(missing)}); the "
            "planner covers Llama-architecture models (RMSNorm, rotary attention, SwiGLU MLP)"
        )
    if (config.get("num_local_experts") or config.get("num_experts") or 0) > 1:
        raise FineflowError(f"{label}: mixture-of-experts models are not covered by the planner")
    heads = int(config["num_attention_heads"])
    shape = ModelShape(
        name=label,
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(config["vocab_size"]),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
    )
    if not config.get("model_type"):  # a bare config: Llama's layout
        return shape
    from fineflow.objectives.token_loss import PLAIN_HEAD_MODELS  # torch-free module constant

    chunked = config["model_type"] in PLAIN_HEAD_MODELS
    return replace(shape, linears=described_linears(config, shape), chunked_loss=chunked)


def described_linears(config: dict, shape: ModelShape) -> tuple[tuple[str, int, int], ...]:
    """One decoder layer's linears as the config's transformers class builds them (one layer, meta device); ()
    when they are Llama's layout (so a Llama-like config equals its known size)."""
    try:
        from transformers import AutoConfig

        from fineflow.train.architecture import describe_config

        one_layer = {**config, "num_hidden_layers": 1}
        if isinstance(config.get("layer_types"), list):  # per-layer kinds (Gemma 2/3, Qwen3): one layer's
            one_layer["layer_types"] = config["layer_types"][:1]
        one_layer = {k: v for k, v in one_layer.items() if k not in ("model_type", "architectures", "auto_map")}
        described = describe_config(AutoConfig.for_model(config["model_type"], **one_layer))
    except Exception as exc:  # whatever transformers raises for a config it cannot build: said as a user error
        raise FineflowError(
            f"{shape.name}: cannot build model_type {config['model_type']!r} with transformers to read its "
            f"linears ({type(exc).__name__}: {str(exc)[:200]}); the planner covers transformers' own decoder classes"
        ) from None
    linears = tuple((name, d_in, d_out) for name, (d_in, d_out) in described.shapes.items())
    return () if dict(described.shapes) == shape.llama_linear_dims() else linears


def shape_from_file(path: str | Path) -> ModelShape:
    """A ModelShape from a ``config.json`` file, or from a model directory holding one."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FineflowError(f"{path}: no config.json there (is it a Hugging Face model directory?)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FineflowError(f"{file}: cannot read the model config ({exc})") from None
    if not isinstance(config, dict):
        raise FineflowError(f"{file}: a model config must be a JSON object")
    return shape_from_config(config, name=str(path))


def parse_param_count(text: str) -> float | None:
    """'7B' -> 7e9, '1500M' -> 1.5e9, '6.7e9' -> 6.7e9; None when text is not a count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMbBtT]?)\s*", text)
    if match:
        scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
        return float(match.group(1)) * scale
    try:
        return float(text)
    except ValueError:
        return None


def shape_for_params(count: float) -> ModelShape:
    """The known shape nearest to a parameter count, within 30%; a count elsewhere needs a config."""
    nearest = min(KNOWN_SHAPES.values(), key=lambda s: abs(math.log(s.params / count)))
    if abs(math.log(nearest.params / count)) > math.log(1.3):
        raise FineflowError(
            f"no standard shape near {count / 1e9:.2f}B parameters (known: "
            f"{', '.join(KNOWN_SHAPES)}); pass the model's config.json or directory instead"
        )
    return nearest


def load_shape(base: str) -> ModelShape:
    """Resolve what a user typed: a known size ('7B'), a hub id of HUB_CONFIGS, a parameter count, a config.json or
    a model dir."""
    known = {key.lower(): shape for key, shape in KNOWN_SHAPES.items()}
    if base.strip().lower() in known:
        return known[base.strip().lower()]
    if base.strip() in HUB_CONFIGS:
        return shape_from_config(HUB_CONFIGS[base.strip()], name=base.strip())
    if Path(base).exists():
        return shape_from_file(base)
    count = parse_param_count(base)
    if count is None or count <= 0:
        raise FineflowError(
            f"--model {base!r} is neither a known size ({', '.join(KNOWN_SHAPES)}), a hub id the planner "
            f"knows ({', '.join(HUB_CONFIGS)}), a parameter count, a config.json nor a model directory"
        )
    return shape_for_params(count)
