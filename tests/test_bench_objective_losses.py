"""bench/objective_losses_trl.py, fineflow's objective losses against TRL's on one fixed batch: its batch, its two
layouts of that batch and its table's verdicts, without TRL (a bench-only extra); the bench itself where TRL is
importable."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def bench():
    """bench/objective_losses_trl.py as a module (bench/ is no package)."""
    if "objective_losses_trl" not in sys.modules:
        spec = importlib.util.spec_from_file_location("objective_losses_trl", ROOT / "bench/objective_losses_trl.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["objective_losses_trl"] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules["objective_losses_trl"]


def test_the_fixed_batch_has_unequal_lengths_and_margins_of_both_signs_for_every_pair_objective():
    import torch

    b = bench()
    batch = b.BATCHES["pairs"]
    assert batch == b.make_batch()  # seeded: the same batch every run
    assert len({len(a) for a in batch.chosen}) > 1 and len({len(a) for a in batch.rejected}) > 1
    assert any(len(c) != len(r) for c, r in zip(batch.chosen, batch.rejected))
    assert len({len(p) for p in batch.prompt}) > 1 and batch.pairs % b.PAIRS_PER_ROW  # a row holds a single pair
    for name, settings in (("dpo", {"beta": 0.1}), ("simpo", {"beta": 2.0}), ("orpo", {"orpo_lambda": 0.25})):
        side = b.fineflow_pair(name)(batch, settings, torch.float64)
        assert 0 < side.accuracy < 1, f"{name}: every margin has one sign ({side.accuracy})"
    # TRL's other log1mexp branch: an answer whose mean log-prob is above -ln 2
    assert any(sum(a) / len(a) > -math.log(2) for a in (*batch.chosen, *batch.rejected))
    aligned = b.BATCHES["orpo-aligned"]
    assert not any(aligned.prompt) and len({len(a) for a in aligned.chosen}) == 1


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_fineflows_packed_rows_and_trls_padded_sequences_hold_the_batchs_sums(dtype_name):
    """The two layouts the sides read: fineflow's pair_scores over packed rows and TRL's masked per-position
    log-probs give each answer's sum and length, in pair order."""
    import torch

    b = bench()
    dtype = getattr(torch, dtype_name)
    batch = b.BATCHES["pairs"]
    policy, reference = b.fineflow_scores(batch, dtype)

    def rounded(answers):  # each answer's sum of its log-probs as the dtype holds them
        return [math.fsum(torch.tensor(a, dtype=torch.float64).to(dtype).double().tolist()) for a in answers]

    assert policy.chosen.tolist() == pytest.approx(rounded(batch.chosen), abs=1e-12)
    assert policy.rejected.tolist() == pytest.approx(rounded(batch.rejected), abs=1e-12)
    assert reference.chosen.tolist() == pytest.approx(rounded(batch.ref_chosen), abs=1e-12)
    assert policy.chosen_len.tolist() == [len(a) for a in batch.chosen]
    assert policy.rejected_len.tolist() == [len(a) for a in batch.rejected]

    seq = b.trl_sequences(batch, dtype)
    shift = seq.completion_mask[:, 1:].bool()
    answers = (seq.policy.double() * shift).sum(dim=1).tolist()
    assert answers == pytest.approx(rounded(batch.chosen) + rounded(batch.rejected), abs=1e-5)
    assert shift.sum(dim=1).tolist() == [len(a) for a in (*batch.chosen, *batch.rejected)]
    # every predicted token of a chosen sequence (prompt after its first token, answer) and nothing past it
    predicted = seq.attention_mask[:, 1:].bool()
    assert predicted[: batch.pairs].sum(dim=1).tolist() == [len(p) + len(a) for p, a in zip(batch.prompt, batch.chosen)]
    assert not bool((seq.policy[~predicted] != 0).any())


def test_the_orpo_halves_from_the_registry_add_up_to_its_loss():
    import torch

    b = bench()
    batch, settings = b.BATCHES["pairs"], {"orpo_lambda": 0.25}
    nll, odds_ratio = b.fineflow_orpo_halves(batch, settings, torch.float64)
    assert nll + odds_ratio == pytest.approx(b.fineflow_pair("orpo")(batch, settings, torch.float64).loss, abs=1e-12)
    fineflows = b.orpo_nll_conventions(batch)["fineflow: pair mean of each chosen answer's token mean"]
    assert nll == pytest.approx(fineflows, abs=1e-12)


def test_the_table_judges_only_what_both_sides_computed():
    b = bench()
    comparison = b.COMPARISONS[0]
    close = b.Row(comparison, b.Side(0.5, 0.1, -0.1, 0.2, 0.5), b.Side(0.5 + 5e-6, 0.1, -0.1, 0.2, 0.5))
    apart = b.Row(comparison, b.Side(0.5, 0.1, -0.1, 0.2, 0.5), b.Side(0.5, 0.1, -0.1 + 2e-5, 0.2, 0.5))
    assert (close.verdict, close.failed) == ("yes", False)
    assert (apart.verdict, apart.failed) == ("NO", True)
    convention = b.Row(next(c for c in b.COMPARISONS if not c.judged), b.Side(0.9), b.Side(1.1))
    assert not convention.failed and convention.verdict.startswith("no (not judged")
    errored = b.Row(comparison, error="ImportError: x")
    assert errored.failed and errored.verdict.startswith("ERROR")
    # an objective fineflow lacks (the next one, before its module lands): TRL's figure alone, never a pass or failure
    [kto] = [c for c in b.COMPARISONS if c.name == "kto"]
    alone = b.Row(dataclasses.replace(kto, fineflow=None), None, b.Side(0.6, 0.1, -0.1, 0.2))
    assert (alone.verdict, alone.failed, alone.within) == ("not compared", False, False)
    table = b.render([close, apart, convention])
    assert "0.5000000000" in table and "NO" in table and "2.0e-05" in table


def test_fineflows_kto_side_equals_the_formula_the_bench_states():
    """Without TRL: the bench's fineflow KTO side (the registry's objective) against the script's plain-float
    formula of TRL's loss, on the fixed batch; the TRL side is compared where the bench extra is installed."""
    import torch

    b = bench()
    [kto] = [c for c in b.COMPARISONS if c.name == "kto"]
    batch = b.BATCHES[kto.batch]
    side = kto.fineflow(batch, kto.settings, torch.float64)
    assert side.loss == pytest.approx(b.kto_formula(*b.kto_inputs(batch), **kto.settings), abs=1e-12)


def test_fineflows_reward_model_side_is_the_objectives_loss_and_equals_the_plain_bradley_terry_formula():
    """Without TRL: the bench's fineflow reward-model side runs the reward_model objective's own loss, and on the
    fixed batch's rewards it equals the script's formula without TRL's extras; the row is judged, not a formula."""
    import torch

    b = bench()
    [rm] = [c for c in b.COMPARISONS if c.name == "rm: Bradley-Terry"]
    assert rm.fineflow is b.fineflow_reward_model and not rm.fineflow_is_formula and rm.judged
    batch = b.BATCHES[rm.batch]
    side, formula = rm.fineflow(batch, {}, torch.float64), b.bradley_terry_formula(batch, {}, torch.float64)
    assert (side.loss, side.margin, side.accuracy) == pytest.approx(
        (formula.loss, formula.margin, formula.accuracy), abs=1e-12
    )
    assert 0 < side.accuracy < 1


def test_the_bench_passes_against_trl():
    """The bench itself (seconds), where the bench extra is installed; CI's venv has no TRL."""
    pytest.importorskip("trl", reason="trl is the bench extra (pip install -e '.[bench]'): not installed here")
    assert bench().main(["--dtype", "both"]) == 0
