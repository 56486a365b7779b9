"""/v1/datasets: the operator's dataset uploads, stored by content hash. A refused upload (wrong hash,
too large, empty, not the operator) is a 4xx and stores nothing; the same bytes twice are stored
once; a job names an uploaded dataset by its hash, and an unknown hash is a 422."""

import hashlib
from collections.abc import Iterator

import pytest

from crowdtrain.cli.datasets import pack_folder
from crowdtrain.core import keys
from crowdtrain.server.ledger.models import Job
from tests.server.inprocess import Scheduler, private_scheduler

pytest.importorskip("pyarrow")
LIMIT = 4096  # bytes: dataset_max_bytes of this scheduler
CSV = "a,b,label\n" + "".join(f"{i},{-i},{'cat' if i % 2 else 'dog'}\n" for i in range(60))


@pytest.fixture(scope="module")
def sched(tmp_path_factory) -> Iterator[Scheduler]:
    with private_scheduler(tmp_path_factory.mktemp("datasets"), dataset_max_bytes=LIMIT) as app:
        yield app


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chunks(data: bytes, size: int = 100) -> Iterator[bytes]:
    """The body in pieces, as `crowdtrain job submit` streams it (chunked transfer encoding here)."""
    for i in range(0, len(data), size):
        yield data[i : i + size]


def leftovers(sched: Scheduler) -> list:
    return list((sched.settings.var_dir / "scratch").glob("*"))


def test_an_upload_is_stored_under_its_hash_once(sched: Scheduler) -> None:
    data, admin = CSV.encode(), sched.admin()
    assert admin.get(f"/v1/datasets/{sha(data)}").status_code == 404
    first = admin.put(f"/v1/datasets/{sha(data)}", content=chunks(data))
    assert first.status_code == 201, first.text
    assert first.json() == {"sha256": sha(data), "created": True}
    assert (sched.storage_dir / keys.dataset_key(sha(data))).read_bytes() == data
    again = admin.put(f"/v1/datasets/{sha(data)}", content=data)
    assert again.status_code == 200 and again.json()["created"] is False
    assert admin.get(f"/v1/datasets/{sha(data)}").json() == {"sha256": sha(data), "created": False}
    assert not leftovers(sched)


@pytest.mark.parametrize(
    ("name", "body", "code", "words"),
    [
        ("wrong hash", b"abc", 400, "the body's sha256 is"),
        ("broken off", CSV.encode()[:100], 400, "an interrupted upload?"),
        ("empty", b"", 400, "the dataset is empty"),
        ("too large", b"x" * (LIMIT + 1), 413, f"exceeds the limit of {LIMIT} bytes"),
    ],
)
def test_a_refused_upload_is_a_4xx_and_stores_nothing(sched: Scheduler, name, body, code, words) -> None:
    named = sha(CSV.encode() + b"#") if name in ("wrong hash", "broken off") else sha(body)
    before = sched.stored_files()
    resp = sched.admin().put(f"/v1/datasets/{named}", content=chunks(body) if body else body)
    assert resp.status_code == code, resp.text
    assert words in resp.json()["detail"]
    assert sched.stored_files() == before
    assert not leftovers(sched)


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read(sched: Scheduler) -> None:
    resp = sched.admin().put(f"/v1/datasets/{'b' * 64}", content=b"x", headers={"Content-Length": str(LIMIT + 1)})
    assert resp.status_code == 413


@pytest.mark.parametrize("name", ["abc", "A" * 64, "g" * 64])
def test_a_name_that_is_no_sha256_is_refused(sched: Scheduler, name: str) -> None:
    assert sched.admin().put(f"/v1/datasets/{name}", content=b"x").status_code == 422
    assert sched.admin().get(f"/v1/datasets/{name}").status_code == 422


def test_only_the_operator_may_upload(sched: Scheduler) -> None:
    data = b"a,label\n1,x\n"
    assert sched.client().put(f"/v1/datasets/{sha(data)}", content=data).status_code == 401
    host = sched.register("uploader")
    assert host.put(f"/v1/datasets/{sha(data)}", content=data).status_code == 401
    assert not (sched.storage_dir / keys.dataset_key(sha(data))).exists()


def job_spec(source: str) -> dict:
    return {
        "name": "uploaded",
        "model": {"name": "mlp", "options": {"hidden": [8]}},
        "dataset": {"source": source, "subsets": 2},
        "stop": {"target_accuracy": 0.9, "max_epochs": 2},
    }


def test_a_job_trains_on_an_uploaded_table_and_records_its_label_order(sched: Scheduler) -> None:
    data, admin = CSV.encode(), sched.admin()
    assert admin.put(f"/v1/datasets/{sha(data)}", content=data).status_code in (200, 201)
    resp = admin.post("/v1/jobs", json=job_spec(f"csv:sha256:{sha(data)}"))
    assert resp.status_code == 201, resp.text
    with sched.db.begin() as s:
        job = s.get_one(Job, resp.json()["job_id"])
        assert job.spec["dataset"]["label_names"] == ["cat", "dog"]
        assert job.model_config_["input_shape"] == [2]


def test_a_job_naming_a_dataset_never_uploaded_is_refused(sched: Scheduler) -> None:
    jobs = sched.count(Job)
    resp = sched.admin().post("/v1/jobs", json=job_spec(f"csv:sha256:{'c' * 64}"))
    assert resp.status_code == 422
    assert f"no dataset with sha256 {'c' * 64} was uploaded" in resp.json()["detail"]
    assert sched.count(Job) == jobs


def test_an_image_folder_declaring_more_pixels_than_the_bound_is_a_422_and_stores_no_job(tmp_path) -> None:
    """Images are bounded by the pixels their headers declare, in all, before one is decoded."""
    image = pytest.importorskip("PIL.Image")
    folder = tmp_path / "images"
    for name in ("a", "b"):
        (folder / name).mkdir(parents=True)
        for i in range(4):
            image.new("L", (100, 100), color=255 * (name == "a")).save(folder / name / f"{i}.png")
    pack_folder(folder, tmp_path / "images.tar")
    data = (tmp_path / "images.tar").read_bytes()
    with private_scheduler(tmp_path / "sched", dataset_max_pixels=50_000) as bounded:
        admin = bounded.admin()
        assert admin.put(f"/v1/datasets/{sha(data)}", content=data).status_code in (200, 201)
        resp = admin.post("/v1/jobs", json=job_spec(f"images:sha256:{sha(data)}"))
        assert resp.status_code == 422, resp.text
        detail = resp.json()["detail"]
        assert "8 images declare 80,000 pixels" in detail and "CROWDTRAIN_DATASET_MAX_PIXELS" in detail, detail
        assert bounded.count(Job) == 0
