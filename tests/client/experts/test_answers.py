"""A trainer refuses expert answers it cannot use and counts, per expert and host, what each call came
to (crowdtrain.client.experts.mixture.ExpertClient.take_calls): the figures its reports carry to the
scheduler, which charges refused answers to the host and credits answered rows."""

import time
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from crowdtrain.client.experts.mixture import ExpertCallFailed, ExpertClient, suspects
from crowdtrain.core.experts import FORWARD_ARGS, ExpertLayout, encode_call, read_call
from tests.stub_http import Handle, stub_server

LAYOUT = ExpertLayout(layers=1, grid=[2, 3], dim=4, hidden=8, k=2, max_rows=16)
ROWS = 5


def answer(uid: str, rows: int) -> tuple[int, bytes]:
    """What the hostile host answers for each expert: one way of being wrong each, one honest."""
    dim = LAYOUT.dim
    return {
        "0.0.0": (200, encode_call(y=np.full((rows, dim), np.nan))),
        "0.0.1": (200, encode_call(y=np.zeros((rows, dim + 1)))),
        "0.0.2": (200, encode_call(y=np.zeros((rows - 1, dim)))),
        "0.1.0": (200, encode_call(y=np.zeros((LAYOUT.max_rows * 20, dim)))),  # beyond the size limit of an answer
        "0.1.1": (503, b'{"detail": "expert failed"}'),
        "0.1.2": (200, encode_call(y=np.ones((rows, dim)))),
    }[uid]


def hostile(_method: str, path: str, body: bytes) -> tuple[int, bytes]:
    rows = read_call(body, FORWARD_ARGS, LAYOUT.dim, LAYOUT.max_rows)["x"].shape[0]
    return answer(path.split("/")[3], rows)


@pytest.fixture
def url() -> Iterator[str]:
    with stub_server(hostile) as url:
        yield url


def test_unusable_answers_are_refused_and_counted_apart_from_failed_calls_and_answered_rows(url) -> None:
    uids = LAYOUT.uids(0)
    client = ExpertClient(LAYOUT, dict.fromkeys(uids, url))
    x = np.zeros((ROWS, LAYOUT.dim), np.float32)
    outcomes = {}
    for uid in uids:
        try:
            client.submit(uid, "forward", x=x).result(timeout=30)
            outcomes[uid] = "answered"
        except ExpertCallFailed as exc:
            outcomes[uid] = str(exc)
    client.close()
    assert outcomes["0.1.2"] == "answered"
    assert "NaN" in outcomes["0.0.0"] and "shape" in outcomes["0.0.1"] and "4 rows answered for 5" in outcomes["0.0.2"]
    assert "more than" in outcomes["0.1.0"] and "503" in outcomes["0.1.1"]
    counts = {c.uid: (c.answered, c.rows, c.failed, c.refused) for c in client.take_calls()}
    assert counts == {
        "0.0.0": (0, 0, 0, 1),
        "0.0.1": (0, 0, 0, 1),
        "0.0.2": (0, 0, 0, 1),
        "0.1.0": (0, 0, 0, 1),
        "0.1.1": (0, 0, 1, 0),
        "0.1.2": (1, ROWS, 0, 0),
    }
    assert client.take_calls() == []  # taken once


def answering(y: Callable[[np.ndarray], np.ndarray]) -> Handle:
    """A host whose every expert answers forward with `y(x)`."""

    def handle(_method: str, _path: str, body: bytes) -> tuple[int, bytes]:
        return 200, encode_call(y=y(read_call(body, FORWARD_ARGS, LAYOUT.dim, 16)["x"]))

    return handle


def test_replicas_are_called_in_turn_a_sample_is_compared_and_a_disagreement_blamed_on_the_suspect() -> None:
    layout = LAYOUT.model_copy(update={"replicas": 2, "compare_every": 2, "compare_tolerance": 0.5})
    with (
        stub_server(answering(lambda x: x + 1)) as honest,
        stub_server(answering(lambda x: x + 1.05)) as close,
        stub_server(answering(lambda x: np.full_like(x, -5.0))) as made_up,
    ):
        client = ExpertClient(layout, {})
        client.set_routes({("0.0.0", 0): honest, ("0.0.0", 1): close, ("0.0.1", 0): honest, ("0.0.1", 1): made_up})
        x = np.zeros((ROWS, layout.dim), np.float32)
        for uid in ("0.0.0", "0.0.1"):
            for _ in range(4):
                client.submit(uid, "forward", x=x).result(timeout=30)
        wait_compared(client, 4)
        client.close()
    counts = {(c.uid, c.url): (c.answered, c.compared, c.disagreed) for c in client.take_calls()}
    # Four calls per expert, at its two replicas in turn; every second one also went to the other. The
    # honest host agreed with another host, the made-up one never did: the disagreements are its.
    assert counts == {
        ("0.0.0", honest): (4, 2, 0),
        ("0.0.0", close): (2, 2, 0),
        ("0.0.1", honest): (4, 2, 0),
        ("0.0.1", made_up): (2, 2, 2),
    }


def test_a_disagreement_between_two_hosts_with_the_same_record_waits_for_more_evidence() -> None:
    layout = LAYOUT.model_copy(update={"replicas": 2, "compare_every": 1})
    with (
        stub_server(answering(lambda x: x + 1)) as one,
        stub_server(answering(lambda x: x - 9)) as two,
        stub_server(answering(lambda x: x + 1.01)) as three,
    ):
        client = ExpertClient(layout, {})
        client.set_routes({("0.0.0", 0): one, ("0.0.0", 1): two})
        x = np.zeros((ROWS, layout.dim), np.float32)
        client.submit("0.0.0", "forward", x=x).result(timeout=30)
        wait_compared(client, 1)
        assert [c.disagreed for c in client.take_calls()] == [0, 0], "neither has agreed with anyone: no blame yet"
        client.set_routes({("0.0.0", 1): three})  # host one now shares the expert with a third, and agrees
        client.submit("0.0.0", "forward", x=x).result(timeout=30)
        wait_compared(client, 2)
        client.close()
    blamed = {c.url: c.disagreed for c in client.take_calls()}
    assert blamed == {one: 0, two: 1, three: 0}


def test_an_honest_host_compared_mostly_with_a_made_up_one_is_not_blamed_for_drifting_from_its_honest_partner() -> None:
    """Host `a` shares one expert with a host that makes its answers up and another with an honest host
    `b` whose replica drifted: they agree on one call and not on the next. Counted over all its
    comparisons, `a` agreed least after the made-up host; judged without the made-up host, `a` and `b`
    agree as often as each other, so the drift is nobody's fault and only the made-up host is charged."""
    layout = LAYOUT.model_copy(update={"replicas": 2, "compare_every": 1})
    drifted = iter([1.0, 4.0] * 10)  # b's offsets call by call: agreeing with a's x + 1, then far off
    with (
        stub_server(answering(lambda x: x + 1)) as a,
        stub_server(answering(lambda x: x + next(drifted))) as b,
        stub_server(answering(lambda x: np.full_like(x, -5.0))) as made_up,
    ):
        client = ExpertClient(layout, {})
        client.set_routes({("0.0.0", 0): a, ("0.0.0", 1): made_up, ("0.0.1", 0): a, ("0.0.1", 1): b})
        x = np.zeros((ROWS, layout.dim), np.float32)
        for _ in range(4):
            client.submit("0.0.0", "forward", url=a, x=x).result(timeout=30)
        for _ in range(2):
            client.submit("0.0.1", "forward", url=a, x=x).result(timeout=30)
        wait_compared(client, 6)
        client.close()
    assert client.figures["compared_disagreed"] == 5
    blamed = {(c.uid, c.url): c.disagreed for c in client.take_calls()}
    assert blamed == {("0.0.0", a): 0, ("0.0.0", made_up): 4, ("0.0.1", a): 0, ("0.0.1", b): 0}


def test_suspects_are_the_hosts_that_disagree_most_with_those_not_suspected_counted_again_without_them() -> None:
    def record(*pairs: tuple[str, str, int, int]) -> dict[tuple[str, str], Counter[str]]:
        out: dict[tuple[str, str], Counter[str]] = {}
        for host, partner, agreed, disagreed in pairs:
            for key in ((host, partner), (partner, host)):
                out[key] = Counter(agreed=agreed, disagreed=disagreed)
        return out

    # Two hosts that make answers up, each compared with honest hosts that agree among themselves.
    liars = record(("m1", "a", 0, 9), ("m1", "b", 0, 3), ("m2", "a", 0, 2), ("a", "b", 5, 1), ("b", "c", 4, 0))
    assert suspects(liars) == {"m1", "m2"}
    assert suspects(record(("a", "b", 0, 3))) == {"a", "b"}, "two hosts alone: both, so neither is blamed"
    assert suspects(record(("a", "b", 3, 3), ("b", "c", 2, 2))) == set(), "agreeing half the time is no proof"
    assert suspects({}) == set()


def wait_compared(client: ExpertClient, n: int) -> None:
    """Until `n` comparisons are done: the second answer of a compared call may come after the first."""
    deadline = time.monotonic() + 30
    while client.figures["compared_agreed"] + client.figures["compared_disagreed"] < n:
        assert time.monotonic() < deadline, client.figures
        time.sleep(0.01)
