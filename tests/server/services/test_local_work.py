"""Dynamic local work: a host's share of the local epochs follows its measured speed on the job.

Pure tests of the speed and fraction arithmetic, then dispatch through the in-process scheduler:
a slow host gets a smaller `local_fraction` than a fast one, an unmeasured host and any host of a
job without `training.dynamic_local_work` get 1, and the fraction is kept on the assignment."""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from crowdtrain.server.ledger.models import Assignment
from crowdtrain.server.services.local_work import REFERENCE_QUANTILE, host_speeds, local_fraction
from tests.server.inprocess import Scheduler, scheduler_app

SHARD_EXAMPLES, LOCAL_EPOCHS = 50, 2


def test_a_hosts_speed_is_its_total_examples_over_total_seconds() -> None:
    speeds = host_speeds([(1, 100, 1.0), (1, 300, 3.0), (2, 100, 4.0), (3, 100, 0.0), (2, 50, 2.0)])
    assert speeds == {1: 100.0, 2: 25.0}  # host 3 reported no time: not measured


@pytest.mark.parametrize(
    ("host", "speeds", "expected"),
    [
        (100.0, [100.0, 50.0], 1.0),
        (50.0, [100.0, 50.0], 50.0 / (50.0 + REFERENCE_QUANTILE * 50.0)),
        (10.0, [100.0, 10.0], 0.25),  # below min_local_fraction
        (None, [100.0, 50.0], 1.0),  # never measured
        (50.0, [], 1.0),
        (500.0, [100.0, 500.0], 1.0),
    ],
)
def test_the_fraction_is_speed_over_a_high_quantile_clipped(host, speeds, expected) -> None:
    assert local_fraction(host, speeds, 0.25) == pytest.approx(expected)


def test_one_absurd_claim_among_many_hosts_does_not_shrink_the_others_work() -> None:
    honest = list(np.linspace(90.0, 110.0, 19))
    assert local_fraction(100.0, honest + [1e9], 0.25) > 0.9


@pytest.fixture
def scheduler(tmp_path: Path, private_redis) -> Iterator[Scheduler]:
    with scheduler_app(tmp_path, private_redis) as app:
        yield app


@pytest.fixture
def npz(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    y = np.arange(8 * SHARD_EXAMPLES) % 4
    x = rng.normal(size=(len(y), 16)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=y, x_val=x[:40], y_val=y[:40])
    return tmp_path / "d.npz"


def submit(scheduler: Scheduler, npz: Path, dynamic: bool) -> int:
    spec = {
        "name": "t",
        "model": {"name": "mlp", "options": {"hidden": [8]}},
        "dataset": {"source": f"npz:{npz}", "subsets": 8},
        "training": {"local_epochs": LOCAL_EPOCHS, "dynamic_local_work": dynamic, "min_local_fraction": 0.1},
        "stop": {"target_accuracy": 0.99, "max_epochs": 5},
    }
    resp = scheduler.http.post("/v1/jobs", json=spec, headers=scheduler.admin_headers)
    assert resp.status_code == 201, resp.text
    return resp.json()["job_id"]


def work(scheduler: Scheduler, host: dict) -> dict:
    resp = scheduler.http.post("/v1/work", json={"free_slots": 1}, headers=host)
    assert resp.status_code == 200, resp.text
    (a,) = resp.json()["assignments"]
    return a


def upload(scheduler: Scheduler, host: dict, a: dict, examples: int, seconds: float) -> None:
    """Send back the snapshot itself, with the speed figures a host of that speed would report."""
    body = scheduler.http.get(a["snapshot"]["url"], headers=host).content
    resp = scheduler.http.put(
        f"/v1/assignments/{a['assignment_id']}/result",
        content=body,
        headers=host,
        params={"train_loss": 1.0, "examples": examples, "seconds": seconds},
    )
    assert resp.status_code == 202, resp.text


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_slow_host_gets_less_local_work_than_a_fast_one_in_a_dynamic_job(scheduler, npz, dynamic: bool) -> None:
    submit(scheduler, npz, dynamic)
    fast, slow, liar = (scheduler.register_host(name) for name in ("fast", "slow", "liar"))
    full = SHARD_EXAMPLES * LOCAL_EPOCHS
    first = {name: work(scheduler, h) for name, h in (("fast", fast), ("slow", slow), ("liar", liar))}
    assert {a["local_fraction"] for a in first.values()} == {1.0}  # nobody measured yet
    upload(scheduler, fast, first["fast"], full, 1.0)  # 100 examples/s
    upload(scheduler, slow, first["slow"], full, 4.0)  # 25 examples/s
    # Claims more examples than its shard holds: counted as the shard's, so 100 examples / 2 s.
    upload(scheduler, liar, first["liar"], 10**9, 2.0)

    again = {name: work(scheduler, h) for name, h in (("fast", fast), ("slow", slow), ("liar", liar))}
    newcomer = work(scheduler, scheduler.register_host("new"))
    fractions = {name: a["local_fraction"] for name, a in again.items()}
    if not dynamic:
        assert set(fractions.values()) == {1.0} and newcomer["local_fraction"] == 1.0
        return
    reference = float(np.quantile([100.0, 25.0, 50.0], 0.9))
    assert fractions["fast"] == 1.0
    assert fractions["slow"] == pytest.approx(25.0 / reference)
    assert fractions["liar"] == pytest.approx(50.0 / reference)
    assert newcomer["local_fraction"] == 1.0
    with scheduler.db.begin() as s:  # kept with the assignment, as sent
        kept = dict(
            s.execute(
                select(Assignment.id, Assignment.local_fraction).where(
                    Assignment.id.in_([a["assignment_id"] for a in again.values()])
                )
            ).all()
        )
    assert kept == {a["assignment_id"]: a["local_fraction"] for a in again.values()}
