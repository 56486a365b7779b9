"""The registration policy's pure parts: the sliding hour and the account a host is under."""

from datetime import datetime, timedelta

import pytest

from crowdtrain.server.services.registration import host_account, seconds_until_admitted

NOW = datetime(2026, 11, 24, 12, 0, 0)


def ago(minutes: float) -> datetime:
    return NOW - timedelta(minutes=minutes)


@pytest.mark.parametrize(
    ("recent_minutes_ago", "limit", "wait"),
    [
        ([], 1, None),
        ([5, 10], 3, None),  # two in the hour, a third allowed
        ([5, 10, 20], 3, 40 * 60),  # full: the oldest of the three leaves the hour in 40 minutes
        ([5, 10, 70], 3, None),  # one of them is over an hour old: not counted
        ([1, 2, 3, 4], 3, 57 * 60),  # more than the limit (a race): the 3rd newest decides
        ([59.999], 1, 1),  # at least one second
    ],
)
def test_a_registration_waits_until_the_oldest_counted_leaves_the_hour(recent_minutes_ago, limit, wait) -> None:
    assert seconds_until_admitted([ago(m) for m in recent_minutes_ago], limit, NOW) == wait


@pytest.mark.parametrize(
    ("token_account", "named", "account"),
    [("", "", ""), ("", "bob", "bob"), ("alice", "", "alice"), ("alice", "mallory", "alice")],
)
def test_a_token_issued_to_an_account_imposes_it(token_account, named, account) -> None:
    assert host_account(token_account, named) == account
