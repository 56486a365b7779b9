"""POST /v1/jobs refuses, with 422 naming the field and the problem, every spec that could only
give a stuck or silently wrong job, and stores nothing for it (no job row, no storage file)."""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from crowdtrain.server.ledger.models import Job, Mixture, Shard, Workunit
from tests.server.inprocess import private_scheduler

UPLOAD_LIMIT = 200_000  # bytes: cnn1d at the defaults (43 kB) fits, mlp hidden [256, 256] (0.3 MB) does not


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory) -> Iterator:
    """One in-process scheduler for the module: every refusal must leave it empty."""
    with private_scheduler(tmp_path_factory.mktemp("scheduler"), upload_max_bytes=UPLOAD_LIMIT) as app:
        yield app


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("datasets")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 16)).astype(np.float32), np.arange(60) % 3
    x_val, y_val = rng.normal(size=(12, 16)).astype(np.float32), np.arange(12) % 3
    np.savez(d / "good.npz", x=x, y=y, x_val=x_val, y_val=y_val)
    x_nan = x.copy()
    x_nan[5, 3] = np.nan
    np.savez(d / "nan.npz", x=x_nan, y=y, x_val=x_val, y_val=y_val)
    np.savez(d / "unseen.npz", x=x, y=y, x_val=x_val, y_val=np.arange(12) % 4)
    np.savez(d / "short-val.npz", x=x, y=y, x_val=x_val[:10], y_val=y_val)
    np.savez(d / "images.npz", x=rng.normal(size=(60, 3, 8, 8)), y=y)
    (d / "empty.npz").write_bytes(b"")
    return d


def spec(datasets: Path, source: str = "good.npz", model: dict | None = None, subsets: int = 3, **dataset) -> dict:
    return {
        "name": "t",
        "model": model or {"name": "cnn1d", "options": {"channels": 8}},
        "dataset": {"source": source if ":" in source else f"npz:{datasets / source}", "subsets": subsets, **dataset},
        "stop": {"target_accuracy": 0.9, "max_epochs": 2},
    }


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"source": "nan.npz"}, "dataset x: 1 values are NaN or infinite as float32 (the first in example 5)"),
        ({"source": "unseen.npz"}, "dataset y_val: classes [3] never occur in the training labels y"),
        ({"source": "short-val.npz"}, "x_val has 10 examples but y_val has 12"),
        ({"classes": 2}, "dataset y: label 2 is outside [0, 2) (dataset.classes)"),
        ({"source": "empty.npz"}, "is not a readable npz dataset: the file is empty"),
        (
            {"source": "npz:data/good.npz"},
            "'data/good.npz' is a relative path, but the scheduler reads dataset files on its own machine",
        ),
        ({"subsets": 61}, "dataset.subsets: cannot split 60 training examples into 61 shards"),
        (
            {"shuffle": "none", "reshuffle_each_epoch": True},
            "dataset.reshuffle_each_epoch needs dataset.shuffle 'stratified' or 'random'",
        ),
        ({"shuffle": "sorted"}, "dataset.shuffle"),
        (
            {"source": "images.npz"},
            "model: 'cnn1d' with options {'channels': 8} cannot take the dataset's examples shaped (3, 8, 8)",
        ),
        (
            {"model": {"name": "cnn1d", "options": {"channels": 8, "layers": 6}}},
            "cannot take the dataset's examples shaped (16,)",
        ),
        (
            {"model": {"name": "mlp"}},
            f"more than the scheduler accepts in one upload ({UPLOAD_LIMIT:,} bytes, upload_max_bytes)",
        ),
        (
            {"model": {"name": "mlp", "options": {"hidden": [65536] * 64}}},
            "bytes of parameters, more than the scheduler",
        ),
        ({"model": {"name": "cnn1d", "options": {"seed": 1}}}, "model.options.seed: not an option of 'cnn1d'"),
        ({"model": {"name": "cnn1d", "options": {"channels": 0}}}, "model.options.channels"),
        ({"model": {"name": "mlp", "options": {"hidden": [-4]}}}, "model.options.hidden.0"),
    ],
)
def test_a_spec_that_cannot_train_is_refused_and_stores_nothing(scheduler, datasets, kwargs: dict, words: str) -> None:
    resp = scheduler.http.post("/v1/jobs", json=spec(datasets, **kwargs), headers=scheduler.admin_headers)
    assert resp.status_code == 422, resp.text
    assert words in resp.text
    assert scheduler.count(Job) == 0 and scheduler.stored_files() == []


@pytest.mark.parametrize(
    ("assimilation", "words"),
    [
        ({"rule": "delta", "alpha": 0.7}, "assimilation.alpha is an option of rule vc-asgd, not of rule delta"),
        (
            {"rule": "vc-asgd", "buffer_size": 8},
            "assimilation.buffer_size is an option of rule fedbuff, not of rule vc",
        ),
        ({"rule": "sgd"}, "assimilation.rule 'sgd' is not a merge rule: one of vc-asgd, delta, fedbuff"),
    ],
)
def test_an_assimilation_section_with_another_rule_s_option_is_refused_naming_its_rule(
    scheduler, datasets, assimilation: dict, words: str
) -> None:
    resp = scheduler.http.post(
        "/v1/jobs", json=spec(datasets) | {"assimilation": assimilation}, headers=scheduler.admin_headers
    )
    assert resp.status_code == 422, resp.text
    assert words in resp.text
    assert scheduler.count(Job) == 0 and scheduler.stored_files() == []


def moe_spec(datasets: Path, **experts) -> dict:
    layout = {"layers": 1, "grid": [2, 2], "dim": 8, "hidden": 8, "k": 2, **experts}
    return spec(datasets, model={"name": "moe"}) | {"mode": "moe", "experts": layout}


@pytest.mark.parametrize(
    ("experts", "words"),
    [
        ({"dim": 4096}, "bytes of parameters, more than the scheduler accepts in one upload"),
        ({"k": 5}, "k (5) is above the 4 experts of a layer"),
        ({"grid": [2, 300]}, "grid sizes must lie in [1, 256]"),
        ({"heartbeat_seconds": 0}, "experts.heartbeat_seconds"),
    ],
)
def test_a_moe_spec_that_cannot_train_is_refused_and_stores_nothing_not_even_a_mixture(
    scheduler, datasets, experts: dict, words: str
) -> None:
    resp = scheduler.http.post("/v1/jobs", json=moe_spec(datasets, **experts), headers=scheduler.admin_headers)
    assert resp.status_code == 422, resp.text
    assert words in resp.text
    assert scheduler.count(Job) == 0 and scheduler.count(Mixture) == 0 and scheduler.stored_files() == []


def test_a_good_npz_spec_is_accepted(scheduler, datasets) -> None:
    """Runs after the refusals: the harness accepts what it should."""
    resp = scheduler.http.post("/v1/jobs", json=spec(datasets), headers=scheduler.admin_headers)
    assert resp.status_code == 201, resp.text
    assert resp.json()["shards"] == 3
    assert (scheduler.count(Job), scheduler.count(Shard), scheduler.count(Workunit)) == (1, 3, 3)


def test_a_moe_job_is_accepted_with_a_mixture_of_its_experts(scheduler, datasets) -> None:
    """Runs last in this module: the job's status names its mixture, which lists every expert."""
    resp = scheduler.http.post("/v1/jobs", json=moe_spec(datasets), headers=scheduler.admin_headers)
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["job_id"]
    mixture = scheduler.http.get(f"/v1/jobs/{job_id}", headers=scheduler.admin_headers).json()["mixture_id"]
    view = scheduler.http.get(f"/v1/mixtures/{mixture}", headers=scheduler.admin_headers).json()
    assert sorted(e["uid"] for e in view["experts"]) == ["0.0.0", "0.0.1", "0.1.0", "0.1.1"]
    assert scheduler.count(Mixture) == 1
