"""A pass: the results queued for a job merged into W_s read once and written once, and the W_s a
process keeps between its passes, against a real (private) Redis."""

import json
import multiprocessing
import threading
from dataclasses import replace

import numpy as np
import pytest

from crowdtrain.assimilator.rules import Update, make_rule, merge_vc_asgd
from crowdtrain.core import keys, merge_stages
from crowdtrain.server.paramstore import merging, store
from crowdtrain.server.paramstore.steps import QueuedResult, Taken
from tests.server.paramstore.w_s_values import NESTEROV, STEP, assert_same, filled

BIG = 1 << 20  # float32 values: a 4 MB W_s, whose reading back shows in the bytes Redis sends


def _half_way_to_one(r, job_id: int, assignment_id: int, size: int = 1000) -> merging.MergeOutcome:
    return merging.merge_once(
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
    return QueuedResult(
        assignment_id, step, stamps=merge_stages.received(1.0), update_norm=norm, workunit_id=workunit_id
    )


def _merged_record(r, job_id: int) -> tuple:
    version, ws, state = store.read_with_state(r, job_id)
    log = {k: json.loads(v)["version"] for k, v in r.hgetall(keys.merge_log(job_id)).items()}
    return version, ws, state, log, merging.recent_update_norms(r, job_id), r.smembers(keys.merged(job_id))


@pytest.mark.parametrize("spec", RULES, ids=lambda s: f"{s['rule']}-{s.get('outer_optimizer', s.get('alpha', 'poly'))}")
def test_k_results_in_one_pass_equal_k_single_merges(private_redis, spec: dict) -> None:
    """The same 7 results (bases 0..3, so their staleness differs) merged one by one into job 1 and in
    one pass into job 2: the same W_s, rule state, versions, recent norms and merged-set."""
    rule = make_rule(spec)
    results = [_queued(rule, aid, base_version=aid % 4) for aid in range(1, 8)]
    for job_id in (1, 2):
        store.initialise(private_redis, job_id, filled(0.0))
    for q in results:
        assert merging.merge_batch(private_redis, 1, [q], rule.initial_state)[0].taken is Taken.merged
    takings = merging.merge_batch(private_redis, 2, results, rule.initial_state)
    assert [(t.taken, t.version) for t in takings] == [(Taken.merged, v) for v in range(1, 8)]
    single, batched = _merged_record(private_redis, 1), _merged_record(private_redis, 2)
    assert single[0] == batched[0] == 7
    assert_same(batched[1], single[1])
    assert_same(batched[2], single[2])
    assert single[3:] == batched[3:]


def test_a_pass_writes_w_s_once(private_redis) -> None:
    """Four results of a W_s of BIG values in one pass: Redis receives W_s's bytes once, not four times."""
    store.initialise(private_redis, 1, {"w": np.zeros(BIG, np.float32)})
    _half_way_to_one(private_redis, 1, 1, BIG)  # this process now holds W_s: the pass reads nothing back
    received = private_redis.info("stats")["total_net_input_bytes"]
    ones = {"w": np.ones(BIG, np.float32)}
    half = QueuedResult(0, lambda ws, _state, _v, _norms: merge_vc_asgd(ws, ones, 0.5, out=ws) and None)
    takings = merging.merge_batch(private_redis, 1, [replace(half, assignment_id=aid) for aid in range(2, 6)])
    assert [t.version for t in takings] == [2, 3, 4, 5]
    assert 4 * BIG < private_redis.info("stats")["total_net_input_bytes"] - received < 2 * 4 * BIG
    np.testing.assert_allclose(store.read(private_redis, 1)[1]["w"], 1 - 0.5**5)


def test_a_pass_refuses_supersedes_and_skips_results_one_by_one(private_redis) -> None:
    """In one pass: a result an earlier pass merged, one its step refuses, and the duplicate of a
    workunit merged earlier in the pass change nothing; the others are merged at consecutive versions."""
    rule = make_rule(NESTEROV)
    store.initialise(private_redis, 1, filled(0.0))
    merging.merge_batch(private_redis, 1, [_queued(rule, 1)], rule.initial_state)

    def refuse(ws, state, version, norms):
        return "too large"

    results = [
        _queued(rule, 1),  # merged by the earlier pass
        _queued(rule, 2, workunit_id=20),
        QueuedResult(3, refuse, update_norm=99.0),
        _queued(rule, 4, workunit_id=20),  # the straggler's duplicate of 2
        _queued(rule, 5),
    ]
    takings = merging.merge_batch(private_redis, 1, results, rule.initial_state)
    assert [(t.taken, t.version, t.reason, t.winner) for t in takings] == [
        (Taken.already_merged, 1, "", None),
        (Taken.merged, 2, "", None),
        (Taken.refused, None, "too large", None),
        (Taken.superseded, None, "", 2),
        (Taken.merged, 3, "", None),
    ]
    assert private_redis.smembers(keys.merged(1)) == {b"1", b"2", b"5"}
    assert private_redis.hgetall(keys.merged_workunits(1)) == {b"20": b"2"}
    assert 99.0 not in merging.recent_update_norms(private_redis, 1)
    assert int(store.read_state(private_redis, 1)[1]["step"]) == 3


def test_a_pass_that_fails_midway_writes_nothing(private_redis) -> None:
    rule = make_rule(NESTEROV)
    store.initialise(private_redis, 1, filled(0.0))

    def fail(ws, state, version, norms):
        raise RuntimeError("a bug in a rule")

    with pytest.raises(RuntimeError):
        merging.merge_batch(private_redis, 1, [_queued(rule, 1), QueuedResult(2, fail)], rule.initial_state)
    assert store.read_state(private_redis, 1) == (0, None) and not private_redis.exists(keys.merged(1))
    assert merging.merge_batch(private_redis, 1, [_queued(rule, 1)], rule.initial_state)[0].version == 1


def _deliver_passes(port: int, job_id: int, passes: list[list[int]]) -> None:
    conn = store.connect(f"redis://127.0.0.1:{port}/0")
    rule = make_rule(NESTEROV)
    for ids in passes:
        merging.merge_batch(conn, job_id, [_queued(rule, aid, own_delta=False) for aid in ids], rule.initial_state)


@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_racing_passes_merge_each_result_once_with_one_optimizer_step(private_redis, workers: str) -> None:
    """4 workers, each with its own Redis connection, merge 24 results in overlapping passes of 3 (each
    result in two passes): 24 merges, 24 momentum steps, and the same W_s and momentum as 24 single
    merges (of the same update, so that the order the passes land in does not matter)."""
    store.initialise(private_redis, 3, filled(0.0))
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
    store.initialise(private_redis, 4, filled(0.0))
    _deliver_passes(port, 4, [[aid] for aid in ids])
    _, ws, expected = store.read_with_state(private_redis, 4)
    assert_same(state, expected)
