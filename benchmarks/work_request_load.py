"""The load generator of benchmarks/dispatch_throughput.py: `POST /v1/work` requests sent back to
back over raw keep-alive HTTP/1.1 on asyncio streams, each host's request bytes built once and the
answer's assignments counted without parsing its JSON, so that it measures the scheduler rather
than itself. What completes inside a measured window is counted in a `Window`."""

import asyncio
import random
import time
from dataclasses import dataclass, field


@dataclass
class Window:
    """What completed between `start` and `end` (monotonic seconds)."""

    start: float
    end: float
    latencies: list[float] = field(default_factory=list)
    dispatches: int = 0
    empty: int = 0  # 200 answers without an assignment: the job ran out of ready workunits
    status_codes: dict[int, int] = field(default_factory=dict)
    transport_errors: int = 0

    def contains(self, t: float) -> bool:
        return self.start <= t <= self.end


def work_requests(tokens: list[str]) -> list[bytes]:
    body = b'{"free_slots":1}'
    return [
        b"POST /v1/work HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {t}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
        for t in tokens
    ]


async def lean_worker(port: int, requests: list[bytes], w: Window, seed: int) -> int:
    """One keep-alive connection sending work requests back to back until the window ends."""
    rng = random.Random(seed)
    done = 0
    while time.monotonic() < w.end:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            w.transport_errors += 1
            await asyncio.sleep(0.1)
            continue
        try:
            while time.monotonic() < w.end:
                start = time.monotonic()
                writer.write(rng.choice(requests))
                head = await reader.readuntil(b"\r\n\r\n")
                at = head.lower().find(b"content-length:")
                length = int(head[at + 15 : head.index(b"\r\n", at)]) if at >= 0 else 0
                body = await reader.readexactly(length)
                finished = time.monotonic()
                done += 1
                if not w.contains(finished):
                    continue
                w.latencies.append(finished - start)
                code = int(head[9:12])
                if code != 200:
                    w.status_codes[code] = w.status_codes.get(code, 0) + 1
                    continue
                n = body.count(b'"assignment_id"')
                w.dispatches += n
                w.empty += n == 0
        except (OSError, asyncio.IncompleteReadError, ValueError):
            w.transport_errors += 1
        finally:
            writer.close()
    return done


async def drive(port: int, requests: list[bytes], concurrency: int, warmup: float, seconds: float) -> Window:
    now = time.monotonic()
    window = Window(start=now + warmup, end=now + warmup + seconds)
    await asyncio.gather(*(lean_worker(port, requests, window, i) for i in range(concurrency)))
    return window
