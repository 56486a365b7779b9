"""POST /v1/jobs with an image-folder dataset: its images are decoded by a child process, not by the
scheduler's, so that the scheduler serves other requests meanwhile; a decoding over its time bound
is refused with 422 naming the setting, and stores nothing (crowdtrain.workgen.image_decoding).

The folder's last image is a FIFO (tests.workgen.blocking_image): decoding blocks on it until the
test writes it, so each test knows, without a clock, that decoding is under way."""

import hashlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from crowdtrain.cli.datasets import pack_folder
from crowdtrain.server.ledger.models import Job, Shard
from tests.server.inprocess import Scheduler, private_scheduler
from tests.workgen.blocking_image import (
    GUARD_SECONDS,
    holders,
    opened_by_decoder,
    release,
    unblock,
    write_folder_with_fifo,
)

pytest.importorskip("PIL.Image")
pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs FIFOs and /proc (Linux)")


@pytest.fixture(scope="module")
def sched(tmp_path_factory) -> Iterator[Scheduler]:
    with private_scheduler(tmp_path_factory.mktemp("images")) as app:
        yield app


def images_job(source: str) -> dict:
    return {
        "name": "images",
        "model": {"name": "mlp", "options": {"hidden": [8]}},
        "dataset": {"source": source, "subsets": 2, "image_size": [6, 5], "image_mode": "L"},
        "stop": {"target_accuracy": 0.9, "max_epochs": 2},
    }


def scratch_leftovers(sched: Scheduler) -> list[Path]:
    return list((sched.settings.var_dir / "scratch").glob("*"))


def test_a_datasets_images_are_decoded_by_a_child_process_not_the_schedulers(sched: Scheduler, tmp_path) -> None:
    fifo = write_folder_with_fifo(tmp_path / "images")
    with ThreadPoolExecutor(1) as pool:
        submitted = pool.submit(sched.admin().post, "/v1/jobs", json=images_job(f"images:{tmp_path / 'images'}"))
        with opened_by_decoder(fifo, submitted) as pipe:
            held = holders(fifo)
            decoders = [pid for pid in held if pid != os.getpid()]
            # The scheduler (this process) holds only the test's writing end; the image is read by its child.
            assert held[os.getpid()] == 1, held
            assert len(decoders) == 1 and psutil.Process(decoders[0]).ppid() == os.getpid(), held
            release(fifo, pipe, tmp_path)
        resp = submitted.result(timeout=GUARD_SECONDS)
    assert resp.status_code == 201, resp.text
    with sched.db.begin() as s:
        job = s.get_one(Job, resp.json()["job_id"])
        assert job.model_config_["input_shape"] == [1, 6, 5]
        assert job.spec["dataset"]["label_names"] == ["a", "b"]
    assert not scratch_leftovers(sched)


def test_other_requests_are_answered_while_a_dataset_decodes(sched: Scheduler, tmp_path) -> None:
    fifo = write_folder_with_fifo(tmp_path / "images")
    admin = sched.admin()
    jobs_before = [job["job_id"] for job in admin.get("/v1/jobs").json()]
    with ThreadPoolExecutor(1) as pool:
        submitted = pool.submit(admin.post, "/v1/jobs", json=images_job(f"images:{tmp_path / 'images'}"))
        with opened_by_decoder(fifo, submitted) as pipe:
            listed = admin.get("/v1/jobs")  # while decoding waits for the image the test has not written
            project = sched.client().get("/v1/project")
            assert not submitted.done()
            release(fifo, pipe, tmp_path)
        resp = submitted.result(timeout=GUARD_SECONDS)
    assert listed.status_code == 200 and [job["job_id"] for job in listed.json()] == jobs_before
    assert project.status_code == 200, project.text
    assert resp.status_code == 201, resp.text
    assert resp.json()["job_id"] not in jobs_before


def test_a_decoding_over_its_time_bound_is_a_422_naming_the_setting_and_stores_nothing(tmp_path) -> None:
    """The FIFO is never written: the decoding process waits on it until it is killed."""
    fifo = write_folder_with_fifo(tmp_path / "images")
    with private_scheduler(tmp_path / "sched", dataset_decode_max_seconds=0.2) as bounded:
        rows, files = bounded.rows(), bounded.stored_files()
        with ThreadPoolExecutor(1) as pool:
            submitted = pool.submit(bounded.admin().post, "/v1/jobs", json=images_job(f"images:{tmp_path / 'images'}"))
            try:
                resp = submitted.result(timeout=GUARD_SECONDS)
            finally:
                unblock(fifo)  # only a decoding never stopped still waits on the FIFO
        assert resp.status_code == 422, resp.text
        detail = resp.json()["detail"]
        assert "took longer than the 0.2 s" in detail and "CROWDTRAIN_DATASET_DECODE_MAX_SECONDS" in detail, detail
        assert bounded.rows() == rows and bounded.stored_files() == files
        assert bounded.count(Job) == 0
        assert not scratch_leftovers(bounded)
        assert holders(fifo) == {}  # the decoding process is gone


def test_an_uploaded_image_folder_is_decoded_into_a_job(sched: Scheduler, tmp_path) -> None:
    folder = tmp_path / "images"
    os.remove(write_folder_with_fifo(folder))  # a FIFO does not pack; the other images do
    pack_folder(folder, tmp_path / "images.tar")
    data = (tmp_path / "images.tar").read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    admin = sched.admin()
    assert admin.put(f"/v1/datasets/{sha}", content=data).status_code in (200, 201)
    resp = admin.post("/v1/jobs", json=images_job(f"images:sha256:{sha}"))
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["job_id"]
    with sched.db.begin() as s:
        assert s.get_one(Job, job_id).model_config_["input_shape"] == [1, 6, 5]
        shards = s.scalars(select(Shard).where(Shard.job_id == job_id)).all()
        assert len(shards) == 2 and sum(shard.examples for shard in shards) == 8  # 2 of the 10 validate
    assert not scratch_leftovers(sched)
