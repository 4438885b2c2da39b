"""Model-family recipes (``recipes/*.yaml``): what a practitioner would set for a real model, applied into
params.yaml in one command, after the memory planner has checked it fits the device.

    fineflow recipe list
    fineflow recipe show llama3-8b-lora
    fineflow recipe apply llama3-8b-lora [--params params.yaml] [--device-memory-gib 48 --gpus 1]

A recipe file has two top-level keys: ``device`` (``count`` and ``memory_gib`` per device: what it is planned for)
and ``params`` (a fragment of params.yaml; every value line says where the value comes from). ``apply``:

1. validates the fragment against the typed params (fineflow.core.config): an unknown key is refused, naming the
   recipe file and the key;
2. runs the train stage's own planner verdict (fineflow.train.run_plan.fit_plan) on params.yaml with the recipe's
   values, for the recipe's device (or the flags'), without downloading anything (the recipes' hub ids are in
   fineflow.train.planner.HUB_CONFIGS); a run that does not fit is refused with what to change, and nothing is
   written;
3. writes the values into params.yaml with ruamel.yaml's round-trip mode (DVC's own YAML library): every other key
   and comment stays; a changed value's comment becomes the recipe's source.

Applied into params.yaml rather than included from it: params.yaml stays the only source of hyperparameters, and
DVC (which tracks params.yaml's keys per stage) sees each changed value and re-runs exactly the stages it feeds.
(Not to be confused with fineflow.train.procedure, the training loop read in order.)
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import yaml

from fineflow.core.config import Params, parse_params
from fineflow.errors import ConfigError, FineflowError

RECIPE_DIR = Path(__file__).resolve().parents[1] / "recipes"
RECIPE_KEYS = ("device", "params")
DEVICE_KEYS = ("count", "memory_gib")
COMMENT_COLUMN = 28  # where params.yaml's comments start


@dataclass(frozen=True)
class Device:
    """What a run is planned for: count devices of memory_gib GiB each."""

    count: int
    memory_gib: float

    @property
    def label(self) -> str:
        return f"{self.count} x {self.memory_gib:g} GiB"


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    device: Device
    values: dict  # the params fragment, as plain data
    summary: str  # the file's first comment line


def recipe_path(name: str, recipe_dir: Path = RECIPE_DIR) -> Path:
    """A recipe by name (a file of recipes/) or by path."""
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    found = recipe_dir / f"{name}.yaml"
    if not found.is_file():
        known = ", ".join(p.stem for p in sorted(recipe_dir.glob("*.yaml"))) or "none"
        raise FineflowError(f"no recipe {name!r} in {recipe_dir} (known: {known})")
    return found


def list_recipes(recipe_dir: Path = RECIPE_DIR) -> list[Recipe]:
    return [load_recipe(str(path)) for path in sorted(recipe_dir.glob("*.yaml"))]


def load_recipe(name: str, recipe_dir: Path = RECIPE_DIR) -> Recipe:
    """Read and validate a recipe: its top-level keys, its device, and its params fragment against Params."""
    path = recipe_path(name, recipe_dir)
    text = path.read_text(encoding="utf-8")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe is a mapping with the keys {', '.join(RECIPE_KEYS)}")
    unknown = [key for key in raw if key not in RECIPE_KEYS]
    if unknown or "params" not in raw or "device" not in raw:
        raise ConfigError(
            f"{path}: a recipe has exactly the top-level keys {', '.join(RECIPE_KEYS)} "
            f"(unknown: {', '.join(map(str, unknown)) or 'none'}; missing: "
            f"{', '.join(k for k in RECIPE_KEYS if k not in raw) or 'none'})"
        )
    parse_params(raw["params"], source=str(path))  # unknown keys and bad values, named with this file
    summary = next((line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")), "")
    return Recipe(path.stem, path, _device(raw["device"], path), raw["params"], summary)


def _device(raw: object, path: Path) -> Device:
    if not isinstance(raw, dict) or set(raw) != set(DEVICE_KEYS):
        raise ConfigError(f"{path}: device must have exactly the keys {', '.join(DEVICE_KEYS)} (got {raw!r})")
    count, memory = raw["count"], raw["memory_gib"]
    if not isinstance(count, int) or count < 1 or not isinstance(memory, (int, float)) or memory <= 0:
        raise ConfigError(f"{path}: device.count must be an integer >= 1 and device.memory_gib > 0 (got {raw!r})")
    return Device(count, float(memory))


def merged(base: dict, values: dict) -> dict:
    """base with values written over it, section by section (a list is replaced whole)."""
    out = dict(base)
    for key, value in values.items():
        both_maps = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both_maps else value
    return out


def check_fits(params: Params, device: Device, recipe: Recipe):
    """The train stage's planner verdict for params on device (fineflow.train.run_plan.fit_plan, without adapting):
    the RunPlan, or a FineflowError with what to change."""
    from fineflow.train import planner
    from fineflow.train.profile import load_profile
    from fineflow.train.run_plan import fit_plan, world_size

    profile = load_profile(params.train.accelerate_profile)
    ranks = world_size(params.train, profile)
    if ranks != device.count:
        raise FineflowError(
            f"{recipe.path}: train.accelerate_profile {params.train.accelerate_profile} runs {ranks} process(es), "
            f"but the device is {device.label}: pick a profile for {device.count} GPU(s) (configs/accelerate/) "
            f"or pass --gpus {ranks}"
        )
    train = params.train.model_copy(update={"device_memory_gib": device.memory_gib, "auto_fit": False})
    try:
        run_plan = fit_plan(params.model_copy(update={"train": train}), profile, params.model.base, has_gpu=True)
    except planner.DoesNotFit as refused:
        raise FineflowError(f"recipe {recipe.name} does not fit {device.label}: {refused}") from None
    check_eval_fits(params, device, recipe)
    return run_plan


def check_eval_fits(params: Params, device: Device, recipe: Recipe):
    """The evaluate stage's placement for params on device (fineflow.evaluate.sizing.choose_placement, as the
    stage runs it on GPUs): its EvalPlan, or a FineflowError naming evaluate.batch_size or more devices. A recipe
    whose training fits but whose evaluation does not would fail after hours of training."""
    from fineflow.evaluate.sizing import choose_placement, eval_precision, qlora_base
    from fineflow.train.planner import GiB
    from fineflow.train.run_plan import model_shape

    chosen = qlora_base(params.train.method, params.evaluate.qlora_base, has_gpu=True)
    try:
        return choose_placement(
            model_shape(params.model.base),
            eval_precision(params, has_gpu=True),
            params.evaluate.batch_size,
            params.tokenize.seq_len,
            [device.memory_gib * GiB] * device.count,
            quantized=chosen == "4bit",
            lora_r=params.train.lora.r,
        )
    except FineflowError as refused:
        raise FineflowError(f"recipe {recipe.name}: its evaluation does not fit {device.label}: {refused}") from None


@dataclass(frozen=True)
class Applied:
    params: Params
    changes: list[str]  # "key: old -> new", one per changed value
    plan: object  # fineflow.train.run_plan.RunPlan


def apply_recipe(recipe: Recipe, params_path: Path, device: Device | None = None) -> Applied:
    """Check the recipe fits, then write its values into params_path (comments and other keys kept)."""
    from fineflow.core.reports import write_text_atomic

    device = device or recipe.device
    current = yaml.safe_load(params_path.read_text(encoding="utf-8")) or {}
    params = parse_params(merged(current, recipe.values), source=f"{params_path} with {recipe.path}")
    try:
        run_plan = check_fits(params, device, recipe)
    except FineflowError as refused:
        raise FineflowError(f"{refused}; nothing was written to {params_path}") from None
    text, changes = _written(params_path.read_text(encoding="utf-8"), recipe)
    write_text_atomic(params_path, text)
    parse_params(yaml.safe_load(text), source=str(params_path))  # what was written reads back as validated
    return Applied(params, changes, run_plan)


def _round_trip():
    from ruamel.yaml import YAML

    rt = YAML()  # round-trip: comments, key order, flow lists and number formats as written
    rt.width = 4096
    rt.preserve_quotes = True
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return rt


def _written(params_text: str, recipe: Recipe) -> tuple[str, list[str]]:
    """params.yaml's text with the recipe's values written in, and the list of changes."""
    rt = _round_trip()
    document = rt.load(params_text)
    source = rt.load(recipe.path.read_text(encoding="utf-8"))["params"]
    changes: list[str] = []
    _write_section(document, source, "", recipe.name, params_text.splitlines(), changes)
    out = io.StringIO()
    rt.dump(document, out)
    return out.getvalue(), changes


def _write_section(target, values, prefix: str, name: str, lines: list[str], changes: list[str]) -> None:
    """Write values (a ruamel map of the recipe) into target (params.yaml's map), recursively."""
    for key, value in values.items():
        if hasattr(value, "items") and hasattr(target.get(key), "items"):
            _write_section(target[key], value, f"{prefix}{key}.", name, lines, changes)
            continue
        old = target.get(key)
        if old != value:
            target[key] = value
            changes.append(f"{prefix}{key}: {_plain(old)} -> {_plain(value)}")
        # every key the recipe sets says so, an unchanged one too (it may carry another recipe's source)
        _set_comment(target, key, f"recipe {name}: {_comment_of(values, key)}", lines)


def _plain(value) -> str:
    """A value as YAML writes it (null, true, [a, b])."""
    if isinstance(value, list):
        return f"[{', '.join(map(str, value))}]"
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return str(value)


def _comment_of(mapping, key) -> str:
    """The end-of-line comment of key in a ruamel map (its first line), without the '#'."""
    token = (mapping.ca.items.get(key) or [None] * 4)[2]
    return token.value.split("\n", 1)[0].lstrip("# ").strip() if token is not None else ""


def _set_comment(mapping, key, comment: str, lines: list[str]) -> None:
    """Replace key's end-of-line comment (and the comment lines that continue it, indented past the key) with
    comment; comment lines at the key's own indentation belong to the next key and stay."""
    entry = mapping.ca.items.get(key)
    token = entry[2] if entry else None
    if token is None:
        mapping.yaml_add_eol_comment(f"# {comment}", key, column=COMMENT_COLUMN)
        return
    line = lines[token.start_mark.line] if token.start_mark.line < len(lines) else ""
    indent = len(line) - len(line.lstrip())
    _first, _, rest = token.value.partition("\n")
    kept = rest.splitlines(keepends=True)
    while kept and kept[0].strip().startswith("#") and len(kept[0]) - len(kept[0].lstrip()) > indent:
        kept.pop(0)
    token.value = f"# {comment}\n" + "".join(kept)
