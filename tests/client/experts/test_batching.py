"""An expert's calls gathered into batches: each caller gets its own rows; a failing batch fails its own calls."""

import asyncio
import threading

import numpy as np
import pytest

from crowdtrain.client.experts.batching import BatchQueue


def rows(n: int, value: float) -> np.ndarray:
    return np.full((n, 2), value, np.float32)


def test_calls_that_arrive_within_the_window_run_as_one_batch_and_each_gets_its_rows() -> None:
    seen: list[int] = []

    def double(x: np.ndarray) -> np.ndarray:
        seen.append(x.shape[0])
        return 2 * x

    async def main() -> list[np.ndarray]:
        queue = BatchQueue(double, window=0.2, max_rows=100)
        return await asyncio.gather(*(queue.call(rows(n, n)) for n in (1, 2, 3)))

    out = asyncio.run(main())
    assert seen == [6]
    assert [o.tolist() for o in out] == [rows(n, 2 * n).tolist() for n in (1, 2, 3)]


def test_a_call_that_would_overflow_a_batch_starts_the_next_one_in_order() -> None:
    seen: list[list[float]] = []

    def identity(x: np.ndarray) -> np.ndarray:
        seen.append(sorted(set(x[:, 0].tolist())))
        return x

    async def main() -> list[np.ndarray]:
        queue = BatchQueue(identity, window=0.2, max_rows=4)
        return await asyncio.gather(*(queue.call(rows(n, n)) for n in (3, 1, 2, 2)))

    out = asyncio.run(main())
    assert seen == [[1.0, 3.0], [2.0]]
    assert [o.shape[0] for o in out] == [3, 1, 2, 2]


def test_a_failing_batch_fails_its_own_calls_and_the_next_batch_is_served() -> None:
    calls = {"n": 0}

    def flaky(x: np.ndarray) -> np.ndarray:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("expert broke")
        return x + 1

    async def main() -> tuple[list[object], np.ndarray]:
        queue = BatchQueue(flaky, window=0.1, max_rows=100)
        first = await asyncio.gather(queue.call(rows(1, 0)), queue.call(rows(1, 0)), return_exceptions=True)
        return first, await queue.call(rows(2, 5))

    first, second = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) and "expert broke" in str(e) for e in first)
    assert second.tolist() == rows(2, 6).tolist()


def test_a_batch_runs_off_the_event_loop() -> None:
    loop_thread: list[int] = []
    run_thread: list[int] = []

    def record(x: np.ndarray) -> np.ndarray:
        run_thread.append(threading.get_ident())
        return x

    async def main() -> None:
        loop_thread.append(threading.get_ident())
        await BatchQueue(record, window=0).call(rows(1, 1))

    asyncio.run(main())
    assert run_thread and run_thread[0] != loop_thread[0]


@pytest.mark.parametrize("window", [0.0, 0.01])
def test_a_lone_call_is_answered_whatever_the_window(window: float) -> None:
    async def main() -> np.ndarray:
        return await BatchQueue(lambda x: -x, window=window).call(rows(2, 1))

    assert asyncio.run(main()).tolist() == rows(2, -1).tolist()
