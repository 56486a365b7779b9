"""The merge rule's state beside W_s, merged exactly once with it, against a real (private) Redis."""

import multiprocessing
import threading

import numpy as np
import pytest

from crowdtrain.assimilator.rules import Update, make_rule
from crowdtrain.core import keys
from crowdtrain.core.tensors import encode
from crowdtrain.server.paramstore import cache, merging, store
from tests.server.paramstore.w_s_values import NESTEROV, STEP, assert_same, filled


def _rule_merge(rule, delta: dict[str, np.ndarray] = STEP):
    def merge(ws, state, version):
        rule.apply(ws, state, Update({}, delta, 0, 1))
        return ws

    return merge


def _merge_with(r, job_id: int, assignment_id: int, spec: dict) -> merging.MergeOutcome:
    rule = make_rule(spec)
    return merging.merge_once(r, job_id, assignment_id, _rule_merge(rule), initial_state=rule.initial_state)


def _reference(spec: dict, merges: int) -> tuple[dict, dict]:
    """W_s and the rule's state after `merges` merges, applied in one process without Redis."""
    rule = make_rule(spec)
    ws = filled(0.0)
    state = rule.initial_state(ws)
    for _ in range(merges):
        _rule_merge(rule)(ws, state, 0)
    return ws, state


def test_the_rule_state_is_created_by_the_first_merge_and_written_with_w_s(private_redis) -> None:
    store.initialise(private_redis, 1, filled(0.0))
    assert store.read_state(private_redis, 1) == (0, None)
    _merge_with(private_redis, 1, 10, NESTEROV)
    _merge_with(private_redis, 1, 11, NESTEROV)
    version, state = store.read_state(private_redis, 1)
    ws, expected = _reference(NESTEROV, 2)
    assert version == 2 and int(state["step"]) == 2
    assert_same(state, expected)
    assert_same(store.read(private_redis, 1)[1], ws)


def test_a_redelivered_merge_takes_one_momentum_step(private_redis) -> None:
    store.initialise(private_redis, 1, filled(0.0))
    first = _merge_with(private_redis, 1, 42, NESTEROV)
    cache.clear()  # the redelivery may reach another parameter server
    again = _merge_with(private_redis, 1, 42, NESTEROV)
    assert (first.applied_now, again.applied_now, again.version) == (True, False, 1)
    version, state = store.read_state(private_redis, 1)
    assert version == 1 and int(state["step"]) == 1
    ws, expected = _reference(NESTEROV, 1)
    assert_same(state, expected)
    assert_same(store.read(private_redis, 1)[1], ws)


def test_a_refused_merge_leaves_the_rule_state_alone(private_redis) -> None:
    store.initialise(private_redis, 1, filled(0.0))
    _merge_with(private_redis, 1, 1, NESTEROV)
    rule = make_rule(NESTEROV)

    def refuse(ws, state, version):
        rule.apply(ws, state, Update({}, STEP, 0, 1))  # even an in-place change must not leak out
        raise ValueError("refused")

    with pytest.raises(ValueError):
        merging.merge_once(private_redis, 1, 2, refuse, initial_state=rule.initial_state)
    _merge_with(private_redis, 1, 3, NESTEROV)
    version, state = store.read_state(private_redis, 1)
    assert version == 2 and int(state["step"]) == 2
    assert_same(state, _reference(NESTEROV, 2)[1])


def test_a_merge_that_replaces_a_state_array_is_an_error(private_redis) -> None:
    store.initialise(private_redis, 1, filled(0.0))
    rule = make_rule(NESTEROV)

    def replace(ws, state, version):
        state["step"] = state["step"] + 1
        return ws

    with pytest.raises(ValueError, match="in place"):
        merging.merge_once(private_redis, 1, 1, replace, initial_state=rule.initial_state)
    assert store.read_state(private_redis, 1) == (0, None)


def _deliver(port: int, job_id: int, assignment_ids: list[int], spec: dict) -> None:
    conn = store.connect(f"redis://127.0.0.1:{port}/0")
    for aid in assignment_ids:
        _merge_with(conn, job_id, aid, spec)


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_racing_parameter_servers_take_one_optimizer_step_per_assignment(private_redis, workers: str) -> None:
    """4 workers, each with its own Redis connection, deliver 24 assignments twice each: 24 merges, 24
    momentum steps, and W_s and the momentum are what 24 merges in one process give."""
    store.initialise(private_redis, 3, filled(0.0))
    port = private_redis.connection_pool.connection_kwargs["port"]
    ids = list(range(100, 124)) * 2
    chunks = [ids[i::4] for i in range(4)]
    if workers == "threads":
        errors: list[BaseException] = []

        def run(chunk: list[int]) -> None:
            try:
                _deliver(port, 3, chunk, NESTEROV)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        pool = [threading.Thread(target=run, args=(c,)) for c in chunks]
    else:
        ctx = multiprocessing.get_context("fork")  # no re-import: the children only need redis and numpy
        pool = [ctx.Process(target=_deliver, args=(port, 3, c, NESTEROV)) for c in chunks]
    for w in pool:
        w.start()
    for w in pool:
        w.join()
    if workers == "threads":
        assert not errors
    else:
        assert [p.exitcode for p in pool] == [0] * 4
    version, state = store.read_state(private_redis, 3)
    assert version == 24 and private_redis.scard(keys.merged(3)) == 24
    assert int(state["step"]) == 24, "one momentum step per merged assignment"
    ws, expected = _reference(NESTEROV, 24)
    assert_same(state, expected)
    assert_same(store.read(private_redis, 3)[1], ws)


def test_fedbuff_versions_count_merges_while_w_s_moves_once_per_buffer(private_redis) -> None:
    spec = {"rule": "fedbuff", "buffer_size": 2, "outer_optimizer": "nesterov"}
    store.initialise(private_redis, 1, filled(0.0))
    outcomes = [_merge_with(private_redis, 1, aid, spec).version for aid in (1, 2, 3)]
    assert outcomes == [1, 2, 3]
    version, state = store.read_state(private_redis, 1)
    assert version == 3 and int(state["buffer.count"]) == 1 and int(state["step"]) == 1
    ws, expected = _reference(spec, 3)
    assert_same(state, expected)
    assert_same(store.read(private_redis, 1)[1], ws)


def test_a_state_given_at_initialisation_is_used(private_redis) -> None:
    rule = make_rule(NESTEROV)
    state = rule.initial_state(filled(0.0))
    state["step"][...] = 7
    store.initialise(private_redis, 1, filled(0.0), state=state)
    _merge_with(private_redis, 1, 1, NESTEROV)
    assert int(store.read_state(private_redis, 1)[1]["step"]) == 8


def test_restoring_w_s_resets_the_rule_state(private_redis) -> None:
    """Redis lost the version (and so W_s): the restored snapshot starts with a fresh rule state."""
    store.initialise(private_redis, 1, filled(0.0))
    for aid in (1, 2, 3):
        _merge_with(private_redis, 1, aid, NESTEROV)
    private_redis.delete(keys.version(1))
    # This process still holds W_s v3 with its rule state: the restore's new tag must make it read W_s again.
    assert store.initialise_blob(private_redis, 1, encode(filled(0.0)), 3)
    assert store.read_state(private_redis, 1) == (3, None)
    assert not private_redis.keys(keys.rule_state_chunk(1, 0))
    _merge_with(private_redis, 1, 4, NESTEROV)
    assert int(store.read_state(private_redis, 1)[1]["step"]) == 1
