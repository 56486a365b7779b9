"""Checkpoint and resume: the trainer continues exactly where it stopped, and a client killed with
SIGKILL takes its assignment up again from the checkpoint when it restarts."""

import json
import signal
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from sqlalchemy import select

from crowdtrain.client.journal import AssignmentJournal, FileCheckpoint
from crowdtrain.client.trainers import Cancelled, train
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.core.zoo import build_model, state_to_numpy
from crowdtrain.launch.cluster import wait_for
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Host
from tests.conftest import EXAMPLE_SPEC

RECIPE = {
    "model": {"name": "cnn1d", "input_shape": [40], "num_classes": 10, "options": {}},
    "training": {
        "local_epochs": 3,
        "batch_size": 16,
        "optimizer": "adam",
        "lr": 0.01,
        "momentum": 0.0,
        "weight_decay": 0.0,
    },
    "seed": 5,
}


class _StopAtSave(FileCheckpoint):
    """Saves at the n-th batch boundary, then stops training as a killed process would."""

    def __init__(self, path: Path, at_batch: int):
        super().__init__(path, interval=1.0)
        self.at_batch, self.batches = at_batch, 0

    def due(self) -> bool:
        self.batches += 1
        return self.batches == self.at_batch

    def save(self, tensors, progress) -> None:
        super().save(tensors, progress)
        raise Cancelled()


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resumed_training_ends_exactly_where_uninterrupted_training_does(
    tmp_path: Path, optimizer: str, framework: str
) -> None:
    if framework == "tensorflow":
        pytest.importorskip("tensorflow")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 40)).astype(np.float32), rng.integers(0, 10, 200)
    recipe = {**RECIPE, "training": {**RECIPE["training"], "optimizer": optimizer, "momentum": 0.9}}
    params = state_to_numpy(build_model("cnn1d", [40], 10, seed=0))
    whole = train(framework, recipe, params, x, y)

    with pytest.raises(Cancelled):
        train(framework, recipe, params, x, y, checkpoint=_StopAtSave(tmp_path / "c.safetensors", at_batch=20))
    resumed = FileCheckpoint(tmp_path / "c.safetensors", interval=0)
    assert resumed.resumed is not None and resumed.resumed[1]["epoch"] == 1  # stopped in the second epoch
    again = train(framework, recipe, params, x, y, checkpoint=resumed)
    for name in params:
        np.testing.assert_array_equal(again.params[name], whole.params[name])
    assert again.train_loss == whole.train_loss


def test_a_torn_checkpoint_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "c.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert FileCheckpoint(tmp_path / "c.safetensors", interval=1).resumed is None


def _checkpoint_progress(cache: Path) -> dict | None:
    for path in (cache / "assignments").glob("*.checkpoint.safetensors"):
        try:
            with safe_open(str(path), framework="numpy") as f:
                return json.loads(f.metadata()[FileCheckpoint.PROGRESS])
        except Exception:  # being replaced right now
            return None
    return None


@pytest.mark.integration
def test_a_sigkilled_client_resumes_its_assignment_from_the_checkpoint(make_cluster, sqlite_url: str) -> None:
    cluster = make_cluster(sqlite_url)
    spec = load_job_spec(EXAMPLE_SPEC)
    spec.training.local_epochs = 16
    spec.scheduling.deadline_seconds = 600
    cluster.submit(spec.model_dump(mode="json"))
    db = session_factory(sqlite_url)
    args = ("--no-prefetch", "--checkpoint-seconds", "0.5", "--max-assignments", "1")
    client = cluster.start_client("volunteer", 1, *args)
    cache = cluster.var_dir / "clients" / "volunteer"
    wait_for(
        lambda: (_checkpoint_progress(cache) or {}).get("epoch", 0) >= 3, 120, "no checkpoint past epoch 3", client
    )
    client.signal(signal.SIGKILL)
    client.proc.wait(10)
    with db.begin() as s:
        (a,) = s.scalars(select(Assignment).join(Host).where(Host.name == "volunteer"))
    assert a.status == AssignmentStatus.in_progress.value
    assert AssignmentJournal(cache / "assignments", cluster.url).pending()[0].assignment.assignment_id == a.id

    restarted = cluster.start_client("volunteer", 1, *args)
    assert restarted.proc.wait(180) == 0, restarted.tail()
    log = restarted.tail(200)
    assert f"assignment {a.id}: resuming from its checkpoint at {{'epoch': " in log
    resumed_epoch = int(log.split(f"assignment {a.id}: resuming from its checkpoint at {{'epoch': ")[1].split(",")[0])
    assert resumed_epoch >= 3
    with db.begin() as s:
        rows = s.scalars(select(Assignment).where(Assignment.workunit_id == a.workunit_id)).all()
    # The same assignment finished: nothing timed out, nothing was dispatched again.
    assert [(r.id, r.status) for r in rows] in ([(a.id, "uploaded")], [(a.id, "merged")])
    assert rows[0].examples == 16 * 1000
    assert not list((cache / "assignments").iterdir()), "journal and checkpoint are removed once uploaded"
