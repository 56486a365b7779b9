"""One parameter-server merge, without Celery: a real SQLite ledger, file storage and a private Redis.

Each test submits the demo job, registers a host, claims work and uploads results as the scheduler
does, then calls crowdtrain.assimilator.merge.assimilate the way the Celery task does.
"""

from dataclasses import dataclass

import numpy as np
import pytest
from sqlalchemy import func, select

from crowdtrain.assimilator.inputs import read_result, replay_of
from crowdtrain.assimilator.merge import MergeResult, MergeServices, Outcome, assimilate
from crowdtrain.assimilator.rules.control import GROW
from crowdtrain.core import keys, merge_stages
from crowdtrain.core.assimilationspec import assimilation_of
from crowdtrain.core.credit import COBBLESTONE_FLOPS
from crowdtrain.core.digests import weights_digest
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.schemas import HostRegister, ResultMetrics
from crowdtrain.core.settings import Settings
from crowdtrain.core.states import AssignmentStatus, WorkunitStatus
from crowdtrain.core.tensors import Params
from crowdtrain.core.updates import encode_result
from crowdtrain.server.ledger import merges, result_records
from crowdtrain.server.ledger.models import Assignment, Host, Metric, Shard, Workunit
from crowdtrain.server.ledger.models import Job as JobRow
from crowdtrain.server.paramstore import merging, store
from crowdtrain.server.services.dispatch import request_work
from crowdtrain.server.services.hosts import register_host
from crowdtrain.server.services.results import check_result, store_result
from crowdtrain.workgen.generator import submit_job
from tests.conftest import EXAMPLE_SPEC

ALPHA = 0.6  # the paper's rule, as these tests merge unless they name another


@dataclass
class Job:
    """The demo job with one host holding `assignments` (all started from W_s v0, `w0`)."""

    svc: MergeServices
    job_id: int
    host_id: int
    assignments: list[int]
    w0: Params
    upload_spec: dict  # the job's assimilation.upload

    def upload(self, assignment_id: int, body: bytes, digest: str | None = None) -> None:
        """Store `body` as the scheduler does; with `digest`, as checked at upload (its digest recorded beside it)."""
        store_result(
            self.svc.db,
            self.svc.storage,
            self.host_id,
            self.job_id,
            assignment_id,
            body,
            ResultMetrics(),
            enqueue=lambda *_: None,
            r=self.svc.r,
            digest=digest,
        )

    def upload_weights(self, assignment_id: int, client: Params) -> None:
        self.upload(assignment_id, encode_result(client, self.w0, self.upload_spec))

    def upload_checked(self, assignment_id: int, client: Params) -> str | None:
        """Upload as the scheduler's route does: checked once, its digest recorded beside the body."""
        body = encode_result(client, self.w0, self.upload_spec)
        with self.svc.db.begin() as s:
            manifest = s.get_one(JobRow, self.job_id).param_manifest
        digest = check_result(body, manifest, self.upload_spec)
        self.upload(assignment_id, body, digest)
        return digest

    def upload_key(self, assignment_id: int) -> str:
        with self.svc.db.begin() as s:
            key = s.get_one(Assignment, assignment_id).upload_key
        assert key is not None
        return key

    def w_s(self) -> tuple[int, Params]:
        return store.read(self.svc.r, self.job_id)

    def assignment(self, assignment_id: int) -> tuple[str, int | None, str]:
        """(status, merged W_s version, message)"""
        with self.svc.db.begin() as s:
            a = s.get_one(Assignment, assignment_id)
            return a.status, a.merged_version, a.message

    def workunit(self, assignment_id: int) -> tuple[str, int]:
        with self.svc.db.begin() as s:
            wu = s.get_one(Workunit, s.get_one(Assignment, assignment_id).workunit_id)
            return wu.status, wu.error_count

    def host(self) -> tuple[int, int]:
        with self.svc.db.begin() as s:
            host = s.get_one(Host, self.host_id)
            return host.results_valid, host.results_failed

    def credit(self, assignment_id: int) -> tuple[float, float | None]:
        """(the host's credit, the assignment's)"""
        with self.svc.db.begin() as s:
            return s.get_one(Host, self.host_id).credit, s.get_one(Assignment, assignment_id).credit

    def expected_credit(self, assignment_id: int) -> float:
        """The work asked for: the shard's examples, the recipe's local epochs, the model's FLOPs per example."""
        with self.svc.db.begin() as s:
            a = s.get_one(Assignment, assignment_id)
            job = s.get_one(JobRow, a.job_id)
            shard = s.get_one(Shard, s.get_one(Workunit, a.workunit_id).shard_id)
            assert job.training_flops > 0 and shard.examples > 0
            return shard.examples * job.spec["training"]["local_epochs"] * job.training_flops / COBBLESTONE_FLOPS

    def metrics(self) -> int:
        with self.svc.db.begin() as s:
            return s.scalar(select(func.count()).select_from(Metric).where(Metric.job_id == self.job_id))


def _job(svc: MergeServices, assignments: int = 1, **assimilation) -> Job:
    spec = load_job_spec(EXAMPLE_SPEC)
    vc_asgd = {"rule": "vc-asgd", "alpha": ALPHA}  # unless another rule is named
    spec.assimilation = assimilation_of(
        (vc_asgd if assimilation.get("rule", "vc-asgd") == "vc-asgd" else {}) | assimilation
    )
    settings = Settings()
    job_id = submit_job(svc.db, svc.storage, svc.r, spec, settings.upload_max_bytes).job_id
    token = "join-token-for-this-test"
    host_id = register_host(svc.db, HostRegister(join_token=token, name="alice"), token).host_id
    given = request_work(svc.db, svc.storage, host_id, assignments, [], None)
    assert len(given) == assignments
    return Job(
        svc,
        job_id,
        host_id,
        [a.assignment_id for a in given],
        store.read(svc.r, job_id)[1],
        spec.assimilation.upload.model_dump(),
    )


def _moved(params: Params, step: float, seed: int = 0) -> Params:
    """W_c: `params` with every float tensor moved by noise of scale `step`."""
    rng = np.random.default_rng(seed)
    return {
        k: (v + step * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
        for k, v in params.items()
    }


def _vc_asgd(server: Params, client: Params) -> Params:
    return {k: ALPHA * v + (1 - ALPHA) * client[k] if v.dtype.kind == "f" else v for k, v in server.items()}


def _assert_params_equal(actual: Params, expected: Params) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        np.testing.assert_allclose(actual[k], expected[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _assert_refused_unchanged(job: Job, result: MergeResult, reason: str, charged: bool) -> None:
    """Refused for `reason`, recorded as such, W_s still v0; charged to the workunit and host or not."""
    a = job.assignments[-1]
    assert result.outcome is Outcome.refused and reason in result.reason, result
    status, merged_version, message = job.assignment(a)
    assert (status, merged_version) == (AssignmentStatus.rejected.value, None) and reason in message
    assert job.workunit(a) == (WorkunitStatus.ready.value, 1 if charged else 0)
    assert job.host()[1] == (1 if charged else 0)
    assert not job.svc.r.sismember(keys.merged(job.job_id), str(a))
    merged = [x for x in job.assignments if job.assignment(x)[0] == AssignmentStatus.merged.value]
    host_credit, credit = job.credit(a)
    assert credit is None, "a refused result earns no credit"
    assert host_credit == pytest.approx(sum(job.expected_credit(x) for x in merged))


@pytest.mark.parametrize(
    "upload", [{"send": "weights"}, {"send": "delta", "dtype": "float32"}], ids=["weights", "delta"]
)
def test_a_valid_result_is_merged_and_recorded(services, upload) -> None:
    job = _job(services, upload=upload)
    [a] = job.assignments
    client = _moved(job.w0, 0.01)
    job.upload_weights(a, client)

    result = assimilate(services, a, stamps=merge_stages.received())

    assert result == MergeResult(Outcome.merged, 1)
    version, w_s = job.w_s()
    assert version == 1
    _assert_params_equal(w_s, _vc_asgd(job.w0, client))
    assert job.assignment(a) == (AssignmentStatus.merged.value, 1, "")
    assert job.workunit(a) == (WorkunitStatus.done.value, 0)
    assert job.host() == (1, 0)
    assert job.credit(a) == (pytest.approx(job.expected_credit(a)), pytest.approx(job.expected_credit(a)))
    assert job.metrics() == 1  # eval_every 1
    assert merging.recent_update_norms(services.r, job.job_id) == [
        pytest.approx(
            np.sqrt(
                sum(
                    float(np.sum((client[k].astype(np.float64) - v) ** 2))
                    for k, v in job.w0.items()
                    if v.dtype.kind == "f"
                )
            ),
            rel=1e-4,
        )
    ]


def test_a_redelivered_merge_is_applied_once(services) -> None:
    job = _job(services)
    [a] = job.assignments
    client = _moved(job.w0, 0.01)
    job.upload_weights(a, client)

    first = assimilate(services, a)
    _, after_first = job.w_s()
    again = assimilate(services, a)

    assert first == MergeResult(Outcome.merged, 1)
    assert again == MergeResult(Outcome.already_merged, 1)
    version, w_s = job.w_s()
    assert version == 1
    _assert_params_equal(w_s, after_first)
    assert job.assignment(a)[1] == 1 and job.host() == (1, 0) and job.metrics() == 1
    assert job.credit(a)[0] == pytest.approx(job.expected_credit(a)), "credited once"


def test_a_delivery_that_died_after_merging_is_completed_by_the_next(services) -> None:
    """W_s holds the merge, the ledger does not yet: the next delivery records it and merges nothing."""
    job = _job(services)
    [a] = job.assignments
    client = _moved(job.w0, 0.01)
    job.upload_weights(a, client)
    merging.merge_once(services.r, job.job_id, a, lambda ws, _state, v: _merge_in_place(ws, client))
    _, merged_once = job.w_s()

    result = assimilate(services, a)

    assert result == MergeResult(Outcome.already_merged, 1)
    version, w_s = job.w_s()
    assert version == 1
    _assert_params_equal(w_s, merged_once)
    assert job.assignment(a) == (AssignmentStatus.merged.value, 1, "")
    assert job.workunit(a) == (WorkunitStatus.done.value, 0)
    assert job.metrics() == 1


@pytest.mark.parametrize("died_after_reading", [False, True], ids=["redelivered", "first-delivery-died"])
def test_a_result_checked_at_upload_is_read_once_and_merged_once(services, died_after_reading) -> None:
    """The scheduler's check and digest go with the stored bytes: the parameter server merges them
    without hashing again, a redelivery merges nothing more, and a delivery that died after reading
    the result (its digest already noted) leaves it to the next, which merges it, not as a replay."""
    job = _job(services)
    [a] = job.assignments
    client = _moved(job.w0, 0.01)
    digest = job.upload_checked(a, client)
    key = job.upload_key(a)
    assert digest == weights_digest(client)
    assert result_records.checked_upload_digest(services.r, job.job_id, key) == digest
    if died_after_reading:
        pending = merges.pending_merge(services.db, a)
        assert pending is not None
        assert replay_of(services.r, job.job_id, a, read_result(services.storage, services.r, pending).digest) is None

    first = assimilate(services, a, stamps=merge_stages.received())
    again = assimilate(services, a)

    assert (first, again) == (MergeResult(Outcome.merged, 1), MergeResult(Outcome.already_merged, 1))
    version, w_s = job.w_s()
    assert version == 1
    _assert_params_equal(w_s, _vc_asgd(job.w0, client))
    assert job.assignment(a) == (AssignmentStatus.merged.value, 1, "")
    assert job.credit(a)[0] == pytest.approx(job.expected_credit(a)), "credited once"
    assert services.r.hget(keys.result_digests(job.job_id), digest) == str(a).encode()
    assert result_records.checked_upload_digest(services.r, job.job_id, key) is None, "the record goes with the upload"
    assert not services.storage.exists(key)


def test_a_result_checked_at_upload_that_replays_an_earlier_one_is_refused(services) -> None:
    """The digest the scheduler took is the one the parameter server would: a replay is still caught."""
    job = _job(services, assignments=2)
    first, second = job.assignments
    client = _moved(job.w0, 0.01)
    job.upload_weights(first, client)  # hashed by the parameter server
    assert assimilate(services, first).outcome is Outcome.merged
    job.upload_checked(second, client)  # hashed by the scheduler

    result = assimilate(services, second)

    _assert_refused_unchanged_since(job, result, f"those of assignment {first}'s result", 1)


def _assert_refused_unchanged_since(job: Job, result: MergeResult, reason: str, version: int) -> None:
    assert result.outcome is Outcome.refused and reason in result.reason, result
    assert job.assignment(job.assignments[-1])[0] == AssignmentStatus.rejected.value
    assert job.w_s()[0] == version


def _merge_in_place(server: Params, client: Params) -> Params:
    for k, v in server.items():
        if v.dtype.kind == "f":
            v *= ALPHA
            v += (1 - ALPHA) * client[k]
    return server


def test_a_result_over_the_staleness_bound_is_refused(services) -> None:
    job = _job(services, assignments=2, max_staleness=0)
    first, stale = job.assignments
    job.upload_weights(first, _moved(job.w0, 0.01, seed=1))
    job.upload_weights(stale, _moved(job.w0, 0.01, seed=2))
    assert assimilate(services, first).outcome is Outcome.merged
    _, w_s_v1 = job.w_s()

    result = assimilate(services, stale)

    _assert_refused_unchanged(job, result, "stale result", charged=True)
    version, w_s = job.w_s()
    assert version == 1
    _assert_params_equal(w_s, w_s_v1)


def test_a_result_over_the_update_bound_is_refused(services) -> None:
    job = _job(services, max_update_norm=1.0)
    [a] = job.assignments
    job.upload_weights(a, _moved(job.w0, 1.0))  # ||Δ|| ≈ sqrt(10.8k parameters) ≈ 100

    result = assimilate(services, a)

    _assert_refused_unchanged(job, result, "exceeds", charged=True)
    version, w_s = job.w_s()
    assert version == 0
    _assert_params_equal(w_s, job.w0)
    assert job.metrics() == 0


def _shifted(params: Params, shift: float) -> Params:
    """W_c: `params` with `shift` added to every float tensor (0: W_base unchanged, a lazy host)."""
    return {k: (v + np.asarray(shift, v.dtype)) if v.dtype.kind == "f" else v for k, v in params.items()}


@pytest.mark.parametrize(
    "upload",
    [{"send": "weights"}, {"send": "delta", "dtype": "float32"}, {"send": "delta", "dtype": "int8"}],
    ids=["weights", "delta", "int8"],
)
@pytest.mark.parametrize("shift", [0.0, 0.003], ids=["zero", "constant"])
def test_a_zero_or_constant_update_is_refused_without_a_validation_section(services, upload, shift) -> None:
    """A lazy host that uploads W_base (or W_base + c everywhere) did no training: refused, charged, no credit."""
    job = _job(services, upload=upload)
    assert not load_job_spec(EXAMPLE_SPEC).validation.enabled
    [a] = job.assignments
    job.upload_weights(a, _shifted(job.w0, shift))

    result = assimilate(services, a)

    _assert_refused_unchanged(job, result, "no training", charged=True)
    version, w_s = job.w_s()
    assert version == 0
    _assert_params_equal(w_s, job.w0)


def test_a_constant_update_may_be_allowed_by_the_job(services) -> None:
    job = _job(services, min_update_spread=None)
    [a] = job.assignments
    job.upload_weights(a, _shifted(job.w0, 0.003))

    assert assimilate(services, a).outcome is Outcome.merged


@pytest.mark.parametrize("body", [b"not a safetensors blob", None], ids=["not-safetensors", "nan-delta"])
def test_a_malformed_result_is_refused(services, body) -> None:
    job = _job(services, upload={"send": "delta", "dtype": "float32"})
    [a] = job.assignments
    if body is None:  # the model's tensors, but a NaN in Δ
        client = _moved(job.w0, 0.01)
        name = next(k for k, v in client.items() if v.dtype.kind == "f")
        client[name].flat[0] = np.nan
        body = encode_result(client, job.w0, job.upload_spec)
    job.upload(a, body)

    result = assimilate(services, a)

    _assert_refused_unchanged(job, result, "invalid result", charged=True)
    version, w_s = job.w_s()
    assert version == 0
    _assert_params_equal(w_s, job.w0)


def test_a_merge_after_the_job_ended_is_refused_uncharged(services) -> None:
    """The job's merges were closed (it ended in Redis) before the ledger shows it: MergesClosed."""
    job = _job(services)
    [a] = job.assignments
    job.upload_weights(a, _moved(job.w0, 0.01))
    store.close_merges(services.r, job.job_id)

    result = assimilate(services, a)

    _assert_refused_unchanged(job, result, "job is no longer running", charged=False)
    version, w_s = job.w_s()
    assert version == 0
    _assert_params_equal(w_s, job.w0)


def test_a_loss_controlled_step_reads_the_evaluation_the_ledger_recorded(services) -> None:
    """`step_control: loss`: the first merge, before any evaluation, takes the floor's step; the
    second, after the first merge's evaluation was recorded (a new lowest loss), takes a grown one."""
    job = _job(services, assignments=2, rule="delta", server_lr=1.0, step_control="loss", step_floor=0.25)
    first, second = job.assignments
    c1, c2 = _moved(job.w0, 0.01, seed=1), _moved(job.w0, 0.01, seed=2)
    job.upload_weights(first, c1)
    assert assimilate(services, first) == MergeResult(Outcome.merged, 1)
    assert job.metrics() == 1 and merges.latest_validation(services.db, job.job_id)[0] == 1
    _, after_first = job.w_s()
    job.upload_weights(second, c2)
    assert assimilate(services, second) == MergeResult(Outcome.merged, 2)

    _, w_s = job.w_s()
    floats = [k for k, v in job.w0.items() if v.dtype.kind == "f"]
    _assert_params_equal(
        {k: after_first[k] for k in floats}, {k: job.w0[k] + 0.25 * (c1[k] - job.w0[k]) for k in floats}
    )
    grown = {k: after_first[k] + 0.25 * GROW * (c2[k] - job.w0[k]) for k in floats}
    _assert_params_equal({k: w_s[k] for k in floats}, grown)
