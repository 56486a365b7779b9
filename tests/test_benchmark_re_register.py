"""The `re-register` strategy of benchmarks/adversarial.py: its garbage upload, and a summary that counts
the hosts it registered and whose goal allows it no credit."""

import numpy as np

from tests.benchmark_modules import load_benchmark

hostile_strategies = load_benchmark("hostile_strategies")
adversarial_summary = load_benchmark("adversarial_summary")


def test_garbage_changes_every_float_tensor_and_keeps_the_others():
    base = {"w": np.zeros((4, 3), np.float32), "n": np.array([7], np.int64)}
    out = hostile_strategies.garbage(base, np.random.default_rng(0))
    assert out["w"].dtype == np.float32 and np.all(out["w"] != 0) and np.std(out["w"]) > 0.05
    assert out["n"].tolist() == [7]


def test_re_register_summary_counts_its_hosts_and_its_goal_needs_no_credit():
    def row(strategy: str, credit: float | None = None, hosts: int = 1) -> dict:
        figures = {
            "strategy": strategy,
            "seed": 0,
            "job_status": "succeeded",
            "examples_to_target": 20000,
            "examples_trained_to_target": 20000,
            "seconds_to_target": 10.0,
            "honest_refused": 0,
        }
        if credit is None:
            return figures
        return figures | {
            "hostile_attacks": 6,
            "hostile_merged": 0,
            "hostile_attacks_merged": 0,
            "hostile_validated": 0,
            "hostile_results": {"rejected": 6},
            "hostile_reputation": 0.12,
            "hostile_credit": credit,
            "hostile_attack_credit": credit,
            "hostile_quarantined": True,
            "hostile_hosts_registered": hosts,
        }

    clean = [row("clean"), row("clean-unvalidated")]
    [summary] = adversarial_summary.summarize([*clean, row("re-register", 0.0, hosts=9)])[2:]
    assert (summary["hostile_hosts_registered"], summary["goal_met"]) == (9, True)
    [credited] = adversarial_summary.summarize([*clean, row("re-register", 0.4)])[2:]
    assert not credited["goal_met"], "credit for garbage"
