"""One definition of a job's best accuracy: the best figure of its closed epochs. A job whose closed
epoch 1 scored 0.6 while its unfinished epoch 2 scores 0.9 so far shows 0.6 on the dashboard's job
page, the public project page, `crowdtrain job status` and the demo's summary, each labelled so."""

import pytest
from fastapi.testclient import TestClient
from rich.console import Console

from crowdtrain.cli.demo import summary_table
from crowdtrain.cli.progress import status_table
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.schemas_jobs import BEST_LABEL, EpochFigures, JobStatusOut, best_closed_epoch
from crowdtrain.core.states import WorkunitStatus
from crowdtrain.server.ledger.epochs import release_epoch
from crowdtrain.server.ledger.job_end import lock_job
from crowdtrain.server.ledger.models import Metric, Workunit
from tests.conftest import EXAMPLE_SPEC
from tests.server.inprocess import ADMIN_TOKEN, Scheduler, ok, scheduler_app

CLOSED = [0.5, 0.7]  # epoch 1's merges: figure 0.6
UNFINISHED = [0.9]  # epoch 2's so far


@pytest.fixture
def sched(tmp_path, private_redis):
    with scheduler_app(tmp_path / "var", private_redis) as app:
        yield app


def job_with_an_unfinished_better_epoch(sched: Scheduler) -> int:
    spec = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    job_id = ok(sched.admin().post("/v1/jobs", json=spec)).json()["job_id"]
    with sched.db.begin() as s:
        job = lock_job(s, job_id)
        for wu in s.query(Workunit).filter_by(job_id=job_id, epoch=1):
            wu.status = WorkunitStatus.done.value
        assert release_epoch(s, job, 2)
        s.add_all(
            Metric(job_id=job_id, epoch=epoch, param_version=v, val_loss=1.0, val_accuracy=acc)
            for v, (epoch, acc) in enumerate([(1, a) for a in CLOSED] + [(2, a) for a in UNFINISHED], start=1)
        )
    return job_id


def test_every_view_shows_the_best_of_closed_epochs(sched: Scheduler) -> None:
    job_id = job_with_an_unfinished_better_epoch(sched)
    best = pytest.approx(sum(CLOSED) / len(CLOSED))

    st = JobStatusOut.model_validate(ok(sched.admin().get(f"/v1/jobs/{job_id}")).json())
    assert [(e.epoch, e.closed) for e in st.epochs] == [(1, True), (2, False)]
    assert st.epochs[1].mean_accuracy == pytest.approx(0.9)
    assert st.best_epoch_accuracy == best

    browser = TestClient(sched.app, base_url="https://testserver", follow_redirects=False)
    assert browser.post("/dashboard/login", data={"token": ADMIN_TOKEN}).status_code == 303
    assert ok(browser.get(f"/dashboard/api/jobs/{job_id}")).json()["job"]["best_epoch_accuracy"] == best
    assert f">{BEST_LABEL}<" in browser.get(f"/dashboard/jobs/{job_id}").text

    (public,) = ok(browser.get("/v1/project")).json()["jobs"]
    assert public["best_accuracy"] == best
    assert f">{BEST_LABEL}<" in browser.get("/project").text

    console = Console(width=200, record=True)
    console.print(status_table(st))
    console.print(summary_table(st, wall=1.0))
    shown = console.export_text()
    assert f"{BEST_LABEL} 0.600 (epoch 1)" in shown  # job status
    assert BEST_LABEL in shown and "0.6000 (epoch 1)" in shown  # the demo's summary
    assert "0.9000" not in shown


def figures(epoch: int, workunits: int, done: int, failed: int, mean: float | None) -> EpochFigures:
    return EpochFigures(
        epoch=epoch,
        workunits=workunits,
        done=done,
        failed=failed,
        merges=1,
        mean_accuracy=mean,
        min_accuracy=mean,
        max_accuracy=mean,
    )


def test_best_closed_epoch_skips_running_and_cut_short_epochs() -> None:
    running, cut_short = figures(3, 4, 2, 0, 0.95), figures(4, 4, 1, 0, 0.99)  # the rest cancelled with the job
    assert best_closed_epoch([figures(1, 4, 4, 0, 0.5), figures(2, 4, 3, 1, 0.8), running, cut_short]).epoch == 2
    assert best_closed_epoch([running]) is None and best_closed_epoch([]) is None
    # A DeDLOC step has no workunits: recorded once committed, it counts.
    assert best_closed_epoch([figures(7, 0, 0, 0, 0.4)]).epoch == 7
    # Equal figures: the first.
    assert best_closed_epoch([figures(1, 1, 1, 0, 0.5), figures(2, 1, 1, 0, 0.5)]).epoch == 1
