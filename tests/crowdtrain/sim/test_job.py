"""The simulator's job changes statuses only as the ledger's table allows (crowdtrain.server.ledger.states)."""

import numpy as np
import pytest

from crowdtrain.core.jobspec import JobSpec
from crowdtrain.core.states import AssignmentStatus, JobStatus, WorkunitStatus
from crowdtrain.server.ledger.states import IllegalTransition
from crowdtrain.sim.job import SimJob
from tests.crowdtrain.sim.conftest import job


def _sim_job() -> SimJob:
    spec = JobSpec.model_validate(job(subsets=2, max_epochs=2)).model_dump(mode="json")
    return SimJob(spec, {"w": np.zeros(4, dtype=np.float32)}, shards=2, backpressure=False)


def test_a_timed_out_assignment_frees_its_workunit_and_every_move_is_one_the_ledger_allows() -> None:
    sim = _sim_job()
    a = sim.dispatch(host=1, cached=set(), now=0.0, timeout=10.0)
    assert a is not None and a.wu.status == WorkunitStatus.in_progress
    assert sim.time_out(a, now=11.0)
    assert a.status == AssignmentStatus.timed_out and a.wu.status == WorkunitStatus.ready
    assert not sim.time_out(a, now=12.0), "an assignment times out once"


def test_a_move_the_ledger_forbids_is_refused_in_the_simulator_too() -> None:
    """The simulator holds no table of its own: a workunit that is done cannot be made ready again,
    and a job that ended cannot end again, exactly as in the ledger."""
    sim = _sim_job()
    a = sim.dispatch(host=1, cached=set(), now=0.0, timeout=10.0)
    assert a is not None
    sim._settle(a.wu, WorkunitStatus.done)
    with pytest.raises(IllegalTransition, match="cannot go from done to ready"):
        sim._make_ready(a.wu)
    sim._finish(JobStatus.failed, "ended")
    assert not sim.running
    with pytest.raises(IllegalTransition, match="cannot go from failed to succeeded"):
        sim._finish(JobStatus.succeeded, "again")
