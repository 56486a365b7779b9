import pytest

from server import states
from server.states import AssignmentStatus as A
from server.states import IllegalTransition
from server.states import JobStatus as J
from server.states import WorkunitStatus as W


class Obj:
    def __init__(self, status: str):
        self.id = 1
        self.status = status


LEGAL = [
    (W.ready, W.in_progress), (W.in_progress, W.done), (W.in_progress, W.ready), (W.in_progress, W.failed),
    (W.ready, W.cancelled), (W.in_progress, W.cancelled),
    (A.in_progress, A.uploaded), (A.uploaded, A.merged), (A.uploaded, A.rejected), (A.in_progress, A.timed_out),
    (A.in_progress, A.abandoned), (A.in_progress, A.client_error),
    (J.pending, J.running), (J.running, J.succeeded), (J.running, J.failed), (J.running, J.cancelled),
]

ILLEGAL = [
    (W.done, W.ready), (W.failed, W.ready), (W.ready, W.done), (W.cancelled, W.ready), (W.done, W.in_progress),
    (A.merged, A.uploaded), (A.merged, A.merged), (A.timed_out, A.uploaded), (A.in_progress, A.merged),
    (A.rejected, A.merged), (A.abandoned, A.in_progress),
    (J.succeeded, J.running), (J.cancelled, J.running), (J.pending, J.succeeded),
]


@pytest.mark.parametrize(("current", "new"), LEGAL)
def test_legal_transitions_change_the_status(current, new) -> None:
    obj = Obj(current.value)
    states.move(obj, new)
    assert obj.status == new.value


@pytest.mark.parametrize(("current", "new"), ILLEGAL)
def test_illegal_transitions_raise_and_leave_the_status(current, new) -> None:
    obj = Obj(current.value)
    with pytest.raises(IllegalTransition):
        states.move(obj, new)
    assert obj.status == current.value


def test_every_status_appears_in_the_table_or_is_terminal() -> None:
    for enum, table in states.TRANSITIONS.items():
        targets = {s for targets in table.values() for s in targets}
        assert set(enum) == set(table) | targets, enum
