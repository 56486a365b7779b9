"""The job's merge lease against a real (private) Redis: one process merges a job's results at a time,
the others return at once, and no request to merge is lost."""

import random
import threading
import time

from crowdtrain.core import keys
from crowdtrain.server.paramstore import lease


def test_a_process_that_finds_the_lease_held_returns_at_once_and_the_holder_runs_its_request(private_redis) -> None:
    """While the holder's pass runs, another process asks: it returns without waiting, and the holder
    runs one more pass for it before letting the lease go."""
    in_pass, finish = threading.Event(), threading.Event()
    passes: list[str] = []

    def drain(renew) -> None:
        passes.append("pass")
        if len(passes) == 1:
            in_pass.set()
            assert finish.wait(10)
        renew()

    holder = threading.Thread(target=lease.serve, args=(private_redis, 1, drain))
    holder.start()
    assert in_pass.wait(10)
    started = time.monotonic()
    assert not lease.serve(private_redis, 1, lambda renew: passes.append("the other's"))
    assert time.monotonic() - started < 0.5, "it did not wait for the lease"
    finish.set()
    holder.join(10)
    assert passes == ["pass", "pass"]
    assert not private_redis.exists(keys.merge_lease(1)) and not private_redis.exists(keys.merges_wanted(1))


def test_no_request_is_lost_between_the_holder_s_last_pass_and_its_release(private_redis) -> None:
    """In each of 300 rounds, 3 threads each store a result and ask for the job's merges at the same
    moment, then nobody asks again: a pass takes every result stored so far, and each thread's result
    must be taken, however the requests interleave with a holder's last look and its release."""
    stored: list[int] = []
    taken: set[int] = set()
    guard = threading.Lock()
    rounds, threads = 300, 3
    start = threading.Barrier(threads)
    lost: list[int] = []

    def drain(renew) -> None:
        with guard:
            taken.update(stored)

    def deliver(me: int) -> None:
        jitter = random.Random(me)
        for n in range(rounds):
            start.wait(10)
            time.sleep(jitter.uniform(0, 0.002))  # requests land anywhere in a holder's pass and release
            result = n * threads + me
            with guard:
                stored.append(result)
            lease.serve(private_redis, 2, drain)
            deadline = time.monotonic() + 2
            while result not in taken and time.monotonic() < deadline:
                time.sleep(0.001)
            if result not in taken:
                lost.append(result)
                start.abort()
                return

    pool = [threading.Thread(target=deliver, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(120)
    assert not lost, f"results never taken: {lost}"
    assert taken == set(range(rounds * threads))


def test_a_lease_left_by_a_dead_holder_lapses(private_redis) -> None:
    """A holder that died keeps others out until its lease lapses; the next request then runs."""
    assert private_redis.lock(keys.merge_lease(3), timeout=0.3).acquire(blocking=False)
    passes: list[int] = []
    assert not lease.serve(private_redis, 3, lambda renew: passes.append(1))
    time.sleep(0.4)
    assert lease.serve(private_redis, 3, lambda renew: passes.append(2))
    assert passes == [2]
