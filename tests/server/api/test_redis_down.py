"""While Redis is down the scheduler answers 503 with Retry-After and says why, never 500: a real
private redis-server that the test stops under an in-process scheduler."""

import pytest
import redis

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import free_port, start_redis
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import ok, scheduler_app


@pytest.mark.parametrize(
    ("caller", "method", "path", "body"),
    [("host", "POST", "/v1/work", {"free_slots": 1}), ("admin", "GET", "/v1/jobs/1/problems", None)],
    ids=["work", "job-problems"],
)
def test_a_request_while_redis_is_down_is_a_503_with_retry_after(tmp_path, caller, method, path, body) -> None:
    port = free_port()
    svc = start_redis(tmp_path / "redis", port)
    r = redis.Redis(port=port)
    try:
        with scheduler_app(tmp_path / "var", r) as sched:
            ok(sched.admin().post("/v1/jobs", json=load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")))
            client = sched.register("alice") if caller == "host" else sched.admin()
            svc.stop()

            resp = client.request(method, path, json=body)

            assert resp.status_code == 503, resp.text
            assert int(resp.headers["Retry-After"]) > 0
            assert "parameter store (Redis) is unreachable" in resp.json()["detail"]
    finally:
        r.close()
        svc.stop()
