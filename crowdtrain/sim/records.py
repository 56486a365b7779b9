"""What the training simulator's job holds: its workunits, assignments and validation figures, with
the statuses the scheduler gives them (crowdtrain.core.states; each change goes through the ledger's
table, crowdtrain.server.ledger.states.move), and the shards' deals."""

from dataclasses import dataclass

import numpy as np

from crowdtrain.core.states import AssignmentStatus, WorkunitStatus
from crowdtrain.core.tensors import Params
from crowdtrain.workgen.datasets import deal_shards


@dataclass(eq=False)
class Workunit:
    id: int
    epoch: int
    shard: int
    status: str = WorkunitStatus.ready.value
    error_count: int = 0


@dataclass(eq=False)
class Assignment:
    id: int
    wu: Workunit
    host: int
    base_version: int
    base: Params  # the snapshot the host starts from (read-only)
    sent: float
    deadline: float
    uploaded: float | None = None  # when its result reached the scheduler
    status: str = AssignmentStatus.in_progress.value  # then as the ledger's table allows
    client: Params | None = None  # W_c once trained (decoded from its upload)
    examples: int = 0
    local_fraction: float = 1.0  # of the recipe's local epochs (dynamic local work)
    train_seconds: float = 0.0  # simulated compute time, as the host reports it
    upload_bytes: int = 0  # the size of its result on the wire


@dataclass(frozen=True)
class Metric:
    """A validation figure of W_s right after a merge."""

    version: int
    epoch: int
    time: float  # simulated seconds
    examples: int  # examples trained into the merged results so far
    accuracy: float
    loss: float


class ShardDeals:
    """The example indices of each shard, per deal (see crowdtrain.sim.job.SimJob.shard_key): deal 0 as
    crowdtrain.workgen.generator.submit_job deals the training set; deal e >= 2 as write_epoch_shards deals
    the examples of deal 0's shards, laid end to end, anew for epoch e."""

    def __init__(self, y: np.ndarray, dataset: dict, seed: int) -> None:
        self.y, self.subsets, self.shuffle, self.seed = y, dataset["subsets"], dataset["shuffle"], seed
        self._deals = {0: deal_shards(y, self.subsets, self.shuffle, seed)}

    def of(self, deal: int) -> list[np.ndarray]:
        if deal not in self._deals:
            line = np.concatenate(self._deals[0])
            self._deals[deal] = [
                line[p] for p in deal_shards(self.y[line], self.subsets, self.shuffle, self.seed, deal)
            ]
        return self._deals[deal]
