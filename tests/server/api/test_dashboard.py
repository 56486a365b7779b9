"""The web dashboard in-process: the login form and its session cookie, logout, pages and their JSON
refused without a session, the cookie refused for anything but reading, the figures of a job with real
merges, and a public project page that shows no token, hash, address or data location."""

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient

from crowdtrain.assimilator.merge import MergeServices, assimilate
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.storage import open_storage
from crowdtrain.core.tensors import decode, encode
from crowdtrain.launch.cluster import free_port, start_redis
from crowdtrain.server.api.deps import SESSION_COOKIE
from crowdtrain.server.ledger.models import Assignment
from crowdtrain.server.services import sessions
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import ADMIN_TOKEN, Scheduler, ok, scheduler_app

HTTPS = "https://testserver"  # the cookie is Secure: a client sends it back over https only
OPERATOR_PAGES = ["/dashboard/jobs", "/dashboard/jobs/1", "/dashboard/hosts"]
OPERATOR_DATA = [
    "/dashboard/api/jobs",
    "/dashboard/api/jobs/1",
    "/dashboard/api/jobs/1/in-flight",
    "/dashboard/api/hosts",
]
HOST_EXAMPLES = (2147483647, 10)  # what alice's two uploads claim they trained
RESULT_EXAMPLES = 2000  # what each was asked for: the shard's 1,000 examples x 2 local epochs


@dataclass
class Site:
    sched: Scheduler
    r: redis.Redis
    job_id: int
    merged: list[int]

    def browser(self, address: str = "browser") -> TestClient:
        """A caller with no token, as a browser is, that keeps cookies and follows no redirect."""
        return TestClient(self.sched.app, base_url=HTTPS, client=(address, 50000), follow_redirects=False)

    def logged_in(self, address: str = "browser") -> TestClient:
        browser = self.browser(address)
        resp = browser.post("/dashboard/login", data={"token": ADMIN_TOKEN})
        assert resp.status_code == 303, resp.text
        return browser


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[Site]:
    """The example job with two results of alice's merged by the real merge path, one refused, and bob idle."""
    tmp = tmp_path_factory.mktemp("dashboard")
    port = free_port()
    redis_svc = start_redis(tmp / "redis", port)
    r = redis.Redis(port=port)
    try:
        with scheduler_app(tmp / "var", r, auth_failures_per_minute=5) as sched:
            spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
            job_id = ok(sched.admin().post("/v1/jobs", json=spec)).json()["job_id"]
            alice = sched.register("alice-laptop", account="alice")
            sched.register("bob-desktop")  # no account: anonymous
            work = ok(alice.post("/v1/work", json={"free_slots": 3})).json()["assignments"]
            snapshot = decode(alice.get(work[0]["snapshot"]["url"]).content)
            for i, a in enumerate(work[:2]):
                # Two results of one snapshot, not the same weights twice (the second would be a replay).
                rng = np.random.default_rng(i)
                result = {
                    k: (v + 1e-3 * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
                    for k, v in snapshot.items()
                }
                # The host's own figures: one absurd, one too low. Neither is what the pages count.
                url = f"/v1/assignments/{a['assignment_id']}/result?examples={HOST_EXAMPLES[i]}&seconds=2"
                ok(alice.put(url, content=encode(result)))
            refused = alice.put(f"/v1/assignments/{work[2]['assignment_id']}/result", content=b"not safetensors")
            assert refused.status_code == 422, refused.text
            services = MergeServices(sched.db, open_storage(sched.settings.resolved_storage_url), r, snapshots_kept=3)
            for a in work[:2]:
                assimilate(services, a["assignment_id"])
            yield Site(sched, r, job_id, [a["assignment_id"] for a in work[:2]])
    finally:
        r.close()
        redis_svc.stop()


def test_login_sets_a_secure_http_only_strict_cookie_that_is_not_the_token(site: Site) -> None:
    browser = site.browser("login-ok")
    resp = browser.post("/dashboard/login", data={"token": ADMIN_TOKEN})
    assert resp.status_code == 303 and resp.headers["location"] == "/dashboard/jobs"
    cookie = resp.headers["set-cookie"]
    attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
    assert {"httponly", "secure", "samesite", "max-age", "path"} <= attributes
    assert "samesite=strict" in cookie.lower() and "path=/dashboard" in cookie.lower()
    value = browser.cookies[SESSION_COOKIE]
    assert ADMIN_TOKEN not in value and sessions.is_valid(ADMIN_TOKEN, value)
    page = browser.get("/dashboard/jobs")
    assert page.status_code == 200 and '<table id="jobs"' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]


def test_a_wrong_token_gets_the_form_again_with_401_and_spends_the_failure_budget(site: Site) -> None:
    browser = site.browser("guesser")
    for attempt in range(5):
        resp = browser.post("/dashboard/login", data={"token": f"guess-{attempt}"})
        assert resp.status_code == 401
        assert "wrong admin token" in resp.text and "<form" in resp.text
        assert SESSION_COOKIE not in browser.cookies
    # The budget (5 a minute here) is spent: another guess waits for the window to end...
    resp = browser.post("/dashboard/login", data={"token": "guess-5"})
    assert resp.status_code == 429 and "Retry-After" in resp.headers
    # ... but the right token is admitted (only failures are throttled).
    assert browser.post("/dashboard/login", data={"token": ADMIN_TOKEN}).status_code == 303


@pytest.mark.parametrize("body", [b"", b"token=", b"\xff\xfe=%%%", b"a=1&" * 5000, b"token=" + b"x" * 100_000])
def test_a_malformed_login_form_is_a_401_not_a_500(site: Site, body: bytes) -> None:
    resp = site.browser(f"junk-{len(body)}-{body[:3]!r}").post(
        "/dashboard/login", content=body, headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert resp.status_code == 401 and "wrong admin token" in resp.text


@pytest.mark.parametrize("path", OPERATOR_PAGES)
def test_operator_pages_redirect_to_the_login_without_a_session(site: Site, path: str) -> None:
    resp = site.browser().get(path)
    assert resp.status_code == 303 and resp.headers["location"] == "/dashboard/login"


@pytest.mark.parametrize("path", OPERATOR_DATA)
@pytest.mark.parametrize("cookie", ["none", "forged", "expired", "other-token"])
def test_operator_data_is_401_without_a_live_session(site: Site, path: str, cookie: str) -> None:
    browser = site.browser()
    values = {
        "forged": "9999999999." + "0" * 64,
        "expired": sessions.issue(ADMIN_TOKEN, 60, now=1_000_000),
        "other-token": sessions.issue("an-older-admin-token", 3600),
    }
    if cookie in values:
        browser.cookies.set(SESSION_COOKIE, values[cookie], domain="testserver", path="/dashboard")
    resp = browser.get(path)
    assert resp.status_code == 401 and "login" in resp.json()["detail"]


def test_the_cookie_admits_no_state_changing_call(site: Site) -> None:
    browser = site.logged_in("csrf")
    value = browser.cookies[SESSION_COOKIE]
    assert browser.get("/dashboard/api/jobs").status_code == 200
    # Not the bearer API's changes, even with the cookie sent to every path ...
    headers = {"cookie": f"{SESSION_COOKIE}={value}"}
    assert browser.post(f"/v1/jobs/{site.job_id}/cancel", headers=headers).status_code == 401
    assert browser.post("/v1/admin/join-tokens", json={"label": "x"}, headers=headers).status_code == 401
    assert browser.get("/v1/jobs", headers=headers).status_code == 401
    # ... nor any other method on the dashboard's own data.
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert browser.request(method, "/dashboard/api/jobs").status_code in (401, 405)
    job = ok(site.sched.admin().get(f"/v1/jobs/{site.job_id}")).json()
    assert job["status"] == "running"


def test_logout_drops_the_cookie(site: Site) -> None:
    browser = site.logged_in("logout")
    resp = browser.post("/dashboard/logout")
    assert resp.status_code == 303 and resp.headers["location"] == "/dashboard/login"
    assert SESSION_COOKIE not in browser.cookies
    assert browser.get("/dashboard/api/jobs").status_code == 401
    assert browser.get("/dashboard/jobs").status_code == 303


def test_logout_ends_the_session_on_the_server_for_the_rest_of_its_life(site: Site) -> None:
    """A copy of the cookie (another tab, a stolen value) admits nothing after logout, until it expires."""
    browser = site.logged_in("logout-everywhere")
    value = browser.cookies[SESSION_COOKIE]
    copy = TestClient(site.sched.app, base_url=HTTPS, headers={"Cookie": f"{SESSION_COOKIE}={value}"})
    copy.follow_redirects = False
    assert copy.get("/dashboard/api/jobs").status_code == 200
    other = site.logged_in("another-login")  # logged in the same second: a session of its own
    marks = set(site.r.scan_iter("*ended-session*"))
    assert browser.post("/dashboard/logout").status_code == 303
    assert copy.get("/dashboard/api/jobs").status_code == 401
    assert copy.get("/dashboard/jobs").status_code == 303
    assert other.get("/dashboard/api/jobs").status_code == 200
    [mark] = set(site.r.scan_iter("*ended-session*")) - marks
    assert (
        site.sched.settings.dashboard_session_seconds - 5
        <= site.r.ttl(mark)
        <= site.sched.settings.dashboard_session_seconds
    )


def test_the_job_data_has_the_merges_staleness_workunits_and_refusals(site: Site) -> None:
    d = ok(site.logged_in("job").get(f"/dashboard/api/jobs/{site.job_id}")).json()
    job = d["job"]
    assert job["merges"] == 2 and len(job["metrics"]) == 2
    assert [p["examples"] for p in job["metrics"]] == [RESULT_EXAMPLES, 2 * RESULT_EXAMPLES]
    assert all(0 <= p["val_accuracy"] <= 1 for p in job["metrics"])
    # Both started from v0: the first merged at v0 (τ 0), the second at v1 (τ 1).
    assert d["staleness"] == {"merges": 2, "mean": 0.5, "max": 1, "recent_mean": 0.5}
    # Both merged within the job's first minute: the rate is over its age, not the whole minute.
    assert d["merges_per_second"] == pytest.approx(2 / max(job["elapsed_seconds"], 1), rel=0.2)
    assert d["workunits"] == d["epoch_workunits"] == {"done": 2, "ready": 2}
    assert [r["status"] for r in d["problems"]["reasons"]] == ["rejected"]
    assert d["problems"]["recent"][0]["host_name"] == "alice-laptop"


def test_the_hosts_data_has_device_frameworks_throughput_and_reliability(site: Site) -> None:
    hosts = {h["name"]: h for h in ok(site.logged_in("hosts").get("/dashboard/api/hosts")).json()}
    alice, bob = hosts["alice-laptop"], hosts["bob-desktop"]
    assert alice["results_merged"] == 2 and alice["examples"] == 2 * RESULT_EXAMPLES
    assert alice["examples_per_second"] == pytest.approx(RESULT_EXAMPLES / 2)
    assert alice["results_valid"] == 2 and alice["results_failed"] == 1
    assert alice["frameworks"] and alice["device"] and alice["last_seen"] and alice["revoked"] is False
    assert alice["account"] == "alice" and alice["credit"] > 0 and bob["account"] == "" and bob["credit"] == 0
    assert bob["results_merged"] == 0 and bob["examples_per_second"] is None


def test_examples_are_counted_from_the_workunits_never_from_the_hosts_figures(site: Site) -> None:
    """Each merged result counts the examples it was asked to train (shard x local epochs x fraction),
    on the public page, the job's progress and the hosts' figures; the host's own claim is not stored."""
    with site.sched.db.begin() as s:
        stored = [s.get_one(Assignment, a).examples for a in site.merged]
    assert stored == [RESULT_EXAMPLES, RESULT_EXAMPLES]
    public = ok(site.browser("public").get("/v1/project")).json()
    assert public["examples"] == public["jobs"][0]["examples"] == 2 * RESULT_EXAMPLES
    job = ok(site.logged_in("job").get(f"/dashboard/api/jobs/{site.job_id}")).json()["job"]
    assert [p["examples"] for p in job["metrics"]] == [RESULT_EXAMPLES, 2 * RESULT_EXAMPLES]


def test_a_job_that_does_not_exist_is_404(site: Site) -> None:
    assert site.logged_in("404").get("/dashboard/api/jobs/999").status_code == 404


def test_the_public_project_data_shows_progress_and_contributions_and_no_secrets(site: Site) -> None:
    resp = site.browser("public").get("/v1/project")
    assert resp.status_code == 200
    p = resp.json()
    assert p["results_merged"] == 2 and p["examples"] == 2 * RESULT_EXAMPLES
    (job,) = p["jobs"]
    assert job["name"] == "mnist1d-cnn" and job["status"] == "running" and job["results_merged"] == 2
    assert job["best_accuracy"] is None, "its first epoch has not closed (two workunits are still ready)"
    volunteers = {v["name"]: v for v in p["volunteers"]}
    alice = volunteers["alice"]
    assert alice == {
        "name": "alice",
        "hosts": 1,
        "results_merged": 2,
        "results_valid": 2,
        "examples": 2 * RESULT_EXAMPLES,
        "credit": alice["credit"],
    }
    assert set(volunteers) == {"alice", "anonymous"} and volunteers["anonymous"]["credit"] == 0
    # Credit is the sum of the merged results' credit, per host and per account, and in all.
    with site.sched.db.begin() as s:
        merged_credit = sum(s.get_one(Assignment, a).credit or 0.0 for a in site.merged)
    assert merged_credit > 0 and alice["credit"] == pytest.approx(merged_credit) == p["credit"]
    assert [(h["account"], h["results"]) for h in p["hosts"]] == [("alice", 2), ("", 0)]
    assert p["hosts"][0]["credit"] == pytest.approx(merged_credit)
    # Exactly these fields, at every level: nothing that could hold a token, a hash, an address, a key
    # or a host's own name (often its machine's).
    assert set(p) == {"jobs", "volunteers", "hosts", "hosts_active", "results_merged", "examples", "credit"}
    assert set(job) == {"name", "status", "current_epoch", "max_epochs", "best_accuracy", "results_merged", "examples"}
    assert set(volunteers["anonymous"]) == {"name", "hosts", "results_merged", "results_valid", "examples", "credit"}
    assert set(p["hosts"][1]) == {"host_id", "account", "credit", "results"}
    text = json.dumps(p)
    assert "laptop" not in text and "desktop" not in text
    assert not re.search(r"token|hash|sha256|key|url|address|testclient|[0-9a-f]{32}", text, re.IGNORECASE)
    assert ADMIN_TOKEN not in text and site.sched.settings.join_token not in text


@pytest.mark.parametrize("path", ["/project", "/static/dashboard.js", "/static/dashboard.css", "/dashboard/login"])
def test_the_public_page_its_files_and_the_login_form_need_no_session(site: Site, path: str) -> None:
    assert site.browser().get(path).status_code == 200


@pytest.mark.parametrize("name", ["job.html", "..%2Fapp.py", "nothing.js", "%2E%2E%2F__init__.py", "dashboard.py"])
def test_only_the_scripts_and_styles_are_served_as_static_files(site: Site, name: str) -> None:
    assert site.browser().get(f"/static/{name}").status_code == 404


def test_the_public_page_has_its_figures_in_its_first_paint(site: Site) -> None:
    """Rendered by the server: a browser shows the figures before the script runs (and without it)."""
    page = site.browser("first-paint").get("/project").text
    p = ok(site.browser("public").get("/v1/project")).json()
    assert f'id="fig-results">{p["results_merged"]}<' in page
    assert f'id="fig-examples">{p["examples"]:,}<' in page and f'id="fig-jobs">{len(p["jobs"])}<' in page
    assert '<td>mnist1d-cnn</td><td><span class="status running">running</span></td>' in page
    assert "<td>alice</td>" in page and "<td>host 1</td>" in page
    assert "<!--" not in page, "every marker is filled"
    for figure in ("fig-jobs", "fig-results", "fig-examples", "fig-active", "fig-credit"):
        assert f'id="{figure}">–<' not in page
