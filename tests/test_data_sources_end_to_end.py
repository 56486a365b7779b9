"""Each dataset source, end to end with real processes: the operator's `crowdtrain job submit` (or
`job upload`) sends local data to the scheduler's object storage, and a client trains the job to its
target. The datasets are small and easy (separable Gaussian blobs, striped images) so each run is short.

What the csv case proves about a directory the scheduler cannot read: the operator's folder is
outside every folder the scheduler works in, and it is deleted after `crowdtrain job upload` and
before the job is submitted; the job's stored spec names the dataset by hash only. So neither
preparing the job nor training it can have read the operator's path. (It does not prove that the
scheduler process never tried to open the path during the upload itself; nothing in the upload
route is given one.)
"""

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from crowdtrain.launch.cluster import Cluster, crowdtrain_argv
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Job
from tests.test_training_end_to_end import wait_finished

pytestmark = pytest.mark.integration
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
NAMES = ["ant", "bee", "cow"]


def blobs(n: int = 600, features: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Three well-separated Gaussian blobs: a small MLP tells them apart almost perfectly."""
    rng = np.random.default_rng(0)
    centers = rng.normal(scale=4.0, size=(3, features))
    y = rng.integers(0, 3, n)
    return (centers[y] + rng.normal(size=(n, features))).astype(np.float32), y


def write_csv(folder: Path) -> str:
    x, y = blobs()
    lines = [",".join([*(f"f{i}" for i in range(x.shape[1])), "animal"])]
    lines += [",".join([*(f"{v:.5f}" for v in row), NAMES[c]]) for row, c in zip(x, y, strict=True)]
    (folder / "blobs.csv").write_text("\n".join(lines) + "\n")
    return "csv:blobs.csv"


def write_parquet(folder: Path) -> str:
    x, y = blobs()
    pq.write_table(pa.table({f"f{i}": x[:, i] for i in range(x.shape[1])} | {"animal": y}), folder / "blobs.parquet")
    return "parquet:blobs.parquet"


def write_npz(folder: Path) -> str:
    x, y = blobs()
    np.savez(folder / "blobs.npz", x=x, y=y)
    return "npz:blobs.npz"


def write_hf(folder: Path) -> str:
    datasets = pytest.importorskip("datasets")
    x, y = blobs()
    datasets.Dataset.from_dict({"x": x.tolist(), "animal": [NAMES[c] for c in y]}).save_to_disk(str(folder / "hf"))
    return "hf:hf"


def write_images(folder: Path) -> str:
    """Three classes of 12x12 grey images (horizontal stripes, vertical stripes, plain), noisy."""
    image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    stripes = (np.arange(12) // 2 % 2 * 200).astype(float)
    patterns = {"rows": np.repeat(stripes[:, None], 12, 1), "cols": np.repeat(stripes[None, :], 12, 0)}
    patterns["plain"] = np.full((12, 12), 100.0)
    for name, pattern in patterns.items():
        (folder / "images" / name).mkdir(parents=True)
        for i in range(60):
            pixels = np.clip(pattern + rng.normal(scale=20, size=(12, 12)), 0, 255).astype(np.uint8)
            image.fromarray(pixels).save(folder / "images" / name / f"{i}.png")
    return "images:images"


SOURCES = {"csv": write_csv, "parquet": write_parquet, "npz": write_npz, "hf": write_hf, "images": write_images}


def job_spec(source: str) -> dict:
    dataset = {"source": source, "subsets": 2, "label_column": "animal"}
    if source.startswith("images:"):
        dataset |= {"image_size": [8, 8], "image_mode": "L"}
    return {
        "name": f"data-{source.split(':')[0]}",
        "model": {"name": "mlp", "options": {"hidden": [32]}},
        "dataset": dataset,
        "training": {"local_epochs": 2, "batch_size": 32, "optimizer": "adam", "lr": 0.01},
        "assimilation": {"rule": "vc-asgd", "schedule": "constant", "alpha": 0.5},
        "stop": {"target_accuracy": 0.9, "max_epochs": 10},
        "scheduling": {"deadline_seconds": 60},
    }


def operator(cluster: Cluster, cwd: Path, *args: str) -> str:
    """A `crowdtrain job ...` command on the operator's side (in `cwd`); its standard output."""
    done = subprocess.run(
        crowdtrain_argv("job", *args, "--server", cluster.url),
        cwd=cwd,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def stored_source(cluster: Cluster, job_id: int) -> str:
    with session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}").begin() as s:
        return s.get_one(Job, job_id).spec["dataset"]["source"]


@pytest.fixture(scope="module")
def trained_by_one_volunteer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster and one volunteer for every data source's job, each job submitted once the one
    before it ended: a cluster and a client started per source would show nothing more."""
    cluster = Cluster(var_dir=tmp_path_factory.mktemp("sources") / "cluster").start()
    try:
        cluster.start_client("volunteer", tasks=2)
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("fmt", list(SOURCES))
def test_a_job_on_each_data_source_trains_to_its_target(trained_by_one_volunteer, tmp_path: Path, fmt: str) -> None:
    cluster = trained_by_one_volunteer
    home = tmp_path / "operator"
    home.mkdir()
    source = SOURCES[fmt](home)
    spec_file = home / "job.yaml"
    if fmt == "csv":
        # Uploaded first, then the operator's folder is gone before the job is even submitted.
        source = operator(cluster, home, "upload", source.split(":")[1], "--format", "csv").strip()
        shutil.rmtree(home)
        spec_file = tmp_path / "elsewhere" / "job.yaml"
        spec_file.parent.mkdir()
    elif fmt == "images":
        source = f"images:{home / 'images'}"  # read on the scheduler's own disk: still an option
    spec_file.write_text(yaml.safe_dump(job_spec(source)))
    extra = ["--no-upload"] if fmt == "images" else []
    created = json.loads(operator(cluster, spec_file.parent, "submit", str(spec_file), *extra))
    job_id = created["job_id"]
    if fmt != "images":
        assert stored_source(cluster, job_id).startswith(f"{fmt}:sha256:")
        shutil.rmtree(home, ignore_errors=True)  # training needs nothing of the operator's
    st = wait_finished(cluster, job_id, timeout=240)
    assert st["status"] == "succeeded", st["status_message"]
    assert max(e["mean_accuracy"] or 0 for e in st["epochs"]) >= 0.9


def test_the_same_dataset_is_uploaded_once(make_cluster, tmp_path: Path) -> None:
    cluster = make_cluster()
    write_csv(tmp_path)
    first = subprocess.run(
        crowdtrain_argv("job", "upload", "blobs.csv", "--format", "csv", "--server", cluster.url),
        cwd=tmp_path,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    second = subprocess.run(
        crowdtrain_argv("job", "upload", "blobs.csv", "--format", "csv", "--server", cluster.url),
        cwd=tmp_path,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout
    assert "uploaded" in first.stderr and "already has these bytes" in second.stderr
