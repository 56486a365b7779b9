"""The exactly-once merge of W_s against a real (private) Redis."""

import json
import threading

import numpy as np
import pytest

from crowdtrain.assimilator.rules import merge_vc_asgd
from crowdtrain.core import keys
from crowdtrain.server.paramstore import merging, store
from tests.server.paramstore.w_s_values import filled


def test_a_redelivered_merge_is_applied_once(private_redis) -> None:
    store.initialise(private_redis, 1, filled(0.0))
    merge = lambda ws, _state, v: merge_vc_asgd(ws, filled(1.0), 0.5, out=ws)  # noqa: E731
    first = merging.merge_once(private_redis, 1, 42, merge)
    again = merging.merge_once(private_redis, 1, 42, merge)
    assert (first.version, first.applied_now) == (1, True)
    assert (again.version, again.applied_now) == (1, False)
    version, params = store.read(private_redis, 1)
    assert version == 1
    np.testing.assert_allclose(params["w"], 0.5)


def test_initialise_does_not_overwrite_a_live_model(private_redis) -> None:
    store.initialise(private_redis, 1, filled(0.0))
    merging.merge_once(private_redis, 1, 1, lambda ws, _state, v: merge_vc_asgd(ws, filled(1.0), 0.5, out=ws))
    store.initialise(private_redis, 1, filled(9.0))
    version, params = store.read(private_redis, 1)
    assert version == 1 and params["w"][0] == pytest.approx(0.5)


def test_a_refused_merge_writes_nothing(private_redis) -> None:
    store.initialise(private_redis, 1, filled(0.0))

    def refuse(ws, _state, v):
        ws["w"] += 100  # even an in-place change must not leak out of a refused merge
        raise ValueError("stale")

    with pytest.raises(ValueError):
        merging.merge_once(private_redis, 1, 7, refuse)
    version, params = store.read(private_redis, 1)
    assert version == 0 and params["w"][0] == 0.0
    assert not private_redis.sismember(keys.merged(1), "7")
    ok = merging.merge_once(private_redis, 1, 8, lambda ws, _state, v: merge_vc_asgd(ws, filled(2.0), 0.5, out=ws))
    assert ok.version == 1
    np.testing.assert_allclose(store.read(private_redis, 1)[1]["w"], 1.0)


def test_racing_parameter_servers_merge_each_assignment_exactly_once(private_redis) -> None:
    """8 threads deliver 40 assignments, each twice: 40 merges, and W_s is what 40 merges give."""
    store.initialise(private_redis, 3, filled(0.0))
    alpha = 0.9
    ids = list(range(100, 140)) * 2
    errors: list[BaseException] = []

    def deliver(chunk: list[int]) -> None:
        conn = store.connect(f"redis://127.0.0.1:{private_redis.connection_pool.connection_kwargs['port']}/0")
        try:
            for aid in chunk:
                merging.merge_once(conn, 3, aid, lambda ws, _state, v: merge_vc_asgd(ws, filled(1.0), alpha, out=ws))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=deliver, args=(ids[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    version, params = store.read(private_redis, 3)
    assert version == 40
    assert private_redis.scard(keys.merged(3)) == 40
    versions = sorted(json.loads(x)["version"] for x in private_redis.hgetall(keys.merge_log(3)).values())
    assert versions == list(range(1, 41))
    # Every client sends 1.0, so after n merges W_s = 1 - alpha^n whatever the order.
    np.testing.assert_allclose(params["w"], 1 - alpha**40, rtol=1e-5)
