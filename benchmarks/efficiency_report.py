"""The figures of benchmarks/learning_efficiency.py and how they are shown: the pure measures of a
run's examples-vs-accuracy curve, a run against its single-process baseline, the summary over seeds,
and the table and progress lines on stderr. Not a benchmark of its own: learning_efficiency.py
imports it."""

import re
import statistics
import sys

import numpy as np
from rich.console import Console
from rich.table import Table

from efficiency_tasks import DEFAULT_RULE, Task

console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


def say(msg: str) -> None:
    console.print(msg, highlight=False, markup=False)


# ---------------------------------------------------------------- pure measures


def examples_to_target(points: list[tuple[int, float]], target: float) -> int | None:
    """The examples at the first point (in order of examples) whose accuracy is >= `target`; None if none is."""
    for examples, accuracy in sorted(points, key=lambda p: p[0]):
        if accuracy >= target:
            return int(examples)
    return None


def best_accuracy(points: list[tuple[int, float]], max_examples: int | None = None) -> float | None:
    """The best accuracy among points with at most `max_examples` examples (all points if None)."""
    within = [a for e, a in points if max_examples is None or e <= max_examples]
    return max(within) if within else None


def merge_curve(merged: list[tuple[int, int]], metrics: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(examples merged so far, accuracy) per metric: `merged` holds (merged_version, examples) of
    each merged result, `metrics` (param_version, accuracy) of each evaluation of W_s."""
    versions = np.array(sorted(v for v, _ in merged), dtype=np.int64)
    cumulative = np.cumsum([e for _, e in sorted(merged)], dtype=np.int64)
    curve = []
    for version, accuracy in sorted(metrics, key=lambda m: m[0]):
        upto = int(np.searchsorted(versions, version, side="right"))
        curve.append((int(cumulative[upto - 1]) if upto else 0, float(accuracy)))
    return curve


def ratio(examples: int | None, baseline: int | None) -> float | None:
    return None if examples is None or not baseline else round(examples / baseline, 3)


def eval_gap(points: list[tuple[int, float]], reached: int | None) -> float | None:
    """The largest gap between successive evaluations up to `reached` examples (from 0), as a fraction
    of `reached`: how finely a curve locates its examples to target (None when not reached)."""
    if not reached:
        return None
    seen = sorted({0, *(e for e, _ in points if e <= reached)})
    return round(max(b - a for a, b in zip(seen, seen[1:], strict=False)) / reached, 4)


def best_of_sweep(runs: list[dict]) -> dict:
    """The best run of a learning-rate sweep: the fewest examples to target among those that reached
    it; when none did, the best accuracy."""
    reached = [r for r in runs if r["examples_to_target"] is not None]
    if reached:
        return min(reached, key=lambda r: r["examples_to_target"])
    return max(runs, key=lambda r: r["best_accuracy"] if r["best_accuracy"] is not None else -1.0)


def against_bound(examples: int | None, bound: dict) -> dict:
    """A run's examples to target against the large-batch bound at its slot count."""
    return {
        "bound_examples": bound["examples_to_target"],
        "bound_lr": bound["lr"],
        "bound_ratio": ratio(examples, bound["examples_to_target"]),
    }


def speedup(one_process_seconds: float | None, slots_seconds: float | None) -> float | None:
    """Wall-time speedup of T slots over one process, each to the target (None unless both reached it)."""
    return round(one_process_seconds / slots_seconds, 2) if one_process_seconds and slots_seconds else None


def staleness_figures(staleness: list[int]) -> dict:
    """Mean and max staleness of a run's merged results (None when nothing was merged)."""
    if not staleness:
        return {"staleness_mean": None, "staleness_max": None}
    return {"staleness_mean": round(statistics.mean(staleness), 2), "staleness_max": int(max(staleness))}


UPLOAD_LINE = re.compile(r"assignment (\d+): result uploaded \((\d+) bytes")


def upload_sizes(log_text: str) -> dict[int, int]:
    """Bytes of each uploaded result, by assignment id, from the scheduler's log."""
    return {int(a): int(b) for a, b in UPLOAD_LINE.findall(log_text)}


def compare_to_baseline(curve: list[tuple[int, float]], task: Task, base: dict) -> dict:
    """A run's curve against its baseline: examples to target, ratio, best accuracies."""
    reached = examples_to_target(curve, task.target)
    row = {
        "examples_to_target": reached,
        "baseline_examples": base["examples_to_target"],
        "ratio": ratio(reached, base["examples_to_target"]),
        "best_accuracy": best_accuracy(curve),
        "best_accuracy_within_baseline_budget": best_accuracy(curve, base["budget_examples"]),
        "baseline_best_accuracy": base["best_accuracy"],
        "examples_seen": curve[-1][0] if curve else 0,
    }
    if base["examples_to_target"] is None:
        return row | {"status": "not reached", "note": "the single process did not reach the target"}
    if reached is None:
        return row | {
            "status": "not reached",
            "note": f"target {task.target} not reached in {row['examples_seen']} examples",
        }
    return row | {"status": "ok", "note": ""}


def describe(row: dict) -> str:
    """A row's figures in one progress line."""
    return (
        f"{row['status']}; ratio {row.get('ratio')}, best {row.get('best_accuracy')}, "
        f"{row.get('merges', '-')} merges, {row.get('bytes_per_merge', '-')} B/merge {row.get('note', '')}"
    )


# ---------------------------------------------------------------- summary and table


SUMMED = (
    "examples_to_target",
    "baseline_examples",
    "best_accuracy",
    "best_accuracy_within_baseline_budget",
    "baseline_best_accuracy",
    "merges",
    "wall_seconds",
    "wall_seconds_to_target",
    "bytes_per_merge",
    "param_bytes",
    "simulated_seconds_to_target",
    "one_process_seconds_to_target",
    "speedup",
    "staleness_mean",
    "staleness_max",
    "bound_examples",
)


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.mean(present), 4) if present else None


def _all_or_none(values: list) -> float | None:
    return _mean(values) if values and None not in values else None


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (task, rule, mode, slots): means over seeds. The ratio is the mean over seeds
    only when every seed reached the target, and the bound ratio only when every seed's bound did
    too; otherwise it is null and the note says how many did."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["rule"], r["mode"], r["slots"]), []).append(r)
    out = []
    for (task, rule, mode, slots), rs in groups.items():
        ran = [r for r in rs if r["status"] in ("ok", "not reached")]
        reached = [r for r in ran if r["status"] == "ok"]
        every = bool(ran) and len(reached) == len(ran)
        s = {
            "task": task,
            "rule": rule,
            "mode": mode,
            "slots": slots,
            "seeds": len(rs),
            "reached": len(reached),
            "ratio": _mean([r["ratio"] for r in reached]) if every else None,
            "bound_ratio": _all_or_none([r.get("bound_ratio") for r in reached]) if every else None,
            **{k: _mean([r.get(k) for r in ran]) for k in SUMMED},
        }
        if not ran:  # unsupported, unavailable or failed: say why
            s |= {"status": rs[0]["status"], "note": rs[0]["note"]}
        elif every:
            s |= {"status": "ok", "note": ""}
        else:
            s |= {
                "status": "not reached",
                "note": f"target reached in {len(reached)} of {len(ran)} seeds: "
                + "; ".join(r["note"] for r in ran if r["note"]),
            }
        out.append(s)
    return out


def _cell(v) -> str:
    return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def print_summary_table(title: str, columns: dict[str, str], summary: list[dict]) -> None:
    """`summary` as a table on stderr, one row per entry: `columns` maps each key to its heading
    (a missing or None value shows as -)."""
    t = Table(title=title)
    for heading in columns.values():
        t.add_column(heading)
    for s in summary:
        t.add_row(*(_cell(s.get(c)) for c in columns))
    console.print(t)


def print_table(summary: list[dict]) -> None:
    cols = {
        "task": "task",
        "rule": "rule",
        "mode": "mode",
        "slots": "slots",
        "ratio": "ratio",
        "bound_ratio": "/bound",
        "examples_to_target": "examples",
        "baseline_examples": "1-process",
        "best_accuracy": "best acc",
        "best_accuracy_within_baseline_budget": "best in 1-p budget",
        "baseline_best_accuracy": "1-p best",
        "merges": "merges",
        "staleness_mean": "τ mean",
        "staleness_max": "τ max",
        "wall_seconds": "wall s",
        "bytes_per_merge": "B/merge",
        "speedup": "speedup vs 1-p",
        "status": "status",
    }
    title = "learning efficiency: examples to target / single-process examples (/bound: / large-batch bound's)"
    print_summary_table(title, cols, summary)
    for s in summary:
        if s["note"]:
            say(f"  {s['task']} {s['rule']} {s['mode']} {s['slots']}: {s['note']}")


def headline(summary: list[dict], task: str, mode: str, slots: int, key: str = "ratio") -> float | None:
    """The default rule's figure `key` for `task` at `slots` slots in `mode` (None when not measured or not reached)."""
    return next(
        (s[key] for s in summary if (s["task"], s["rule"], s["mode"], s["slots"]) == (task, DEFAULT_RULE, mode, slots)),
        None,
    )
