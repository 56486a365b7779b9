"""Every benchmark runs as its docstring says, and the pure parts of the benchmarks (no benchmark runs
here, only `--help`): benchmarks/learning_efficiency.py and the modules beside it that it imports
(efficiency_tasks, efficiency_runs, efficiency_report), and benchmarks/adversarial.py (its forged
updates, hostile_strategies, and its summary, adversarial_summary).

An entry point of benchmarks/ is a module with `if __name__ == "__main__":` and a `Run` section in its
docstring; a module without that guard is a part that entry points import by name, and says so."""

import ast
import importlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from crowdtrain.client.trainers import train
from crowdtrain.core.zoo import build_model, state_to_numpy
from crowdtrain.workgen.datasets import make_dataset

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    """benchmarks/NAME.py, imported as `python benchmarks/learning_efficiency.py` imports it: with its
    folder first on sys.path, so that the modules beside it import by name."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


tasks = _load("efficiency_tasks")
runs = _load("efficiency_runs")
report = _load("efficiency_report")


ROOT = BENCHMARKS.parent
MAIN_GUARD = 'if __name__ == "__main__":'
MODULES = sorted(BENCHMARKS.glob("*.py"))
ENTRY_POINTS = [m for m in MODULES if MAIN_GUARD in m.read_text()]


def _run_commands(module: Path) -> list[list[str]]:
    """The commands of the module docstring's `Run` section (its lines naming a file of benchmarks/)."""
    doc = ast.get_docstring(ast.parse(module.read_text())) or ""
    _, found, section = doc.partition("\nRun\n")
    lines = section.split("\n\n", 1)[0].splitlines() if found else []
    return [shlex.split(line.split("#", 1)[0]) for line in lines if "benchmarks/" in line]


def _imported(module: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("script", ENTRY_POINTS, ids=lambda p: p.stem)
def test_each_benchmark_runs_its_help_as_its_docstring_says(script: Path) -> None:
    """As documented: `.venv/bin/python benchmarks/NAME.py ...` from the repository root, and nothing set
    in the environment (no PYTHONPATH): the modules beside it import by name, the package as installed."""
    commands = _run_commands(script)
    assert commands, f"{script.name}: its docstring has no `Run` section naming its command"
    for argv in commands:
        assert argv[:2] == [".venv/bin/python", f"benchmarks/{script.name}"], " ".join(argv)
    venv_python = ROOT / ".venv" / "bin" / "python"
    python = str(venv_python) if venv_python.exists() else sys.executable
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [python, f"benchmarks/{script.name}", "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]


def test_no_benchmark_imports_the_test_tree() -> None:
    importing = {m.name for m in MODULES if any(n == "tests" or n.startswith("tests.") for n in _imported(m))}
    assert not importing, f"benchmarks importing `tests`: {sorted(importing)}"


def test_a_benchmark_module_without_a_main_guard_is_a_part_an_entry_point_imports() -> None:
    """Telling entry points apart: a part has no `Run` section, and some benchmark imports it by name."""
    imported_here = set().union(*(_imported(m) for m in MODULES))
    for part in (m for m in MODULES if m not in ENTRY_POINTS):
        assert not _run_commands(part), f"{part.name} says how to run it but has no `{MAIN_GUARD}`"
        assert part.stem in imported_here, f"{part.name}: neither an entry point nor imported by one"


def test_examples_to_target_is_the_first_point_at_or_above_the_target_in_order_of_examples():
    points = [(3000, 0.91), (1000, 0.5), (2000, 0.90), (4000, 0.95)]
    assert report.examples_to_target(points, 0.90) == 2000
    assert report.examples_to_target(points, 0.95) == 4000
    assert report.examples_to_target(points, 0.96) is None
    assert report.examples_to_target([], 0.5) is None


def test_best_accuracy_within_a_budget_of_examples():
    points = [(1000, 0.5), (2000, 0.8), (3000, 0.7), (4000, 0.9)]
    assert report.best_accuracy(points) == 0.9
    assert report.best_accuracy(points, max_examples=3000) == 0.8
    assert report.best_accuracy(points, max_examples=500) is None


def test_merge_curve_pairs_each_evaluation_with_the_examples_merged_up_to_its_version():
    merged = [(2, 2000), (1, 2000), (3, 1500), (5, 2000)]  # (merged_version, examples), any order
    metrics = [(1, 0.4), (3, 0.6), (2, 0.5), (5, 0.8)]  # version 4 was not evaluated
    assert report.merge_curve(merged, metrics) == [(2000, 0.4), (4000, 0.5), (5500, 0.6), (7500, 0.8)]
    assert report.merge_curve(merged, [(0, 0.1)]) == [(0, 0.1)]
    assert report.merge_curve([], []) == []


@pytest.mark.parametrize(
    ("examples", "baseline", "expected"), [(9000, 6000, 1.5), (None, 6000, None), (9000, None, None), (6000, 6000, 1.0)]
)
def test_ratio_is_null_unless_both_reached(examples, baseline, expected):
    assert report.ratio(examples, baseline) == expected


def test_tabular_generator_is_deterministic_in_its_seed_and_a_valid_5_class_dataset():
    a, b, c = tasks.tabular_arrays(0), tasks.tabular_arrays(0), tasks.tabular_arrays(1)
    for key in ("x", "y", "x_val", "y_val"):
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["x"], c["x"])
    assert a["x"].shape == (4000, 24) and a["x_val"].shape == (1000, 24)
    assert set(np.unique(a["y"])) == set(range(5)) == set(np.unique(a["y_val"]))
    data = make_dataset(a["x"], a["y"], a["x_val"], a["y_val"])  # the checks a job's dataset passes
    assert data.num_classes == 5


def test_upload_sizes_read_from_scheduler_log_lines():
    log = (
        "2026-11-23 11:00:00 INFO crowdtrain.server.ledger.uploads: "
        "assignment 7: result uploaded (43960 bytes, loss 0.5), merge queued\n"
        "unrelated line\n"
        "2026-11-23 11:00:01 INFO crowdtrain.server.ledger.uploads: "
        "assignment 12: result uploaded (11000 bytes, loss None), merge queued\n"
    )
    assert report.upload_sizes(log) == {7: 43960, 12: 11000}


@pytest.mark.parametrize(
    ("slots", "per_client", "expected"), [(1, 4, [1]), (4, 4, [4]), (8, 4, [4, 4]), (6, 4, [4, 2])]
)
def test_client_slots_add_up(slots, per_client, expected):
    assert runs.client_slots(slots, per_client) == expected


def test_a_rule_the_code_does_not_know_is_unsupported_not_a_crash():
    task = tasks.Task("mnist1d", tasks.example_spec(), 0.9, budget_passes=1)
    assert tasks.unsupported_reason(tasks.job_spec(task, "vc-asgd", 0, 5, False)) is None
    bad = tasks.job_spec(task, "vc-asgd", 0, 5, False)
    bad["assimilation"] = {"rule": "no-such-rule"}
    assert "assimilation.rule" in tasks.unsupported_reason(bad)
    with pytest.raises(ValueError, match="--rules"):
        tasks.assimilation_for("no-such-configuration")


def test_default_rule_is_the_example_jobs_assimilation():
    assert tasks.assimilation_for(tasks.DEFAULT_RULE) == tasks.example_spec()["assimilation"]


def test_summary_ratio_is_null_and_says_so_when_a_seed_misses_the_target():
    ok = {"task": "t", "rule": "r", "mode": "real", "slots": 8, "status": "ok", "note": "", "ratio": 2.0}
    missed = ok | {
        "seed": 1,
        "status": "not reached",
        "note": "target 0.9 not reached in 80000 examples",
        "ratio": None,
    }
    unsupported = {
        "task": "t",
        "rule": "u",
        "mode": "real",
        "slots": 8,
        "seed": 0,
        "status": "unsupported",
        "note": "merge rule: unknown merge rule 'u'",
    }
    both = {s["rule"]: s for s in report.summarize([ok | {"seed": 0}, missed, unsupported])}
    assert both["r"]["ratio"] is None and both["r"]["reached"] == 1 and "1 of 2" in both["r"]["note"]
    assert both["u"]["status"] == "unsupported" and both["u"]["ratio"] is None
    assert report.summarize([ok | {"seed": 0}, ok | {"seed": 1, "ratio": 3.0}])[0]["ratio"] == 2.5
    assert report.headline(report.summarize([ok | {"seed": 0, "rule": tasks.DEFAULT_RULE}]), "t", "real", 8) == 2.0


def test_baseline_hook_evaluates_every_k_examples_in_one_training_call():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(100, 4)).astype(np.float32), rng.integers(0, 2, 100)
    config = {"name": "mlp", "input_shape": [4], "num_classes": 2, "options": {"hidden": [8]}}
    recipe = {
        "model": config,
        "seed": 0,
        "training": {
            "local_epochs": 3,
            "batch_size": 10,
            "optimizer": "adam",
            "lr": 0.01,
            "momentum": 0.0,
            "weight_decay": 0.0,
        },
    }
    seen = []
    hook = runs._EvaluateEvery(25, len(x), lambda params: seen.append(sorted(params)) or 0.5)
    train("pytorch", recipe, state_to_numpy(build_model("mlp", [4], 2, **config["options"])), x, y, checkpoint=hook)
    # every 25 examples, at the first batch boundary at or after it (an epoch's first batch is never one)
    assert [e for e, _ in hook.points] == [30, 50, 80, 110, 130, 150, 180, 210, 230, 250, 280]
    assert all(names == sorted(state_to_numpy(build_model("mlp", [4], 2, hidden=[8]))) for names in seen)


hostile_strategies = _load("hostile_strategies")
adversarial_summary = _load("adversarial_summary")


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
