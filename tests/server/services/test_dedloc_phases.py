"""The DeDLOC round's phases (crowdtrain.server.services.dedloc_document.ROUND_MOVES): every pair of phases is
tried, the table's moves succeed and every other is refused, and a stored round keeps its phase."""

import itertools
import json
from dataclasses import asdict

import pytest

from crowdtrain.server.services.dedloc_document import ROUND_MOVES, IllegalRoundMove, Round, RoundPhase


@pytest.mark.parametrize(("current", "to"), list(itertools.product(RoundPhase, RoundPhase)))
def test_every_move_the_table_allows_succeeds_and_every_other_is_refused(current: RoundPhase, to: RoundPhase) -> None:
    rnd = Round(step=3, phase=current)
    if to in ROUND_MOVES[current]:
        rnd.move(to)
        assert rnd.phase is to
    else:
        with pytest.raises(IllegalRoundMove, match=f"no move from {current} to {to}"):
            rnd.move(to)
        assert rnd.phase is current


def test_every_phase_is_reached_from_accumulating_and_every_phase_can_go_on() -> None:
    assert set(ROUND_MOVES) == set(RoundPhase)
    reached, frontier = {RoundPhase.accumulating}, [RoundPhase.accumulating]
    while frontier:
        for to in ROUND_MOVES[frontier.pop()] - reached:
            reached.add(to)
            frontier.append(to)
    assert reached == set(RoundPhase)
    assert all(ROUND_MOVES[phase] for phase in RoundPhase), "a round never ends in a phase: the job ends it"


def test_a_stored_round_comes_back_in_its_phase_and_an_unknown_phase_is_refused() -> None:
    stored = json.loads(json.dumps(asdict(Round(phase=RoundPhase.reducing))))
    assert stored["phase"] == "reducing"
    assert Round(**stored).phase is RoundPhase.reducing
    with pytest.raises(ValueError, match="'sleeping' is not a valid RoundPhase"):
        Round(**(stored | {"phase": "sleeping"}))
