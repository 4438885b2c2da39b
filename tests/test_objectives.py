"""Objectives as plug-ins (fineflow.objectives): every stage asks the objective, none names one; each objective's
loss is its paper's formula, computed here independently of the library's code."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest

from fineflow.objectives import NAMES, OBJECTIVES, objective_for
from fineflow.objectives.interface import FEEDBACK, ROW_SCHEMAS, Objective

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fineflow"


def _code_mentions(path: Path, names: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """Where a module's code names an objective: a string constant (docstrings aside: they explain) or an
    identifier (a variable, attribute, function, argument) with an objective's name as one of its words."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    # a string names one as train.objective spells it ("reward_model"; prose's "reward model" is no name); an
    # identifier as words, its underscores breaking them as the name's do (load_reward_model, REWARD_MODEL)
    as_value = re.compile(rf"(?<![a-z0-9])({'|'.join(map(re.escape, names))})(?![a-z0-9])", re.IGNORECASE)
    as_words = [re.escape(name.replace("_", " ")) for name in names]
    word = re.compile(rf"(?<![a-z0-9])({'|'.join(as_words)})(?![a-z0-9])", re.IGNORECASE)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if as_value.search(node.value):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value[:80]!r}")
            continue
        if isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = node.name
        elif isinstance(node, ast.arg):
            text = node.arg
        else:
            continue
        if word.search(text.replace("_", " ")):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {text[:80]!r}")
    return found


# A name that is another registry's, not train.objective's: the online-RL reward scoring with the champion reward
# model is named after that model (train.grpo.rewards[i].name, the value of its Reward.name, and nowhere else).
ANOTHER_REGISTRYS = {"fineflow/rewards/reward_model.py": "'reward_model'"}


def _another_registrys(mention: str) -> bool:
    path, _, text = mention.split(":", 2)
    return ANOTHER_REGISTRYS.get(path) == text.strip()


def test_no_module_outside_the_objectives_package_names_an_objective():
    """A stage or library module asks fineflow.objectives (rows, needs_reference, loss, eval_task) instead of
    branching on train.objective's value: adding an objective touches its own module and the registry only."""
    modules = [path for path in PACKAGE.rglob("*.py") if "objectives" not in path.relative_to(PACKAGE).parts]
    found = [mention for path in modules for mention in _code_mentions(path, NAMES)]
    exempt = [mention for mention in found if _another_registrys(mention)]
    assert len(exempt) <= len(ANOTHER_REGISTRYS), f"another registry's name used beyond its own name: {exempt}"
    found = [mention for mention in found if mention not in exempt]
    assert not found, "modules that name an objective (ask fineflow.objectives instead):\n  " + "\n  ".join(found)


def test_the_check_sees_a_name_in_a_string_or_an_identifier_but_not_in_a_docstring(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        '"""dpo here is prose."""\nif x == "dpo":\n    use_simpo_path = 1\nload_reward_model()\nreward_margin = 0\n'
        'y = "reward_model"\nsay("the champion reward model")\n',
        encoding="utf-8",
    )
    found = _code_mentions(module, NAMES, root=tmp_path)
    # "reward margin" is no objective, nor is "reward model" in a message's prose
    assert sorted(int(line.split(":")[1]) for line in found) == [2, 3, 4, 6], found


def test_the_registry_holds_every_objective_under_its_own_name_and_refuses_others():
    assert NAMES == ("sft", "dpo", "simpo", "orpo", "kto", "reward_model", "grpo")
    for name, objective in OBJECTIVES.items():
        assert isinstance(objective, Objective) and objective.name == name and objective.summary
        assert objective.rows in ROW_SCHEMAS
        assert objective.eval_task is None or objective.pair_shards
    assert [n for n in NAMES if objective_for(n).needs_reference] == ["dpo", "kto"]
    # a reference model is the model the run starts from, frozen: every objective that needs one is anchored
    assert [n for n in NAMES if objective_for(n).anchored] == ["dpo", "simpo", "orpo", "kto", "grpo"]
    assert [n for n in NAMES if objective_for(n).trains_pairs] == ["dpo", "simpo", "orpo", "reward_model"]
    assert [n for n in NAMES if objective_for(n).rows == FEEDBACK] == ["kto"]
    assert [n for n in NAMES if not objective_for(n).generates] == ["reward_model"]
    with pytest.raises(
        Exception, match="train.objective: 'ppo' is not one of sft, dpo, simpo, orpo, kto, reward_model"
    ):
        objective_for("ppo")


def test_params_accept_exactly_the_registered_objectives_and_list_them_in_the_reference():
    from fineflow.core.config import parse_params
    from fineflow.errors import ConfigError
    from fineflow.params_doc import render

    for name in NAMES:
        assert parse_params({"train": {"objective": name}}).train.objective == name
    with pytest.raises(ConfigError, match="train.objective"):
        parse_params({"train": {"objective": "ppo"}})
    page = render()
    assert all(f"{objective.name}: {objective.summary}" in page for objective in OBJECTIVES.values())
    # each objective's own settings: its section train.<name>, every field listed, validated as every section is
    own = {o.name: o.params for o in OBJECTIVES.values() if o.params is not None}
    assert set(own) == {"simpo", "orpo", "kto", "grpo"}
    assert all(f"train.{name}.{field}" in page for name, section in own.items() for field in section.model_fields)
    with pytest.raises(ConfigError) as refused:
        parse_params({"train": {"kto": {"desirable_weight": 0, "weight": 2}, "orpo": {"odds_ratio_weight": -1}}})
    assert all(key in str(refused.value) for key in ("train.kto.desirable_weight", "train.kto.weight", "train.orpo"))


# ---- each pair objective's loss against its paper's formula, written here ----------------------------------------


def _scores(chosen, rejected, chosen_len, rejected_len):
    import torch

    from fineflow.objectives.pair_logps import PairScores

    as_tensor = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    return PairScores(as_tensor(chosen), as_tensor(rejected), as_tensor(chosen_len), as_tensor(rejected_len))


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


POLICY = ([-12.0, -30.5, -7.25], [-15.0, -28.0, -9.5], [6, 14, 3], [8, 11, 5])
REFERENCE = ([-13.0, -29.0, -8.0], [-14.5, -29.5, -9.0], [6, 14, 3], [8, 11, 5])


@pytest.mark.parametrize("beta, gamma", [(0.1, 0.5), (2.0, 0.0), (0.7, 1.3)])
def test_dpo_and_simpo_sum_their_papers_loss_over_the_pairs(beta, gamma):
    """DPO (Rafailov et al. 2023, eq. 7) and SimPO (Meng et al. 2024, eq. 6), pair by pair in plain floats."""
    from fineflow.core.train_config import TrainParams

    prefs = TrainParams(preference={"beta": beta}, simpo={"gamma": gamma})
    policy, reference = _scores(*POLICY), _scores(*REFERENCE)
    dpo_by_hand = simpo_by_hand = 0.0
    dpo_right = simpo_right = 0
    for k in range(3):
        pc, pr, lc, lr = POLICY[0][k], POLICY[1][k], POLICY[2][k], POLICY[3][k]
        rc, rr = REFERENCE[0][k], REFERENCE[1][k]
        dpo_margin = beta * ((pc - rc) - (pr - rr))
        dpo_by_hand -= _log_sigmoid(dpo_margin)
        dpo_right += dpo_margin > 0
        simpo_margin = beta * pc / lc - beta * pr / lr
        simpo_by_hand -= _log_sigmoid(simpo_margin - gamma)
        simpo_right += simpo_margin > 0
    dpo = objective_for("dpo").pair_loss(policy, reference, prefs)
    simpo = objective_for("simpo").pair_loss(policy, None, prefs)
    assert float(dpo.loss_sum) == pytest.approx(dpo_by_hand, abs=1e-12) and dpo.count == 3
    assert float(simpo.loss_sum) == pytest.approx(simpo_by_hand, abs=1e-12) and simpo.count == 3
    assert (dpo.rewards[0], simpo.rewards[0]) == (dpo_right, simpo_right)


def test_the_docs_worked_example_plugs_in_with_one_registry_line(monkeypatch):
    """docs/objectives.md's example objective, run as written: registered, the stages' questions answer from its
    parent (pairs, a reference model, the preference task), its settings section becomes train.rdpo (defaults,
    bounds and unknown keys as any section's), and its loss is its own formula with the alpha params give."""
    from pydantic import ValidationError

    import fineflow.objectives as objectives
    from fineflow.core.train_config import TrainSettings, with_objective_sections

    page = (ROOT / "docs/objectives.md").read_text(encoding="utf-8")
    [example] = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    namespace: dict = {}
    exec(compile(example, "docs/objectives.md", "exec"), namespace)
    added = namespace["LengthRegularisedDPO"]()
    monkeypatch.setitem(objectives.OBJECTIVES, added.name, added)
    assert objective_for("rdpo") is added and added.trains_pairs and added.needs_reference
    assert added.eval_task == objective_for("dpo").eval_task
    train_params = with_objective_sections(TrainSettings)  # as fineflow.core builds it from the registry
    assert train_params().rdpo.alpha == 0.01
    with pytest.raises(ValidationError) as refused:
        train_params(rdpo={"alpha": -1, "alhpa": 0.2})
    assert {error["loc"] for error in refused.value.errors()} == {("rdpo", "alpha"), ("rdpo", "alhpa")}
    cfg = train_params(preference={"beta": 0.5}, rdpo={"alpha": 0.03})
    policy, reference = _scores(*POLICY), _scores(*REFERENCE)
    by_hand = 0.0
    for k in range(3):
        chosen = 0.5 * (POLICY[0][k] - REFERENCE[0][k]) - 0.03 * POLICY[2][k]
        rejected = 0.5 * (POLICY[1][k] - REFERENCE[1][k]) - 0.03 * POLICY[3][k]
        by_hand -= _log_sigmoid(chosen - rejected)
    assert float(added.pair_loss(policy, reference, cfg).loss_sum) == pytest.approx(by_hand, abs=1e-12)


@pytest.mark.parametrize("lam", [0.1, 1.0, 0.25])
def test_orpo_sums_the_chosen_nll_and_its_odds_ratio_term_over_the_pairs(lam):
    """ORPO (Hong et al. 2024, eqs. 6-7): per pair the chosen answer's mean token NLL plus lambda times
    -log sigmoid of the log odds ratio, odds(y) = p / (1 - p) with p the answer's mean per-token probability."""
    from fineflow.core.train_config import TrainParams

    prefs = TrainParams(orpo={"odds_ratio_weight": lam})
    by_hand, right = 0.0, 0
    for k in range(3):
        chosen, rejected = POLICY[0][k] / POLICY[2][k], POLICY[1][k] / POLICY[3][k]
        p_chosen, p_rejected = math.exp(chosen), math.exp(rejected)
        log_odds = math.log(p_chosen / (1 - p_chosen)) - math.log(p_rejected / (1 - p_rejected))
        by_hand += -chosen - lam * _log_sigmoid(log_odds)
        right += chosen > rejected
    orpo = objective_for("orpo")
    got = orpo.pair_loss(_scores(*POLICY), None, prefs)
    assert float(got.loss_sum) == pytest.approx(by_hand, abs=1e-12) and got.count == 3 and got.rewards[0] == right
    assert not orpo.needs_reference and orpo.trains_pairs


@pytest.mark.parametrize("beta, weights", [(0.1, (1.0, 1.0)), (0.5, (1.33, 1.0)), (2.0, (1.0, 0.75))])
def test_kto_weighs_each_answers_loss_against_the_batch_kl_estimate(beta, weights):
    """KTO (Ethayarajh et al. 2024, eq. 8): z = max(0, mean KL sample log-ratio), no gradient; per row
    w_D (1 - sigmoid(beta (r - z))) when desirable, w_U (1 - sigmoid(beta (z - r))) when not, r the answer's
    log-ratio to the reference. Here the answers are POLICY's chosen column and the KL samples its rejected."""
    import torch

    from fineflow.core.train_config import TrainParams

    prefs = TrainParams(
        preference={"beta": beta}, kto={"desirable_weight": weights[0], "undesirable_weight": weights[1]}
    )
    labels = [True, False, True]
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    kl_terms = [POLICY[1][k] - REFERENCE[1][k] for k in range(3)]
    z = max(0.0, sum(kl_terms) / 3)
    by_hand, right = 0.0, 0
    for k, desirable in enumerate(labels):
        r = POLICY[0][k] - REFERENCE[0][k]
        if desirable:
            by_hand += weights[0] * (1 - sigmoid(beta * (r - z)))
            right += r > z
        else:
            by_hand += weights[1] * (1 - sigmoid(beta * (z - r)))
            right += r < z
    kto = objective_for("kto")
    got = kto.feedback_loss(_scores(*POLICY), _scores(*REFERENCE), torch.tensor(labels), prefs)
    assert float(got.loss_sum) == pytest.approx(by_hand, abs=1e-12) and got.count == 3 and got.rewards[0] == right
    assert kto.needs_reference and kto.rows == FEEDBACK and kto.pair_shards and not kto.trains_pairs


def test_kto_clamps_a_negative_kl_estimate_to_zero():
    """The KL estimate is a KL: when the samples' mean log-ratio is below 0 (the policy likes the mismatched
    answers less than the reference does) z is 0, not negative."""
    import torch

    from fineflow.core.train_config import TrainParams

    policy = _scores([-10.0], [-20.0], [4], [4])
    reference = _scores([-11.0], [-15.0], [4], [4])  # KL sample log-ratio -5: clamped to 0
    got = objective_for("kto").feedback_loss(
        policy, reference, torch.tensor([True]), TrainParams(preference={"beta": 1.0})
    )
    assert float(got.loss_sum) == pytest.approx(1 - 1 / (1 + math.exp(-1.0)), abs=1e-12)


@pytest.mark.parametrize("name", [name for name in NAMES if objective_for(name).trains_pairs])
def test_each_pair_objectives_validate_stage_quarantines_a_pair_with_an_empty_side(tmp_path, name):
    """A pair with an empty answer trains nothing on that side: the validate stage (as dvc.yaml runs it, before any
    training) quarantines it naming the file, the line and the field, whichever pair objective the run trains."""
    import json

    from fineflow.core.config import parse_params
    from fineflow.stages import data, validate
    from tests.conftest import TINY_PARAMS, _merge

    params = parse_params(_merge(TINY_PARAMS, {"train": {"objective": name}}))
    raw = tmp_path / "data/raw"
    data.run(params, raw / "train.jsonl", raw / "eval.jsonl")
    validate.run(params, raw / "train.jsonl", raw / "eval.jsonl", tmp_path / "validated", tmp_path / "report.json")
    rows = [json.loads(line) for line in (raw / "train.jsonl").read_text().splitlines()]
    empty = [n for n, row in enumerate(rows, start=1) if row.get("rejected") == ""]
    quarantine = [json.loads(line) for line in (tmp_path / "validated/quarantine.jsonl").read_text().splitlines()]
    reasons = {entry["line"]: entry["reasons"] for entry in quarantine}
    assert empty and all(f"{raw / 'train.jsonl'}:{n}: failed pair_non_empty(rejected)" in reasons[n] for n in empty)
