"""The experts' weights that evaluating a mixture-of-experts job (mode moe) uses beside its trunk W_s:
each expert's last checkpoint in object storage, as its host uploaded it (crowdtrain.server.services.
experts). An expert with no checkpoint yet is evaluated with its initial weights, where its host
started it (crowdtrain.core.zoo_experts.local_experts), so an evaluation lags the experts by at most
one checkpoint interval.

A checkpoint is read once per process and kept while it is the expert's last (each has its own key).
"""

import logging

from sqlalchemy.orm import Session, sessionmaker

from crowdtrain.core.experts import checkpoint_weights
from crowdtrain.core.storage import ObjectNotFound, Storage
from crowdtrain.core.tensors import Params, TensorFormatError
from crowdtrain.server.ledger import experts as ledger

log = logging.getLogger(__name__)


class ExpertCheckpoints:
    """`(mixture id) -> the weights of its experts' last checkpoints`, as expert/UID/NAME arrays."""

    def __init__(self, db: sessionmaker[Session], storage: Storage):
        self.db, self.storage = db, storage
        self._read: dict[tuple[int, str], tuple[str, Params]] = {}  # (mixture, uid) -> (key, weights)

    def __call__(self, mixture_id: int) -> Params:
        out: Params = {}
        for uid, key in ledger.checkpoint_keys(self.db, mixture_id).items():
            held = self._read.get((mixture_id, uid))
            if held is None or held[0] != key:
                held = self._read[(mixture_id, uid)] = (key, self._weights(uid, key))
            out.update(held[1])
        return out

    def _weights(self, uid: str, key: str) -> Params:
        try:
            return checkpoint_weights(uid, self.storage.get(key))
        except (TensorFormatError, ObjectNotFound) as exc:
            log.warning("expert %s: checkpoint %s unreadable (%s); evaluated with its initial weights", uid, key, exc)
            return {}
