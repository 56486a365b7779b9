"""Dynamic local work on the client: a trainer given `local_fraction` trains that share of its local
epochs' steps (rounded up, at least one), reports the examples it trained, and resumes exactly."""

import json
from pathlib import Path

import numpy as np
import pytest

from crowdtrain.client.journal import FileCheckpoint
from crowdtrain.client.trainers import Cancelled, TrainControl, examples_in, local_steps, train
from crowdtrain.core.zoo import build_model, state_to_numpy
from tests.client.test_checkpoint import RECIPE, _StopAtSave


class CountingControl(TrainControl):
    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def between_batches(self) -> None:
        self.batches += 1
        super().between_batches()


@pytest.mark.parametrize(
    ("examples", "batch", "epochs", "fraction", "steps"),
    [
        (200, 16, 2, 1.0, 26),
        (200, 16, 2, 0.5, 13),
        (200, 16, 2, 0.3, 8),
        (200, 16, 1, 0.01, 1),
        (10, 16, 3, 0.1, 1),
        (100, 10, 1, 0.3, 3),  # 0.3 * 10 is 3.0000000000000004 in floating point
    ],
)
def test_local_steps_round_up_to_at_least_one(
    examples: int, batch: int, epochs: int, fraction: float, steps: int
) -> None:
    assert local_steps(examples, batch, epochs, fraction) == steps


def test_examples_count_the_short_last_batch_of_each_pass() -> None:
    assert examples_in(13, 200, 16) == 200
    assert examples_in(14, 200, 16) == 216
    assert examples_in(26, 200, 16) == 400
    assert examples_in(12, 200, 16) == 192


@pytest.mark.parametrize("fraction", [0.0, 1.5, -1.0])
def test_a_fraction_outside_0_1_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="local_fraction"):
        local_steps(200, 16, 2, fraction)


@pytest.fixture(scope="module")
def shard() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(200, 40)).astype(np.float32), rng.integers(0, 10, 200)


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_half_the_local_work_trains_half_the_examples(framework: str, shard) -> None:
    if framework == "tensorflow":
        pytest.importorskip("tensorflow")
    x, y = shard
    recipe = {**RECIPE, "training": {**RECIPE["training"], "local_epochs": 2}}
    params = state_to_numpy(build_model("cnn1d", [40], 10, seed=0))
    whole, half = CountingControl(), CountingControl()
    full = train(framework, recipe, params, x, y, control=whole)
    part = train(framework, recipe, params, x, y, control=half, local_fraction=0.5)
    assert (whole.batches, full.examples) == (26, 400)
    assert (half.batches, part.examples) == (13, 200)
    assert any(not np.array_equal(part.params[k], full.params[k]) for k in params)
    assert any(not np.array_equal(part.params[k], params[k]) for k in params)


def test_a_resumed_partial_run_stops_where_an_uninterrupted_one_does(tmp_path: Path, shard) -> None:
    x, y = shard
    params = state_to_numpy(build_model("cnn1d", [40], 10, seed=0))
    # 3 local epochs of 13 batches, 0.7 of them: 28 steps, ending two batches into the third pass.
    whole = train("pytorch", RECIPE, params, x, y, local_fraction=0.7)
    with pytest.raises(Cancelled):
        train(
            "pytorch",
            RECIPE,
            params,
            x,
            y,
            checkpoint=_StopAtSave(tmp_path / "c.safetensors", at_batch=20),
            local_fraction=0.7,
        )
    resumed = FileCheckpoint(tmp_path / "c.safetensors", interval=0)
    progress = resumed.resumed[1]
    done_before = progress["epoch"] * 13 + progress["batch_start"] // 16
    control = CountingControl()
    again = train("pytorch", RECIPE, params, x, y, checkpoint=resumed, control=control, local_fraction=0.7)
    assert whole.examples == again.examples == 2 * 200 + 2 * 16
    assert control.batches == 28 - done_before
    for name in params:
        np.testing.assert_array_equal(again.params[name], whole.params[name])


def test_a_journaled_assignment_resumes_with_its_local_fraction_and_its_heartbeat_interval(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from crowdtrain.client.journal import AssignmentJournal
    from crowdtrain.core.schemas import AssignmentOut

    ref = {"url": "/x", "sha256": "0" * 64, "size": 1}
    a = AssignmentOut(
        assignment_id=7,
        job_id=1,
        workunit_id=3,
        epoch=2,
        shard_index=0,
        base_version=4,
        deadline=datetime.now(UTC),
        local_fraction=0.4,
        recipe={"model": {}, "training": {}, "seed": 1},
        shard=ref,
        snapshot=ref,
    )
    journal = AssignmentJournal(tmp_path, "http://scheduler")
    journal.record(a, 2.0)
    (resumed,) = journal.pending()
    assert resumed.assignment.local_fraction == 0.4
    assert resumed.heartbeat_every == 2.0, "heartbeated at the pace its work reply named, not the default"

    # An entry of an older client (no interval), or one whose interval is not a positive number: the default.
    for every in (None, -1, "soon", float("inf"), True):
        entry = json.loads(journal._path(7).read_text())
        entry.pop("heartbeat_every", None)
        if every is not None:
            entry["heartbeat_every"] = every
        journal._path(7).write_text(json.dumps(entry))
        (resumed,) = journal.pending()
        assert (resumed.assignment.assignment_id, resumed.heartbeat_every) == (7, None), every


@pytest.mark.parametrize("fraction", [0.0, 1.01, float("nan")])
def test_a_local_fraction_outside_0_1_from_the_scheduler_is_refused(fraction: float) -> None:
    from pydantic import ValidationError

    from crowdtrain.core.schemas import AssignmentOut

    with pytest.raises(ValidationError, match="local_fraction"):
        AssignmentOut.model_validate(
            {
                "assignment_id": 1,
                "job_id": 1,
                "workunit_id": 1,
                "epoch": 1,
                "shard_index": 0,
                "base_version": 0,
                "deadline": "2026-01-01T00:00:00Z",
                "local_fraction": fraction,
                "recipe": {"model": {}, "training": {}, "seed": 1},
                "shard": {"url": "/x", "sha256": "0" * 64, "size": 1},
                "snapshot": {"url": "/x", "sha256": "0" * 64, "size": 1},
            }
        )
