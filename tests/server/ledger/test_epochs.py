"""Closing epochs against a real SQLite ledger and a private Redis: what a finished job reports."""

import json
import subprocess
import sys

import numpy as np
import pytest
from sqlalchemy import func, make_url, select, update

from crowdtrain.assimilator.evaluate import FrameworkEvaluator, evaluate
from crowdtrain.assimilator.rules import merge_vc_asgd
from crowdtrain.core import keys
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.keys import final_key
from crowdtrain.core.modelfile import model_metadata, read_metadata
from crowdtrain.core.settings import Settings
from crowdtrain.core.states import JobStatus
from crowdtrain.core.storage import open_storage
from crowdtrain.core.tensors import decode, decode_shard
from crowdtrain.migrations import upgrade
from crowdtrain.server.ledger import result_records
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.epochs import close_epoch_if_complete, release_epoch
from crowdtrain.server.ledger.exports import export_final_model, export_pending_models
from crowdtrain.server.ledger.job_end import fail_job
from crowdtrain.server.ledger.jobs import cancel_job
from crowdtrain.server.ledger.models import Job, Metric, Workunit
from crowdtrain.server.paramstore import merging, store
from crowdtrain.server.services.jobs import final_model_key
from crowdtrain.workgen.generator import submit_job
from tests.conftest import EXAMPLE_SPEC


def _merge(r, job_id: int, assignment_id: int, client: dict) -> int:
    return merging.merge_once(
        r, job_id, assignment_id, lambda ws, _state, v: merge_vc_asgd(ws, client, 0.6, out=ws)
    ).version


def _easy_job(sqlite_url, r, tmp_path):
    """The example job on a fresh SQLite ledger, its target (0.01) met by any model: (db, storage, job id)."""
    upgrade(sqlite_url)
    db, storage = session_factory(sqlite_url), open_storage((tmp_path / "storage").as_uri())
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.stop.target_accuracy = 0.01
    return db, storage, submit_job(db, storage, r, spec, Settings().upload_max_bytes).job_id


def test_the_final_accuracy_is_the_exported_models(sqlite_url, private_redis, tmp_path) -> None:
    """A merge lands after the last recorded metric: the job exports that newer W_s, and must report
    its accuracy, not the older metric's."""
    r = private_redis
    db, storage, job_id = _easy_job(sqlite_url, r, tmp_path)
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        model_config, validation_key = job.model_config_, job.validation_key
    x, y = decode_shard(storage.get(validation_key))
    _, w0 = store.read(r, job_id)
    rng = np.random.default_rng(0)
    v1 = _merge(r, job_id, 1, w0)
    acc_v1 = evaluate(job_id, model_config, store.read(r, job_id)[1], x, y)[1]
    with db.begin() as s:
        s.add(Metric(job_id=job_id, epoch=1, param_version=v1, val_loss=2.0, val_accuracy=acc_v1))
        s.execute(update(Workunit).where(Workunit.job_id == job_id).values(status="done"))
    # A noisy update that scores differently from v1 (two near-chance models can tie; try a few draws).
    w1 = store.read(r, job_id)[1]
    for _ in range(20):
        noise = {
            k: (rng.standard_normal(v.shape) * 3).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in w0.items()
        }
        merged = merge_vc_asgd({k: np.array(v, copy=True) for k, v in w1.items()}, noise, 0.6)
        if evaluate(job_id, model_config, merged, x, y)[1] != pytest.approx(acc_v1):
            break
    assert _merge(r, job_id, 2, noise) == 2  # no metric for v2 (as with eval_every > 1, or a late merge)

    close_epoch_if_complete(db, storage, r, job_id, 1, FrameworkEvaluator())

    with db.begin() as s:
        job = s.get_one(Job, job_id)
        status, final_accuracy = job.status, job.final_accuracy
    exported = decode(storage.get(final_key(job_id)))
    for name, value in store.read(r, job_id)[1].items():
        np.testing.assert_array_equal(exported[name], value)  # the exported model is W_s v2
    acc_exported = evaluate(job_id, model_config, exported, x, y)[1]
    assert acc_exported != pytest.approx(acc_v1), "the test needs v1 and v2 to score differently"
    assert status == JobStatus.succeeded.value
    assert final_accuracy == pytest.approx(acc_exported, abs=1e-9)


def test_a_job_succeeds_only_if_the_model_it_exports_meets_the_target(sqlite_url, private_redis, tmp_path) -> None:
    """An epoch's mean accuracy over its merges reached the target, but W_s as it stands (a merge
    after the last metric) scores below it: training goes on; the job succeeds once W_s itself does."""
    upgrade(sqlite_url)
    db, storage, r = session_factory(sqlite_url), open_storage((tmp_path / "storage").as_uri()), private_redis
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.stop.target_accuracy, spec.stop.max_epochs = 0.9, 5
    job_id = submit_job(db, storage, r, spec, Settings().upload_max_bytes).job_id
    _, w0 = store.read(r, job_id)
    v1 = _merge(r, job_id, 1, w0)
    with db.begin() as s:
        s.add(Metric(job_id=job_id, epoch=1, param_version=v1, val_loss=0.1, val_accuracy=0.95))
        s.execute(update(Workunit).where(Workunit.job_id == job_id).values(status="done"))
    v2 = _merge(r, job_id, 2, w0)  # no metric: scored now, an untrained model near chance

    close_epoch_if_complete(db, storage, r, job_id, 1, FrameworkEvaluator())

    with db.begin() as s:
        job = s.get_one(Job, job_id)
        assert (job.status, job.current_epoch) == (JobStatus.running.value, 2), "the epoch mean alone ends nothing"
        s.add(Metric(job_id=job_id, epoch=2, param_version=v2, val_loss=0.1, val_accuracy=0.92))
        s.execute(update(Workunit).where(Workunit.job_id == job_id, Workunit.epoch == 2).values(status="done"))
    assert not storage.exists(final_key(job_id))

    close_epoch_if_complete(db, storage, r, job_id, 2, FrameworkEvaluator())

    with db.begin() as s:
        job = s.get_one(Job, job_id)
        assert job.status == JobStatus.succeeded.value and job.final_accuracy == pytest.approx(0.92)
    assert read_metadata(storage.get(final_key(job_id)))["param_version"] == str(v2)


def test_the_exported_model_says_what_it_is(sqlite_url, private_redis, tmp_path) -> None:
    """The exported file's header names the job, its spec and model, and the version and accuracy
    exported; its tensors are W_s's, read back from the parameter store's own bytes."""
    r = private_redis
    db, storage, job_id = _easy_job(sqlite_url, r, tmp_path)
    _, w0 = store.read(r, job_id)
    version = _merge(r, job_id, 1, w0)
    with db.begin() as s:
        s.add(Metric(job_id=job_id, epoch=1, param_version=version, val_loss=2.0, val_accuracy=0.25))
        s.execute(update(Workunit).where(Workunit.job_id == job_id).values(status="done"))

    close_epoch_if_complete(db, storage, r, job_id, 1, FrameworkEvaluator())

    exported = storage.get(final_key(job_id))
    meta = read_metadata(exported)
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        assert meta == model_metadata(job_id, job.name, job.spec, job.model_config_, version, 0.25)
    assert json.loads(meta["job_spec"])["name"] == load_job_spec(EXAMPLE_SPEC).name and meta["param_version"] == "1"
    stored = store.read_blob(r, job_id)[1]
    assert exported.endswith(stored[8 + int.from_bytes(stored[:8], "little") :])


@pytest.mark.parametrize(
    ("target", "max_epochs", "status", "current_epoch"),
    [
        (0.5, 5, JobStatus.succeeded, 2),  # epoch 2 reaches the target
        (0.99, 2, JobStatus.failed, 2),  # epoch 2 is the last
        (0.99, 5, JobStatus.running, 3),  # neither: epoch 3 is released
    ],
)
def test_a_newer_epoch_that_closes_first_waits_for_the_older(
    sqlite_url, private_redis, tmp_path, target, max_epochs, status, current_epoch
) -> None:
    """Epoch 2, released early, closes while a workunit of epoch 1 is still running: the stop rule
    waits (the running workunit is not cancelled), then applies to both epochs once epoch 1 closes."""
    upgrade(sqlite_url)
    db, storage, r = session_factory(sqlite_url), open_storage((tmp_path / "storage").as_uri()), private_redis
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.stop.target_accuracy, spec.stop.max_epochs = target, max_epochs
    job_id = submit_job(db, storage, r, spec, Settings().upload_max_bytes).job_id
    with db.begin() as s:
        release_epoch(s, s.get_one(Job, job_id), 2)
    with db.begin() as s:
        s.execute(update(Workunit).where(Workunit.job_id == job_id).values(status="done"))
        straggler = s.scalars(select(Workunit.id).where(Workunit.job_id == job_id, Workunit.epoch == 1)).first()
        s.execute(update(Workunit).where(Workunit.id == straggler).values(status="in_progress"))
        s.add(Metric(job_id=job_id, epoch=1, param_version=0, val_loss=2.0, val_accuracy=0.1))
        s.add(Metric(job_id=job_id, epoch=2, param_version=0, val_loss=1.0, val_accuracy=0.9))

    close_epoch_if_complete(db, storage, r, job_id, 2, FrameworkEvaluator())

    with db.begin() as s:
        assert s.get_one(Job, job_id).status == JobStatus.running.value
        assert s.get_one(Workunit, straggler).status == "in_progress"
        s.execute(update(Workunit).where(Workunit.id == straggler).values(status="done"))

    close_epoch_if_complete(db, storage, r, job_id, 1, FrameworkEvaluator())

    with db.begin() as s:
        job = s.get_one(Job, job_id)
        assert (job.status, job.current_epoch) == (status.value, current_epoch)
        assert s.scalar(select(func.count()).select_from(Workunit).where(Workunit.status == "cancelled")) == 0
        if status != JobStatus.running:
            assert "epoch 2" in job.status_message or "max_epochs=2" in job.status_message


@pytest.mark.parametrize("end", ["failed", "cancelled"])
def test_the_end_of_a_job_deletes_what_only_its_merges_read(sqlite_url, private_redis, tmp_path, end) -> None:
    """The replay digests, recent norms, failed-merge count and workunit owners go with the job's end;
    what a late merge task still reads (the closed flag, the merged set, the merge log, W_s) stays, and
    a late task writes none of the deleted keys back."""
    upgrade(sqlite_url)
    db, storage, r = session_factory(sqlite_url), open_storage((tmp_path / "storage").as_uri()), private_redis
    job_id = submit_job(db, storage, r, load_job_spec(EXAMPLE_SPEC), Settings().upload_max_bytes).job_id
    _, w0 = store.read(r, job_id)
    merging.merge_once(r, job_id, 1, lambda ws, _s, _v: ws, update_norm=1.0, workunit_id=7)
    assert result_records.first_with_digest(r, job_id, "a" * 64, 1) == 1
    assert store.count_merge_failure(r, job_id) == 1
    forgotten = [keys.result_digests, keys.update_norms, keys.merge_failures, keys.merged_workunits]
    kept = [keys.closed, keys.merged, keys.merge_log, keys.version, keys.params_size]
    assert all(r.exists(key(job_id)) for key in forgotten + kept[1:])

    if end == "failed":
        assert fail_job(db, storage, r, job_id, "given up", FrameworkEvaluator())
    else:
        assert cancel_job(db, r, job_id) == JobStatus.cancelled.value

    assert [key.__name__ for key in forgotten if r.exists(key(job_id))] == []
    assert [key.__name__ for key in kept if not r.exists(key(job_id))] == []
    assert result_records.first_with_digest(r, job_id, "a" * 64, 2) == 2, "a late task records no digest"
    assert store.count_merge_failure(r, job_id) == 0
    assert [key.__name__ for key in forgotten if r.exists(key(job_id))] == []


def test_the_stop_rule_scores_the_version_it_exports_once(sqlite_url, private_redis, tmp_path) -> None:
    """W_s has a merge after the last metric: the stop rule evaluates that version, and the export
    reports the same figure without evaluating it again."""
    r = private_redis
    db, storage, job_id = _easy_job(sqlite_url, r, tmp_path)
    _, w0 = store.read(r, job_id)
    v1 = _merge(r, job_id, 1, w0)
    with db.begin() as s:
        s.add(Metric(job_id=job_id, epoch=1, param_version=v1, val_loss=2.0, val_accuracy=0.25))
        s.execute(update(Workunit).where(Workunit.job_id == job_id).values(status="done"))
    v2 = _merge(r, job_id, 2, w0)
    calls = []

    class Counted(FrameworkEvaluator):
        def evaluate(self, *args, **kwargs):
            calls.append(args[0])
            return super().evaluate(*args, **kwargs)

    close_epoch_if_complete(db, storage, r, job_id, 1, Counted())

    with db.begin() as s:
        job = s.get_one(Job, job_id)
        assert job.status == JobStatus.succeeded.value and job.final_accuracy is not None
    assert calls == [job_id], "scored once"
    assert read_metadata(storage.get(final_key(job_id)))["param_version"] == str(v2)


def _ended_job(sqlite_url, r, tmp_path):
    """The example job with one merge measured and its first epoch done, ready to end at the target."""
    db, storage, job_id = _easy_job(sqlite_url, r, tmp_path)
    version = _merge(r, job_id, 1, store.read(r, job_id)[1])
    with db.begin() as s:
        s.add(Metric(job_id=job_id, epoch=1, param_version=version, val_loss=2.0, val_accuracy=0.25))
        s.execute(update(Workunit).where(Workunit.job_id == job_id).values(status="done"))
    return db, storage, job_id, version


def test_the_final_model_is_written_after_the_end_commits_not_under_the_jobs_lock(
    sqlite_url, private_redis, tmp_path
) -> None:
    db, storage, job_id, version = _ended_job(sqlite_url, private_redis, tmp_path)
    put = storage.put
    seen_when_written: list[tuple[str, str | None]] = []

    def watched_put(key: str, data: bytes) -> None:
        if key == final_key(job_id):  # read on a connection of its own: what is committed by now
            with db.begin() as s:
                job = s.get_one(Job, job_id)
                seen_when_written.append((job.status, job.final_key))
        put(key, data)

    storage.put = watched_put
    close_epoch_if_complete(db, storage, private_redis, job_id, 1, FrameworkEvaluator())

    assert seen_when_written == [(JobStatus.succeeded.value, None)], "the end was committed before the write"
    with db.begin() as s:
        assert s.get_one(Job, job_id).final_key == final_key(job_id)
    assert read_metadata(storage.get(final_key(job_id)))["param_version"] == str(version)


def test_an_export_lost_between_the_end_and_the_write_is_written_by_the_next_sweep_or_download(
    sqlite_url, private_redis, tmp_path
) -> None:
    """The process that ended the job could not write its model (storage down, or it died): the job
    has ended all the same, with no model yet; the transitioner's sweep writes it, exactly as the end
    would have, and a download that comes first writes it itself."""
    db, storage, job_id, version = _ended_job(sqlite_url, private_redis, tmp_path)
    put = storage.put

    def storage_down(key: str, data: bytes) -> None:
        raise OSError("object storage unreachable")

    storage.put = storage_down
    close_epoch_if_complete(db, storage, private_redis, job_id, 1, FrameworkEvaluator())
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        assert (job.status, job.final_key, job.final_accuracy) == (JobStatus.succeeded.value, None, 0.25)
    assert not storage.exists(final_key(job_id))

    storage.put = put
    assert export_pending_models(db, storage, private_redis) == 1
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        assert job.final_key == final_key(job_id)
        expected = model_metadata(job_id, job.name, job.spec, job.model_config_, version, 0.25)
    assert read_metadata(storage.get(final_key(job_id))) == expected
    assert export_pending_models(db, storage, private_redis) == 0, "nothing left to export"
    assert export_final_model(db, storage, private_redis, job_id) == final_key(job_id), "idempotent"


def test_a_download_that_comes_before_the_sweep_writes_the_model_itself(sqlite_url, private_redis, tmp_path) -> None:
    db, storage, job_id, version = _ended_job(sqlite_url, private_redis, tmp_path)
    put = storage.put
    storage.put = lambda key, data: (_ for _ in ()).throw(OSError("object storage unreachable"))
    close_epoch_if_complete(db, storage, private_redis, job_id, 1, FrameworkEvaluator())
    storage.put = put

    assert final_model_key(db, storage, private_redis, job_id) == final_key(job_id)
    assert read_metadata(storage.get(final_key(job_id)))["param_version"] == str(version)


class _WriterMeanwhile:
    """An evaluator that, before it scores, has another process take SQLite's write lock and commit
    (`BEGIN IMMEDIATE`, with 60 s to get it), and waits for that process: were the job's end to
    evaluate inside its transaction, the writer would wait on the end's lock and the end on the writer
    until the writer gives up, and `writes` would record the failure."""

    def __init__(self, path: str):
        self.path, self.writes = path, []
        self.scorer = FrameworkEvaluator()

    def evaluate(self, job_id, model_config, params, x, y):
        code = (
            "import sqlite3, sys\n"
            "db = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)\n"
            "db.execute('BEGIN IMMEDIATE')\n"
            "db.execute('UPDATE workunits SET error_count = error_count WHERE id = -1')\n"
            "db.execute('COMMIT')\n"
        )
        done = subprocess.run([sys.executable, "-c", code, self.path], capture_output=True, text=True, timeout=120)
        self.writes.append((done.returncode, done.stderr[-500:]))
        return self.scorer.evaluate(job_id, model_config, params, x, y)


@pytest.mark.parametrize("end", ["stop rule", "failure"])
def test_a_job_s_end_scores_its_model_with_no_lock_held_so_another_process_writes_meanwhile(
    end, sqlite_url, private_redis, tmp_path
) -> None:
    """The exported W_s has no recorded metric, so the job's end must evaluate it: it does so outside
    its transaction, and a writer in another process commits during the evaluation (on SQLite the job
    row's lock is the database's write lock). The end then records that evaluation's accuracy."""
    r = private_redis
    db, storage, job_id = _easy_job(sqlite_url, r, tmp_path)
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        model_config, validation_key = job.model_config_, job.validation_key
    _, w0 = store.read(r, job_id)
    version = _merge(r, job_id, 1, w0)  # no metric of v1: the end must score it
    with db.begin() as s:
        s.add(Metric(job_id=job_id, epoch=1, param_version=0, val_loss=2.0, val_accuracy=0.5))
        s.execute(update(Workunit).where(Workunit.job_id == job_id).values(status="done"))
    evaluator = _WriterMeanwhile(make_url(sqlite_url).database)

    if end == "stop rule":
        close_epoch_if_complete(db, storage, r, job_id, 1, evaluator)
    else:
        assert fail_job(db, storage, r, job_id, "given up", evaluator)

    assert evaluator.writes == [(0, "")]
    x, y = decode_shard(storage.get(validation_key))
    with db.begin() as s:
        job = s.get_one(Job, job_id)
        status, final_accuracy = job.status, job.final_accuracy
    assert status == (JobStatus.succeeded.value if end == "stop rule" else JobStatus.failed.value)
    assert final_accuracy == pytest.approx(evaluate(job_id, model_config, store.read(r, job_id)[1], x, y)[1])
    assert store.read(r, job_id)[0] == version
