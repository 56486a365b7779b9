"""The pure parts of benchmarks/adversarial.py (no benchmark runs here): its forged updates
(hostile_strategies) and its summary (adversarial_summary)."""

import numpy as np
import pytest

from tests.benchmark_modules import load_benchmark

hostile_strategies = load_benchmark("hostile_strategies")
adversarial_summary = load_benchmark("adversarial_summary")


def test_forged_updates_are_what_each_strategy_says_of_the_honest_update():
    rng = np.random.default_rng(0)
    base = {"w": np.array([1.0, 1.0, 1.0], np.float32), "n": np.array(7, np.int64)}
    honest = {"w": np.array([1.0, 3.0, 1.0], np.float32), "n": np.array(7, np.int64)}  # Δ = (0, 2, 0)
    np.testing.assert_allclose(hostile_strategies.sign_flipped(base, honest, rng)["w"], [1.0, -1.0, 1.0])
    np.testing.assert_allclose(hostile_strategies.scaled(base, honest, rng)["w"], [1.0, 21.0, 1.0])
    noisy = hostile_strategies.noise(base, honest, rng)
    assert np.linalg.norm(noisy["w"] - base["w"]) == pytest.approx(2.0, rel=1e-5), "noise of the honest norm"
    assert all(f["n"] == 7 for f in (noisy, hostile_strategies.scaled(base, honest, rng))), "integer tensors kept"


def test_a_colluding_pair_shares_its_direction_per_workunit():
    base = {"w": np.full(50, 2.0, np.float32), "n": np.array(7, np.int64)}
    d = hostile_strategies.shared_direction(base, 3, 11)
    again = hostile_strategies.shared_direction(base, 3, 11)
    assert np.array_equal(d["w"], again["w"]), "both hosts of the pair draw the same d"
    assert "n" not in d and np.linalg.norm(d["w"]) == pytest.approx(hostile_strategies.PAIR_STEP * np.sqrt(200))
    other = hostile_strategies.shared_direction(base, 3, 12)["w"]
    assert abs(float(other @ d["w"])) < 0.5 * float(d["w"] @ d["w"]), "another workunit, another direction"


def test_the_permuted_labels_move_every_class():
    perm = hostile_strategies.class_derangement(10, np.random.default_rng(0))
    assert sorted(perm) == list(range(10)) and not np.any(perm == np.arange(10))


def test_adversarial_summary_ratio_is_against_the_clean_run_and_the_goal_needs_no_credit_for_replay():
    def row(strategy, examples, **extra):
        return {
            "strategy": strategy,
            "seed": 0,
            "job_status": "succeeded",
            "examples_to_target": examples,
            "examples_trained_to_target": examples,
            "seconds_to_target": 10.0,
            "honest_refused": 0,
        } | extra

    hostile = {
        "hostile_attacks": 5,
        "hostile_merged": 0,
        "hostile_attacks_merged": 0,
        "hostile_validated": 0,
        "hostile_results": {"rejected": 5},
        "hostile_reputation": 0.2,
        "hostile_credit": 1.0,
        "hostile_quarantined": True,
    }
    rows = [
        row("clean", 20000),
        row("clean-unvalidated", 25000),
        row("lazy", 24000, **hostile, hostile_attack_credit=0.0),
        row("replay", 22000, **hostile, hostile_attack_credit=0.5),
        row("noise", 30000, **hostile, hostile_attack_credit=0.0),
        row("scaled", None, **hostile, hostile_attack_credit=0.0, job_status="timeout"),
    ]
    by = {s["strategy"]: s for s in adversarial_summary.summarize(rows)}
    assert by["lazy"]["ratio"] == 1.2 and by["lazy"]["ratio_to_unvalidated"] == 0.96 and by["lazy"]["goal_met"]
    assert by["replay"]["ratio"] == 1.1 and not by["replay"]["goal_met"], "credit for a replayed result"
    assert by["noise"]["ratio"] == 1.5 and not by["noise"]["goal_met"]
    assert by["scaled"]["ratio"] is None and not by["scaled"]["goal_met"]
    assert "goal_met" not in by["clean"]
