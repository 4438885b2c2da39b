"""``fineflow recipe list|show|apply``: model-family recipes written into params.yaml after the planner's
check (fineflow.recipes)."""

from __future__ import annotations

from pathlib import Path

from fineflow.errors import FineflowError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "recipe",
        help="model-family recipes (recipes/): list, show, apply one into params.yaml after the planner's check",
        description="A recipe holds what a practitioner sets for a real model (recipes/*.yaml, each value with its "
        "source). apply checks the plan fits the recipe's device (or --gpus/--device-memory-gib) and only then writes "
        "the values into params.yaml, keeping its comments and other keys (fineflow/recipes.py).",
        epilog="Exit codes: 0 applied (or listed/shown); 2 unknown recipe or key, or the plan does not fit (nothing "
        "written).",
    )
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every recipe: its device, its base model, what it is").set_defaults(
        run=_run_recipe_list
    )
    show = actions.add_parser("show", help="print a recipe file (values and their sources)")
    show.add_argument("name", help="a recipe of recipes/ (e.g. llama3-8b-lora) or a path")
    show.set_defaults(run=_run_recipe_show)
    apply = actions.add_parser("apply", help="plan it for the device, then write it into params.yaml")
    apply.add_argument("name", help="a recipe of recipes/ (e.g. llama3-8b-lora) or a path")
    apply.add_argument(
        "--params", type=Path, default=Path("params.yaml"), help="the file to write (default: params.yaml)"
    )
    apply.add_argument("--gpus", type=int, help="devices to plan for (default: the recipe's device.count)")
    apply.add_argument(
        "--device-memory-gib", type=float, help="GiB per device (default: the recipe's device.memory_gib)"
    )
    apply.set_defaults(run=_run_recipe_apply)


def _run_recipe_list(args) -> int:
    from fineflow.recipes import list_recipes

    for recipe in list_recipes():
        print(f"{recipe.name:<22}{recipe.device.label:<14}{recipe.values['model']['base']:<38}{recipe.summary}")
    return 0


def _run_recipe_show(args) -> int:
    from fineflow.recipes import load_recipe

    print(load_recipe(args.name).path.read_text(encoding="utf-8"), end="")
    return 0


def _run_recipe_apply(args) -> int:
    from fineflow.recipes import Device, apply_recipe, load_recipe
    from fineflow.train.planner import GiB

    recipe = load_recipe(args.name)
    if (args.gpus is not None and args.gpus < 1) or (
        args.device_memory_gib is not None and args.device_memory_gib <= 0
    ):
        raise FineflowError("--gpus must be >= 1 and --device-memory-gib > 0")
    device = Device(args.gpus or recipe.device.count, args.device_memory_gib or recipe.device.memory_gib)
    applied = apply_recipe(recipe, args.params, device)
    memory = applied.plan.memory
    print(
        f"planned: {memory['model']} {memory['setup']['method']}, {memory['bytes']['total'] / GiB:.2f} GiB per device "
        f"of {device.label}: fits"
    )
    for change in applied.changes:
        print(f"  {change}")
    print(
        f"wrote {len(applied.changes)} value(s) of {recipe.path} into {args.params} (its comments and other keys kept)"
    )
    return 0
