"""The training simulator: volunteer hosts train one job on a simulated clock, in one process.

A discrete-event simulation (a heap of timed events) of `hosts` hosts with `slots` task slots
each. The server side is crowdtrain.sim.job: the scheduler's dispatch and epochs and the parameter
servers' merges, with the same rule and policy code. The hosts train with the client's own
trainer (crowdtrain.client.trainers.pytorch.train, same recipe and seed as dispatch gives), so a simulated
result is exactly what a real host would upload from the same snapshot; only time is simulated.
So 8, 64 or 256 slots can be studied on 2 cores.

The rest is the real system's code too: shards are dealt by crowdtrain.workgen.datasets.deal_shards (anew
each epoch from 2 on with `dataset.reshuffle_each_epoch`, as crowdtrain.workgen.generator.write_epoch_shards
deals them); each result goes through crowdtrain.core.updates' encode_result and decode_result, so an
int8 or bfloat16 delta upload costs what it costs in accuracy, and its bytes are counted; with
`training.dynamic_local_work` each assignment's local fraction comes from crowdtrain.server.services.local_work's
host_speeds and local_fraction over the simulated hosts' recent (examples, seconds) reports. In
the compute-free mode nothing is encoded: an upload's size is crowdtrain.core.updates.upload_sizes'.

A host trains an assignment when it takes a compute slot, from the snapshot it was dispatched with.
With `keep_optimizer_state` (off by default: the client's optimizer starts from zero on each
workunit) each slot of a host carries its optimizer's state from one workunit to the next: a
workunit starts from the state its slot's last workunit ended with (none on a slot's first), though
its W is the newer snapshot. A host keeps the states of its free slots, and a workunit taking a
slot takes the one that came back last; a preempted assignment never trains and leaves them as
they are. One job is simulated, so this is per host and job.

Where staleness comes from, as in the real system (DESIGN.md section 9): slots, prefetch and merge
lag. A host asks for work as the client does (client/worker.py): it holds `slots` assignments not
yet trained, one more with prefetch (the default), and asks for the next the moment a slot stops
training, before that result is uploaded; so each assignment's base snapshot is older by the work
queued on its host. Uploads join the job's merge queue (crowdtrain.sim.servers): W_s's version
moves when a merge leaves the lease, a snapshot is published after the evaluation that may follow
it, and dispatch hands out the snapshot published by then. Events at one instant run in order of
cause; dispatch comes after all of them.

How dispatch holds back (the epoch-release window, and the in-flight budget) is crowdtrain.sim.job's.

Against the real system: benchmarks/sim_agreement.py runs jobs for real, measures their timing
(crowdtrain.sim.calibration) and replays them here. On 2026-11-28 (2 tasks x 2 rules x 4 and 8
slots, seed 0, docs/benchmarks.md) examples to target agreed within 15% in 4 of 6 pairs, mean
staleness in 4 of 8; where staleness differs, this model's is higher (4.4-5.0 against 2.6-3.4 on
a machine busy with other work). A real client's slots share its cores and train in waves; here
each slot keeps its own time.

This module runs the events. The hosts' side (downloads, compute slots, training) is in
crowdtrain.sim.slots; the upload's arrival and the merge passes that take it in crowdtrain.sim.passes;
the hosts' timing model, their preemptions and the wall time the VC-ASGD paper's model predicts in
crowdtrain.sim.hosts; the parameter servers' queue in crowdtrain.sim.servers; what a run did, in
crowdtrain.sim.result.
"""

import heapq
import itertools
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from crowdtrain.assimilator.evaluate import evaluate
from crowdtrain.core.jobspec import VC_ASGD, JobSpec
from crowdtrain.core.tensors import Params, manifest_of
from crowdtrain.core.updates import upload_label, upload_of, upload_sizes
from crowdtrain.core.zoo import build_model, state_to_numpy
from crowdtrain.server.services.backpressure import held_wait
from crowdtrain.server.services.backpressure import retry_after as scheduler_retry_after
from crowdtrain.server.services.local_work import WINDOW
from crowdtrain.sim.hosts import WORK_RETRY_AFTER, Fleet
from crowdtrain.sim.job import SimJob
from crowdtrain.sim.passes import EVALUATED, MERGED, MergePasses
from crowdtrain.sim.records import Assignment, ShardDeals
from crowdtrain.sim.result import Dispatch, SimResult
from crowdtrain.sim.servers import EVAL_SECONDS, MAX_PASS, MERGE_SECONDS, PASS_SECONDS, MergeQueue, ParameterServers
from crowdtrain.sim.slots import ARRIVE, DEADLINE, FETCHED, POLL, TRAINED, HostSlots
from crowdtrain.workgen.datasets import Dataset, load_dataset

_sim_ids = itertools.count(-1, -1)  # evaluation caches models per job id: never a real job's


def simulate_training(
    spec: JobSpec | dict,
    hosts: int = 8,
    slots: int = 1,
    p: float = 0.0,
    timeout: float | None = None,
    network_seconds: float = 0.0,
    seed: int = 0,
    *,
    speed_sigma: float = 0.5,
    example_seconds: float = 1e-3,
    workunit_seconds: float | None = None,
    restart_seconds: float | None = None,
    compute: bool = True,
    data: Dataset | None = None,
    prefetch: bool = True,
    merge_seconds: float = MERGE_SECONDS,
    eval_seconds: float = EVAL_SECONDS,
    pass_seconds: float = PASS_SECONDS,
    max_pass: int = MAX_PASS,
    parameter_servers: int = 1,
    backpressure: bool = True,
    keep_optimizer_state: bool = False,
    jitter_sigma: float = 0.0,
    late_snapshot: bool = False,
    retry_after: float = WORK_RETRY_AFTER,
) -> SimResult:
    """Simulate one VC-ASGD job on `hosts` x `slots` simulated slots until its stop rule ends it.

    `spec` is a JobSpec or its dict (validated here; ValueError names a bad field). `seed` draws the
    hosts' speeds, the preemptions and each assignment's compute-time jitter (`jitter_sigma`, see
    crowdtrain.sim.hosts); the model and the training follow the spec's own seed, as
    in the real system. `compute=False` trains and validates nothing (each host returns the
    snapshot it was given), for timing studies: the job then runs to stop.max_epochs. `data`
    skips loading the spec's dataset (a benchmark running many simulations loads it once).
    `prefetch` is the client's (client/worker.py): each host holds `slots` + 1 assignments not yet
    trained. The job's merges go in passes, one at a time, each taking `pass_seconds` and
    `merge_seconds` per result (up to `max_pass` results a pass), and an evaluation `eval_seconds`
    when due (crowdtrain.sim.servers; `parameter_servers` processes serve the job, one holding its
    merge lease at a time). `backpressure` holds dispatch at the job's in-flight budget, as the
    scheduler does (crowdtrain.server.services.backpressure); off, the run is what it was before
    the scheduler had one. `keep_optimizer_state`, or the spec's
    `training.keep_optimizer_state` as the client reads it: each host's slots carry their optimizer
    state across workunits (see the module docstring). `late_snapshot`, or the spec's
    `scheduling.snapshot_binding` "start": a slot trains from the snapshot published when it starts the
    assignment. Training runs on one CPU thread.
    """
    spec = spec if isinstance(spec, JobSpec) else JobSpec.model_validate(spec)
    if spec.mode != VC_ASGD:
        raise ValueError(f"mode: the simulator runs {VC_ASGD} jobs, not {spec.mode!r}")
    if spec.model.name == "keras":
        raise ValueError("model.name: the simulator trains zoo models with PyTorch, not Keras JSON models")
    timeout = spec.scheduling.deadline_seconds if timeout is None else timeout
    fleet = Fleet(
        hosts,
        slots,
        p,
        timeout,
        network_seconds,
        speed_sigma,
        example_seconds,
        workunit_seconds,
        restart_seconds,
        prefetch,
        keep_optimizer_state or spec.training.keep_optimizer_state,
        jitter_sigma,
        late_snapshot or spec.scheduling.snapshot_binding == "start",
        retry_after,
    )
    servers = ParameterServers(parameter_servers, merge_seconds, eval_seconds, pass_seconds, max_pass)
    data = (
        data
        if data is not None
        else load_dataset(spec.dataset.source, spec.dataset.validation_fraction, spec.dataset.classes)
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sim = _Simulation(
            spec.model_dump(mode="json"), fleet, servers, data, np.random.default_rng(seed), compute, backpressure
        )
        started = time.perf_counter()
        sim.run()
        return sim.result(seed, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)


class _Simulation(HostSlots, MergePasses):
    """The event loop and dispatch; the hosts' side of the events is HostSlots', the scheduler's and
    parameter servers' side MergePasses'."""

    def __init__(
        self,
        spec: dict,
        fleet: Fleet,
        servers: ParameterServers,
        data: Dataset,
        rng: np.random.Generator,
        compute: bool,
        backpressure: bool = True,
    ) -> None:
        self.spec, self.fleet, self.servers, self.data = spec, fleet, servers, data
        self.rng, self.compute = rng, compute
        m = spec["model"]
        self.model_config = {
            "name": m["name"],
            "framework": "pytorch",
            "input_shape": data.input_shape,
            "num_classes": data.num_classes,
            "options": m["options"],
        }
        params = state_to_numpy(
            build_model(m["name"], data.input_shape, data.num_classes, seed=spec["seed"], **m["options"])
        )
        self.deals = ShardDeals(data.y, spec["dataset"], spec["seed"])
        if not compute:  # every host returns W_base unchanged: a stand-in for training, not a lazy host
            spec = {**spec, "assimilation": {**spec["assimilation"], "min_update_spread": None}}
        self.job = SimJob(
            spec, params, spec["dataset"]["subsets"], self._evaluate if compute else None, backpressure=backpressure
        )
        self.job_id = next(_sim_ids)
        self.timeout = fleet.timeout if fleet.timeout is not None else spec["scheduling"]["deadline_seconds"]
        self.restart = fleet.restart_seconds if fleet.restart_seconds is not None else self.timeout
        self.speeds = fleet.speeds(rng)
        self.caches: list[set[tuple[int, int]]] = [set() for _ in range(fleet.hosts)]
        self.events: list[tuple[float, int, str, Any]] = []  # payload: the Assignment (and its Metric)
        self.seq = itertools.count()
        # The client holds `slots` assignments not yet trained, one more with prefetch (client/worker.py).
        self.places = fleet.slots + (1 if fleet.prefetch else 0)
        self.idle: deque[int] = deque()  # one entry per free place: its host
        self.asks_at = [0.0] * fleet.hosts  # when each host asks for work next (told to wait: later)
        self.held_at: dict[int, float] = {}  # when the in-flight budget last held each host back
        self.fetched: list[deque[Assignment]] = [deque() for _ in range(fleet.hosts)]  # waiting for a slot
        self.free_slots = [fleet.slots] * fleet.hosts
        # With fleet.keep_optimizer_state: each host's free slots' optimizer states, the last back at
        # the end, and the state each assignment's training ended with until its slot is free again.
        self.slot_states: list[list[Params]] = [[] for _ in range(fleet.hosts)]
        self.end_states: dict[int, Params] = {}
        self.ended: dict[int, float] = {}  # assignment id -> when its place on its host was free again
        self.arrivals: list[int] = []  # assignment ids, in the order their results reached the scheduler
        self.queue = MergeQueue(servers)
        self.now = 0.0
        self.late = self.uploads = self.bytes_uploaded = 0
        self.manifest = manifest_of(params)
        self.upload = upload_of(spec["assimilation"])
        self.upload_size = next(iter(upload_sizes(self.manifest, (self.upload,)).values()))
        self.reports: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)  # (host, examples, seconds)
        self.trace: list[Dispatch] = []

    def run(self) -> None:
        for host in range(self.fleet.hosts):
            self.idle.extend([host] * self.places)  # the client's first request asks for them all
        self._wake()
        while self.events and self.job.running:
            self.now, _, kind, payload = heapq.heappop(self.events)
            self._handle(kind, payload)
            self._wake()
        if self.job.running:
            raise RuntimeError(f"simulation stalled at epoch {self.job.current_epoch}: nothing left to happen")

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == FETCHED:
            self.fetched[payload.host].append(payload)
            self._train_next(payload.host)
        elif kind == TRAINED:
            self._trained(payload)
        elif kind == ARRIVE:
            self._arrive(payload)
        elif kind == MERGED:
            self._merged(payload)
        elif kind == EVALUATED:
            self._evaluated(*payload)
        elif kind == DEADLINE:
            self.job.time_out(payload, self.now)
        elif kind == POLL:  # a host that was told to wait asks again (_wake, after every event)
            pass
        else:  # BACK: a preempted assignment's place on its host is free again
            self.ended[payload.id] = self.now
            self.idle.append(payload.host)
            self.asks_at[payload.host] = self.now

    def _at(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self.events, (float(t), next(self.seq), kind, payload))

    def _after(self, delay: float, kind: str, payload: object) -> None:
        """`kind` happens `delay` seconds from now; at once, before anything else, when that is 0."""
        if delay == 0:
            self._handle(kind, payload)
        else:
            self._at(self.now + delay, kind, payload)

    def _wake(self) -> None:
        """Give work to hosts' free places (client/worker.py's requests), oldest first, while there is some
        and the job is under its in-flight budget. A host that got nothing waits, as the client does, for
        the reply's retry_after (`fleet.retry_after`) or until one of its own slots frees; with
        retry_after 0 a place left waiting asks again after the next event."""
        while self.idle and self.job.running:
            i = next((k for k, h in enumerate(self.idle) if self.asks_at[h] <= self.now), None)
            if i is None:
                return
            host = self.idle[i]
            a = self.job.dispatch(host, self.caches[host], self.now, self.timeout)
            if a is None:
                self._told_to_wait()
                return
            del self.idle[i]
            self._start(a)

    def _told_to_wait(self) -> None:
        """Nothing to dispatch now: every host asking is answered so, with the wait the scheduler tells
        it (crowdtrain.server.services.backpressure.retry_after: fleet.retry_after when nothing is
        ready, shorter when the in-flight budget holds it and merges will soon make room)."""
        if not self.fleet.retry_after:
            return
        for host in {h for h in self.idle if self.asks_at[h] <= self.now}:
            held = self.job.held_seconds(host)
            if held is not None:  # crowdtrain.server.services.held_hosts: the hosts held lately
                self.held_at[host] = self.now
                waiting = sum(self.now - t <= self.fleet.retry_after for t in self.held_at.values())
                held = held_wait(held, self.job.pace.merge_rate if self.job.pace else None, waiting)
            wait = scheduler_retry_after(held, self.fleet.retry_after)
            self.asks_at[host] = self.now + wait
            self._at(self.now + wait, POLL, host)

    def _evaluate(self, params: Params) -> tuple[float, float]:
        return evaluate(self.job_id, self.model_config, params, self.data.x_val, self.data.y_val, framework="pytorch")

    def result(self, seed: int, real_seconds: float) -> SimResult:
        job = self.job
        return SimResult(
            self.spec["name"],
            self.spec["assimilation"]["rule"],
            self.fleet,
            seed,
            self.compute,
            job.status,
            job.message,
            job.current_epoch,
            job.version,
            len(self.trace),
            sum(d.preempted for d in self.trace),
            job.timeouts,
            self.late,
            dict(job.refusals),
            job.failed_workunits,
            job.examples,
            self.uploads,
            upload_label(self.upload),
            round(self.bytes_uploaded / self.uploads) if self.uploads else self.upload_size,
            self.bytes_uploaded,
            float(self.now),
            real_seconds,
            job.final_accuracy,
            job.staleness,
            job.metrics,
            job.epoch_figures,
            self.trace,
            job.merged_hosts,
            self.speeds.tolist(),
            servers=self.servers,
            merged=job.merged,
            arrivals=self.arrivals,
            place_freed=self.ended,
            merge_waits=self.queue.waits,
            passes=self.queue.passes,
            longest_backlog=self.queue.longest,
        )
