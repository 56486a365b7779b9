"""Every benchmark runs as its docstring says, and the pure parts of the benchmarks (no benchmark runs
here, only `--help` and one tiny learning-rate sweep): benchmarks/learning_efficiency.py and the
modules beside it that it imports (efficiency_tasks and the task files of benchmarks/tasks/,
efficiency_data, efficiency_runs, efficiency_report). benchmarks/adversarial.py's parts are tested in
tests/test_benchmark_adversarial.py.

An entry point of benchmarks/ is a module with `if __name__ == "__main__":` and a `Run` section in its
docstring; a module without that guard is a part that entry points import by name, and says so."""

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from crowdtrain.client.trainers import train
from crowdtrain.core.zoo import build_model, state_to_numpy
from crowdtrain.workgen.datasets import load_dataset, make_dataset
from tests.benchmark_modules import BENCHMARKS, load_benchmark

tasks = load_benchmark("efficiency_tasks")
runs = load_benchmark("efficiency_runs")
report = load_benchmark("efficiency_report")
generators = load_benchmark("efficiency_data")


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
    a, b, c = generators.tabular_arrays(0), generators.tabular_arrays(0), generators.tabular_arrays(1)
    for key in ("x", "y", "x_val", "y_val"):
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["x"], c["x"])
    assert a["x"].shape == (4000, 24) and a["x_val"].shape == (1000, 24)
    assert set(np.unique(a["y"])) == set(range(5)) == set(np.unique(a["y_val"]))
    data = make_dataset(a["x"], a["y"], a["x_val"], a["y_val"])  # the checks a job's dataset passes
    assert data.num_classes == 5


def test_image_generator_is_deterministic_in_its_seed_and_a_valid_dataset_of_images():
    a, b = generators.image_arrays(0, n_train=200, n_val=50), generators.image_arrays(0, n_train=200, n_val=50)
    c = generators.image_arrays(1, n_train=200, n_val=50)
    for key in ("x", "y", "x_val", "y_val"):
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["x"], c["x"])
    assert a["x"].shape == (200, 1, 16, 16) and a["x_val"].shape == (50, 1, 16, 16)
    data = make_dataset(a["x"], a["y"], a["x_val"], a["y_val"])
    assert data.num_classes == 10 and data.input_shape == [1, 16, 16]


def test_every_task_file_names_a_valid_job_and_generator(tmp_path):
    """The shipped task files load (their data generated, their job spec validated); the small
    ones are checked here end to end, the large ones up to their data."""
    assert {"mnist1d", "tabular", "tabular-large", "images"} <= set(tasks.known_tasks())
    for name in tasks.known_tasks():
        path, task_file, spec = tasks.read_task_file(name)
        assert path == tasks.TASKS_DIR / f"{name}.yaml" and 0 < task_file.target_accuracy <= 1
        assert task_file.data is None or task_file.data.generator in generators.GENERATORS
    mnist1d = tasks.make_task("mnist1d", tmp_path)
    assert mnist1d.spec == tasks.example_spec() and (mnist1d.target, mnist1d.budget_passes) == (0.9, 12)
    tabular = tasks.make_task(str(tasks.TASKS_DIR / "tabular.yaml"), tmp_path, budget_passes=3)  # a path works too
    assert (tabular.name, tabular.target, tabular.budget_passes) == ("tabular", 0.88, 3)
    assert (tabular.spec["model"]["name"], tabular.spec["model"]["options"]) == ("mlp", {"hidden": [64, 64]})
    assert tabular.spec["training"]["lr"] == 0.001 and tabular.spec["training"]["batch_size"] == 32, "merged"
    data = load_dataset(tabular.spec["dataset"]["source"])
    np.testing.assert_array_equal(data.x, generators.tabular_arrays(0)["x"])


GOOD_TASK = {
    "target_accuracy": 0.8,
    "extends": str(tasks.EXAMPLE_SPEC),
    "job": {"model": {"name": "mlp", "options": {"hidden": [8]}}},
    "data": {"generator": "tabular", "params": {"n_train": 300, "n_val": 100}},
}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"target_accuracy": 1.5}, "target_accuracy"),
        ({"budget_pases": 3}, "budget_pases"),
        ({"job": {"training": {"lr": -1}}}, "job.training.lr"),
        ({"data": {"generator": "no-such-generator"}}, "data.generator"),
        ({"data": {"generator": "tabular", "params": {"rows": 10}}}, "data.params"),
        ({"extends": "no-such-spec.yaml"}, "extends"),
    ],
)
def test_a_bad_task_file_is_an_error_naming_the_file_and_the_field(tmp_path, change, field):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(GOOD_TASK))
    assert tasks.make_task(str(path), tmp_path).target == 0.8  # the file is good but for the change
    path.write_text(yaml.safe_dump(GOOD_TASK | change))
    with pytest.raises(ValueError, match=rf"bad\.yaml: .*{re.escape(field)}"):
        tasks.make_task(str(path), tmp_path)


def test_an_unknown_task_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="no task 'no-such-task'.*mnist1d"):
        tasks.read_task_file("no-such-task")


def test_bound_learning_rates_are_the_job_rate_scaled_by_1_sqrt_t_and_t_within_the_spec_limit():
    assert tasks.bound_lrs(0.01, 4) == pytest.approx([0.01, 0.02, 0.04])
    assert tasks.bound_lrs(0.01, 1) == [0.01]
    assert tasks.bound_lrs(0.5, 64) == pytest.approx([0.5, 4.0, 10.0])


def test_best_of_sweep_is_the_fewest_examples_to_target_else_the_best_accuracy():
    def run(lr, examples, best):
        return {"lr": lr, "examples_to_target": examples, "best_accuracy": best}

    assert report.best_of_sweep([run(0.1, 9000, 0.95), run(0.2, 6000, 0.91), run(0.4, None, 0.97)])["lr"] == 0.2
    assert report.best_of_sweep([run(0.1, None, 0.5), run(0.2, None, 0.7), run(0.4, None, None)])["lr"] == 0.2


def test_large_batch_bound_runs_each_learning_rate_and_keeps_the_one_that_reached_the_target_first(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(GOOD_TASK | {"target_accuracy": 0.5}))
    task = tasks.make_task(str(path), tmp_path)  # Adam lr 0.01: lr x T of 4 and 16 slots reach 0.5 sooner
    bound = runs.large_batch_bound(task, 4, 0, passes=20, eval_every=60)
    assert [r["lr"] for r in bound["sweep"]] == pytest.approx(tasks.bound_lrs(0.01, 4))
    assert all(r["batch_size"] == 4 * 32 for r in bound["sweep"])
    reached = [r["examples_to_target"] for r in bound["sweep"] if r["examples_to_target"] is not None]
    assert reached and bound["examples_to_target"] == min(reached)
    assert bound["lr"] == next(r["lr"] for r in bound["sweep"] if r["examples_to_target"] == min(reached))


def test_bound_ratio_and_speedup_from_given_figures():
    bound = {"examples_to_target": 6000, "lr": 0.04}
    assert report.against_bound(9000, bound) == {"bound_examples": 6000, "bound_lr": 0.04, "bound_ratio": 1.5}
    assert report.against_bound(None, bound)["bound_ratio"] is None
    assert report.against_bound(9000, bound | {"examples_to_target": None})["bound_ratio"] is None
    assert (
        report.speedup(120.0, 20.0) == 6.0 and report.speedup(None, 20.0) is None and report.speedup(9.0, None) is None
    )
    # one process in the simulator's timing model: example_seconds per example, nothing else
    fleet = runs.Fleet()
    assert runs.one_process_seconds(8000) == pytest.approx(8000 * fleet.example_seconds)
    assert runs.one_process_seconds(None) is None


def test_summary_bound_ratio_needs_every_seed_and_its_bound():
    ok = {"task": "t", "rule": "r", "mode": "sim", "slots": 8, "status": "ok", "note": "", "ratio": 2.0}
    both = [ok | {"seed": 0, "bound_ratio": 1.2, "speedup": 3.0}, ok | {"seed": 1, "bound_ratio": 1.4, "speedup": 5.0}]
    s = report.summarize(both)[0]
    assert s["bound_ratio"] == pytest.approx(1.3) and s["speedup"] == pytest.approx(4.0)
    assert report.summarize([both[0], ok | {"seed": 1, "bound_ratio": None}])[0]["bound_ratio"] is None


def test_staleness_and_evaluation_gap():
    assert report.staleness_figures([0, 2, 4, 6]) == {"staleness_mean": 3, "staleness_max": 6}
    assert report.staleness_figures([]) == {"staleness_mean": None, "staleness_max": None}
    points = [(100, 0.5), (150, 0.7), (300, 0.9), (320, 0.95)]
    assert report.eval_gap(points, 300) == 0.5  # 150 -> 300 of 300
    assert report.eval_gap(points, None) is None


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


def test_a_rule_in_rounds_gets_rounds_of_the_runs_slots():
    task = tasks.Task("mnist1d", tasks.example_spec(), 0.9, budget_passes=1)
    for rule in ("rounds", "rounds-0.35"):
        spec = tasks.job_spec(task, rule, 0, 5, False, slots=64)
        assert (spec["assimilation"]["buffer_size"], spec["scheduling"]["rounds"]) == (64, True)
        assert tasks.unsupported_reason(spec) is None
    plain = tasks.job_spec(task, "fedbuff", 0, 5, False, slots=64)
    assert (plain["assimilation"]["buffer_size"], plain["scheduling"]["rounds"]) == (2, False)


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


def test_learning_efficiency_hands_over_every_run_as_it_ends_and_marks_its_output_whole_at_the_end(tmp_path):
    """A long benchmark stopped part way keeps what it measured: `run` gives its progress callback the
    rows so far after each run (with their bound ratios), and `--out` holds them, marked partial until
    the last run is in."""
    efficiency = load_benchmark("learning_efficiency")
    argv = ["--tasks", "tabular", "--rules", "vc-asgd,delta", "--slots", "", "--sim-slots", "2", "--budget-passes", "1"]
    args = efficiency.parse_args(argv)
    seen: list[list[str]] = []
    rows, singles = efficiency.run(
        args,
        [tasks.make_task("tabular", tmp_path, 1)],
        tmp_path,
        lambda rows, singles: seen.append([r["rule"] for r in rows]),
    )
    assert seen == [["vc-asgd"], ["vc-asgd", "delta"]]
    assert [r["rule"] for r in rows] == ["vc-asgd", "delta"] and set(singles) == {"baseline", "bound"}
    assert all("bound_examples" in r for r in rows if r["status"] in ("ok", "not reached"))
    out = tmp_path / "out.json"
    efficiency.main([*argv, "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["partial"] is False and [r["rule"] for r in written["runs"]] == ["vc-asgd", "delta"]
