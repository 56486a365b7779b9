"""One in-process scheduler for the API's contract tests, with a VC-ASGD job and a DeDLOC job, and a
fingerprint of everything it stores, so that a test can show a refused request changed nothing."""

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from crowdtrain.core import keys
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.launch.cluster import free_port, start_redis
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import Scheduler, ok, scheduler_app


@dataclass
class World:
    sched: Scheduler
    r: redis.Redis
    vc_job: int
    dedloc_job: int
    alice: TestClient  # holds an assignment of the VC-ASGD job and has joined the DeDLOC job
    assignment: dict
    peer_id: str
    bob: TestClient  # registered, holds nothing

    def fingerprint(self) -> tuple:
        """Every row of every table, every stored file's digest and every Redis value (but the
        failed-authentication counters, which a refused token is meant to spend, and the processes'
        health records, which their heartbeats renew)."""
        rows = self.sched.rows()
        files = tuple(sorted((str(p), hashlib.sha256(p.read_bytes()).hexdigest()) for p in self.sched.stored_files()))
        skipped = (keys.auth_failures(""), f"{keys.PREFIX}:health:")
        values = tuple(sorted((k, self._value(k)) for k in self.r.scan_iter() if not k.decode().startswith(skipped)))
        return rows, files, values

    def _value(self, key: bytes) -> object:
        """A Redis value; of the DeDLOC peers, all but when each was last seen (any request of a peer's
        host shows it alive, refused or not)."""
        if key.decode() != keys.dedloc_peers(self.dedloc_job):
            return self.r.dump(key)
        peers = {peer: json.loads(raw) for peer, raw in self.r.hgetall(key).items()}
        return tuple(
            sorted(
                (peer, tuple(sorted((k, v) for k, v in fields.items() if k != "last_seen")))
                for peer, fields in peers.items()
            )
        )


def dedloc_spec() -> dict:
    data = load_job_spec(EXAMPLE_SPEC.parent / "mnist1d-dedloc.yaml").model_dump(mode="json", exclude_none=True)
    return data | {"stop": {"target_accuracy": 0.99, "max_steps": 10}}


@pytest.fixture(scope="package")
def world(tmp_path_factory) -> Iterator[World]:
    tmp: Path = tmp_path_factory.mktemp("contract")
    port = free_port()
    redis_svc = start_redis(tmp / "redis", port)
    r = redis.Redis(port=port)
    try:
        with scheduler_app(tmp / "var", r, auth_failures_per_minute=100_000) as sched:
            admin = sched.admin()
            vc_job = ok(admin.post("/v1/jobs", json=load_job_spec(EXAMPLE_SPEC).model_dump(mode="json"))).json()
            dedloc_job = ok(admin.post("/v1/jobs", json=dedloc_spec())).json()["job_id"]
            alice, bob = sched.register("alice"), sched.register("bob")
            work = ok(alice.post("/v1/work", json={"free_slots": 1})).json()["assignments"]
            joined = ok(alice.post(f"/v1/dedloc/jobs/{dedloc_job}/join", json={})).json()
            yield World(sched, r, vc_job["job_id"], dedloc_job, alice, work[0], joined["peer_id"], bob)
    finally:
        r.close()
        redis_svc.stop()
