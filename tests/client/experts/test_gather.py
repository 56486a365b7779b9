"""How long a trainer waits for a micro-batch's calls (crowdtrain.client.experts.mixture._gather): until
each row has the answers it needs, or a quorum of the calls has answered, then a short grace; a call
still out is dropped and counted late."""

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from crowdtrain.client.experts.mixture import ExpertClient, _gather, _Routed
from crowdtrain.core.experts import ExpertLayout

LAYOUT = ExpertLayout(layers=1, grid=[10], dim=2, hidden=2, k=1, grace=0.05)


def calls(pool: ThreadPoolExecutor, slow: threading.Event) -> dict[Future, _Routed]:
    """Ten calls, one per row: nine answer at once, the one of row 0 when `slow` is set."""

    def answer(wait: threading.Event | None) -> np.ndarray:
        if wait is not None:
            wait.wait(30)
        return np.zeros((1, LAYOUT.dim), np.float32)

    return {
        pool.submit(answer, slow if row == 0 else None): _Routed(
            f"0.{row}", torch.tensor([row]), torch.tensor([0]), "http://a:1"
        )
        for row in range(10)
    }


def test_a_quorum_of_answers_ends_the_wait_for_a_lost_call_after_the_grace() -> None:
    client, slow = ExpertClient(LAYOUT, {"0.0": "http://a:1"}), threading.Event()
    with ThreadPoolExecutor(10) as pool:
        answers = _gather(client, calls(pool, slow), torch.ones(10, dtype=torch.long), timeout=30, quorum=0.9)
        slow.set()
    assert sorted(answers) == [f"0.{row}" for row in range(1, 10)]
    assert client.figures["late"] == 1 and [(c.uid, c.late) for c in client.take_calls()] == [("0.0", 1)]
    client.close()


def test_without_a_quorum_a_row_that_needs_the_call_waits_for_it() -> None:
    client, slow = ExpertClient(LAYOUT, {}), threading.Event()
    threading.Timer(0.3, slow.set).start()
    with ThreadPoolExecutor(10) as pool:
        answers = _gather(client, calls(pool, slow), torch.ones(10, dtype=torch.long), timeout=30, quorum=1.0)
    assert sorted(answers) == sorted(f"0.{row}" for row in range(10)) and client.figures["late"] == 0
    client.close()
