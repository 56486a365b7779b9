"""Which uploaded DeDLOC state is the collaboration's, and who is asked to upload it (pure rules)."""

import pytest

from crowdtrain.core.dedloc import (
    StateUpload,
    StateVerdict,
    agreed_digest,
    asked_to_upload,
    judge_state,
    state_orphaned,
)

MEMBERS = ["a", "b", "c"]


@pytest.mark.parametrize(
    ("reported", "members", "agreed"),
    [
        ({"a": "X", "b": "X", "c": "Y"}, MEMBERS, "X"),  # two of three
        ({"a": "X"}, MEMBERS, None),  # one of three is no majority yet
        ({"a": "X", "b": "Y"}, ["a", "b"], None),  # a tie of two
        ({"a": "X", "b": "X"}, ["a", "b"], "X"),
        # reports of peers outside the commit count for nothing
        ({"a": "Y", "m1": "Y", "m2": "Y", "b": "X", "c": "X"}, MEMBERS, "X"),
        ({"a": "Y", "m1": "Y", "m2": "Y"}, MEMBERS, None),
        ({}, [], None),
    ],
)
def test_the_agreed_digest_is_a_strict_majority_of_the_members(reported, members, agreed) -> None:
    assert agreed_digest(reported, members) == agreed


def test_a_state_is_accepted_only_with_the_agreed_digest() -> None:
    assert judge_state("X", "X") is StateVerdict.accepted
    assert judge_state("Z", "X") is StateVerdict.refused
    assert judge_state("X", None) is StateVerdict.undecided


def _upload(**changes) -> StateUpload:
    fields = {
        "members": MEMBERS,
        "uploader": "a",
        "reported": {"a": "X", "b": "X", "c": "X"},
        "refused": frozenset(),
        "waited": 0.0,
        "grace": 3.0,
    }
    return StateUpload(**(fields | changes))


@pytest.mark.parametrize(
    ("upload", "asked"),
    [
        (_upload(), {"a"}),  # the designated uploader first
        (_upload(refused=frozenset({"a"})), {"b", "c"}),  # refused: the others holding the agreed digest
        (_upload(reported={"b": "X", "c": "X"}), set()),  # the uploader has not reported yet: it is awaited
        (_upload(reported={"b": "X", "c": "X"}, waited=3.5), {"b", "c"}),  # ... for `grace` seconds
        (_upload(reported={"a": "Z", "b": "X", "c": "X"}), {"b", "c"}),  # it holds other parameters
        (_upload(waited=3.5), {"a", "b", "c"}),  # it let the grace pass
        (_upload(reported={"a": "X"}), set()),  # no majority: nobody
        (_upload(everyone=True, reported={"a": "X", "b": "X", "c": "Z"}), {"a", "b"}),  # the last state
    ],
)
def test_the_designated_uploader_is_asked_first_and_another_member_when_it_fails(upload, asked) -> None:
    assert {p for p in [*MEMBERS, "outsider"] if asked_to_upload(p, upload)} == asked


def test_a_state_is_orphaned_when_no_member_can_upload_it() -> None:
    assert not state_orphaned(MEMBERS, live={"a", "b"}, excluded=set(), refused={"a"})
    assert state_orphaned(MEMBERS, live={"a", "b"}, excluded={"b"}, refused={"a"})
    assert state_orphaned(MEMBERS, live={"x"}, excluded=set(), refused=set())
    assert state_orphaned([], live={"a"}, excluded=set(), refused=set())
