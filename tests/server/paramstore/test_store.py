"""The exactly-once merge of W_s and of its rule's state against a real (private) Redis."""

import json
import multiprocessing
import threading
from dataclasses import replace

import numpy as np
import pytest

from crowdtrain.assimilator.rules import Update, make_rule, merge_vc_asgd
from crowdtrain.core import keys
from crowdtrain.core.tensors import encode
from crowdtrain.server.ledger import snapshot_list
from crowdtrain.server.paramstore import cache, store
from crowdtrain.server.paramstore.steps import QueuedResult, Taken


def _w(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(1000, value, np.float32), "steps": np.array(0, np.int64)}


def test_a_redelivered_merge_is_applied_once(private_redis) -> None:
    store.initialise(private_redis, 1, _w(0.0))
    merge = lambda ws, _state, v: merge_vc_asgd(ws, _w(1.0), 0.5, out=ws)  # noqa: E731
    first = store.merge_once(private_redis, 1, 42, merge)
    again = store.merge_once(private_redis, 1, 42, merge)
    assert (first.version, first.applied_now) == (1, True)
    assert (again.version, again.applied_now) == (1, False)
    version, params = store.read(private_redis, 1)
    assert version == 1
    np.testing.assert_allclose(params["w"], 0.5)


def test_initialise_does_not_overwrite_a_live_model(private_redis) -> None:
    store.initialise(private_redis, 1, _w(0.0))
    store.merge_once(private_redis, 1, 1, lambda ws, _state, v: merge_vc_asgd(ws, _w(1.0), 0.5, out=ws))
    store.initialise(private_redis, 1, _w(9.0))
    version, params = store.read(private_redis, 1)
    assert version == 1 and params["w"][0] == pytest.approx(0.5)


def test_a_refused_merge_writes_nothing(private_redis) -> None:
    store.initialise(private_redis, 1, _w(0.0))

    def refuse(ws, _state, v):
        ws["w"] += 100  # even an in-place change must not leak out of a refused merge
        raise ValueError("stale")

    with pytest.raises(ValueError):
        store.merge_once(private_redis, 1, 7, refuse)
    version, params = store.read(private_redis, 1)
    assert version == 0 and params["w"][0] == 0.0
    assert not private_redis.sismember(keys.merged(1), "7")
    ok = store.merge_once(private_redis, 1, 8, lambda ws, _state, v: merge_vc_asgd(ws, _w(2.0), 0.5, out=ws))
    assert ok.version == 1
    np.testing.assert_allclose(store.read(private_redis, 1)[1]["w"], 1.0)


def test_racing_parameter_servers_merge_each_assignment_exactly_once(private_redis) -> None:
    """8 threads deliver 40 assignments, each twice: 40 merges, and W_s is what 40 merges give."""
    store.initialise(private_redis, 3, _w(0.0))
    alpha = 0.9
    ids = list(range(100, 140)) * 2
    errors: list[BaseException] = []

    def deliver(chunk: list[int]) -> None:
        conn = store.connect(f"redis://127.0.0.1:{private_redis.connection_pool.connection_kwargs['port']}/0")
        try:
            for aid in chunk:
                store.merge_once(conn, 3, aid, lambda ws, _state, v: merge_vc_asgd(ws, _w(1.0), alpha, out=ws))
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


def test_snapshot_retention_returns_the_versions_beyond_the_newest_few(private_redis) -> None:
    expired = [snapshot_list.note_snapshot(private_redis, 5, v, keep=3) for v in range(6)]
    assert expired == [[], [], [], [0], [1], [2]]
    assert [int(v) for v in private_redis.lrange(keys.snapshots(5), 0, -1)] == [5, 4, 3]


# ---- the merge rule's state beside W_s ----------------------------------------------------------------------

NESTEROV = {"rule": "delta", "outer_optimizer": "nesterov", "server_lr": 0.5, "outer_momentum": 0.9}
STEP = {"w": np.full(1000, 0.01, np.float32)}  # every result's update Δ in these tests


def _rule_merge(rule, delta: dict[str, np.ndarray] = STEP):
    def merge(ws, state, version):
        rule.apply(ws, state, Update({}, delta, 0, 1))
        return ws

    return merge


def _merge_with(r, job_id: int, assignment_id: int, spec: dict) -> store.MergeOutcome:
    rule = make_rule(spec)
    return store.merge_once(r, job_id, assignment_id, _rule_merge(rule), initial_state=rule.initial_state)


def _reference(spec: dict, merges: int) -> tuple[dict, dict]:
    """W_s and the rule's state after `merges` merges, applied in one process without Redis."""
    rule = make_rule(spec)
    ws = _w(0.0)
    state = rule.initial_state(ws)
    for _ in range(merges):
        _rule_merge(rule)(ws, state, 0)
    return ws, state


def _assert_same(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for k, v in expected.items():
        np.testing.assert_allclose(actual[k], v, rtol=1e-6)


def test_the_rule_state_is_created_by_the_first_merge_and_written_with_w_s(private_redis) -> None:
    store.initialise(private_redis, 1, _w(0.0))
    assert store.read_state(private_redis, 1) == (0, None)
    _merge_with(private_redis, 1, 10, NESTEROV)
    _merge_with(private_redis, 1, 11, NESTEROV)
    version, state = store.read_state(private_redis, 1)
    ws, expected = _reference(NESTEROV, 2)
    assert version == 2 and int(state["step"]) == 2
    _assert_same(state, expected)
    _assert_same(store.read(private_redis, 1)[1], ws)


def test_a_redelivered_merge_takes_one_momentum_step(private_redis) -> None:
    store.initialise(private_redis, 1, _w(0.0))
    first = _merge_with(private_redis, 1, 42, NESTEROV)
    cache.clear()  # the redelivery may reach another parameter server
    again = _merge_with(private_redis, 1, 42, NESTEROV)
    assert (first.applied_now, again.applied_now, again.version) == (True, False, 1)
    version, state = store.read_state(private_redis, 1)
    assert version == 1 and int(state["step"]) == 1
    ws, expected = _reference(NESTEROV, 1)
    _assert_same(state, expected)
    _assert_same(store.read(private_redis, 1)[1], ws)


def test_a_refused_merge_leaves_the_rule_state_alone(private_redis) -> None:
    store.initialise(private_redis, 1, _w(0.0))
    _merge_with(private_redis, 1, 1, NESTEROV)
    rule = make_rule(NESTEROV)

    def refuse(ws, state, version):
        rule.apply(ws, state, Update({}, STEP, 0, 1))  # even an in-place change must not leak out
        raise ValueError("refused")

    with pytest.raises(ValueError):
        store.merge_once(private_redis, 1, 2, refuse, initial_state=rule.initial_state)
    _merge_with(private_redis, 1, 3, NESTEROV)
    version, state = store.read_state(private_redis, 1)
    assert version == 2 and int(state["step"]) == 2
    _assert_same(state, _reference(NESTEROV, 2)[1])


def test_a_merge_that_replaces_a_state_array_is_an_error(private_redis) -> None:
    store.initialise(private_redis, 1, _w(0.0))
    rule = make_rule(NESTEROV)

    def replace(ws, state, version):
        state["step"] = state["step"] + 1
        return ws

    with pytest.raises(ValueError, match="in place"):
        store.merge_once(private_redis, 1, 1, replace, initial_state=rule.initial_state)
    assert store.read_state(private_redis, 1) == (0, None)


def _deliver(port: int, job_id: int, assignment_ids: list[int], spec: dict) -> None:
    conn = store.connect(f"redis://127.0.0.1:{port}/0")
    for aid in assignment_ids:
        _merge_with(conn, job_id, aid, spec)


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_racing_parameter_servers_take_one_optimizer_step_per_assignment(private_redis, workers: str) -> None:
    """4 workers, each with its own Redis connection, deliver 24 assignments twice each: 24 merges, 24
    momentum steps, and W_s and the momentum are what 24 merges in one process give."""
    store.initialise(private_redis, 3, _w(0.0))
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
    _assert_same(state, expected)
    _assert_same(store.read(private_redis, 3)[1], ws)


def test_fedbuff_versions_count_merges_while_w_s_moves_once_per_buffer(private_redis) -> None:
    spec = {"rule": "fedbuff", "buffer_size": 2, "outer_optimizer": "nesterov"}
    store.initialise(private_redis, 1, _w(0.0))
    outcomes = [_merge_with(private_redis, 1, aid, spec).version for aid in (1, 2, 3)]
    assert outcomes == [1, 2, 3]
    version, state = store.read_state(private_redis, 1)
    assert version == 3 and int(state["buffer.count"]) == 1 and int(state["step"]) == 1
    ws, expected = _reference(spec, 3)
    _assert_same(state, expected)
    _assert_same(store.read(private_redis, 1)[1], ws)


def test_a_state_given_at_initialisation_is_used(private_redis) -> None:
    rule = make_rule(NESTEROV)
    state = rule.initial_state(_w(0.0))
    state["step"][...] = 7
    store.initialise(private_redis, 1, _w(0.0), state=state)
    _merge_with(private_redis, 1, 1, NESTEROV)
    assert int(store.read_state(private_redis, 1)[1]["step"]) == 8


def test_restoring_w_s_resets_the_rule_state(private_redis) -> None:
    """Redis lost the version (and so W_s): the restored snapshot starts with a fresh rule state."""
    store.initialise(private_redis, 1, _w(0.0))
    for aid in (1, 2, 3):
        _merge_with(private_redis, 1, aid, NESTEROV)
    private_redis.delete(keys.version(1))
    # This process still holds W_s v3 with its rule state: the restore's new tag must make it read W_s again.
    assert store.initialise_blob(private_redis, 1, encode(_w(0.0)), 3)
    assert store.read_state(private_redis, 1) == (3, None)
    assert not private_redis.keys(keys.rule_state_chunk(1, 0))
    _merge_with(private_redis, 1, 4, NESTEROV)
    assert int(store.read_state(private_redis, 1)[1]["step"]) == 1


# ---- the W_s a parameter-server process keeps between merges ----------------------------------------------


BIG = 1 << 20  # float32 values: a 4 MB W_s, whose reading back shows in the bytes Redis sends


def _half_way_to_one(r, job_id: int, assignment_id: int, size: int = 1000) -> store.MergeOutcome:
    return store.merge_once(
        r,
        job_id,
        assignment_id,
        lambda ws, _state, v: merge_vc_asgd(ws, {"w": np.ones(size, np.float32), "steps": np.array(0)}, 0.5, out=ws),
    )


def _sent_by_redis(r, job_id: int, assignment_ids: range) -> int:
    """Bytes Redis sent while this process merged `assignment_ids` into the job's W_s of BIG values."""
    before = r.info("stats")["total_net_output_bytes"]
    for aid in assignment_ids:
        _half_way_to_one(r, job_id, aid, BIG)
    return int(r.info("stats")["total_net_output_bytes"] - before)


def test_a_process_that_wrote_w_s_last_merges_without_reading_it_back(private_redis) -> None:
    store.initialise(private_redis, 1, {"w": np.zeros(BIG, np.float32)})
    assert _sent_by_redis(private_redis, 1, range(1, 2)) > 4 * BIG, "the first merge reads W_s"
    assert _sent_by_redis(private_redis, 1, range(2, 5)) < BIG // 10, "the next ones find it here, by its tag"
    np.testing.assert_allclose(store.read(private_redis, 1)[1]["w"], 1 - 0.5**4)


def test_a_cached_w_s_is_read_again_after_another_process_merged(private_redis) -> None:
    """This process caches W_s v1; a second process merges v2; this one's next merge must start from v2."""
    store.initialise(private_redis, 1, {"w": np.zeros(BIG, np.float32)})
    _half_way_to_one(private_redis, 1, 1, BIG)
    port = private_redis.connection_pool.connection_kwargs["port"]
    other = multiprocessing.get_context("fork").Process(
        target=lambda: _half_way_to_one(store.connect(f"redis://127.0.0.1:{port}/0"), 1, 2, BIG)
    )
    other.start()
    other.join()
    assert other.exitcode == 0
    assert _sent_by_redis(private_redis, 1, range(3, 4)) > 4 * BIG, "W_s is read again"
    version, params = store.read(private_redis, 1)
    assert version == 3
    np.testing.assert_allclose(params["w"], 1 - 0.5**3)  # from a stale copy: 0.75


# ---- a pass: the results queued for a job merged into W_s read once and written once --------------------------

FEDBUFF = {"rule": "fedbuff", "buffer_size": 3, "outer_optimizer": "nesterov"}
RULES = [{"rule": "vc-asgd", "alpha": 0.6}, NESTEROV, FEDBUFF, {"rule": "delta", "staleness_weight": "polynomial"}]


def _queued(
    rule, assignment_id: int, base_version: int = 0, workunit_id: int | None = None, own_delta: bool = True
) -> QueuedResult:
    """A result of its own Δ (seeded by its id; STEP without `own_delta`) that started from
    `base_version`: its staleness, and so what a staleness-weighted rule does with it, depends on the
    version it is merged into."""
    rng = np.random.default_rng(assignment_id)
    delta = {"w": rng.normal(0, 0.01, 1000).astype(np.float32)} if own_delta else STEP
    client = {"w": delta["w"] + np.float32(1), "steps": np.array(0, np.int64)}

    def step(ws, state, version, norms):
        rule.apply(ws, state, Update(client, delta, version - base_version, 1))

    norm = float(np.linalg.norm(delta["w"]))
    return QueuedResult(assignment_id, step, received_at=1.0, update_norm=norm, workunit_id=workunit_id)


def _merged_record(r, job_id: int) -> tuple:
    version, ws, state = store.read_with_state(r, job_id)
    log = {k: json.loads(v)["version"] for k, v in r.hgetall(keys.merge_log(job_id)).items()}
    return version, ws, state, log, store.recent_update_norms(r, job_id), r.smembers(keys.merged(job_id))


@pytest.mark.parametrize("spec", RULES, ids=lambda s: f"{s['rule']}-{s.get('outer_optimizer', s.get('alpha', 'poly'))}")
def test_k_results_in_one_pass_equal_k_single_merges(private_redis, spec: dict) -> None:
    """The same 7 results (bases 0..3, so their staleness differs) merged one by one into job 1 and in
    one pass into job 2: the same W_s, rule state, versions, recent norms and merged-set."""
    rule = make_rule(spec)
    results = [_queued(rule, aid, base_version=aid % 4) for aid in range(1, 8)]
    for job_id in (1, 2):
        store.initialise(private_redis, job_id, _w(0.0))
    for q in results:
        assert store.merge_batch(private_redis, 1, [q], rule.initial_state)[0].taken is Taken.merged
    takings = store.merge_batch(private_redis, 2, results, rule.initial_state)
    assert [(t.taken, t.version) for t in takings] == [(Taken.merged, v) for v in range(1, 8)]
    single, batched = _merged_record(private_redis, 1), _merged_record(private_redis, 2)
    assert single[0] == batched[0] == 7
    _assert_same(batched[1], single[1])
    _assert_same(batched[2], single[2])
    assert single[3:] == batched[3:]


def test_a_pass_writes_w_s_once(private_redis) -> None:
    """Four results of a W_s of BIG values in one pass: Redis receives W_s's bytes once, not four times."""
    store.initialise(private_redis, 1, {"w": np.zeros(BIG, np.float32)})
    _half_way_to_one(private_redis, 1, 1, BIG)  # this process now holds W_s: the pass reads nothing back
    received = private_redis.info("stats")["total_net_input_bytes"]
    ones = {"w": np.ones(BIG, np.float32)}
    half = QueuedResult(0, lambda ws, _state, _v, _norms: merge_vc_asgd(ws, ones, 0.5, out=ws) and None)
    takings = store.merge_batch(private_redis, 1, [replace(half, assignment_id=aid) for aid in range(2, 6)])
    assert [t.version for t in takings] == [2, 3, 4, 5]
    assert 4 * BIG < private_redis.info("stats")["total_net_input_bytes"] - received < 2 * 4 * BIG
    np.testing.assert_allclose(store.read(private_redis, 1)[1]["w"], 1 - 0.5**5)


def test_a_pass_refuses_supersedes_and_skips_results_one_by_one(private_redis) -> None:
    """In one pass: a result an earlier pass merged, one its step refuses, and the duplicate of a
    workunit merged earlier in the pass change nothing; the others are merged at consecutive versions."""
    rule = make_rule(NESTEROV)
    store.initialise(private_redis, 1, _w(0.0))
    store.merge_batch(private_redis, 1, [_queued(rule, 1)], rule.initial_state)

    def refuse(ws, state, version, norms):
        return "too large"

    results = [
        _queued(rule, 1),  # merged by the earlier pass
        _queued(rule, 2, workunit_id=20),
        QueuedResult(3, refuse, update_norm=99.0),
        _queued(rule, 4, workunit_id=20),  # the straggler's duplicate of 2
        _queued(rule, 5),
    ]
    takings = store.merge_batch(private_redis, 1, results, rule.initial_state)
    assert [(t.taken, t.version, t.reason, t.winner) for t in takings] == [
        (Taken.already_merged, 1, "", None),
        (Taken.merged, 2, "", None),
        (Taken.refused, None, "too large", None),
        (Taken.superseded, None, "", 2),
        (Taken.merged, 3, "", None),
    ]
    assert private_redis.smembers(keys.merged(1)) == {b"1", b"2", b"5"}
    assert private_redis.hgetall(keys.merged_workunits(1)) == {b"20": b"2"}
    assert 99.0 not in store.recent_update_norms(private_redis, 1)
    assert int(store.read_state(private_redis, 1)[1]["step"]) == 3


def test_a_pass_that_fails_midway_writes_nothing(private_redis) -> None:
    rule = make_rule(NESTEROV)
    store.initialise(private_redis, 1, _w(0.0))

    def fail(ws, state, version, norms):
        raise RuntimeError("a bug in a rule")

    with pytest.raises(RuntimeError):
        store.merge_batch(private_redis, 1, [_queued(rule, 1), QueuedResult(2, fail)], rule.initial_state)
    assert store.read_state(private_redis, 1) == (0, None) and not private_redis.exists(keys.merged(1))
    assert store.merge_batch(private_redis, 1, [_queued(rule, 1)], rule.initial_state)[0].version == 1


def _deliver_passes(port: int, job_id: int, passes: list[list[int]]) -> None:
    conn = store.connect(f"redis://127.0.0.1:{port}/0")
    rule = make_rule(NESTEROV)
    for ids in passes:
        store.merge_batch(conn, job_id, [_queued(rule, aid, own_delta=False) for aid in ids], rule.initial_state)


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_racing_passes_merge_each_result_once_with_one_optimizer_step(private_redis, workers: str) -> None:
    """4 workers, each with its own Redis connection, merge 24 results in overlapping passes of 3 (each
    result in two passes): 24 merges, 24 momentum steps, and the same W_s and momentum as 24 single
    merges (of the same update, so that the order the passes land in does not matter)."""
    store.initialise(private_redis, 3, _w(0.0))
    port = private_redis.connection_pool.connection_kwargs["port"]
    ids = list(range(100, 124))
    passes = [ids[i : i + 3] for i in range(0, 24, 3)] + [ids[i : i + 3] for i in range(1, 24, 3)]
    chunks = [passes[i::4] for i in range(4)]
    if workers == "threads":
        pool = [threading.Thread(target=_deliver_passes, args=(port, 3, c)) for c in chunks]
    else:
        ctx = multiprocessing.get_context("fork")
        pool = [ctx.Process(target=_deliver_passes, args=(port, 3, c)) for c in chunks]
    for w in pool:
        w.start()
    for w in pool:
        w.join()
    if workers == "processes":
        assert [p.exitcode for p in pool] == [0] * 4
    version, state = store.read_state(private_redis, 3)
    assert version == 24 and private_redis.scard(keys.merged(3)) == 24 and int(state["step"]) == 24
    versions = sorted(json.loads(x)["version"] for x in private_redis.hgetall(keys.merge_log(3)).values())
    assert versions == list(range(1, 25))
    store.initialise(private_redis, 4, _w(0.0))
    _deliver_passes(port, 4, [[aid] for aid in ids])
    _, ws, expected = store.read_with_state(private_redis, 4)
    _assert_same(state, expected)
    _assert_same(store.read(private_redis, 3)[1], ws)
