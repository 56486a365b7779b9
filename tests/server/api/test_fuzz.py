"""Property-based fuzzing of the real scheduler against its own OpenAPI document (schemathesis).

Every operation gets a bounded number of generated requests, with a valid host token or the admin
token as the operation needs; any 5xx, undocumented status code, content type or response body fails.
Three in four requests of a DeDLOC job's routes are aimed at a live round whose member is the
fuzzer's host (its job, step, attempt and peer id), so that they reach the member routes.
"""

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import Cluster
from tests.conftest import EXAMPLE_SPEC
from tests.server.dedloc_round import LiveRound

pytestmark = pytest.mark.integration
EXAMPLES = 25
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Operations that take away the fuzzer's own credentials or job run last.
LAST_WORDS = ("revoke", "cancel")
DEDLOC_JOB = "/v1/dedloc/jobs/{job_id}"


def _dedloc_spec() -> dict:
    """A DeDLOC job whose rounds stay open a few seconds at most (a request waiting for a round's
    total waits that long) and whose peers are never excluded, however often the fuzzer fails them."""
    spec = load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-dedloc.yaml").model_dump(mode="json", exclude_none=True)
    spec["dedloc"] |= {
        "target_batch_size": 64,
        "micro_batch_size": 16,
        "matchmaking_timeout": 1,
        "averaging_timeout": 3,
        "exclude_after": None,
    }
    return spec | {"stop": {"target_accuracy": 0.99, "max_steps": 1000}}


def _credentials(cluster: Cluster) -> tuple[dict, dict]:
    token = httpx.post(
        f"{cluster.url}/v1/hosts", json={"join_token": cluster.join_token, "name": "fuzzer"}, timeout=60
    ).json()["host_token"]
    return {"Authorization": f"Bearer {token}"}, {"Authorization": f"Bearer {cluster.admin_token}"}


def _fuzz(operation, headers: dict, failures: list[str], live: LiveRound | None, reached: Counter) -> int:
    """Fuzz one operation; with `live`, three requests in four are aimed at its round, and those
    answered below 400 count in `reached` under the operation's label."""
    sent = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def run(case) -> None:
        nonlocal sent
        aimed = live is not None and sent % 4 != 3
        if aimed:
            assert live is not None
            live.ensure()
            live.aim(case.path_parameters, case.query, case.body)
        response = case.call(headers=headers, timeout=30)
        sent += 1
        if aimed and response.status_code < 400:
            reached[operation.label] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except Exception as exc:  # a schemathesis FailureGroup, or the request itself failed
            failures.append(f"{operation.label}: {response.status_code} {str(exc)[:500]}")

    run()
    return sent


def test_the_api_answers_every_generated_request_as_documented(tmp_path) -> None:
    # Generated join tokens fail by the hundred: the throttle would soon answer every request 429.
    cluster = Cluster(var_dir=tmp_path / "fuzz", extra_env={"CROWDTRAIN_AUTH_FAILURES_PER_MINUTE": "1000000"}).start()
    try:
        spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
        cluster.submit(spec)
        host, admin = _credentials(cluster)
        partner = _credentials(cluster)[0]
        peers = [httpx.Client(base_url=cluster.url, headers=h, timeout=60) for h in (host, partner)]
        live = LiveRound(httpx.Client(base_url=cluster.url, headers=admin, timeout=120), _dedloc_spec(), peers, 40)
        live.ensure()  # its job, before the fuzzer can give the project a key (jobs would await a signature)
        schema = schemathesis.openapi.from_url(f"{cluster.url}/openapi.json")
        operations = sorted(
            (r.ok() for r in schema.get_all_operations()), key=lambda op: any(w in op.path for w in LAST_WORDS)
        )
        failures: list[str] = []
        requests, reached = 0, Counter[str]()
        for op in operations:
            is_admin = {"admin", "operations"} & set(op.definition.raw.get("tags", []))
            aimed = live if op.path.startswith(DEDLOC_JOB) else None
            requests += _fuzz(op, admin if is_admin else host, failures, aimed, reached)
    finally:
        cluster.stop()
    print(f"fuzzed {len(operations)} operations with {requests} requests: {len(failures)} failures")
    print(f"DeDLOC requests answered below 400 in the live round (re-opened {live.reopened} times):")
    print(f"  {sum(reached.values())} of them: {dict(sorted(reached.items()))}")
    assert not failures, "\n".join(failures[:20])
    assert len(operations) >= 25 and requests >= len(operations) * 5
    members = ("progress", "report", "store/{op}", "states/latest")
    for route in members:
        assert any(route in label and n > 0 for label, n in reached.items()), (route, reached)
