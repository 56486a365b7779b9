"""Property-based fuzzing of the real scheduler against its own OpenAPI document (schemathesis).

Every operation gets a bounded number of generated requests, with a valid host token or the admin
token as the operation needs; any 5xx, undocumented status code, content type or response body fails.
"""

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

pytestmark = pytest.mark.integration
EXAMPLES = 25
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Operations that take away the fuzzer's own credentials or job run last.
LAST_WORDS = ("revoke", "cancel")


def _credentials(cluster: Cluster) -> tuple[dict, dict]:
    token = httpx.post(
        f"{cluster.url}/v1/hosts", json={"join_token": cluster.join_token, "name": "fuzzer"}, timeout=60
    ).json()["host_token"]
    return {"Authorization": f"Bearer {token}"}, {"Authorization": f"Bearer {cluster.admin_token}"}


def _fuzz(operation, headers: dict, failures: list[str]) -> int:
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
        response = case.call(headers=headers, timeout=30)
        sent += 1
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
        schema = schemathesis.openapi.from_url(f"{cluster.url}/openapi.json")
        operations = sorted(
            (r.ok() for r in schema.get_all_operations()), key=lambda op: any(w in op.path for w in LAST_WORDS)
        )
        failures: list[str] = []
        requests = 0
        for op in operations:
            is_admin = {"admin", "operations"} & set(op.definition.raw.get("tags", []))
            requests += _fuzz(op, admin if is_admin else host, failures)
    finally:
        cluster.stop()
    print(f"fuzzed {len(operations)} operations with {requests} requests: {len(failures)} failures")
    assert not failures, "\n".join(failures[:20])
    assert len(operations) >= 25 and requests >= len(operations) * 5
