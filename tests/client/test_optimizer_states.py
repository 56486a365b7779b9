"""The optimizer states a client's slots keep across a job's workunits: the pool on its own, and the
real client's assignment path training two workunits of one job with and without the recipe's
`training.keep_optimizer_state`."""

from pathlib import Path

import numpy as np
import pytest

import crowdtrain.client.assignment
from crowdtrain.client.assignment import Running
from crowdtrain.client.config import ClientConfig
from crowdtrain.client.optimizer_states import OptimizerStates, keeps_optimizer_state, recipe_key
from crowdtrain.client.trainers import TrainResult, local_steps
from crowdtrain.client.trainers import train as real_train
from crowdtrain.client.worker import VolunteerClient
from crowdtrain.core import signing
from crowdtrain.core.jobspec import TrainingSpec, load_job_spec
from crowdtrain.core.schemas import AssignmentOut, Recipe
from crowdtrain.core.tensors import Params, encode, encode_shard, sha256
from crowdtrain.core.zoo import build_model, state_to_numpy
from tests.client.test_checkpoint import RECIPE
from tests.client.test_hostile_scheduler import RecordingServer
from tests.conftest import EXAMPLE_SPEC

KEY = "recipe-a"


def state(value: float, floats: int = 4) -> Params:
    return {"__opt__/0/exp_avg": np.full(floats, value, dtype=np.float32)}


def test_a_slot_takes_the_state_that_came_back_last_and_nothing_is_shared_between_jobs() -> None:
    pool = OptimizerStates()
    assert pool.take(1, KEY) is None, "a job's first workunit starts from zero"
    pool.put(1, KEY, state(1))
    pool.put(1, KEY, state(2))
    pool.put(2, KEY, state(9))
    assert pool.take(1, KEY)["__opt__/0/exp_avg"][0] == 2
    assert pool.take(1, KEY)["__opt__/0/exp_avg"][0] == 1
    assert pool.take(1, KEY) is None, "a state is taken by one slot at a time"
    assert pool.held(2) == 1


def test_a_changed_recipe_drops_the_jobs_states() -> None:
    pool = OptimizerStates()
    pool.put(1, KEY, state(1))
    pool.put(2, KEY, state(2))
    assert pool.take(1, "recipe-b") is None
    assert pool.held(1) == 0
    pool.put(1, "recipe-b", state(3))
    assert pool.take(1, KEY) is None, "the new recipe's state is no use to the old one either"
    assert pool.held(2) == 1, "other jobs keep theirs"


def test_past_its_bound_in_bytes_the_pool_drops_the_least_recently_used_states_first() -> None:
    one = 4 * 4  # bytes of one state(…)
    pool = OptimizerStates(max_bytes=3 * one)
    pool.put(1, KEY, state(1))
    pool.put(2, KEY, state(2))
    pool.put(1, KEY, state(3))
    assert pool.take(2, KEY) is not None
    pool.put(2, KEY, state(4))  # job 2 is now the most recently used
    pool.put(3, KEY, state(5))
    assert pool.bytes == 3 * one
    assert (pool.held(1), pool.held(2), pool.held(3)) == (1, 1, 1)
    assert pool.take(1, KEY)["__opt__/0/exp_avg"][0] == 3, "the job's oldest state went first"
    pool.put(4, KEY, state(6, floats=100))
    assert pool.bytes == 2 * one and pool.held(4) == 0, "a state larger than the bound is not kept"


def test_recipes_differ_in_key_by_model_and_training_and_older_recipes_keep_nothing() -> None:
    spec = TrainingSpec().model_dump()
    a = Recipe(model=RECIPE["model"], training=spec, seed=1)
    assert recipe_key(a) == recipe_key(Recipe(model=RECIPE["model"], training=spec, seed=2))
    assert recipe_key(a) != recipe_key(Recipe(model=RECIPE["model"], training={**spec, "lr": 0.5}, seed=1))
    assert spec["keep_optimizer_state"] is False and not keeps_optimizer_state(a)
    assert not keeps_optimizer_state(Recipe(model=RECIPE["model"], training=RECIPE["training"], seed=1))
    assert keeps_optimizer_state(Recipe(model=RECIPE["model"], training={**spec, "keep_optimizer_state": True}, seed=1))


class FilesAndUploads(RecordingServer):
    """Serves the snapshot and shard by path and accepts every result upload."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        super().__init__(self.route)

    def route(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if method == "GET" and path in self.files:
            return 200, self.files[path]
        if method == "PUT" and path.split("?")[0].endswith("/result"):
            return 200, b"{}"
        return 404, b'{"detail": "not here"}'


def assignment(aid: int, keep: bool, snapshot: bytes, shard: bytes) -> AssignmentOut:
    training = {**RECIPE["training"], "local_epochs": 1, "keep_optimizer_state": keep}
    return AssignmentOut.model_validate(
        {
            "assignment_id": aid,
            "job_id": 1,
            "workunit_id": aid,
            "epoch": 1,
            "shard_index": 0,
            "base_version": 0,
            "deadline": "2099-01-01T00:00:00Z",
            "recipe": {"model": RECIPE["model"], "training": training, "seed": 5},
            "shard": {"url": "/files/shard", "sha256": sha256(shard), "size": len(shard)},
            "snapshot": {"url": "/files/snapshot", "sha256": sha256(snapshot), "size": len(snapshot)},
        }
    )


def job_files() -> tuple[bytes, bytes]:
    """A snapshot of the recipe's model and a shard of 64 examples, encoded as the server sends them."""
    rng = np.random.default_rng(0)
    m = RECIPE["model"]
    snapshot = encode(state_to_numpy(build_model(m["name"], m["input_shape"], m["num_classes"], seed=0)))
    return snapshot, encode_shard(rng.normal(size=(64, 40)).astype(np.float32), rng.integers(0, 10, 64))


@pytest.mark.parametrize("keep", [True, False])
def test_the_second_workunit_a_slot_trains_continues_the_optimizer_state_of_the_first(
    keep: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the client's own assignment path (download, verify, train, upload): with the flag the
    second workunit's Adam starts where the first's ended (its step count goes on); without, from zero."""
    snapshot, shard = job_files()
    calls: list[tuple[Params | None, TrainResult]] = []

    def recorded_train(*args, **kwargs) -> TrainResult:
        result = real_train(*args, **kwargs)
        calls.append((args[9] if len(args) > 9 else kwargs.get("optimizer_state"), result))
        return result

    monkeypatch.setattr(crowdtrain.client.assignment, "train", recorded_train)
    server = FilesAndUploads({"/files/snapshot": snapshot, "/files/shard": shard})
    volunteer = VolunteerClient(
        ClientConfig(server.url, "join", cache_dir=tmp_path / "cache", checkpoint_seconds=3600, frameworks=["pytorch"])
    )
    try:
        for aid in (1, 2):
            volunteer._work(Running(assignment(aid, keep, snapshot, shard)))
    finally:
        server.close()

    assert [path.split("?")[0] for method, path, _ in server.requests if method == "PUT"] == [
        "/v1/assignments/1/result",
        "/v1/assignments/2/result",
    ]
    steps = local_steps(64, RECIPE["training"]["batch_size"], 1)
    (first_start, first), (second_start, second) = calls
    assert first_start is None, "a job's first workunit on a slot starts from zero"
    assert first.optimizer_state is not None
    if keep:
        assert second_start is not None and second_start.keys() == first.optimizer_state.keys()
        for name, value in first.optimizer_state.items():
            np.testing.assert_array_equal(second_start[name], value)
        assert float(second.optimizer_state["__opt__/0/step"]) == 2 * steps
        assert volunteer.optimizer_states.held(1) == 1
    else:
        assert second_start is None
        assert float(second.optimizer_state["__opt__/0/step"]) == steps
        assert volunteer.optimizer_states.held(1) == 0
    assert volunteer.completed == 2


def test_the_flag_travels_in_the_training_settings_a_jobs_recipe_signs() -> None:
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.training.keep_optimizer_state = True
    assert signing.recipe_training(spec.model_dump(mode="json"))["keep_optimizer_state"] is True


def test_a_failed_training_gives_the_slots_state_back_and_a_resumed_one_takes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state a slot took is unchanged when its training fails (or is cancelled): the slot's next
    workunit continues it. A workunit resumed from its checkpoint has its own state and takes none."""
    snapshot, shard = job_files()
    a = assignment(1, True, snapshot, shard)
    kept = state(1)

    def failing_train(*args, **kwargs) -> TrainResult:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(crowdtrain.client.assignment, "train", failing_train)
    server = FilesAndUploads({"/files/snapshot": snapshot, "/files/shard": shard})
    volunteer = VolunteerClient(
        ClientConfig(server.url, "join", cache_dir=tmp_path / "cache", checkpoint_seconds=3600, frameworks=["pytorch"])
    )
    volunteer.optimizer_states.put(1, recipe_key(a.recipe), kept)
    try:
        volunteer._work(Running(a))
    finally:
        server.close()
    assert [p for m, p, _ in server.requests if m == "POST"] == ["/v1/assignments/1/error"]
    assert volunteer._take_optimizer_state(a, resumed=True) is None
    assert volunteer._take_optimizer_state(a, resumed=False) is kept
