"""The experts' weights a moe job is evaluated and exported with: each expert's newest checkpoint
(of any replica) from object storage, read once per checkpoint by the parameter servers' cache, an
unreadable one left out (the expert is then at its initial weights)."""

from datetime import UTC

import numpy as np
import pytest
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.assimilator.expert_weights import ExpertCheckpoints
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.refusals import Refusal, RefusalKind
from crowdtrain.core.storage import Storage, open_storage
from crowdtrain.core.tensors import encode
from crowdtrain.migrations import upgrade
from crowdtrain.server.ledger import experts
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.experts import KEY_READS
from crowdtrain.server.ledger.exports import mixture_weights
from crowdtrain.server.ledger.models import Host
from crowdtrain.server.services import experts as services
from tests.server.ledger.test_experts import T0, at

LAYOUT = ExpertLayout(layers=1, grid=[2], dim=2, hidden=2, k=1, replicas=2)


class CountingStorage:
    """The file storage, counting its reads."""

    def __init__(self, storage: Storage):
        self.storage, self.reads = storage, 0

    def get(self, key: str) -> bytes:
        self.reads += 1
        return self.storage.get(key)


def setup(tmp_path, sqlite_url: str) -> tuple[sessionmaker[Session], Storage, int]:
    upgrade(sqlite_url)
    db = session_factory(sqlite_url)
    with db.begin() as s:
        s.add_all(Host(name=f"h{i}", token_hash=f"{i:064d}") for i in (1, 2))
    storage = open_storage((tmp_path / "storage").as_uri())
    mixture = experts.create_mixture(db, "m", LAYOUT)
    for host, url in ((1, "http://a:1"), (2, "http://b:1")):
        experts.renew_and_lease(db, host, mixture, url, 4, T0, grant=True)
    return db, storage, mixture


def checkpoint(value: float) -> bytes:
    return encode({"param/w": np.full((2, 2), value, np.float32), "steps": np.array([1])})


def test_the_newest_checkpoint_of_any_replica_is_read_once_and_an_unreadable_one_is_left_out(
    tmp_path, sqlite_url
) -> None:
    db, storage, mixture = setup(tmp_path, sqlite_url)
    storage.put("k/a", checkpoint(1.0))
    storage.put("k/b", checkpoint(2.0))
    storage.put("k/bad", b"not safetensors")
    experts.record_checkpoint(db, 1, mixture, "0.0", 10, "k/a", at(1))
    experts.record_checkpoint(db, 2, mixture, "0.0", 20, "k/b", at(1))
    experts.record_checkpoint(db, 1, mixture, "0.1", 10, "k/bad", at(1))
    weights = mixture_weights(db, storage, mixture)
    assert list(weights) == ["expert/0.0/w"] and float(weights["expert/0.0/w"][0, 0]) == 2.0
    counting = CountingStorage(storage)
    cache = ExpertCheckpoints(db, counting)  # type: ignore[arg-type]
    assert cache(mixture).keys() == weights.keys() and counting.reads == 2
    assert cache(mixture).keys() == weights.keys() and counting.reads == 2, "read again"
    storage.put("k/a2", checkpoint(3.0))
    experts.record_checkpoint(db, 1, mixture, "0.0", 30, "k/a2", at(2))
    assert float(cache(mixture)["expert/0.0/w"][0, 0]) == 3.0 and counting.reads == 3


class ReplacingStorage:
    """The file storage, where the host of `key` uploads a newer checkpoint just before `key` is read
    (the newer one deletes it), `times` times in a row."""

    def __init__(self, storage: Storage, db: sessionmaker[Session], mixture: int, key: str, step: int, times: int):
        self.storage, self.db, self.mixture, self.key, self.times = storage, db, mixture, key, times
        self.step = step

    def get(self, key: str) -> bytes:
        if key == self.key and self.times > 0:
            self.times -= 1
            self.step += 10
            self.key = f"k/b{self.step}"
            self.storage.put(self.key, checkpoint(float(self.step)))
            experts.record_checkpoint(self.db, 2, self.mixture, "0.0", self.step, self.key, at(2))
            self.storage.delete(key)
        return self.storage.get(key)


def test_a_checkpoint_replaced_while_it_is_read_gives_way_to_the_newer_one(tmp_path, sqlite_url, caplog) -> None:
    db, storage, mixture = setup(tmp_path, sqlite_url)
    storage.put("k/b", checkpoint(2.0))
    experts.record_checkpoint(db, 2, mixture, "0.0", 20, "k/b", at(1))
    racing = ReplacingStorage(storage, db, mixture, "k/b", step=20, times=1)
    weights = mixture_weights(db, racing, mixture)  # type: ignore[arg-type]
    assert float(weights["expert/0.0/w"][0, 0]) == 30.0, "the newer checkpoint, not none"
    assert float(ExpertCheckpoints(db, racing)(mixture)["expert/0.0/w"][0, 0]) == 30.0  # type: ignore[arg-type]
    # Replaced at every read: after KEY_READS keys the expert is left out, logged, and nothing raises.
    racing = ReplacingStorage(storage, db, mixture, "k/b30", step=30, times=KEY_READS)
    assert mixture_weights(db, racing, mixture) == {}  # type: ignore[arg-type]
    assert "is gone; left out" in caplog.text


def test_a_host_restoring_a_checkpoint_replaced_as_it_is_read_gets_the_newer_one(tmp_path, sqlite_url) -> None:
    """The scheduler's side of a host's restore (crowdtrain.server.services.experts.checkpoint): the key it
    read is gone when the bytes are read, so it reads the key again, and refuses (conflict: ask again)
    only when that keeps happening, never answering with an error of its own."""
    db, storage, mixture = setup(tmp_path, sqlite_url)
    storage.put("k/b", checkpoint(2.0))
    experts.record_checkpoint(db, 2, mixture, "0.0", 20, "k/b", at(1))
    now = at(3).replace(tzinfo=UTC).timestamp()
    racing = ReplacingStorage(storage, db, mixture, "k/b", step=20, times=1)
    assert services.checkpoint(db, racing, 1, mixture, "0.0", now) == checkpoint(30.0)  # type: ignore[arg-type]
    racing = ReplacingStorage(storage, db, mixture, "k/b30", step=30, times=KEY_READS)
    with pytest.raises(Refusal) as refused:
        services.checkpoint(db, racing, 1, mixture, "0.0", now)  # type: ignore[arg-type]
    assert refused.value.kind == RefusalKind.conflict and "replaced as it was read" in str(refused.value)
