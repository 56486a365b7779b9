"""benchmarks/choosing_table.py: the merge-rule table of docs/operator/choosing-a-mode.md is the
rendering of the evidence file, the evidence ranks the rules as its docstring says, and the example
job's rule (the default) is the best rule of the evidence that does not need the slot count."""

import json

import pytest

from tests.benchmark_modules import load_benchmark

table = load_benchmark("choosing_table")
tasks = load_benchmark("efficiency_tasks")


def _row(task: str, rule: str, status: str = "ok", ratio: float | None = 2.0, **kw) -> dict:
    return {
        "task": task,
        "rule": rule,
        "mode": "sim",
        "slots": 8,
        "status": status,
        "ratio": ratio if status == "ok" else None,
        "bound_ratio": None,
        "best_accuracy": 0.9,
        "last_accuracy": 0.9,
        "examples_seen": 1000,
        "baseline_examples": 100,
    } | kw


def test_rules_rank_by_tasks_missed_then_geometric_mean_with_a_miss_counting_its_examples():
    rows = [
        _row("a", "steady", ratio=2.0),
        _row("b", "steady", ratio=8.0),  # geometric mean 4
        _row("a", "fast-once", ratio=1.0),
        _row("b", "fast-once", status="not reached", examples_seen=500),  # 1 and 5: 2.24, but one missed
        _row("a", "uneven", ratio=1.0),
        _row("b", "uneven", ratio=25.0),  # geometric mean 5
        _row("a", "partial", ratio=1.0),  # never ran b: last
    ]
    ranked = table.ranking(rows, ["a", "b"])
    assert [r["rule"] for r in ranked] == ["steady", "uneven", "fast-once", "partial"]
    assert [r["score"] for r in ranked[:3]] == [4.0, 5.0, pytest.approx(2.236, abs=1e-3)]
    assert [r["missed"] for r in ranked] == [0, 0, 1, 1]


def test_the_default_is_the_best_rule_that_does_not_need_the_slot_count():
    rows = [_row("a", "rounds", ratio=1.1), _row("a", "delta", ratio=3.0), _row("a", "default", ratio=4.0)]
    assert table.needs_slot_count("rounds") and not table.needs_slot_count("delta")
    assert table.best_eligible(rows) == "delta"
    assert table.best_eligible(rows, mode="real") is None


def test_a_cell_shows_the_ratio_and_bound_or_how_far_the_rule_got_and_whether_it_fell_back():
    assert table.cell(_row("a", "r", ratio=1.234, bound_ratio=1.1)) == "1.23 (1.10x)"
    assert table.cell(_row("a", "r", status="not reached", best_accuracy=0.81, last_accuracy=0.8)) == (
        "not reached (0.810)"
    )
    fell = _row("a", "r", status="not reached", best_accuracy=0.58, last_accuracy=0.13)
    assert table.cell(fell) == "not reached (0.580), unstable: fell to 0.130"
    some = _row("a", "r", status="not reached", best_accuracy=0.879, seeds=2, reached=1)
    assert table.cell(some) == "reached in 1 of 2 seeds (0.879)"
    assert table.cell(_row("a", "r", status="error")) == "error"
    assert table.cell(None) == "-"


def test_a_run_folds_in_replacing_its_own_rows_and_taking_the_last_accuracy_from_its_curves():
    output = {
        "default_assimilation": {"rule": "vc-asgd", "schedule": "constant", "alpha": 0.6},
        "results": [
            {"task": "a", "rule": "delta", "mode": "sim", "slots": 8, "status": "not reached", "ratio": None},
            {"task": "b", "rule": "default", "mode": "sim", "slots": 8, "status": "ok", "ratio": 3.0},
        ],
        "runs": [
            {
                "task": "a",
                "rule": "delta",
                "mode": "sim",
                "slots": 8,
                "examples_seen": 90,
                "curve": [[10, 0.5], [90, 0.2]],
            },
            {"task": "b", "rule": "default", "mode": "sim", "slots": 8, "examples_seen": 30, "curve": [[30, 0.9, 1.0]]},
        ],
    }
    rows = table.rows_of(output)
    # The run's default is named by the configuration it was then: the paper's rule, vc-asgd α 0.6.
    assert [(r["task"], r["rule"], r["last_accuracy"], r["examples_seen"]) for r in rows] == [
        ("a", "delta", 0.2, 90),
        ("b", "vc-asgd", 0.9, 30),
    ]
    old = [_row("a", "delta", ratio=9.0), _row("c", "delta", ratio=1.0)]
    folded = table.fold(old, rows)
    assert {(r["task"], r["rule"], r["status"]) for r in folded} == {
        ("a", "delta", "not reached"),
        ("b", "vc-asgd", "ok"),
        ("c", "delta", "ok"),
    }


def test_configurations_are_named_by_what_they_set_with_the_fields_defaults_filled_in():
    assert table.named({"rule": "vc-asgd", "alpha": 0.6}) == "vc-asgd"
    assert table.named(tasks.example_spec()["assimilation"]) == "delta-poly-loss"
    assert table.named({"rule": "vc-asgd", "alpha": 0.33}) is None


def test_the_document_holds_the_rendering_of_the_evidence(capsys):
    table.main(["--check"])  # exits 1 when the document's table is not the evidence's rendering
    assert json.loads(capsys.readouterr().out)["up_to_date"] is True


def test_the_example_jobs_rule_stands_as_the_default_on_the_evidence():
    rows = json.loads(table.EVIDENCE.read_text())["rows"]
    default = table.named(tasks.assimilation_for(tasks.DEFAULT_RULE))
    assert default is not None and table.stands(rows, default)


def test_a_default_stands_only_while_it_misses_no_more_tasks_and_scores_within_the_tie_of_the_best():
    rows = [
        _row("a", "best", ratio=2.0),
        _row("a", "close", ratio=2.0 * (1 + table.TIE) - 0.01),
        _row("a", "far", ratio=2.0 * (1 + table.TIE) + 0.01),
        _row("a", "rounds", ratio=1.0),  # better, but needs the slot count: not the one to tie with
        _row("b", "best", ratio=2.0),
        _row("b", "close", ratio=2.0),
        _row("b", "far", ratio=2.0 * (1 + table.TIE) + 0.01),
        _row("b", "rounds", ratio=1.0),
        _row("a", "missing", ratio=1.0),
        _row("b", "missing", status="not reached", examples_seen=150),  # a better score, one task missed
    ]
    assert table.best_eligible(rows) == "best"
    assert [table.stands(rows, r) for r in ("best", "close", "far", "rounds", "missing", "unknown")] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]


def test_a_document_without_the_generated_block_is_an_error_naming_the_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# no table here\n")
    with pytest.raises(SystemExit, match="no generated merge-rule table"):
        table.main(["--check", "--document", str(doc)])


def test_a_task_only_one_rule_ran_neither_beats_nor_saves_the_default():
    """The default missed a task the others have not run: they are compared on the tasks both ran."""
    rows = [
        _row("a", "default", ratio=2.0),
        _row("a", "other", ratio=2.1),
        _row("b", "default", status="not reached", examples_seen=500),
        _row("c", "other", ratio=1.0),
    ]
    assert not table.beats(rows, "default", "other") and table.stands(rows, "default")
    rows.append(_row("b", "other", ratio=3.0))  # now it has run b, and reached it
    assert table.beats(rows, "default", "other") and not table.stands(rows, "default")
    assert table.beaten_by(rows, "default") == "other"
