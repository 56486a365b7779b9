"""Semi-synchronous rounds as the spec states them and the pure rules the scheduler, the parameter
servers and the simulator share (crowdtrain.core.rounds)."""

import pytest
from pydantic import ValidationError

from crowdtrain.core import rounds
from crowdtrain.core.assimilationspec import FedBuffSpec
from crowdtrain.core.jobspec import JobSpec, load_job_spec
from crowdtrain.server.services.backpressure import BudgetTerms
from tests.conftest import EXAMPLE_SPEC

FEDBUFF_4 = {"rule": "fedbuff", "buffer_size": 4, "outer_optimizer": "nesterov", "server_lr": 0.7}


def spec(assimilation: dict, **scheduling) -> dict:
    base = load_job_spec(EXAMPLE_SPEC).model_dump(mode="json")
    return JobSpec.model_validate(
        base | {"assimilation": assimilation, "scheduling": base["scheduling"] | scheduling}
    ).model_dump(mode="json")


def test_rounds_need_the_fedbuff_rule_and_set_the_budget_themselves() -> None:
    with pytest.raises(ValidationError, match="scheduling.rounds needs assimilation.rule 'fedbuff'"):
        spec({"rule": "delta"}, rounds=True)
    with pytest.raises(ValidationError, match="drop max_in_flight"):
        spec(FEDBUFF_4, rounds=True, max_in_flight=8)
    assert rounds.round_size(spec(FEDBUFF_4, rounds=True)) == 4
    assert rounds.round_size(spec(FEDBUFF_4)) is None
    assert rounds.round_size({"assimilation": FEDBUFF_4}) is None, "a spec stored before the field: no rounds"


def test_a_stored_spec_without_buffer_size_has_the_spec_model_s_default_everywhere_it_is_read() -> None:
    """A job stored before buffer_size existed: its rounds and its in-flight floor both take the
    default the spec model gives, not a figure of their own."""
    stored = spec({"rule": "fedbuff", "buffer_size": 2}, rounds=True)
    del stored["assimilation"]["buffer_size"]
    default = FedBuffSpec.model_fields["buffer_size"].default
    assert default != 2
    assert rounds.round_size(stored) == default
    assert BudgetTerms.of(stored).rule_floor == default


def test_the_budget_is_what_is_left_of_the_round() -> None:
    assert [rounds.budget(4, v) for v in range(9)] == [4, 3, 2, 1, 4, 3, 2, 1, 4]


def test_a_round_is_evaluated_and_published_at_its_end_only() -> None:
    """Inside a round W_s does not change (the buffer fills): its versions are neither evaluated nor
    published, whatever snapshot_every_seconds says; eval_every counts rounds."""
    in_rounds = spec(FEDBUFF_4, rounds=True, eval_every=2, snapshot_every_seconds=0)
    assert [v for v in range(1, 17) if rounds.evaluation_due(in_rounds, v)] == [8, 16]
    assert [v for v in range(1, 9) if rounds.snapshot_due(in_rounds, v, 0, 100.0)] == [4, 5, 6, 7, 8]
    assert not rounds.snapshot_due(in_rounds, 7, 4, 100.0)
    assert rounds.snapshot_due(in_rounds, 9, 7, None), "a pass that ended a round and went on publishes"


def test_out_of_rounds_the_spec_counts_merges_and_seconds() -> None:
    plain = spec(FEDBUFF_4, eval_every=3, snapshot_every_merges=2, snapshot_every_seconds=5)
    assert [v for v in range(1, 10) if rounds.evaluation_due(plain, v)] == [3, 6, 9]
    assert rounds.snapshot_due(plain, 2, 0, 0.1) and not rounds.snapshot_due(plain, 1, 0, 0.1)
    assert rounds.snapshot_due(plain, 1, 0, 5.0) and not rounds.snapshot_due(plain, 1, 0, None)
    assert not rounds.snapshot_due(plain, 3, 3, 100.0), "never the version already published"
