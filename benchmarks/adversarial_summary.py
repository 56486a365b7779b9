"""The summary of benchmarks/adversarial.py: its runs reduced to one row per strategy (means over
seeds, the ratio to the clean run, whether the goal is met) and printed as a table. No I/O but the
table."""

import statistics

from efficiency_report import print_summary_table, ratio

CLEAN, UNVALIDATED = "clean", "clean-unvalidated"
GOAL_RATIO = 1.3
# Strategies whose attacks must earn nothing.
NO_CREDIT_FOR = ("lazy", "lazy-unvalidated", "replay", "re-register", "colluding-pair")


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.mean(present), 3) if present else None


def summarize(rows: list[dict]) -> list[dict]:
    """One row per strategy: means over seeds; the ratio to `clean` (and to `clean-unvalidated`) is the
    ratio of mean examples to target, null unless every seed of both reached the target."""

    def every_seed(strategy: str) -> list[dict] | None:
        rs = [r for r in rows if r["strategy"] == strategy]
        return rs if rs and all(r["examples_to_target"] is not None for r in rs) else None

    out = []
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        rs = [r for r in rows if r["strategy"] == strategy]
        reached = every_seed(strategy)
        examples = _mean([r["examples_to_target"] for r in reached]) if reached else None
        clean, unvalidated = every_seed(CLEAN), every_seed(UNVALIDATED)
        s = {
            "strategy": strategy,
            "seeds": len(rs),
            "succeeded": sum(r["job_status"] == "succeeded" for r in rs),
            "examples_to_target": examples,
            "ratio": ratio(examples, _mean([r["examples_to_target"] for r in clean]) if clean else None),
            "ratio_to_unvalidated": ratio(
                examples, _mean([r["examples_to_target"] for r in unvalidated]) if unvalidated else None
            ),
            "examples_trained_to_target": _mean([r["examples_trained_to_target"] for r in rs]),
            "seconds_to_target": _mean([r["seconds_to_target"] for r in rs]),
            "honest_refused": sum(r["honest_refused"] for r in rs),
        }
        if "hostile_reputation" in rs[0]:
            s |= {
                "hostile_attacks": sum(r["hostile_attacks"] for r in rs),
                "hostile_merged": sum(r["hostile_merged"] for r in rs),
                "hostile_attacks_merged": sum(r["hostile_attacks_merged"] for r in rs),
                "hostile_validated": sum(r["hostile_validated"] for r in rs),
                "hostile_rejected": sum(r["hostile_results"].get("rejected", 0) for r in rs),
                "hostile_reputation": _mean([r["hostile_reputation"] for r in rs]),
                "hostile_credit": round(sum(r["hostile_credit"] for r in rs), 6),
                "hostile_attack_credit": round(sum(r["hostile_attack_credit"] for r in rs), 6),
                "hostile_quarantined": sum(r["hostile_quarantined"] for r in rs),
                "hostile_hosts_registered": sum(r.get("hostile_hosts_registered", 1) for r in rs),
            }
            # A strategy played in the job without validation compares with that job's clean run.
            goal_ratio = s["ratio_to_unvalidated"] if strategy.endswith("-unvalidated") else s["ratio"]
            s["goal_met"] = bool(
                s["succeeded"] == len(rs)
                and goal_ratio is not None
                and goal_ratio <= GOAL_RATIO
                and (strategy not in NO_CREDIT_FOR or s["hostile_attack_credit"] == 0)
            )
        out.append(s)
    return out


def print_table(summary: list[dict]) -> None:
    cols = {
        "strategy": "strategy",
        "succeeded": "succeeded",
        "examples_to_target": "examples",
        "ratio": "ratio",
        "ratio_to_unvalidated": "ratio unval.",
        "examples_trained_to_target": "trained",
        "seconds_to_target": "s to target",
        "hostile_attacks": "attacks",
        "hostile_attacks_merged": "attacks merged",
        "hostile_validated": "validated",
        "hostile_rejected": "refused",
        "hostile_reputation": "reputation",
        "hostile_credit": "credit",
        "hostile_attack_credit": "attack credit",
        "hostile_quarantined": "quarantined",
        "hostile_hosts_registered": "hosts",
        "honest_refused": "honest refused",
        "goal_met": "goal",
    }
    print_summary_table("adversarial: the example job with a hostile host in 1 of 5 slots", cols, summary)
