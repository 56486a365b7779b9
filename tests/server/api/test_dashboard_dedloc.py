"""The job page's DeDLOC section in-process (GET /dashboard/api/jobs/{id}/dedloc): steps committed,
members, mean round time and examples per step against the target batch, from a collaboration of three
peers driven by hand over the real `/v1/dedloc` API (a real SQLite file and a private Redis)."""

import pytest
import redis
from fastapi.testclient import TestClient

from crowdtrain.core.jobspec import load_job_spec
from tests.conftest import EXAMPLE_SPEC
from tests.server.api.conftest import dedloc_spec
from tests.server.dedloc_round import HandCollaboration
from tests.server.inprocess import ADMIN_TOKEN, Scheduler, ok, scheduler_app

TARGET = 96
REPORTS = (40, 50)  # each of 3 peers' examples at step 0, then at step 1: 120 and 150 examples, past 96


def logged_in(sched: Scheduler) -> TestClient:
    browser = TestClient(sched.app, base_url="https://testserver", follow_redirects=False)
    assert browser.post("/dashboard/login", data={"token": ADMIN_TOKEN}).status_code == 303
    return browser


def test_the_dedloc_section_counts_steps_members_round_time_and_examples(tmp_path, private_redis: redis.Redis) -> None:
    spec = dedloc_spec()
    spec["dedloc"] |= {"target_batch_size": TARGET, "micro_batch_size": 16}
    with scheduler_app(tmp_path, private_redis) as sched:
        job_id = ok(sched.admin().post("/v1/jobs", json=spec)).json()["job_id"]
        browser = logged_in(sched)
        before = ok(browser.get(f"/dashboard/api/jobs/{job_id}/dedloc")).json()
        team = HandCollaboration(job_id, [sched.register(f"peer-{i}") for i in range(3)])
        assert before["steps_committed"] == 0 and before["examples_per_step"] is None
        assert before["members_last"] is None and before["mean_round_seconds"] is None
        for step, examples in enumerate(REPORTS):
            assert team.commit(examples=examples) == step

        d = ok(browser.get(f"/dashboard/api/jobs/{job_id}/dedloc")).json()
        commits = ok(sched.admin().get(f"/v1/dedloc/jobs/{job_id}/commits")).json()
        totals = [3 * n for n in REPORTS]
        assert d["steps_committed"] == 2 and d["step"] == 2 and d["phase"] == "accumulating"
        assert d["members_last"] == 3 and d["members_seen"] == 3 and d["peers_live"] == 3
        assert d["target_batch_size"] == TARGET
        assert d["examples_per_step"] == pytest.approx(sum(totals) / 2)
        assert (d["examples_min"], d["examples_max"]) == (min(totals), max(totals))
        assert d["overshoot"] == pytest.approx(sum(totals) / 2 - TARGET)
        assert d["mean_round_seconds"] == pytest.approx(commits["1"]["at"] - commits["0"]["at"])
        assert [(s["step"], s["members"], s["examples"]) for s in d["recent"]] == [(1, 3, totals[1]), (0, 3, totals[0])]
        assert d["recent"][-1]["seconds"] is None

        page = browser.get(f"/dashboard/jobs/{job_id}").text
        assert 'id="dedloc-section"' in page and "the step closes once the sum of their reports reaches" in page
        assert ok(browser.get(f"/dashboard/api/jobs/{job_id}")).json()["mode"] == "dedloc"


def test_the_dedloc_section_is_409_for_another_mode_and_404_for_no_job(tmp_path, private_redis: redis.Redis) -> None:
    with scheduler_app(tmp_path, private_redis) as sched:
        spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
        job_id = ok(sched.admin().post("/v1/jobs", json=spec)).json()["job_id"]
        browser = logged_in(sched)
        resp = browser.get(f"/dashboard/api/jobs/{job_id}/dedloc")
        assert resp.status_code == 409 and "not 'dedloc'" in resp.text
        assert browser.get("/dashboard/api/jobs/999/dedloc").status_code == 404
        anonymous = TestClient(sched.app, base_url="https://testserver", follow_redirects=False)
        assert anonymous.get(f"/dashboard/api/jobs/{job_id}/dedloc").status_code == 401
