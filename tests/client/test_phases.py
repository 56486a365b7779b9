"""The client's assignment phases (crowdtrain.client.assignment.PHASE_MOVES): every pair of phases is
tried, the table's moves succeed and every other move is refused, and the table is one path from
fetching to uploaded that the runner walks in order."""

import itertools
import json

import pytest

from crowdtrain.client.assignment import PHASE_MOVES, Phase, PhaseError, Running
from crowdtrain.core.schemas import AssignmentOut
from tests.client.test_hostile_scheduler import file_ref, work_reply


def _running(phase: Phase) -> Running:
    reply = json.loads(work_reply(file_ref("/files/shard", "0" * 64)))
    return Running(AssignmentOut.model_validate(reply["assignments"][0]), phase=phase)


@pytest.mark.parametrize(("current", "to"), list(itertools.product(Phase, Phase)))
def test_every_move_the_table_allows_succeeds_and_every_other_is_refused(current: Phase, to: Phase) -> None:
    r = _running(current)
    if to in PHASE_MOVES[current]:
        r.move(to)
        assert r.phase is to
    else:
        with pytest.raises(PhaseError, match=f"no move from {current} to {to}"):
            r.move(to)
        assert r.phase is current


def test_the_table_is_one_path_from_fetching_to_uploaded() -> None:
    assert set(PHASE_MOVES) == set(Phase)
    path, phase = [Phase.fetching], Phase.fetching
    while PHASE_MOVES[phase]:
        (phase,) = PHASE_MOVES[phase]
        path.append(phase)
    assert path == [Phase.fetching, Phase.waiting, Phase.training, Phase.uploading, Phase.uploaded]


def test_a_new_assignment_starts_fetching_and_shows_as_downloading() -> None:
    r = _running(Phase.fetching)
    assert Running(r.assignment).phase is Phase.fetching
    assert r.status().phase == "downloading"
    r.move(Phase.waiting)
    assert r.status().phase == "waiting"
