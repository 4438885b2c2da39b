"""DeepSpeed profiles, in-process and fast (no GPU, no launch): the batch settings come from params
(train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size, gradient_clipping); a profile that
contradicts params is refused naming both; the config accelerate builds on a rank from each shipped profile (its
launcher's environment, its DeepSpeedPlugin) is filled before accelerator.prepare and parsed by DeepSpeed itself;
a missing deepspeed package is one message from the launcher, before anything loads. DeepSpeed's engine stepping
once per optimizer step: tests/test_accumulation.py.

    .venv/bin/python -m pytest tests/test_deepspeed.py -q
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from fineflow.errors import FineflowError
from fineflow.train.launch import (
    DEEPSPEED_INSTALL,
    accelerate_command,
    check_deepspeed_profile,
    deepspeed_batch_config,
    fill_deepspeed_plugin,
    profile_deepspeed_config,
    require_engine,
    resolve_deepspeed_config,
)
from fineflow.train.profile import load_profile, resolve_profile

ZERO_PROFILES = ["deepspeed_zero2", "deepspeed_zero3"]
WORLD = 8  # the shipped profiles' num_processes


def _train(tiny_params, **changes):
    """Train params whose values differ from every default accelerate or DeepSpeed would fill in."""
    return tiny_params.train.model_copy(
        update={"micro_batch_size": 3, "grad_accum": 4, "max_grad_norm": 0.5, **changes}
    )


def _rank_plugin(profile, monkeypatch):
    """accelerate's DeepSpeedPlugin as a rank builds it: the environment `accelerate launch --config_file <profile>`
    gives the ranks (its own argument handling and prepare_deepspeed_cmd_env), then DeepSpeedPlugin(), which is what
    Accelerator() does under DeepSpeed."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(profile), "-m", "m"])
    args, defaults, from_config = _validate_launch_command(args)
    # what launch_command adds before it calls the DeepSpeed launcher
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    args.main_process_port = 0  # any free port: the profile's 29500 may be taken on a shared machine
    _, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    return DeepSpeedPlugin()


def test_batch_settings_come_from_params(tiny_params):
    cfg = _train(tiny_params)
    batch = deepspeed_batch_config(cfg, WORLD)
    assert batch == {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 4,
        "train_batch_size": 3 * 4 * WORLD,
        "gradient_clipping": 0.5,
    }
    given = {"train_batch_size": "auto", "gradient_clipping": 0.5, "zero_optimization": {"stage": 3}}
    assert resolve_deepspeed_config(given, batch, "x") == {**batch, "zero_optimization": {"stage": 3}}
    assert given["train_batch_size"] == "auto"  # a copy: the caller's config is left as it was


@pytest.mark.parametrize("name", ZERO_PROFILES)
def test_shipped_profiles_leave_the_batch_settings_to_params(name, tiny_params):
    profile = load_profile(name)
    assert profile_deepspeed_config(profile) == {}
    check_deepspeed_profile(profile, _train(tiny_params), WORLD)
    assert "must equal train.grad_accum" not in profile.path.read_text()  # the old rule, which nothing enforced


def test_a_profile_value_that_contradicts_params_is_refused_naming_both(tiny_params, tmp_path):
    cfg = _train(tiny_params, grad_accum=2, max_grad_norm=1.0)
    shipped = resolve_profile("deepspeed_zero2").read_text()

    def profile(deepspeed_lines: str):
        path = tmp_path / "ds.yaml"
        path.write_text(shipped + deepspeed_lines)  # appended under the file's deepspeed_config section
        return load_profile(str(path))

    with pytest.raises(FineflowError, match=r"gradient_accumulation_steps: 4, but train\.grad_accum gives 2"):
        check_deepspeed_profile(profile("  gradient_accumulation_steps: 4\n"), cfg, WORLD)
    with pytest.raises(FineflowError, match=r"gradient_clipping: 0\.3, but train\.max_grad_norm gives 1\.0"):
        check_deepspeed_profile(profile("  gradient_clipping: 0.3\n"), cfg, WORLD)
    check_deepspeed_profile(profile("  gradient_accumulation_steps: 2\n  gradient_clipping: 1\n"), cfg, WORLD)
    # accelerate would hand "auto" to Accelerator(), which reads it with int()
    with pytest.raises(FineflowError, match="gradient_accumulation_steps: auto.*delete the line"):
        check_deepspeed_profile(profile("  gradient_accumulation_steps: auto\n"), cfg, WORLD)
    # a DeepSpeed JSON named by the profile counts too; "auto" there is filled from params
    ds_json = tmp_path / "ds_config.json"
    ds_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}}))
    with pytest.raises(FineflowError, match=r"train_micro_batch_size_per_gpu: 16, but train\.micro_batch_size gives 3"):
        check_deepspeed_profile(profile(f"  deepspeed_config_file: {ds_json}\n"), cfg, WORLD)
    ds_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}))
    check_deepspeed_profile(profile(f"  deepspeed_config_file: {ds_json}\n"), cfg, WORLD)


@pytest.mark.parametrize("name", ZERO_PROFILES)
def test_the_config_a_rank_builds_is_filled_before_prepare(name, tiny_params, monkeypatch):
    """Without the fill the micro-batch size is "auto", which accelerator.prepare cannot resolve without a
    DataLoader (fineflow passes none), and accelerate would fill an "auto" gradient_clipping with 1.0."""
    cfg = _train(tiny_params)
    plugin = _rank_plugin(resolve_profile(name), monkeypatch)
    assert plugin.is_auto("train_micro_batch_size_per_gpu") and plugin.is_auto("gradient_clipping")
    fill_deepspeed_plugin(plugin, cfg, WORLD)
    batch = deepspeed_batch_config(cfg, WORLD)
    assert {key: plugin.deepspeed_config[key] for key in batch} == batch
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == int(name[-1])
    # what accelerate's _prepare_deepspeed then does with these keys: it fills only "auto" ones (its own
    # gradient_clipping of 1.0 included), so params' values reach deepspeed.initialize unchanged
    assert not plugin.is_auto("train_micro_batch_size_per_gpu")
    plugin.deepspeed_config_process(must_match=False, gradient_clipping=1.0, train_micro_batch_size_per_gpu=1)
    assert {key: plugin.deepspeed_config[key] for key in batch} == batch


def test_a_rank_refuses_an_accumulation_that_contradicts_params(tiny_params, monkeypatch):
    """The same rule on the rank, for a profile launched by hand (the launcher's check did not run)."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "8")  # from --gradient_accumulation_steps 8
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=2)
    with pytest.raises(FineflowError, match=r"gradient_accumulation_steps: 8, but train\.grad_accum gives 4"):
        fill_deepspeed_plugin(plugin, _train(tiny_params), WORLD)


@pytest.mark.parametrize("name", ZERO_PROFILES)
def test_deepspeed_itself_accepts_the_filled_config(name, tiny_params, monkeypatch):
    """DeepSpeed's own config parser (the first thing deepspeed.initialize runs: batch arithmetic, ZeRO section)
    on a rank's filled config, in a process without a process group (DeepSpeed then counts 1 rank)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    plugin = _rank_plugin(resolve_profile(name), monkeypatch)
    fill_deepspeed_plugin(plugin, _train(tiny_params), 1)
    parsed = DeepSpeedConfig(dict(plugin.deepspeed_config))
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (3, 4)
    assert (parsed.train_batch_size, parsed.gradient_clipping, parsed.zero_optimization_stage) == (
        12,
        0.5,
        int(name[-1]),
    )


# --- a missing deepspeed ----------------------------------------------------------------------------------


@pytest.fixture
def no_deepspeed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args, **kwargs: None if name == "deepspeed" else real(name, *args)
    )


@pytest.mark.parametrize("name", ZERO_PROFILES)
def test_missing_deepspeed_is_one_message(name, no_deepspeed):
    with pytest.raises(FineflowError, match=re.escape(DEEPSPEED_INSTALL)):
        require_engine(load_profile(name))
    # before the no-GPU refusal too: on a CPU machine it is the first thing to fix
    for has_gpu in (True, False):
        with pytest.raises(FineflowError, match=re.escape(DEEPSPEED_INSTALL)):
            accelerate_command(None, has_gpu, "m", [], profile=load_profile(name))
    for other in ("auto", "fsdp_lora", "cpu_ddp_2proc"):  # nothing else needs it
        require_engine(load_profile(other))


def test_the_train_launcher_says_it_before_the_planner_loads_anything(tiny_params, no_deepspeed, monkeypatch):
    from fineflow.train import procedure

    monkeypatch.setattr(procedure, "fit_plan", lambda *args, **kwargs: pytest.fail("the memory planner ran"))
    monkeypatch.setattr(procedure, "check_hardware", lambda *args, **kwargs: pytest.fail("the hardware check ran"))
    train = tiny_params.train.model_copy(update={"accelerate_profile": "deepspeed_zero3", "num_processes": None})
    placement = {"base_dir": "models/base", "machine_rank": None, "main_process_ip": None, "main_process_port": None}
    with pytest.raises(FineflowError, match=re.escape(DEEPSPEED_INSTALL)):
        procedure.launch_ranks(tiny_params.model_copy(update={"train": train}), "fineflow.stages.train", [], placement)


@pytest.mark.parametrize(
    ("written_by", "running", "message"),
    [
        ({"sharding": "deepspeed"}, "fsdp", "is a DeepSpeed checkpoint and this run is FSDP"),
        ({}, "deepspeed", "is an FSDP checkpoint and this run is DeepSpeed"),  # sharded before the field existed
        ({"sharding": "deepspeed"}, "ddp", "is a DeepSpeed checkpoint and this run is unsharded"),
    ],
)
def test_a_sharded_checkpoint_is_resumed_only_by_the_engine_that_wrote_it(written_by, running, message):
    """DeepSpeed's files and DCP's shards are not interchangeable: a changed profile is refused, naming both."""
    from types import SimpleNamespace

    from fineflow.errors import FineflowError
    from fineflow.train.checkpointing import restore

    checkpoint = SimpleNamespace(path=Path("step-0000002"), sharded_dir=Path("step-0000002/sharded"), state=written_by)
    with pytest.raises(FineflowError, match=message):
        restore(checkpoint, None, None, None, None, engine=running)
