"""Shards at submission and per epoch, through the in-process scheduler: a class-sorted dataset gives
shards that each hold every class, and a job that re-deals each epoch hands out new shards from
epoch 2 on, written once, holding the same examples dealt anew."""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from crowdtrain.core.assimilationspec import effective_rule
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.settings import Settings
from crowdtrain.core.states import JobStatus
from crowdtrain.core.storage import open_storage
from crowdtrain.core.tensors import decode_shard, sha256
from crowdtrain.migrations import upgrade
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Job, Shard
from crowdtrain.workgen.generator import submit_job, write_epoch_shards
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import Scheduler, scheduler_app

CLASSES, EXAMPLES, SHARDS = 5, 400, 4


@pytest.fixture
def scheduler(tmp_path: Path, private_redis) -> Iterator[Scheduler]:
    with scheduler_app(tmp_path, private_redis) as app:
        yield app


@pytest.fixture
def sorted_npz(tmp_path: Path) -> Path:
    """Examples sorted by class, as many dataset files are."""
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(CLASSES), EXAMPLES // CLASSES)
    x = (rng.normal(size=(EXAMPLES, 16)) + y[:, None]).astype(np.float32)
    path = tmp_path / "sorted.npz"
    np.savez(path, x=x, y=y, x_val=x[::10], y_val=y[::10])
    return path


def submit(scheduler: Scheduler, npz: Path, **dataset) -> int:
    spec = {
        "name": "t",
        "model": {"name": "mlp", "options": {"hidden": [8]}},
        "dataset": {"source": f"npz:{npz}", "subsets": SHARDS, **dataset},
        "stop": {"target_accuracy": 0.99, "max_epochs": 5},
    }
    resp = scheduler.http.post("/v1/jobs", json=spec, headers=scheduler.admin_headers)
    assert resp.status_code == 201, resp.text
    return resp.json()["job_id"]


def shard_labels(scheduler: Scheduler, job_id: int, epoch: int) -> list[np.ndarray]:
    storage = open_storage(scheduler.settings.resolved_storage_url)
    with scheduler.db.begin() as s:
        keys = s.scalars(
            select(Shard.key).where(Shard.job_id == job_id, Shard.epoch == epoch).order_by(Shard.index)
        ).all()
    return [decode_shard(storage.get(k))[1] for k in keys]


@pytest.mark.parametrize(("shuffle", "classes_per_shard"), [("stratified", CLASSES), ("none", 2)])
def test_a_class_sorted_dataset_gives_shards_of_every_class_unless_shuffle_is_none(
    scheduler, sorted_npz, shuffle: str, classes_per_shard: int
) -> None:
    job_id = submit(scheduler, sorted_npz, shuffle=shuffle)
    labels = shard_labels(scheduler, job_id, 0)
    assert sum(len(y) for y in labels) == EXAMPLES
    if shuffle == "stratified":
        for y in labels:  # 80 of each class over 4 shards: 20 each
            assert np.bincount(y, minlength=CLASSES).tolist() == [EXAMPLES // CLASSES // SHARDS] * CLASSES
    else:  # today's contiguous slices: at most two classes each
        assert max(len(np.unique(y)) for y in labels) == classes_per_shard


def work(scheduler: Scheduler, host: dict, slots: int) -> list[dict]:
    resp = scheduler.http.post("/v1/work", json={"free_slots": slots}, headers=host)
    assert resp.status_code == 200, resp.text
    return resp.json()["assignments"]


def test_each_epoch_gets_its_own_deal_written_once_when_first_dispatched(scheduler, sorted_npz) -> None:
    job_id = submit(scheduler, sorted_npz, reshuffle_each_epoch=True)
    host = scheduler.register_host()
    first = work(scheduler, host, SHARDS)
    with scheduler.db.begin() as s:  # epoch 1 uses the deal made at submission
        shared = {sh.sha256 for sh in s.scalars(select(Shard).where(Shard.job_id == job_id, Shard.epoch == 0))}
    assert {a["epoch"] for a in first} == {1} and {a["shard"]["sha256"] for a in first} == shared

    second = work(scheduler, host, 1)  # epoch 1 has nothing left: epoch 2 is released early
    assert [a["epoch"] for a in second] == [2]
    with scheduler.db.begin() as s:
        own = s.scalars(select(Shard).where(Shard.job_id == job_id, Shard.epoch == 2).order_by(Shard.index)).all()
        written = [(sh.sha256, sh.size, sh.examples) for sh in own]
    assert all(h is not None for h, _, _ in written), "the whole epoch is written on its first dispatch"
    assert second[0]["shard"]["sha256"] in {h for h, _, _ in written} and not shared & {h for h, _, _ in written}
    assert sum(n for _, _, n in written) == EXAMPLES

    # The bytes served are those recorded; the epoch holds the same examples, dealt anew and stratified.
    blob = scheduler.http.get(second[0]["shard"]["url"], headers=host).content
    assert sha256(blob) == second[0]["shard"]["sha256"]
    before, after = shard_labels(scheduler, job_id, 0), shard_labels(scheduler, job_id, 2)
    assert sorted(np.concatenate(after).tolist()) == sorted(np.concatenate(before).tolist())
    assert all(np.bincount(y, minlength=CLASSES).tolist() == [20] * CLASSES for y in after)
    storage = open_storage(scheduler.settings.resolved_storage_url)
    x0 = np.concatenate([decode_shard(storage.get(k))[0] for k in _keys(scheduler, job_id, 0)])
    x2 = [decode_shard(storage.get(k))[0] for k in _keys(scheduler, job_id, 2)]
    assert not np.array_equal(x2[0], x0[: len(x2[0])]), "epoch 2's first shard is epoch 0's again"

    third = work(scheduler, host, SHARDS)  # the rest of epoch 2: nothing is written again
    assert sorted(a["shard_index"] for a in second + third) == list(range(SHARDS))
    with scheduler.db.begin() as s:
        job = s.get_one(Job, job_id)
        assert job.status == JobStatus.running.value
        assert write_epoch_shards(s, storage, job, 2) == 0
        again = [
            (sh.sha256, sh.size, sh.examples)
            for sh in s.scalars(select(Shard).where(Shard.job_id == job_id, Shard.epoch == 2).order_by(Shard.index))
        ]
    assert again == written


def _keys(scheduler: Scheduler, job_id: int, epoch: int) -> list[str]:
    with scheduler.db.begin() as s:
        return list(
            s.scalars(select(Shard.key).where(Shard.job_id == job_id, Shard.epoch == epoch).order_by(Shard.index))
        )


def test_a_job_without_reshuffling_shares_its_shards_across_epochs(scheduler, sorted_npz) -> None:
    submit(scheduler, sorted_npz)
    host = scheduler.register_host()
    given = work(scheduler, host, 2 * SHARDS)
    assert sorted(a["epoch"] for a in given) == [1] * SHARDS + [2] * SHARDS
    assert len({a["shard"]["sha256"] for a in given}) == SHARDS
    assert scheduler.count(Shard) == SHARDS


def test_a_job_s_creation_logs_its_effective_merge_rule(sqlite_url, private_redis, tmp_path, caplog) -> None:
    """What the spec left out is in the scheduler's log from the job's first line."""
    upgrade(sqlite_url)
    db, storage = session_factory(sqlite_url), open_storage((tmp_path / "storage").as_uri())
    spec = load_job_spec(EXAMPLE_SPEC)
    with caplog.at_level("INFO", logger="crowdtrain.workgen.generator"):
        submit_job(db, storage, private_redis, spec, Settings().upload_max_bytes)
    assert f"merge rule {effective_rule(spec.assimilation)}; running" in caplog.text
    assert "delta (server_lr 1.0, staleness_weight polynomial" in caplog.text
