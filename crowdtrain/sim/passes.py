"""The server side of the training simulator's events (crowdtrain.sim.training): an upload reaching the
scheduler, and the parameter servers' merge passes and evaluations that take it into W_s.

MergePasses is mixed into the simulation, which owns the clock (`now`, `_after`), the simulated job
(crowdtrain.sim.job.SimJob) and its merge queue (crowdtrain.sim.servers.MergeQueue); the hosts' side,
dispatch and training, stays in crowdtrain.sim.training.
"""

from collections import deque
from dataclasses import replace

from crowdtrain.core.states import AssignmentStatus
from crowdtrain.server.ledger.states import move
from crowdtrain.sim.job import SimJob
from crowdtrain.sim.records import Assignment, Metric
from crowdtrain.sim.servers import MergeQueue, ParameterServers

MERGED, EVALUATED = "merged", "evaluated"


class MergePasses:
    """Uploads join the job's merge queue; each pass applies its results in order, evaluates W_s when
    one of its versions is due, records the results and frees the merge lease."""

    job: SimJob
    queue: MergeQueue
    servers: ParameterServers
    now: float
    late: int
    uploads: int
    bytes_uploaded: int
    arrivals: list[int]
    reports: deque[tuple[int, int, float]]

    def _after(self, delay: float, kind: str, payload: object) -> None:
        raise NotImplementedError

    def _arrive(self, a: Assignment) -> None:
        """The upload reached the scheduler: refused if its assignment timed out, else queued for a merge."""
        self.uploads += 1
        self.bytes_uploaded += a.upload_bytes
        self.arrivals.append(a.id)
        if a.status != AssignmentStatus.in_progress:
            self.late += 1  # timed out on its way: the scheduler refuses the upload
            a.client = None
            return
        move(a, AssignmentStatus.uploaded)
        a.uploaded = self.now
        self.reports.append((a.host, a.examples, a.train_seconds))
        self.queue.arrive(a, self.now)
        self._serve()

    def _serve(self) -> None:
        taken = self.queue.take(self.now)
        if taken is not None:
            batch, written_at = taken
            self._after(written_at - self.now, MERGED, batch)

    def _merged(self, batch: list[Assignment]) -> None:
        """A pass wrote W_s: it took each of `batch` in order (or refused it); then, holding the lease,
        one evaluation when one of its versions is due (crowdtrain.assimilator.recording.record_merged)."""
        taken, due = [], False
        for a in batch:
            if self.job.apply(a, self.now) is None:
                taken.append(a)
                due = due or self.job.evaluation_due()
            a.client = None
        if due:
            metric = self.job.measure(taken[-1], self.now)  # W_s measured once, for each epoch in the pass
            metrics = {a.wu.epoch: metric and replace(metric, epoch=a.wu.epoch) for a in taken}
            self._after(self.servers.eval_seconds, EVALUATED, (taken, metrics))
        else:
            self._evaluated(taken, {})

    def _evaluated(self, taken: list[Assignment], metrics: dict[int, Metric | None]) -> None:
        """The pass's results are recorded, the figure on the last of each epoch, and the lease is free."""
        last = {a.wu.epoch: a.id for a in taken}
        for a in taken:
            self.job.record(a, metrics.get(a.wu.epoch) if last[a.wu.epoch] == a.id else None, self.now)
        self.queue.done()
        self._serve()
