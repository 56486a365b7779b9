"""What `job list` and `job status` print, from the API's answers."""

from datetime import UTC, datetime, timedelta

import pytest
from rich.console import Console

from crowdtrain.cli.progress import age, jobs_table, problems_view
from crowdtrain.core.schemas_jobs import JobProblems, JobSummary

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


def _text(renderable) -> str:
    console = Console(record=True, width=120)
    console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize(
    ("ago", "shown"),
    [
        (timedelta(seconds=5), "5s"),
        (timedelta(minutes=12, seconds=59), "12m"),
        (timedelta(hours=3), "3h"),
        (timedelta(days=2, hours=23), "2d"),
    ],
)
def test_an_age_is_its_largest_whole_unit(ago: timedelta, shown: str) -> None:
    assert age(NOW - ago, NOW) == shown
    assert age(None, NOW) == "-"


def test_the_job_list_has_a_row_per_job() -> None:
    jobs = [
        JobSummary(
            job_id=1,
            name="mnist1d-cnn",
            status="succeeded",
            current_epoch=7,
            max_epochs=40,
            accuracy=0.9041,
            created_at=NOW - timedelta(hours=2),
        ),
        JobSummary(job_id=2, name="peers", status="running", current_epoch=0, mode="dedloc", created_at=NOW),
    ]
    rows = [[cell for cell in line.split() if cell not in "│┃"] for line in _text(jobs_table(jobs, NOW)).splitlines()]
    assert rows[0] == ["id", "name", "mode", "status", "epoch", "accuracy", "age"]
    assert ["1", "mnist1d-cnn", "vc-asgd", "succeeded", "7/40", "0.904", "2h"] in rows
    assert ["2", "peers", "dedloc", "running", "0", "-", "0s"] in rows


def test_the_problems_say_why_by_reason_and_the_latest_in_full() -> None:
    problems = JobProblems.model_validate(
        {
            "job_id": 3,
            "status": "running",
            "status_message": "",
            "counts": {"client_error": 2, "rejected": 1},
            "reasons": [
                {"status": "client_error", "reason": "out of memory at batch #", "count": 2},
                {"status": "rejected", "reason": "stale result: based on #, W_s is #", "count": 1},
            ],
            "recent": [
                {
                    "assignment_id": 9,
                    "host_id": 4,
                    "host_name": "alice",
                    "epoch": 2,
                    "status": "client_error",
                    "message": "out of memory at batch 40",
                    "finished_at": "2026-11-23T11:59:00Z",
                },
            ],
            "hosts_registered": 3,
            "hosts_able": 1,
            "hosts_able_active": 0,
            "findings": ["none of the 1 hosts able to run this job has asked for work in the last 60 seconds"],
        }
    )
    text = _text(problems_view(problems))
    assert "1 of 3 registered can run this job, 0 of them seen in the last minute" in text
    assert "! none of the 1 hosts able to run this job" in text
    assert "out of memory at batch #" in text and "stale result: based on #, W_s is #" in text
    assert "out of memory at batch 40" in text and "4 alice" in text and "2026-11-23 11:59:00" in text
