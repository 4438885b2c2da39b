"""bench/grpo_trl_compare.py, fineflow's GRPO against TRL's GRPOTrainer: its one mapping of the run onto both sides
(group size, prompts per step, lengths, sampling, loss, lr, LoRA), its held-out scorer and its table, without TRL (a
bench-only extra); the bench itself, nightly, where TRL is importable."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def bench():
    """bench/grpo_trl_compare.py as a module (bench/ is no package)."""
    if "grpo_trl_compare" not in sys.modules:
        spec = importlib.util.spec_from_file_location("grpo_trl_compare", ROOT / "bench/grpo_trl_compare.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["grpo_trl_compare"] = module
        spec.loader.exec_module(module)
    return sys.modules["grpo_trl_compare"]


def grpo_params(**overrides):
    """The bench's GRPO params (params.yaml, BENCH_PARAMS, GRPO_PARAMS), plus dotted overrides."""
    from fineflow.core.config import parse_params

    b = bench()
    raw = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    return parse_params(b.set_dotted(b.set_dotted(b.set_dotted(raw, b.BENCH_PARAMS), b.GRPO_PARAMS), overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"train.grad_accum": 2, "train.micro_batch_size": 3, "train.grpo.group_size": 6},
        {"train.grpo.normalization": "dr_grpo", "train.grpo.epsilon_high": 0.28, "train.grpo.top_p": 0.9},
    ],
)
def test_trls_arguments_describe_the_same_run_as_fineflows_params(overrides, tmp_path):
    """Read back from GRPOConfig's arguments, TRL's run has fineflow's prompts per optimizer step, group size,
    completions per micro-step, completion length, sampling, clip range, loss, reward scaling, lr, LoRA shape, steps
    and seed: one generation batch per optimizer step, as fineflow samples one per step."""
    b = bench()
    params = grpo_params(**overrides)
    kwargs = b.trl_grpo_kwargs(params, tmp_path)
    assert b.trl_settings(kwargs, b.lora_config(params)) == b.fineflow_settings(params)
    cfg = params.train
    assert kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"] == (
        cfg.micro_batch_size * cfg.grad_accum * cfg.grpo.group_size
    )
    assert kwargs["num_iterations"] == 1 and kwargs["steps_per_generation"] == cfg.grad_accum
    assert kwargs["activation_checkpointing"] is False and kwargs["bf16"] is False
    assert kwargs["scale_rewards"] == ("none" if cfg.grpo.normalization == "dr_grpo" else "group")


def test_the_bench_run_is_grpo_with_exact_match_from_a_fresh_adapter_on_the_merged_start():
    params = grpo_params()
    cfg = params.train
    assert cfg.objective == "grpo" and cfg.preference.reference == "base" and cfg.grpo.beta == 0
    assert [r.name for r in cfg.grpo.rewards] == ["exact_match"]
    assert params.tokenize.seq_len < 2 * 54  # the bundled examples are 54-81 tokens: one per packed row


def test_the_held_out_reward_is_the_exact_match_of_the_stripped_completion():
    from fineflow.rewards import build_rewards

    b = bench()
    with build_rewards([{"name": "exact_match"}]) as rewards:
        assert b.exact_match_mean([" Paris", "Lyon ", "paris"], ["Paris", " Lyon", "Paris"], rewards) == 2 / 3
        assert b.exact_match_mean([], [], rewards) == 0.0


def test_prompts_are_batched_by_length_so_nothing_is_padded():
    b = bench()
    prompts = [[1, 2], [3], [4, 5], [6, 7, 8], [9, 10], [11]]
    batches = b.length_batches(prompts, size=2)
    assert sorted(i for batch in batches for i in batch) == list(range(len(prompts)))
    assert all(len({len(prompts[i]) for i in batch}) == 1 and len(batch) <= 2 for batch in batches)
    assert batches == [[1, 5], [0, 2], [4], [3]]


class _Tokenizer:
    eos_token_id, pad_token_id = 0, 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) == 0))


def test_greedy_completions_in_batches_are_each_prompts_own():
    """The scorer's unpadded same-length batches give every prompt the completion it gets alone."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    b = bench()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=64, eos_token_id=0, pad_token_id=0, bos_token_id=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12], [13, 14], [15]]
    together = b.greedy_completions(model, _Tokenizer(), prompts, max_new_tokens=5, size=4)
    alone = [b.greedy_completions(model, _Tokenizer(), [p], max_new_tokens=5)[0] for p in prompts]
    assert together == alone and all(together)


def _run(step_s, generate_s, tokens, reward=0.5, completions=16):
    steps = [
        {"step_s": s, "generate_s": g, "reward_s": 0.01, "train_s": s - g - 0.01, "completion_tokens": tokens,
         "completions": completions, "reward_mean": reward}
        for s, g in zip(step_s, generate_s)
    ]  # fmt: skip
    return {"steps": steps}


def test_the_summary_takes_the_median_step_after_the_first_and_tokens_per_generation_second():
    b = bench()
    x = b.summarize(_run([9.0, 1.0, 3.0, 2.0], [4.0, 0.5, 0.5, 1.0], tokens=60))
    assert x["step_median_s"] == 2.0 and x["total_s"] == 15.0 and x["steps"] == 4
    assert x["gen_tok_s"] == pytest.approx(240 / 6.0) and x["wall_tok_s"] == pytest.approx(240 / 15.0)
    assert x["train_reward"] == 0.5


def test_the_table_gives_both_sides_the_start_model_and_the_ratios():
    b = bench()
    ff, trl = b.summarize(_run([1, 0.5, 0.5], [0.2, 0.2, 0.2], 40)), b.summarize(_run([1, 1, 1], [0.4] * 3, 40))
    rounds = [{"fineflow": ff, "trl": trl} for _ in range(3)]
    heldout = {
        "start": 0.25,
        **{(i, "fineflow"): 0.5 for i in range(3)},
        **{(i, "trl"): v for i, v in enumerate((0.4, 0.45, 0.3))},
    }
    table = b.render_table(rounds, heldout)
    lines = table.splitlines()
    ratio = next(line for line in lines if line.startswith("fineflow / TRL"))
    assert ratio.split()[3:6] == ["0.50x", "0.67x", "0.50x"]  # s/step, total, generation seconds
    assert ratio.split()[-1] == "+0.100"  # held-out: fineflow 0.5 against TRL's median round 0.4
    assert next(line for line in lines if line.startswith("start model")).split()[-1] == "0.250"
    assert "trl: held-out reward per round 0.400, 0.450, 0.300" in table
    assert "fineflow: held-out reward the same every round" in table


@pytest.mark.nightly
def test_the_bench_runs_against_trl():
    """The bench end to end (a fresh project: the default base, SFT, both sides, the scorer): minutes, nightly, where
    the bench extra is installed; CI's venv has no TRL."""
    import subprocess

    pytest.importorskip("trl", reason="trl is the bench extra (pip install -e '.[bench]'): not installed here")
    command = [sys.executable, str(ROOT / "bench/grpo_trl_compare.py"), "--steps", "2", "--repeats", "1"]
    done = subprocess.run(command + ["--sft-steps", "20"], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "fineflow / TRL" in done.stdout and "prompt token ids identical" in done.stdout
