"""The server side of the training simulator: one job's workunits, epochs, W_s and merges, in memory.

It follows the scheduler's and the parameter servers' procedures step for step, on a simulated
clock, and merges with the very rule and policy code the parameter servers run
(crowdtrain.assimilator.rules.make_rule, crowdtrain.assimilator.policy). Each method names the procedure it mirrors:

- dispatch: crowdtrain.server.services.dispatch (crowdtrain.server.ledger.claims.claim_workunits: cached
  shards first, then by epoch and workunit; crowdtrain.server.ledger.epochs.release_next_epoch_early: early
  release once the current epoch has nothing left to dispatch; at the job's
  in-flight budget, crowdtrain.server.services.backpressure's, nothing: its pace measured over the simulated
  merges by crowdtrain.server.ledger.pace.pace_of, as record_merge measures it);
- apply, measure, record: crowdtrain.assimilator.merge (`_guarded`: staleness bound, then update-norm
  bound, then the rule; a refusal is charged to the workunit; then record_merged: metrics every
  `eval_every` merges, snapshots, the workunit done). When each happens on the simulated clock, and
  in what order, is crowdtrain.sim.servers' queue's to say;
- time out: the transitioner and crowdtrain.server.ledger.assignments.end_assignment (ready again, or failed
  at max_errors);
- close an epoch: crowdtrain.server.ledger.epochs.close_epoch_if_complete (the stop rule) and
  crowdtrain.server.ledger.epochs.next_epoch_releasable.

The epoch-release window. The next epoch is released as the real scheduler releases it
(crowdtrain.server.ledger.epochs.next_epoch_releasable, called by dispatch when a claim comes up
short and by close_epoch_if_complete): when the current epoch has nothing ready and no older
epoch has a workunit open. So at most two epochs are open at once, and at most twice the shard
count of workunits are held by hosts or wait in the merge queue (a workunit stays open until its
result is merged): slots beyond that idle, prefetched places and a merge backlog included, and a
straggler of the older epoch holds the next release back. The real system has the same limit, by
the same rule; its straggler duplicates (left out here) only copy work already held.

The in-flight budget (`backpressure`, on by default), held as the real scheduler holds it
(crowdtrain.server.services.backpressure): at `scheduling.max_in_flight`, or at the budget derived
from the simulated merges' pace, a host gets nothing and asks again when `held_seconds` tells it (the
hosts' side is crowdtrain.sim.training's). One request at a time, so never past the budget.

Its records (workunits, assignments, metrics, shard deals) are crowdtrain.sim.records'.

Left out: the reliability preference of dispatch (retried workunits to reliable hosts) and
duplicates of stragglers. No I/O: the caller trains, and evaluates through `evaluate`.
"""

import bisect
import statistics
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import numpy as np

from crowdtrain.assimilator.policy import Policy, apply_with_policy
from crowdtrain.assimilator.rules import make_rule, make_update, reads_validation
from crowdtrain.assimilator.rules.update import params_norm
from crowdtrain.core import rounds
from crowdtrain.core.assimilationspec import assimilation_of
from crowdtrain.core.states import AssignmentStatus, JobStatus, WorkunitStatus
from crowdtrain.core.tensors import Params
from crowdtrain.server.ledger.pace import WINDOW, Pace, pace_of
from crowdtrain.server.ledger.states import move
from crowdtrain.server.paramstore.steps import NORMS_KEPT
from crowdtrain.server.services.backpressure import UNMERGED, BudgetTerms, held_seconds, in_flight_budget
from crowdtrain.sim.records import Assignment, Metric, Workunit

_CLOCK_ZERO = datetime(2000, 1, 1, tzinfo=UTC)  # simulated second 0, for pace_of's timestamps


@dataclass(eq=False)
class SimJob:
    """One VC-ASGD job: `spec` is a JobSpec as a dict (model_dump), `params` W_s version 0.

    `evaluate(params) -> (loss, accuracy)` validates W_s; None (the compute-free mode) records no
    metrics, so the job runs to max_epochs. `backpressure=False` dispatches without the in-flight
    budget, as the scheduler did before it had one.
    """

    spec: dict
    params: Params
    shards: int
    evaluate: Callable[[Params], tuple[float, float]] | None = None
    backpressure: bool = True  # hold dispatch at the in-flight budget (crowdtrain.server.services.backpressure)
    version: int = 0
    status: str = JobStatus.running.value
    message: str = ""
    current_epoch: int = 0
    examples: int = 0
    metrics: list[Metric] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    merged_hosts: list[int] = field(default_factory=list)  # the host of each merge, beside `staleness`
    merged: list[int] = field(default_factory=list)  # the assignment of each merge, beside `staleness`
    refusals: Counter = field(default_factory=Counter)
    timeouts: int = 0
    failed_workunits: int = 0
    epoch_figures: dict[int, float | None] = field(default_factory=dict)
    final_accuracy: float | None = None

    def __post_init__(self) -> None:
        asm = assimilation_of(self.spec["assimilation"])  # read once
        self.rule = make_rule(asm)
        self.policy = Policy.from_spec(asm)
        self.reads_validation = reads_validation(asm)
        self.state = self.rule.initial_state(self.params)
        self.recent_norms: deque[float] = deque(maxlen=NORMS_KEPT)
        self.snapshot_version, self.snapshot, self.snapshot_at = 0, _copy(self.params), 0.0
        self._snapshot_norm = params_norm(self.snapshot)
        self.workunits: dict[int, list[Workunit]] = {}
        self.open_count: Counter = Counter()  # epoch -> workunits ready or in progress
        self.ready: list[tuple[int, int, Workunit]] = []  # sorted by (epoch, id): dispatch's order
        self._next_ids = {"wu": 0, "a": 0}
        self.budget_terms = BudgetTerms.of(self.spec)
        self.unmerged: dict[int, Assignment] = {}  # id -> assignment, pruned as they leave UNMERGED
        self.latest_merges: deque[tuple[datetime, datetime | None, datetime]] = deque(maxlen=WINDOW)
        self.pace: Pace | None = None  # measured after each merge, as record_merge measures it
        self._release_epoch(1)

    @property
    def running(self) -> bool:
        return self.status == JobStatus.running

    # --- dispatch (crowdtrain.server.services.dispatch) -------------------------------------------------------------

    def shard_key(self, wu: Workunit) -> tuple[int, int]:
        """(deal, shard index) of the shard `wu` trains on: deal 0 is the deal made at submission, which
        every epoch shares unless `dataset.reshuffle_each_epoch` gives epochs from 2 on their own."""
        own = wu.epoch >= 2 and self.spec["dataset"].get("reshuffle_each_epoch")
        return (wu.epoch if own else 0, wu.shard)

    def dispatch(self, host: int, cached: set[tuple[int, int]], now: float, timeout: float) -> Assignment | None:
        """Claim one workunit for `host`, preferring a shard it has cached (keys as `shard_key`); None
        when nothing is ready, or when the job is at its in-flight budget (`at_budget`)."""
        if not self.running or self.at_budget(host):
            return None
        if not self.ready and self._next_epoch_releasable():
            self._release_epoch(self.current_epoch + 1)
        if not self.ready:
            return None
        i = next((i for i, (_, _, wu) in enumerate(self.ready) if self.shard_key(wu) in cached), 0)
        wu = self.ready.pop(i)[2]
        move(wu, WorkunitStatus.in_progress)
        self._next_ids["a"] += 1
        a = Assignment(self._next_ids["a"], wu, host, self.snapshot_version, self.snapshot, now, now + timeout)
        self.unmerged[a.id] = a
        return a

    def in_flight(self) -> list[Assignment]:
        """The job's assignments dispatched (prefetched included) or uploaded, not yet merged."""
        self.unmerged = {i: a for i, a in self.unmerged.items() if a.status in UNMERGED}
        return list(self.unmerged.values())

    def budget(self, host: int) -> int | None:
        """The job's in-flight budget as `host` asks (backpressure.in_flight_budget); None without one."""
        rate, turnaround = (self.pace.merge_rate, self.pace.turnaround_seconds) if self.pace else (None, None)
        return in_flight_budget(self.budget_terms, rate, turnaround, self._holders(host), self.version)

    def _holders(self, host: int) -> int:  # the hosts holding unmerged work, and `host`
        return len({a.host for a in self.in_flight()} | {host})

    def held_seconds(self, host: int) -> float | None:
        """backpressure.held_seconds when the budget holds `host` back (when to ask again), else None."""
        if self.pace is None or not self.at_budget(host):
            return None
        return held_seconds(self.pace.merge_rate, self._holders(host))

    def at_budget(self, host: int) -> bool:
        """Whether dispatch holds back from `host`: its job has as many in flight as its budget allows."""
        if not self.backpressure:
            return False
        size = self.budget_terms.round_size
        if size is not None and self.version % size == 0 and self.snapshot_version < self.version:
            return True  # a round ended: the next opens once its snapshot is published (record_merged's order)
        budget = self.budget(host)
        return budget is not None and len(self.in_flight()) >= budget

    def _release_epoch(self, epoch: int) -> None:
        """crowdtrain.server.ledger.epochs.release_epoch: one ready workunit per shard."""
        wus = []
        for shard in range(self.shards):
            self._next_ids["wu"] += 1
            wus.append(Workunit(self._next_ids["wu"], epoch, shard))
        self.workunits[epoch] = wus
        self.open_count[epoch] = len(wus)
        for wu in wus:
            self._make_ready(wu)
        self.current_epoch = epoch

    def _make_ready(self, wu: Workunit) -> None:
        if wu.status != WorkunitStatus.ready:  # tried again; a released workunit starts ready
            move(wu, WorkunitStatus.ready)
        bisect.insort(self.ready, (wu.epoch, wu.id, wu), key=lambda t: t[:2])

    def _settle(self, wu: Workunit, status: WorkunitStatus) -> None:
        move(wu, status)
        self.open_count[wu.epoch] -= 1

    def _next_epoch_releasable(self) -> bool:
        """crowdtrain.server.ledger.epochs.next_epoch_releasable (called when no workunit is ready)."""
        if not self.running or self.current_epoch >= self.spec["stop"]["max_epochs"]:
            return False
        return not any(self.open_count[e] for e in range(1, self.current_epoch))

    # --- merge (crowdtrain.assimilator.merge) ---------------------------------------------------------------------

    def apply(self, a: Assignment, now: float) -> str | None:
        """A parameter server's merge of an uploaded result (`_prepare`, paramstore.merge_batch): the
        refusal, the assignment then rejected, or None when W_s took it (its version one higher).
        What follows a merge in the real task is `record`, once the evaluation it may need is done."""
        if not self.running or a.status != AssignmentStatus.uploaded:
            return "job is no longer running" if not self.running else f"assignment is {a.status}"
        assert a.client is not None  # set when its training ended, before it arrived
        update = make_update(a.base, a.client, "weights", self.version - a.base_version, a.wu.epoch)
        if self.metrics and self.reads_validation:
            update = replace(update, validation=(self.metrics[-1].version, self.metrics[-1].loss))
        norm = params_norm(update.delta)
        base_norm = self._snapshot_norm if a.base is self.snapshot else params_norm(a.base)
        refusal = apply_with_policy(
            self.policy,
            self.rule,
            self.params,
            self.state,
            update,
            self.version,
            norm,
            list(self.recent_norms),
            base_norm,
        )
        if refusal:
            self.refusals["stale" if refusal.startswith("stale") else "update norm"] += 1
            self._end_assignment(a, AssignmentStatus.rejected, now)
            return refusal
        self.version += 1
        self.recent_norms.appendleft(norm)  # paramstore.steps.Pass: newest first, NORMS_KEPT kept
        self.staleness.append(update.staleness)
        self.merged_hosts.append(a.host)
        self.merged.append(a.id)
        self.examples += a.examples
        move(a, AssignmentStatus.merged)
        self._measure_pace(a, now)
        return None

    def _measure_pace(self, a: Assignment, now: float) -> None:
        """crowdtrain.server.ledger.pace.measure_pace: the pace of the latest `WINDOW` merges, `a` merged
        at `now` the newest; left as it was when there is nothing to measure."""

        def at(t: float) -> datetime:
            return _CLOCK_ZERO + timedelta(seconds=t)

        self.latest_merges.append((at(a.sent), None if a.uploaded is None else at(a.uploaded), at(now)))
        self.pace = pace_of(list(self.latest_merges)) or self.pace

    def evaluation_due(self) -> bool:
        """Whether the merge that made W_s's version is evaluated (`_record`: every `eval_every` merges);
        in the compute-free mode too, where the evaluation takes its time and records nothing."""
        return rounds.evaluation_due(self.spec, self.version)

    def measure(self, a: Assignment, now: float) -> Metric | None:
        """Validate W_s as it stands (the evaluation `_record_metric` starts after a merge); None in the
        compute-free mode."""
        if self.evaluate is None:
            return None
        loss, accuracy = self.evaluate(self.params)
        return Metric(self.version, a.wu.epoch, float(now), self.examples, accuracy, loss)

    def record(self, a: Assignment, metric: Metric | None, now: float) -> None:
        """The rest of the task after W_s took `a` (`_record`): its metric (`measure`'s, dated `now`,
        when its evaluation ends), a snapshot when due, its workunit done, its epoch closed when complete."""
        if not self.running:
            return
        if metric is not None:
            self.metrics.append(replace(metric, time=float(now)))
        self._publish_snapshot_if_due(now)
        self._settle(a.wu, WorkunitStatus.done)
        self._close_epoch_if_complete(a.wu.epoch, now)

    def _publish_snapshot_if_due(self, now: float) -> None:
        if rounds.snapshot_due(self.spec, self.version, self.snapshot_version, now - self.snapshot_at):
            self.snapshot_version, self.snapshot, self.snapshot_at = self.version, _copy(self.params), now
            self._snapshot_norm = params_norm(self.snapshot)

    # --- failures (transitioner, crowdtrain.server.ledger.assignments.end_assignment) ---------------------------------

    def time_out(self, a: Assignment, now: float) -> bool:
        """The deadline passed: end the assignment if it is still running; True if it was."""
        if a.status != AssignmentStatus.in_progress or not self.running:
            return False
        self.timeouts += 1
        self._end_assignment(a, AssignmentStatus.timed_out, now)
        return True

    def _end_assignment(self, a: Assignment, outcome: AssignmentStatus, now: float) -> None:
        """A charged failure: the workunit is ready again, or failed after max_errors."""
        move(a, outcome)
        wu = a.wu
        wu.error_count += 1
        if wu.error_count >= self.spec["scheduling"]["max_errors"]:
            self._settle(wu, WorkunitStatus.failed)
            self.failed_workunits += 1
            self._close_epoch_if_complete(wu.epoch, now)
        else:
            self._make_ready(wu)

    # --- epochs (crowdtrain.server.ledger.epochs.close_epoch_if_complete) -----------------------------------

    def epoch_accuracy(self, epoch: int) -> float | None:
        figures = [m.accuracy for m in self.metrics if m.epoch == epoch]
        return statistics.fmean(figures) if figures else None

    def _close_epoch_if_complete(self, epoch: int, now: float) -> None:
        if not self.running or self.open_count[epoch] or any(self.open_count[e] for e in range(1, epoch)):
            return  # an epoch that closed before an older one waits for it
        closed = epoch
        while not self._apply_stop_rule(closed):
            if closed >= self.current_epoch:
                self._release_epoch(self.current_epoch + 1)
                return
            closed += 1
            if self.open_count[closed]:
                if not self.ready and self._next_epoch_releasable():
                    self._release_epoch(self.current_epoch + 1)
                return

    def _apply_stop_rule(self, epoch: int) -> bool:
        figure = self.epoch_figures[epoch] = self.epoch_accuracy(epoch)
        stop = self.spec["stop"]
        shown = "n/a" if figure is None else f"{figure:.4f}"
        if figure is not None and figure >= stop["target_accuracy"]:
            self._finish(
                JobStatus.succeeded,
                f"epoch {epoch} reached mean validation accuracy {figure:.4f} >= {stop['target_accuracy']}",
            )
            return True
        if epoch >= stop["max_epochs"]:
            self._finish(
                JobStatus.failed,
                f"max_epochs={stop['max_epochs']} reached; last epoch accuracy {shown} "
                f"< target {stop['target_accuracy']}",
            )
            return True
        return False

    def _finish(self, outcome: JobStatus, message: str) -> None:
        """The job ends; its final accuracy is that of the exported (last) W_s."""
        move(self, outcome)
        self.message = message
        self.ready.clear()
        if self.evaluate is not None:
            recorded = [m.accuracy for m in self.metrics if m.version == self.version]
            self.final_accuracy = recorded[0] if recorded else self.evaluate(self.params)[1]


def _copy(params: Params) -> Params:
    return {k: np.array(v, copy=True) for k, v in params.items()}
