"""The rewards of online RL (fineflow.rewards, issue 47): each built-in against values worked out by hand, the
weighted total, every problem of a list reported at once, the fields a row lacks, the user's function in its worker
(hanging, raising, returning the wrong thing: counted, never a crash, never a stall), math_verify's refusal without
its package, the champion reward model scoring completions as `fineflow reward score` scores rows, and the worked
example of docs/rewards.md.

The user functions are tests/reward_functions.py's, imported by path in the worker process."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path

import pytest

from fineflow.errors import ConfigError, FineflowError
from fineflow.rewards import REWARDS, RewardsParams, RewardSpec, build_rewards, missing_fields

ROOT = Path(__file__).resolve().parent.parent
FUNCTIONS = "tests.reward_functions"

WHERE = "train.grpo.rewards"  # the key the train stage passes for the GRPO objective's rewards


def scores(spec: dict, completions: list[str], rows: list[dict] | None = None) -> list[float]:
    """One reward's scores of the completions (rows default to empty ones)."""
    with build_rewards([spec]) as rewards:
        return rewards.score(completions, rows or [{} for _ in completions]).per_reward[spec["name"]]


# ---- the built-ins, by hand ---------------------------------------------------------------------------------------


def test_exact_match_strips_whitespace_reads_its_field_and_can_ignore_case():
    rows = [{"output": " Paris\n"}, {"output": "Paris"}, {"output": "Paris"}, {"output": ""}, {"output": "x"}]
    assert scores({"name": "exact_match"}, ["Paris", "  Paris  ", "paris", "", ""], rows) == [1, 1, 0, 1, 0]
    assert scores({"name": "exact_match", "case_insensitive": True}, ["PARIS"], [{"output": "paris"}]) == [1]
    assert scores({"name": "exact_match", "field": "answer"}, ["42", "42"], [{"answer": 42}, {"output": "42"}]) == [
        1,
        0,
    ]
    chat = {"messages": [{"role": "user", "content": "Capital?"}, {"role": "assistant", "content": "Paris"}]}
    assert scores({"name": "exact_match"}, ["Paris", "Rome"], [chat, chat]) == [1, 0]


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("The answer is 42.", "42", 1.0),
        ("so 1,234 apples", "1234", 1.0),  # thousands separators
        ("total: $1,234.50", "#### 1,234.5", 1.0),  # the reference's last number too (GSM8K's ####)
        ("it drops to -7 degrees", "-7", 1.0),  # negative
        ("\u22127", "-7", 1.0),  # a Unicode minus
        ("from 3-7", "-7", 0.0),  # a dash, not a sign: 7
        ("3 then 5", "3", 0.0),  # the last number counts
        ("  41.9999 \n", "42", 0.0),  # outside the default tolerance (1e-6)
        ("42.0000001", "42", 1.0),  # inside it
        ("no number here", "42", 0.0),
        ("", "42", 0.0),  # empty
        ("   \n", "42", 0.0),  # whitespace only
        ("42", "forty-two", 0.0),  # a reference without a number
        ("1,2,3", "3", 1.0),  # commas that are no thousands separators end a number
        (".5", "0.5", 1.0),
        ("1e3", "1000", 1.0),
    ],
)
def test_numeric_match_compares_the_last_numbers(completion, reference, expected):
    assert scores({"name": "numeric_match"}, [completion], [{"output": reference}]) == [expected]


def test_numeric_match_tolerance_and_field():
    spec = {"name": "numeric_match", "field": "answer", "tolerance": 0.01}
    assert scores(spec, ["3.141", "3.16", "3.14"], [{"answer": "3.14"}, {"answer": 3.14}, {"output": "3.14"}]) == [
        1,
        0,
        0,
    ]


def test_format_fullmatch_search_and_dotall():
    think = {"name": "format", "pattern": r"<think>.*</think>\s*\S.*"}
    assert scores(think, ["<think>a\nb</think>\n42", "42", "<think>x</think>", ""]) == [1, 0, 0, 0]
    assert scores({**think, "dotall": False}, ["<think>a\nb</think> 42"]) == [0]
    assert scores({"name": "format", "pattern": r"\d+", "mode": "search"}, ["it is 42", "none"]) == [1, 0]
    assert scores({"name": "format", "pattern": r"\d+"}, ["it is 42", "42"]) == [0, 1]
    assert scores({"name": "format", "pattern": "yes", "case_insensitive": True}, ["YES"]) == [1]


def test_length_penalty_is_zero_within_the_target_then_linear_to_minus_one():
    spec = {"name": "length_penalty", "target_chars": 10, "scale_chars": 4}
    completions = ["", "x" * 10, "x" * 11, "x" * 12, "x" * 14, "x" * 15, "x" * 1000]
    assert scores(spec, completions) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]


def test_math_verify_is_refused_with_the_install_line_when_its_package_is_absent():
    if importlib.util.find_spec("math_verify") is not None:
        pytest.skip("math-verify is installed here: the refusal is for its absence")
    with pytest.raises(ConfigError, match=re.escape("train.grpo.rewards[0]: reward math_verify needs the math-verify")):
        build_rewards([{"name": "math_verify"}], where=WHERE)
    with pytest.raises(ConfigError, match="pip install math-verify"):
        build_rewards([{"name": "math_verify", "field": "answer"}])


# ---- the set: weights, labels, validation, rows -----------------------------------------------------------------


def test_the_total_is_the_weighted_sum_and_each_reward_is_reported_by_label():
    specs = [
        {"name": "exact_match", "weight": 2.0},
        {"name": "format", "weight": 0.5, "pattern": r"\d+"},
        {"name": "format", "weight": -1.0, "pattern": r".*7.*"},
        {"name": "length_penalty", "weight": 3.0, "target_chars": 2, "scale_chars": 2},
    ]
    rows = [{"output": "42"}, {"output": "42"}, {"output": "42"}]
    with build_rewards(specs) as rewards:
        got = rewards.score(["42", "427", "no"], rows)
    assert got.per_reward == {
        "exact_match": [1, 0, 0],
        "format[1]": [1, 1, 0],
        "format[2]": [0, 1, 0],
        "length_penalty": [0, -0.5, 0],
    }
    assert got.total == [2 * 1 + 0.5, 0.5 - 1 + 3 * -0.5, 0.0]
    assert got.errors == dict.fromkeys(got.per_reward, 0) and got.error_messages == {}
    assert set(got.seconds) == set(got.per_reward) and all(s >= 0 for s in got.seconds.values())
    assert rewards.score([], []).total == []


def test_every_problem_of_the_list_is_reported_at_once_naming_its_key():
    specs = [
        {"name": "nope"},
        {"name": "format"},
        {"name": "format", "pattern": "(", "mode": "sometimes"},
        {"name": "exact_match", "weight": "heavy", "feild": "answer"},
        {"name": "user", "function": "not a path"},
        {"name": "user", "function": "no_such_package.rewards:f"},
        {"name": "length_penalty", "scale_chars": 0},
        7,
    ]
    with pytest.raises(ConfigError) as caught:
        build_rewards(specs, where=WHERE)
    lines = str(caught.value).splitlines()
    assert lines[0] == "10 problem(s) in train.grpo.rewards:", lines
    keys = [line.strip().split(": ")[0] for line in lines[1:]]
    assert keys == [
        "train.grpo.rewards[0].name",
        "train.grpo.rewards[1].pattern",
        "train.grpo.rewards[2].pattern",
        "train.grpo.rewards[2].mode",
        "train.grpo.rewards[3].weight",
        "train.grpo.rewards[3].feild",
        "train.grpo.rewards[4].function",
        "train.grpo.rewards[5].function",
        "train.grpo.rewards[6].scale_chars",
        "train.grpo.rewards[7]",
    ], lines
    text = str(caught.value)
    assert "'nope' is not one of exact_match, numeric_match, format" in text
    assert "feild: is not a setting of reward exact_match (its settings: field, case_insensitive)" in text
    assert "no module 'no_such_package.rewards' to import" in text
    with pytest.raises(ConfigError, match=r"train\.grpo\.rewards: no rewards"):
        build_rewards([], where=WHERE)


def test_reward_specs_are_a_params_field_whose_names_and_settings_the_set_checks():
    """RewardsParams (fineflow.reward_spec: below the objectives) reads the shape; build_rewards the rest."""
    assert RewardsParams().rewards == [RewardSpec(name="exact_match", weight=1.0)]
    spec = RewardSpec(name="format", weight=0.5, pattern=r"\d+")
    assert spec.settings == {"pattern": r"\d+"} and build_rewards([spec]).labels == ["format"]
    with pytest.raises(ValueError) as caught:
        RewardsParams(rewards=[{"weight": 1}, {"name": "exact_match", "weight": float("nan")}], other=1)
    assert sorted(e["loc"] for e in caught.value.errors()) == [
        ("other",),
        ("rewards", 0, "name"),
        ("rewards", 1, "weight"),
    ]
    with pytest.raises(ValueError, match="at least 1 item"):
        RewardsParams(rewards=[])
    params = RewardsParams(rewards=[{"name": "format"}, {"name": "zz"}, {"name": "exact_match", "case": True}])
    with pytest.raises(ConfigError) as caught:
        build_rewards(params.rewards, where=WHERE)
    assert str(caught.value).splitlines()[1:] == [
        "  train.grpo.rewards[0].pattern: is required by reward format",
        "  train.grpo.rewards[1].name: 'zz' is not one of " + ", ".join(REWARDS),
        "  train.grpo.rewards[2].case: is not a setting of reward exact_match (its settings: field, case_insensitive)",
    ]


def test_missing_fields_names_each_field_a_reward_needs():
    rewards = build_rewards(
        [
            {"name": "numeric_match", "field": "answer"},
            {"name": "exact_match"},
            {"name": "format", "pattern": "x"},
            {"name": "user", "function": f"{FUNCTIONS}:contains_answer", "needs": ["answer", "tests"]},
        ]
    )
    assert missing_fields(rewards, {"answer": 1, "output": "1", "tests": []}) == []
    assert missing_fields(rewards, {"answer": 1, "messages": [], "tests": []}) == []
    assert missing_fields(rewards, {"instruction": "q"}) == [
        'no field "answer" that reward numeric_match needs',
        'no field "output" or "messages" that reward exact_match needs',
        'no field "answer" that reward user needs',
        'no field "tests" that reward user needs',
    ]
    with pytest.raises(FineflowError, match="2 completions but 1 rows"):
        rewards.score(["a", "b"], [{}])
    rewards.close()


# ---- the user's function in its worker ----------------------------------------------------------------------------


def test_a_user_function_scores_in_its_worker_with_the_callers_thread_plan(monkeypatch):
    """The worker follows the caller's thread plan (fineflow.core.threads), which it sets itself: the caller's
    environment names no thread count here."""
    from fineflow.core.threads import PLAN_ENV, plan_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(PLAN_ENV, raising=False)
    specs = [
        {"name": "user", "function": f"{FUNCTIONS}:contains_answer"},
        {"name": "user", "function": f"{FUNCTIONS}:threads"},
    ]
    rows = [{"answer": 42}, {"answer": 7}]
    with build_rewards(specs) as rewards:
        got = rewards.score(["it is 42", "it is 8"], rows)
        again = rewards.score(["7"], rows[1:])
    threads = float(plan_threads().per_process)
    assert got.per_reward == {"user[0]": [1.0, 0.0], "user[1]": [threads, threads]}
    assert again.total == [1.0 + threads]
    assert rewards.summary()["errors"] == {}


def test_a_hanging_or_raising_user_function_is_counted_never_a_crash_or_a_stall():
    """sleep(60) under timeout_s 1: the call returns after about a second with the batch at on_error and one error;
    the worker is restarted for the next batch, which a raising function fails again: its type and message kept."""
    specs = [
        {"name": "user", "function": f"{FUNCTIONS}:hangs", "timeout_s": 1, "on_error": -1.0},
        {"name": "user", "function": f"{FUNCTIONS}:raises"},
        {"name": "exact_match"},
    ]
    rows = [{"output": "a"}, {"output": "b"}]
    with build_rewards(specs) as rewards:
        start = time.monotonic()
        first = rewards.score(["a", "x"], rows)
        second = rewards.score(["a", "b"], rows)
        took = time.monotonic() - start
    assert took < 30, took  # two calls past a 1 s limit, with the worker starts: seconds, never the minute it sleeps
    assert first.per_reward == {"user[0]": [-1.0, -1.0], "user[1]": [0.0, 0.0], "exact_match": [1.0, 0.0]}
    assert first.total == [-1.0 + 0 + 1, -1.0 + 0 + 0] and second.total == [-1.0 + 1, -1.0 + 1]
    assert first.errors == {"user[0]": 1, "user[1]": 1, "exact_match": 0}
    assert first.error_messages["user[0]"] == [
        f"TimeoutError: {FUNCTIONS}:hangs took more than 1 s (stopped, restarted next)"
    ]
    assert first.error_messages["user[1]"] == ["ValueError: the test suite did not compile"]
    summary = rewards.summary()
    assert summary["errors"] == {"user[0]": 2, "user[1]": 2} and len(summary["error_messages"]["user[1]"]) == 2
    assert 1.0 <= summary["seconds"]["user[0]"] < 30


@pytest.mark.parametrize(
    "function, says",
    [
        ("one_short", "BadReturn: returned 1 values for 2 completions"),
        ("not_numbers", "BadReturn: value 0 is 'yes', not a finite number"),
        ("exits", "WorkerDied: the process running tests.reward_functions:exits exited (exit code 3)"),
    ],
)
def test_a_wrong_return_or_a_dead_worker_is_an_error_not_a_crash(function, says):
    with build_rewards([{"name": "user", "function": f"{FUNCTIONS}:{function}"}]) as rewards:
        got = rewards.score(["a", "b"], [{}, {}])
    assert got.total == [0.0, 0.0] and got.errors == {"user": 1} and got.error_messages == {"user": [says]}


def test_a_function_that_cannot_be_loaded_stops_the_run_saying_so():
    with build_rewards([{"name": "user", "function": f"{FUNCTIONS}:no_such_function"}]) as rewards:
        with pytest.raises(ConfigError, match="reward function tests.reward_functions:no_such_function: Attribute"):
            rewards.score(["a"], [{}])
    with build_rewards([{"name": "user", "function": f"{FUNCTIONS}:NOT_A_FUNCTION"}]) as rewards:
        with pytest.raises(ConfigError, match=re.escape("is not callable (its type: int)")):
            rewards.score(["a"], [{}])


# ---- the champion reward model ------------------------------------------------------------------------------------

TEXTS = ["What is two plus two? Four.", "Name a colour. Blue.", "Say hello. Hello there!", "Count to three: 1 2 3."]


@pytest.fixture(scope="module")
def reward_registry(tmp_path_factory):
    """A registry whose reward champion is a random LoRA adapter and head on a tiny random Llama (its own BPE
    tokenizer and chat template), installed as promote installs one: champions/<kind>/ and the kind's alias."""
    import torch
    from peft import LoraConfig, get_peft_model

    from fineflow.base.embedded import build_model, train_tokenizer
    from fineflow.core.model_config import ModelParams
    from fineflow.objectives.reward_model import REWARD, add_head, save_head
    from fineflow.registry.store import kind_champion_dir, set_alias
    from fineflow.train.model import save_adapter

    root = tmp_path_factory.mktemp("reward-registry")
    tokenizer = train_tokenizer(TEXTS * 10, vocab_size=300, model_max_length=256)
    shape = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, vocab_size=300)
    base = build_model(ModelParams(**shape, max_position_embeddings=256), tokenizer, seed=3)
    base.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    champion = kind_champion_dir(root / "registry", REWARD)
    torch.manual_seed(5)
    model = add_head(get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])))
    with torch.no_grad():
        model.reward_head.weight.normal_()
    save_adapter(model, champion)
    save_head(model, champion)
    tokenizer.save_pretrained(champion)
    record = {"candidate_id": "c" * 12, "base_model": str(root / "base"), "model_kind": REWARD}
    (champion / "champion.json").write_text(json.dumps(record))
    set_alias(root / "registry", record["candidate_id"], 1, kind=REWARD)
    return root


def test_the_reward_model_scores_prompt_and_completion_as_reward_score_scores_rows(reward_registry):
    """Loaded on the first score and kept; each completion scored as the row with it as the answer, exactly as
    `fineflow reward score` scores such rows (the champion's template, alone, cut at its seq_len)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fineflow.objectives.reward_model import example_rewards, load_reward_model
    from fineflow.registry.reward_champion import SEQ_LEN, reward_champion
    from fineflow.tokenize.template import encode_batch

    rows = [
        {"instruction": "What is two plus two?", "input": "", "output": "Four."},
        {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]},
        {"messages": [{"role": "user", "content": "Say hello."}]},
    ]
    completions = ["Four.", "Blue.", ""]
    spec = {"name": "reward_model", "registry": str(reward_registry / "registry"), "device": "cpu", "batch_size": 2}
    with build_rewards([spec]) as rewards:
        reward = rewards.rewards[0]
        assert reward._scorer is None  # nothing loads when the set is built
        got = rewards.score(completions, rows).per_reward["reward_model"]
        scorer = reward._scorer
        assert rewards.score(completions[:1], rows[:1]).total == pytest.approx(got[:1], abs=1e-6)
        assert reward._scorer is scorer  # loaded once, kept
    as_scored = [
        {"instruction": rows[0]["instruction"], "input": "", "output": "Four."},
        {"messages": [rows[1]["messages"][0], {"role": "assistant", "content": "Blue."}]},
        {"messages": [rows[2]["messages"][0], {"role": "assistant", "content": ""}]},
    ]
    _, champion, _ = reward_champion(reward_registry / "registry")
    model = load_reward_model(AutoModelForCausalLM.from_pretrained(reward_registry / "base"), champion)
    encoded = encode_batch(AutoTokenizer.from_pretrained(champion), as_scored, train_on="last_assistant")
    assert got == pytest.approx(example_rewards(model, encoded, 1, SEQ_LEN).tolist(), abs=1e-5)
    assert len(set(got)) == 3


def test_the_reward_model_without_a_reward_champion_says_how_to_train_one(tmp_path):
    with build_rewards([{"name": "reward_model", "registry": str(tmp_path / "registry")}]) as rewards:
        with pytest.raises(FineflowError, match="no champion reward model: train one"):
            rewards.score(["a"], [{"instruction": "q", "output": "a"}])


# ---- docs/rewards.md's worked example -----------------------------------------------------------------------------


def test_the_worked_example_of_the_docs_registers_and_scores(monkeypatch):
    page = (ROOT / "docs/rewards.md").read_text(encoding="utf-8")
    example = page.split("## Adding one: a worked example", 1)[1]
    code = re.search(r"```python\n(.*?)```", example, re.DOTALL).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/rewards.md", "exec"), namespace)
    monkeypatch.setitem(REWARDS, "tagged_answer", namespace["TaggedAnswer"])
    rows = [{"output": "42"}, {"output": "42"}, {"answer": "7"}]
    completions = ["<think>hm</think><answer> 42 </answer>", "<answer>41</answer>", "<answer>7</answer>"]
    with build_rewards([{"name": "tagged_answer", "weight": 2.0}, {"name": "tagged_answer", "field": "answer"}]) as rs:
        got = rs.score(completions, rows)
    assert got.per_reward == {"tagged_answer[0]": [1, 0, 0], "tagged_answer[1]": [0, 0, 1]}
    assert got.total == [2.0, 0.0, 1.0]
    assert missing_fields(rs, {"output": "1"}) == ['no field "answer" that reward tagged_answer needs']
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.fields: is not a setting of reward tagged_answer"):
        build_rewards([{"name": "tagged_answer", "fields": "answer"}])
