"""Evaluation and promotion that scale with the model (issue 30, section 3), on CPU.

Evaluation: loaded in the run's compute dtype; sized before it loads (fineflow.evaluate.sizing: the 8B and 70B
plans, a refusal that names what to change); a model too big for one device's budget is placed over two by
accelerate's device map, and scores as it does unsplit; a QLoRA adapter's report says which base it scored.
Promotion: the merged model is a choice (promote.merged); an adapter-only champion (the adapter + its base's
identity) goes through promote, verify, evaluation against it and rollback; the merged model built on demand
streams the base shard by shard (fineflow.registry.merge), equals peft's merge_and_unload, and its peak RSS stays
within a few shards.
"""

import json
import tempfile
from pathlib import Path

import pytest
import yaml

from fineflow.core.errors import FineflowError
from tests.conftest import random_adapter, write_params

GiB = 1024**3


def _params(overrides: dict):
    from fineflow.core.config import parse_params

    return parse_params(yaml.safe_load(write_params(Path(tempfile.mkdtemp()) / "params.yaml", overrides).read_text()))


@pytest.fixture(scope="module")
def candidate(built, tmp_path_factory):
    return random_adapter(built / "models/base", tmp_path_factory.mktemp("eval-scale") / "candidate", seed=3)


def _evaluate(built, candidate, tmp_path, params, champion=None):
    from fineflow.evaluate.recipe import evaluate_models

    return evaluate_models(
        params,
        built / "models/base",
        candidate,
        built / "data/validated/eval.jsonl",
        tmp_path / "eval",
        tmp_path / "lm_eval",
        champion,
    )


def _record_loads(monkeypatch) -> list:
    """Every from_pretrained of a causal LM during the test: (its dtype and device_map kwargs, the model's dtype)."""
    from transformers import AutoModelForCausalLM

    loads, original = [], AutoModelForCausalLM.from_pretrained.__func__

    def recording(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        loads.append({"dtype": str(kwargs.get("dtype")), "device_map": kwargs.get("device_map"), "got": model.dtype})
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recording))
    return loads


# ---- evaluation ------------------------------------------------------------------------------------------


def test_evaluation_loads_in_the_runs_compute_dtype_and_says_which_qlora_base_it_scored(
    built, candidate, tmp_path, monkeypatch
):
    """train.precision bf16: the base is loaded in bf16 (main loaded fp32 whatever the run trained in). A QLoRA
    run scored on CPU with evaluate.qlora_base 16bit: the report and scores.json say it was not the 4-bit base."""
    import torch

    loads = _record_loads(monkeypatch)
    params = _params(
        {"train": {"precision": "bf16", "method": "qlora"}, "evaluate": {"limit": 2, "qlora_base": "16bit"}}
    )
    report = _evaluate(built, candidate, tmp_path, params)
    assert loads and all(load["got"] == torch.bfloat16 for load in loads), loads
    said = "unquantized base in bfloat16, not the 4-bit base QLoRA trained on"
    assert report["base_scored"] == said
    assert json.loads((tmp_path / "eval/scores.json").read_text())["base_scored"] == said
    assert report["load"]["dtype"] == "bfloat16" and report["load"]["devices"] == 1


def test_a_cpu_run_keeps_fp32_and_a_qlora_adapter_cannot_be_scored_4bit_on_cpu():
    from fineflow.evaluate.sizing import base_scored_note, eval_precision, qlora_base

    assert eval_precision(_params({}), has_gpu=False) == "no"  # fp32
    assert qlora_base("lora", "as_trained", has_gpu=False) is None
    assert qlora_base("qlora", "16bit", has_gpu=False) == "16bit"
    assert qlora_base("qlora", "as_trained", has_gpu=True) == "4bit"
    for setting in ("as_trained", "4bit"):
        with pytest.raises(FineflowError, match="evaluate.qlora_base: 16bit") as refused:
            qlora_base("qlora", setting, has_gpu=False)
        assert "CUDA GPU" in str(refused.value)
    assert (
        base_scored_note("qlora", "4bit", "bfloat16") == "4-bit NF4 base, as QLoRA trained it (compute dtype bfloat16)"
    )


def test_the_evaluation_memory_plan_for_8b_and_70b_and_its_refusal(capsys):
    """One lm-eval batch (8 x 4,096 tokens, bf16): an 8B fits one 80 GiB GPU; a 70B does not, and is sharded over
    the fewest of 8 GPUs that hold it (3: 78 GiB each); on one GPU it is refused with the keys to change."""
    from fineflow.evaluate.sizing import choose_placement, plan_evaluation
    from fineflow.train.planner import KNOWN_SHAPES

    h100s = [80 * GiB] * 8
    eight = choose_placement(KNOWN_SHAPES["8B"], "bf16", 8, 4096, h100s)
    assert eight.devices == 1 and 14 < eight.weights / GiB < 16
    seventy = choose_placement(KNOWN_SHAPES["70B"], "bf16", 8, 4096, h100s)
    assert seventy.devices == 3 and 130 < seventy.weights / GiB < 133 and seventy.per_device <= 80 * GiB
    with pytest.raises(FineflowError) as refused:
        choose_placement(KNOWN_SHAPES["70B"], "bf16", 8, 4096, [80 * GiB])
    assert "use more devices" in str(refused.value) and "evaluate.device_memory_gib" in str(refused.value)
    with pytest.raises(FineflowError, match="lower evaluate.batch_size to 4"):
        choose_placement(KNOWN_SHAPES["8B"], "bf16", 32, 4096, [40 * GiB])
    fp32 = plan_evaluation(KNOWN_SHAPES["70B"], "no", 8, 4096, h100s)
    assert fp32.weights / GiB > 260  # what main loaded: fp32 on one device
    with capsys.disabled():
        for name, p in (("8B", eight), ("70B", seventy)):
            print(f"\n{name} eval plan: {json.dumps(p.as_dict())}")


def test_an_evaluation_that_cannot_fit_is_refused_before_any_model_loads(built, candidate, tmp_path, monkeypatch):
    loads = _record_loads(monkeypatch)
    params = _params({"evaluate": {"limit": 2, "device_memory_gib": 0.001}})
    with pytest.raises(FineflowError, match="does not fit.*evaluate.batch_size|does not fit.*more devices"):
        _evaluate(built, candidate, tmp_path, params)
    assert loads == []


def _deeper_base(base: Path, out: Path, layers: int) -> Path:
    """The tiny base's architecture and tokenizer with more decoder layers (random weights): the embedded base's
    2 layers are each smaller than its embedding, too few to show layers placed on two devices."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / name).is_file():
            shutil.copy(base / name, out / name)
    return out


def test_an_evaluation_split_over_two_devices_budgets_scores_as_unsplit(built, tmp_path, monkeypatch):
    """Two devices, each with a budget too small for the whole model: accelerate's device map puts decoder layers
    on both. Mapped onto the CPU (the mechanism, not the speed), the split model scores exactly as the whole one."""
    from transformers import AutoConfig, AutoTokenizer

    from fineflow.evaluate.harness import LoadPlan, ModelScorer, prepare_task_dir, resolve_tasks, summarize
    from fineflow.evaluate.sizing import device_map_for

    base = _deeper_base(built / "models/base", tmp_path / "base", layers=8)
    weights = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    budget = {0: int(weights * 0.6), 1: int(weights * 0.6)}
    device_map = device_map_for(AutoConfig.from_pretrained(base), "no", budget)
    layers = {module: device for module, device in device_map.items() if ".layers." in module}
    assert set(device_map.values()) == {0, 1} and set(layers.values()) == {0, 1}, device_map
    on_cpu = {module: "cpu" for module in device_map}

    tokenizer = AutoTokenizer.from_pretrained(base)
    tasks = prepare_task_dir(tmp_path / "tasks", built / "data/validated/eval.jsonl", 8, tokenizer)
    manager, _ = resolve_tasks(["fineflow_synth", "fineflow_synth_mc"], tasks, [])
    scores = {}
    for name, load in (("whole", LoadPlan()), ("split", LoadPlan(device_map=on_cpu, max_memory=budget))):
        scorer = ModelScorer(str(base), ["fineflow_synth", "fineflow_synth_mc"], manager, 4, 6, load)
        loads = _record_loads(monkeypatch)
        scorer.load_base()
        assert loads[-1]["device_map"] == (on_cpu if name == "split" else None)
        scores[name] = summarize(scorer.score("base")[0])
    assert scores["split"] == scores["whole"]
