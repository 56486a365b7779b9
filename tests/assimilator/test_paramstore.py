"""The exactly-once merge against a real (private) Redis."""

import json
import threading

import numpy as np
import pytest

from assimilator import paramstore
from assimilator.rules import merge_vc_asgd
from crowdtrain import keys


def _w(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(1000, value, np.float32), "steps": np.array(0, np.int64)}


def test_a_redelivered_merge_is_applied_once(private_redis) -> None:
    paramstore.initialise(private_redis, 1, _w(0.0))
    merge = lambda ws, _state, v: merge_vc_asgd(ws, _w(1.0), 0.5, out=ws)  # noqa: E731
    first = paramstore.merge_once(private_redis, 1, 42, merge)
    again = paramstore.merge_once(private_redis, 1, 42, merge)
    assert (first.version, first.applied_now) == (1, True)
    assert (again.version, again.applied_now) == (1, False)
    version, params = paramstore.read(private_redis, 1)
    assert version == 1
    np.testing.assert_allclose(params["w"], 0.5)


def test_initialise_does_not_overwrite_a_live_model(private_redis) -> None:
    paramstore.initialise(private_redis, 1, _w(0.0))
    paramstore.merge_once(private_redis, 1, 1, lambda ws, _state, v: merge_vc_asgd(ws, _w(1.0), 0.5, out=ws))
    paramstore.initialise(private_redis, 1, _w(9.0))
    version, params = paramstore.read(private_redis, 1)
    assert version == 1 and params["w"][0] == pytest.approx(0.5)


def test_a_refused_merge_writes_nothing(private_redis) -> None:
    paramstore.initialise(private_redis, 1, _w(0.0))

    def refuse(ws, _state, v):
        ws["w"] += 100  # even an in-place change must not leak out of a refused merge
        raise ValueError("stale")

    with pytest.raises(ValueError):
        paramstore.merge_once(private_redis, 1, 7, refuse)
    version, params = paramstore.read(private_redis, 1)
    assert version == 0 and params["w"][0] == 0.0
    assert not private_redis.sismember(keys.merged(1), "7")
    ok = paramstore.merge_once(private_redis, 1, 8, lambda ws, _state, v: merge_vc_asgd(ws, _w(2.0), 0.5, out=ws))
    assert ok.version == 1
    np.testing.assert_allclose(paramstore.read(private_redis, 1)[1]["w"], 1.0)


def test_racing_parameter_servers_merge_each_assignment_exactly_once(private_redis) -> None:
    """8 threads deliver 40 assignments, each twice: 40 merges, and W_s is what 40 merges give."""
    paramstore.initialise(private_redis, 3, _w(0.0))
    alpha = 0.9
    ids = list(range(100, 140)) * 2
    errors: list[BaseException] = []

    def deliver(chunk: list[int]) -> None:
        conn = paramstore.connect(f"redis://127.0.0.1:{private_redis.connection_pool.connection_kwargs['port']}/0")
        try:
            for aid in chunk:
                paramstore.merge_once(conn, 3, aid, lambda ws, _state, v: merge_vc_asgd(ws, _w(1.0), alpha, out=ws))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=deliver, args=(ids[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    version, params = paramstore.read(private_redis, 3)
    assert version == 40
    assert private_redis.scard(keys.merged(3)) == 40
    versions = sorted(json.loads(x)["version"] for x in private_redis.hgetall(keys.merge_log(3)).values())
    assert versions == list(range(1, 41))
    # Every client sends 1.0, so after n merges W_s = 1 - alpha^n whatever the order.
    np.testing.assert_allclose(params["w"], 1 - alpha ** 40, rtol=1e-5)


def test_snapshot_retention_returns_the_versions_beyond_the_newest_few(private_redis) -> None:
    expired = [paramstore.note_snapshot(private_redis, 5, v, keep=3) for v in range(6)]
    assert expired == [[], [], [], [0], [1], [2]]
    assert [int(v) for v in private_redis.lrange(keys.snapshots(5), 0, -1)] == [5, 4, 3]
