"""The experts' weights a moe job is evaluated and exported with: each expert's newest checkpoint
(of any replica) from object storage, read once per checkpoint by the parameter servers' cache, an
unreadable one left out (the expert is then at its initial weights)."""

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.assimilator.expert_weights import ExpertCheckpoints
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.storage import Storage, open_storage
from crowdtrain.core.tensors import encode
from crowdtrain.migrations import upgrade
from crowdtrain.server.ledger import experts
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.exports import mixture_weights
from crowdtrain.server.ledger.models import Host
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
