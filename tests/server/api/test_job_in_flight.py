"""Backpressure as the operator sees it: GET /v1/jobs/{id} and `crowdtrain job status` show the job's
unmerged assignments, its in-flight budget and whether dispatch holds it back; a budget the spec
cannot mean is refused with 422 naming the field, storing nothing."""

import pytest
from rich.console import Console

from crowdtrain.cli.progress import status_table
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.schemas_jobs import JobStatusOut
from crowdtrain.server.ledger.models import Job
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import scheduler_app


@pytest.fixture
def scheduler(tmp_path, private_redis):
    with scheduler_app(tmp_path, private_redis) as app:
        yield app


def _spec(**scheduling) -> dict:
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    spec["scheduling"] |= scheduling
    return spec


def test_the_job_json_and_job_status_show_the_budget_and_the_hold(scheduler) -> None:
    created = scheduler.http.post("/v1/jobs", json=_spec(max_in_flight=2), headers=scheduler.admin_headers)
    assert created.status_code == 201, created.text
    job_id = created.json()["job_id"]
    host = scheduler.register_host()
    before = scheduler.http.get(f"/v1/jobs/{job_id}", headers=scheduler.admin_headers).json()["in_flight"]
    assert (before["count"], before["budget"], before["held_back"]) == (0, 2, False)
    assert len(scheduler.http.post("/v1/work", json={"free_slots": 3}, headers=host).json()["assignments"]) == 2
    assert scheduler.http.post("/v1/work", json={"free_slots": 1}, headers=host).json()["assignments"] == []

    reply = scheduler.http.get(f"/v1/jobs/{job_id}", headers=scheduler.admin_headers)
    assert reply.json()["in_flight"] == {
        "count": 2,
        "budget": 2,
        "derived": False,
        "held_back": True,
        "merge_rate": None,
        "turnaround_seconds": None,
    }
    console = Console(width=200, record=True)
    console.print(status_table(JobStatusOut.model_validate(reply.json())))
    shown = console.export_text()
    assert "in flight 2/2 (scheduling.max_in_flight)" in shown and "held back: waiting for merges" in shown


@pytest.mark.parametrize("value", [0, -1, 10**7, "many"])
def test_a_budget_out_of_bounds_is_refused_naming_the_field(scheduler, value) -> None:
    resp = scheduler.http.post("/v1/jobs", json=_spec(max_in_flight=value), headers=scheduler.admin_headers)
    assert resp.status_code == 422, resp.text
    assert "max_in_flight" in resp.text
    assert scheduler.count(Job) == 0
