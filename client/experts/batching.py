"""Calls of one expert, gathered into batches (as hivemind's TaskPool does): the calls that arrive
within `window` seconds of the first, up to `max_rows` rows, run as one batch in a worker thread,
and each caller gets its own rows back. A batch that fails fails its own calls only."""

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

BatchFn = Callable[..., np.ndarray]  # (*arrays [rows, dim]) -> [rows, dim]


@dataclass
class _Call:
    arrays: Sequence[np.ndarray]
    done: asyncio.Future[np.ndarray]

    @property
    def rows(self) -> int:
        return int(self.arrays[0].shape[0])


@dataclass
class BatchQueue:
    """One expert's queue for one kind of call (forward or backward)."""

    run: BatchFn
    window: float = 0.005
    max_rows: int = 4096
    batches: int = 0  # batches run, for the host's figures
    _queue: asyncio.Queue[_Call] = field(default_factory=asyncio.Queue)
    _worker: asyncio.Task[None] | None = None

    async def call(self, *arrays: np.ndarray) -> np.ndarray:
        """Run `arrays` (the rows of one call) with whatever else arrives in the window; their result."""
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._serve())
        done: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Call(arrays, done))
        return await done

    async def _serve(self) -> None:
        carried: _Call | None = None  # the call that would have overflowed the last batch: the next one's first
        while True:
            first = carried if carried is not None else await self._queue.get()
            carried = None
            if first.rows < self.max_rows:
                await asyncio.sleep(self.window)  # the window: calls that arrive meanwhile join this batch
            batch, rows = [first], first.rows
            while not self._queue.empty():
                nxt = self._queue.get_nowait()
                if rows + nxt.rows > self.max_rows:
                    carried = nxt
                    break
                batch.append(nxt)
                rows += nxt.rows
            await self._run(batch)

    async def _run(self, batch: list[_Call]) -> None:
        live = [c for c in batch if not c.done.cancelled()]  # a caller that went away gets nothing
        if not live:
            return
        joined = [np.concatenate([c.arrays[i] for c in live]) for i in range(len(live[0].arrays))]
        self.batches += 1
        try:
            out = await asyncio.to_thread(self.run, *joined)
        except Exception as exc:
            for c in live:
                if not c.done.done():
                    c.done.set_exception(exc)
            return
        start = 0
        for c in live:
            if not c.done.done():
                c.done.set_result(out[start : start + c.rows])
            start += c.rows
