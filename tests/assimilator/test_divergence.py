"""A job whose W_s diverges stops, saying why: a real SQLite ledger, file storage and a private Redis,
the merge as a parameter server runs it (tests.assimilator.test_merge)."""

from crowdtrain.assimilator.merge import MergeResult, Outcome, assimilate
from crowdtrain.core import merge_stages
from crowdtrain.core.states import JobStatus
from crowdtrain.server.ledger.models import Job as JobRow
from crowdtrain.server.ledger.models import Metric
from tests.assimilator.test_merge import _job, _moved


def test_a_job_whose_w_s_diverges_fails_saying_so_and_takes_no_more_merges(services) -> None:
    job = _job(services, 2, divergence_factor=1.5, divergence_patience=1)
    first, second = job.assignments
    with services.db.begin() as s:  # as if W_s had scored far better before: the untrained model is 100x worse
        s.add(Metric(job_id=job.job_id, epoch=1, param_version=0, val_loss=0.02, val_accuracy=0.99))
    job.upload_weights(first, _moved(job.w0, 0.01))

    assert assimilate(services, first, stamps=merge_stages.received()) == MergeResult(Outcome.merged, 1)

    with services.db.begin() as s:
        row = s.get_one(JobRow, job.job_id)
        assert row.status == JobStatus.failed.value
        assert "W_s diverged" in row.status_message and "above 1.5 x its lowest, 0.02" in row.status_message
        assert row.final_key is not None, "the model is exported as it stands"
    job.upload_weights(second, _moved(job.w0, 0.01, seed=1))
    later = assimilate(services, second, stamps=merge_stages.received())
    assert later.outcome == Outcome.refused and "no longer running" in later.reason


def test_a_job_whose_losses_stay_near_their_lowest_goes_on(services) -> None:
    job = _job(services, 2, divergence_factor=1.5, divergence_patience=1)
    for seed, a in enumerate(job.assignments):
        job.upload_weights(a, _moved(job.w0, 0.01, seed=seed))
        assert assimilate(services, a, stamps=merge_stages.received()).outcome == Outcome.merged
    with services.db.begin() as s:
        assert s.get_one(JobRow, job.job_id).status == JobStatus.running.value
