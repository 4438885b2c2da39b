"""params.yaml validation: unknown keys and bad values are reported at once, naming the key."""

import pytest

from fineflow.core.config import load_params, parse_params
from fineflow.errors import ConfigError


def test_repo_params_are_valid():
    from tests.conftest import ROOT

    params = load_params(ROOT / "params.yaml")
    assert params.train.method == "lora" and params.model.is_embedded


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"params.yaml: train.lrr is not a known key"):
        parse_params({"train": {"lrr": 0.1}})


def test_negative_learning_rate_names_key_and_value():
    with pytest.raises(ConfigError, match=r"params.yaml: train.lr must be > 0 \(got -1\)"):
        parse_params({"train": {"lr": -1}})


def test_every_problem_reported_at_once():
    with pytest.raises(ConfigError) as info:
        parse_params({"train": {"lr": -1, "steps": 0}, "bogus": 1, "model": {"hidden_size": 30, "num_heads": 4}})
    message = str(info.value)
    assert message.startswith("4 problem(s) in params.yaml")
    for fragment in ("train.lr", "train.steps", "bogus", "divisible by num_heads"):
        assert fragment in message


def test_yaml_syntax_error_names_line(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("seed: 1\ntrain:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: not valid YAML"):
        load_params(path)


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="cannot read parameters"):
        load_params(tmp_path / "nope.yaml")


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """Flatten nested sections into {dotted.key: value}; a section is walked, any other value is a leaf."""
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_leaves(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def test_params_yaml_states_exactly_the_config_defaults():
    """One source of defaults: the shipped params.yaml and config.py's field defaults agree on every key.

    Each differing or missing key is named at once, so a drift is fixed in one go."""
    import yaml

    from fineflow.core.config import Params
    from tests.conftest import ROOT

    raw = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    shipped = _leaves(parse_params(raw).model_dump(by_alias=True))
    defaults = _leaves(Params().model_dump(by_alias=True))
    stated = _leaves(raw)
    differing = [key for key in defaults if shipped.get(key) != defaults[key]]
    unstated = [key for key in defaults if key not in stated]
    problems = [f"{key}: params.yaml {shipped[key]!r} != config.py default {defaults[key]!r}" for key in differing]
    problems += [f"{key}: in config.py (default {defaults[key]!r}) but not stated in params.yaml" for key in unstated]
    assert not problems, "params.yaml and fineflow/core/config.py disagree:\n  " + "\n  ".join(problems)
    assert parse_params(raw) == Params()


# --- the input paths params.yaml names (fineflow.core.preflight) ---------------------------------------------

# the stages that write and read the paths params.yaml names (only the inputs of stages dvc.yaml has are checked)
PIPELINE = """\
stages:
  data: {cmd: x, outs: [data/raw/train.jsonl, data/raw/eval.jsonl]}
  validate: {cmd: x}
  train: {cmd: x}
  evaluate: {cmd: x}
"""


def _project(tmp_path, params: dict):
    """A project folder with a dvc.yaml whose data stage writes the default data paths, and its params."""
    import yaml

    (tmp_path / "dvc.yaml").write_text(PIPELINE, encoding="utf-8")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    return tmp_path


def test_every_missing_input_path_is_named_with_its_key_at_once(tmp_path):
    from fineflow.core.preflight import preflight

    params = {
        "data": {"train_path": "mine/train.jsonl", "eval_path": "/nowhere/eval.jsonl"},
        "model": {"base": "./models/my-llama"},
        "evaluate": {"task_dirs": ["eval_tasks/a", "eval_tasks/b"]},
        "train": {"accelerate_profile": "configs/mine.yaml"},
    }
    with pytest.raises(ConfigError) as info:
        preflight(_project(tmp_path, params))
    message = str(info.value)
    assert message.startswith("6 input path(s) named in params.yaml do not exist"), message
    for line in (
        "params.yaml: data.train_path: no such file: 'mine/train.jsonl'",
        "params.yaml: data.eval_path: no such file: '/nowhere/eval.jsonl'",
        "params.yaml: model.base: no such folder: './models/my-llama'",
        "params.yaml: evaluate.task_dirs: no such folder: 'eval_tasks/a'",
        "params.yaml: evaluate.task_dirs: no such folder: 'eval_tasks/b'",
        "params.yaml: train.accelerate_profile: no such file: 'configs/mine.yaml'",
    ):
        assert f"\n  {line}" in message, (line, message)


def test_paths_that_exist_a_stage_writes_or_dvc_tracks_pass(tmp_path):
    from fineflow.core.preflight import preflight

    params = {
        "data": {"eval_path": "mine/eval.jsonl"},  # train_path: the data stage's output, not written yet
        "model": {"base": "org/name"},  # a hub id: the base stage resolves it
        "evaluate": {"task_dirs": ["eval_tasks/mine"]},
        "train": {"accelerate_profile": "fsdp_lora"},
    }
    project = _project(tmp_path, params)
    (project / "mine").mkdir()
    (project / "mine/eval.jsonl.dvc").write_text("outs:\n- path: eval.jsonl\n")  # `dvc pull` brings it
    (project / "eval_tasks/mine").mkdir(parents=True)
    assert preflight(project).evaluate.task_dirs == ["eval_tasks/mine"]
    (project / "mine/eval.jsonl.dvc").unlink()
    (project / "mine.dvc").write_text("outs:\n- path: mine\n")  # a file inside a DVC-tracked folder
    preflight(project)
    (project / "params.yaml").write_text("train: {accelerate_profile: fsdp_lora2}\n")  # a name: configs/accelerate/
    with pytest.raises(ConfigError, match=r"train.accelerate_profile: no such file: '.*/configs/accelerate/fsdp_lora2"):
        preflight(project)


def test_invalid_params_are_reported_before_any_path(tmp_path):
    from fineflow.core.preflight import preflight

    project = _project(tmp_path, {"train": {"lr": -1}, "data": {"train_path": "mine/train.jsonl"}})
    with pytest.raises(ConfigError, match=r"train.lr must be > 0") as info:
        preflight(project)
    assert "train_path" not in str(info.value)


def test_the_shipped_params_name_no_missing_path():
    from fineflow.core.preflight import preflight
    from tests.conftest import ROOT

    preflight(ROOT)  # data/raw/*: the data stage's outputs


def test_a_broken_dvc_yaml_is_named_not_a_traceback(tmp_path):
    from fineflow.core.preflight import preflight

    project = _project(tmp_path, {})
    (project / "dvc.yaml").write_text("stages:\n  data: [\n")
    with pytest.raises(ConfigError, match=r"dvc.yaml: not valid YAML"):
        preflight(project)


def test_only_the_inputs_of_the_stages_dvc_yaml_has_are_checked(tmp_path):
    """A pipeline cut down to promote (the tests' gate-only project) reads no training data nor task folders."""
    from fineflow.core.preflight import preflight

    params = {"data": {"train_path": "mine/train.jsonl"}, "evaluate": {"task_dirs": ["eval_tasks/mine"]}}
    project = _project(tmp_path, params)
    (project / "dvc.yaml").write_text("stages:\n  promote:\n    cmd: x\n")
    preflight(project)
    (project / "dvc.yaml").write_text("stages:\n  promote:\n    cmd: x\n  evaluate:\n    cmd: y\n")
    with pytest.raises(ConfigError, match=r"^1 input path.*\n  params.yaml: evaluate.task_dirs: no such folder"):
        preflight(project)
