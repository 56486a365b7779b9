"""A dashboard session value proves a login with the admin token until its expiry, and nothing else."""

import pytest

from crowdtrain.server.services import sessions

TOKEN = "admin-token-of-the-test"
NOW = 1_800_000_000.0


def test_a_session_is_valid_until_its_expiry_and_does_not_hold_the_token() -> None:
    value = sessions.issue(TOKEN, 3600, now=NOW)
    assert TOKEN not in value
    assert sessions.is_valid(TOKEN, value, now=NOW + 3599)
    assert not sessions.is_valid(TOKEN, value, now=NOW + 3600)


def test_a_new_admin_token_ends_every_session() -> None:
    assert not sessions.is_valid("the-next-admin-token", sessions.issue(TOKEN, 3600, now=NOW), now=NOW)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "no-dot",
        f"{int(NOW) + 7200}.",  # no nonce nor signature
        f"{int(NOW) + 7200}." + "0" * 64,  # a v1 value: no nonce
        f"{int(NOW) + 7200}." + "0" * 64,  # a signature made up
        "²³⁴⁵⁶⁷⁸⁹⁰¹." + "0" * 64,  # digits to str.isdigit, not to int()
        "-1." + "0" * 64,
        "9" * 200,
    ],
)
def test_a_malformed_or_forged_value_is_refused(value: str | None) -> None:
    assert not sessions.is_valid(TOKEN, value, now=NOW)


def test_an_extended_expiry_breaks_the_signature() -> None:
    expiry, nonce, signature = sessions.issue(TOKEN, 60, now=NOW).split(".")
    assert not sessions.is_valid(TOKEN, f"{int(expiry) + 86400}.{nonce}.{signature}", now=NOW)


def test_every_login_is_a_session_of_its_own() -> None:
    assert sessions.issue(TOKEN, 60, now=NOW) != sessions.issue(TOKEN, 60, now=NOW)


def test_an_ended_session_is_not_live_until_its_expiry_and_others_are(private_redis) -> None:
    ended, other = sessions.issue(TOKEN, 3600, now=NOW), sessions.issue(TOKEN, 3600, now=NOW)
    assert sessions.is_live(private_redis, TOKEN, ended, now=NOW + 10)
    assert sessions.end(private_redis, TOKEN, ended, now=NOW + 10)
    assert not sessions.is_live(private_redis, TOKEN, ended, now=NOW + 10)
    assert sessions.is_live(private_redis, TOKEN, other, now=NOW + 10)
    [mark] = private_redis.keys("*")
    assert 3590 - 2 <= private_redis.ttl(mark) <= 3590  # the mark lasts as long as the cookie would have


# A session of another token is issued inside the test: its random part would give each xdist worker
# another test id.
@pytest.mark.parametrize("value", [None, "", "forged.value." + "0" * 64, "of-another-token"])
def test_ending_an_invalid_session_stores_nothing(private_redis, value: str | None) -> None:
    if value == "of-another-token":
        value = sessions.issue("another-token", 60, now=NOW)
    assert not sessions.end(private_redis, TOKEN, value, now=NOW)
    assert private_redis.keys("*") == []


def test_no_admin_token_admits_nobody() -> None:
    assert not sessions.is_admin_token("", "")
    assert not sessions.is_valid("", sessions.issue("", 3600, now=NOW), now=NOW)
    assert sessions.is_admin_token(TOKEN, TOKEN) and not sessions.is_admin_token(TOKEN, TOKEN + "x")
