"""The experts' weights that evaluating a mixture-of-experts job (mode moe) uses beside its trunk W_s:
each expert's newest checkpoint in object storage, as its host uploaded it (crowdtrain.server.services.
experts). An expert with no checkpoint yet is evaluated with its initial weights, where its host
started it (crowdtrain.core.zoo_experts.local_experts), so an evaluation lags the experts by at most
one checkpoint interval.

A checkpoint is read once per process and kept while it is the expert's last (each has its own key).
"""

from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.storage import Storage
from crowdtrain.core.tensors import Params
from crowdtrain.server.ledger.exports import checkpoint_weights_at, mixture_weights


class ExpertCheckpoints:
    """`(mixture id) -> the weights of its experts' newest checkpoints`, as expert/UID/NAME arrays
    (crowdtrain.server.ledger.exports.mixture_weights), each checkpoint read once."""

    def __init__(self, db: sessionmaker[Session], storage: Storage):
        self.db, self.storage = db, storage
        self._read: dict[tuple[int, str], tuple[str, Params]] = {}  # (mixture, uid) -> (key, weights)

    def __call__(self, mixture_id: int) -> Params:
        return mixture_weights(self.db, self.storage, mixture_id, self._cached)

    def _cached(self, storage: Storage, mixture_id: int, uid: str, key: str) -> Params:
        held = self._read.get((mixture_id, uid))
        if held is None or held[0] != key:
            held = self._read[(mixture_id, uid)] = (key, checkpoint_weights_at(storage, mixture_id, uid, key))
        return held[1]
