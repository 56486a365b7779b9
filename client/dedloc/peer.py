"""The DeDLOC peer's loop: accumulate, report, reduce when a round names it, apply on commit.

Two gradient accumulators: `reported` holds what the scheduler has been told (and what a round
reduces); `fresh` collects micro-batches since the last report. A round reduces a copy of
`reported`; the step is applied only when the scheduler confirms the commit of this peer's
(step, attempt), so an aborted round leaves every peer where it was. A peer left out of a step keeps
both accumulators, loads the newer state and brings them into the next step. The accumulators
themselves are crowdtrain.client.dedloc.accumulate's.

A peer on a GPU (`PeerOptions.device`) computes its micro-batches there and accumulates their
gradients there (crowdtrain.client.dedloc.compute); the all-reduce, the optimizer and the agreed
parameters work on the CPU.
"""

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from crowdtrain.client.dedloc.accumulate import Accumulator
from crowdtrain.client.dedloc.allreduce import ProcessGroups, reduce_round, result_digest
from crowdtrain.client.dedloc.api import PeerAPI, Refused
from crowdtrain.client.dedloc.compute import ComputeCopy
from crowdtrain.client.dedloc.state import encode_state, load_state, make_optimizer
from crowdtrain.client.trust import ProjectTrust, initial_state_sha256
from crowdtrain.core import dedloc as math
from crowdtrain.core.schemas_dedloc import PeerJoined, ProgressReply, RoundPlanOut
from crowdtrain.core.tensors import decode, decode_shard, encode, sha256
from crowdtrain.core.zoo import build_model, state_to_numpy

log = logging.getLogger(__name__)
ROUND_POLL = 0.1
ROUND_WAIT = 2.0  # while idle, how long the scheduler may hold a report until the round moves (Progress.wait)
REFUSED = 3  # the exit code of a peer that refused its job's recipe (crowdtrain.client.trust)


class JobRefused(Exception):
    """The job's recipe is not the project's signed work (crowdtrain.client.trust); the message says why."""


def attach(api: PeerAPI, trust: ProjectTrust, join_token: str, name: str) -> None:
    """Use the registration `trust` keeps for the scheduler (its identity file), or register with the
    join token; then load the project key the peer trusts and the jobs it has refused."""
    known = trust.identities.get(trust.server_url) if trust.identities is not None else None
    if known is None:
        registered = api.register(join_token, name)
        pin = trust.key_to_pin(registered.project_public_key)
        known = {"host_id": registered.host_id, "project_public_key": pin, "refused_jobs": trust.refused_jobs}
        if trust.identities is not None:
            known = trust.identities.save(
                trust.server_url, registered.host_id, registered.host_token, [], pin, trust.refused_jobs
            )
    else:
        api.use_token(known["host_token"])
    trust.load(known)


@dataclass(frozen=True)
class PeerOptions:
    job_id: int
    relayed: bool = False
    data_rank: int = 0
    data_world: int = 1
    examples_per_step: int | None = None  # stop computing at this many examples per step (reproducible runs)
    trace: Path | None = None  # JSON lines: one per applied step
    kill_at: tuple[int, int] | None = None  # (step, attempt): exit abruptly in the middle of that reduction
    # Testing: a hostile peer that reports its real parameter digest but uploads its parameters x0,
    # after every step it applied and unasked, until the scheduler refuses it.
    poison_state: bool = False
    device: str = "cpu"  # the torch device that computes the gradients (crowdtrain.client.devices.resolve_device)


class DedlocPeer:
    def __init__(self, api: PeerAPI, options: PeerOptions, trust: ProjectTrust | None = None):
        self.api, self.o = api, options
        self.trust = trust  # None: the peer checks no signature (and pins no key)
        self.initial_sha256: str | None = None  # the signed recipe's state of step 0
        self.step = -1
        self.reduced: tuple[int, int, torch.Tensor] | None = None  # (step, attempt, average) awaiting commit
        self.frozen = False  # `reported` is promised to a round: no fresh examples move into it
        self._digest: tuple[int, str] | None = None
        self.grads_step = -1  # the step whose parameters the oldest accumulated gradient was computed at
        self.others = 0  # examples the other peers had reported for this step, as last heard
        self.share = 1  # report at once on holding this many unreported examples (target / live peers)
        self.groups = ProcessGroups(api)  # this peer's process group, kept while its group meets unchanged
        self.poisoned = -1  # poison_state: the last step whose state the scheduler refused from this peer

    # -- set-up -----------------------------------------------------------------------------------
    def join(self) -> PeerJoined:
        """Join the job, once what the scheduler gave is checked against its signed recipe (JobRefused,
        reported to the scheduler, if it is not the project's signed work)."""
        if self.trust is not None and self.o.job_id in self.trust.refused_jobs:
            raise JobRefused(f"job {self.o.job_id} was refused before (its recipe is not the project's signed work)")
        joined = self.api.join(self.o.job_id, self.o.relayed)
        if self.trust is not None:
            reason = self.trust.check_peer(joined)
            if reason is not None:
                self._report_refusal(reason)
                raise JobRefused(reason)
            self.initial_sha256 = initial_state_sha256(joined)
        xs, ys = [], []
        for shard in joined.shards:
            blob = self.api.shard(shard.id, shard.size)
            if sha256(blob) != shard.sha256:
                raise ValueError(f"shard {shard.index} failed its sha256 check")
            x, y = decode_shard(blob)
            xs.append(x)
            ys.append(y)
        self.set_up(joined.recipe, np.concatenate(xs), np.concatenate(ys))
        log.info(
            "peer %s joined job %s (%s) on %s; %d examples of %d are this peer's",
            joined.peer_id,
            self.o.job_id,
            "relayed" if self.o.relayed else "direct",
            self.o.device,
            len(self.mine),
            len(self.x),
        )
        return joined

    def set_up(self, recipe: dict, x: np.ndarray, y: np.ndarray) -> None:
        """What the peer trains, from the recipe the scheduler gave and the job's examples (x, y): the
        model and its optimizer, the model that computes the gradients on the peer's device, the
        accumulators, and which examples are this peer's (`data_rank` of `data_world`)."""
        self.recipe = recipe
        self.spec = recipe["dedloc"]
        m = recipe["model"]
        self.model = build_model(m["name"], m["input_shape"], m["num_classes"], **m["options"])
        self.opt = make_optimizer(self.model, self.spec)
        self.params = [p for p in self.model.parameters()]
        self.compute = ComputeCopy(self.model, self.o.device)
        n = sum(p.numel() for p in self.params)
        # A state is the parameters and at most three optimizer buffers like them (Adam's moments),
        # in float32, and a header: a longer reply is refused unread.
        self.state_limit = 16 * n + 2**20
        self.reported = Accumulator(torch.zeros(n, device=self.o.device))
        self.fresh = Accumulator(torch.zeros(n, device=self.o.device))
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)
        self.mine = np.arange(len(self.x))[self.o.data_rank :: self.o.data_world]
        self.order: np.ndarray = np.empty(0, dtype=np.int64)
        self.passes = 0

    def _report_refusal(self, reason: str) -> None:
        try:
            self.api.refuse(f"peer refused the job: {reason}")
        except Exception as exc:  # the scheduler drops a silent peer from its rounds all the same
            log.warning("peer %s: could not report the refusal (%s)", self.api.peer_id, exc)

    def sync_state(self) -> None:
        """Load the newest state; keeps the accumulated gradients (they join the next step). The state
        of step 0 must be the signed recipe's (JobRefused, reported, if not)."""
        step, blob = self.api.latest_state(self.state_limit)
        if step == self.step:
            return
        if step == 0 and self.initial_sha256 is not None and sha256(blob) != self.initial_sha256:
            assert self.trust is not None  # only a checked recipe sets initial_sha256
            reason = self.trust.refuse(
                self.o.job_id,
                f"peer {self.api.peer_id}",
                f"job {self.o.job_id}'s state of step 0 is not the initial snapshot its signed recipe names",
            )
            self._report_refusal(reason)
            raise JobRefused(reason)
        load_state(self.model, self.opt, blob)
        self.compute.take_parameters(buffers=True)
        stale = self.reported.examples + self.fresh.examples and step > self.grads_step + 1
        if stale:  # gradients of parameters more than one step old would pull the model back
            self.reported.clear()
            self.fresh.clear()
        log.info(
            "peer %s: loaded the state of step %d (was at %d)%s",
            self.api.peer_id,
            step,
            self.step,
            "; dropped gradients more than one step old" if stale else "",
        )
        self.step, self.reduced, self._digest, self.others = step, None, None, 0

    # -- training ---------------------------------------------------------------------------------
    def _next_indices(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if len(self.order) == 0:
                rng = np.random.default_rng([int(self.recipe["seed"]), self.o.data_rank, self.passes])
                self.order, self.passes = rng.permutation(self.mine), self.passes + 1
            take = self.order[: count - len(out)]
            self.order = self.order[len(take) :]
            out += [int(i) for i in take]
        return out

    def _wants_examples(self) -> int:
        if self.others + self.reported.examples + self.fresh.examples >= self.spec["target_batch_size"]:
            return 0  # the step will close with what the collaboration has: don't overshoot the batch
        budget = self.spec["micro_batch_size"]
        if self.o.examples_per_step is not None:
            budget = min(budget, self.o.examples_per_step - self.reported.examples - self.fresh.examples)
        return max(0, budget)

    def compute_micro_batch(self, count: int) -> None:
        if self.reported.examples + self.fresh.examples == 0:
            self.grads_step = self.step
        idx = self._next_indices(count)
        self.fresh.grads += self.compute.summed_gradient(self.x[idx], self.y[idx])
        self.fresh.examples += len(idx)
        self.fresh.indices += idx

    def params_digest(self) -> str:
        if self._digest is None or self._digest[0] != self.step:
            self.compute.give_buffers()
            self._digest = (self.step, math.digest(state_to_numpy(self.model)))
        return self._digest[1]

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, stop_after: float | None = None) -> int:
        """Train until the job finishes (0), or REFUSED if its recipe is not the project's signed work."""
        try:
            self.join()
            self.sync_state()
        except JobRefused as exc:
            log.error("peer of job %s: refused the job: %s", self.o.job_id, exc)
            return REFUSED
        last_poll = 0.0
        started = time.monotonic()
        while stop_after is None or time.monotonic() - started < stop_after:
            count = 0 if self.frozen else self._wants_examples()
            if count:
                self.compute_micro_batch(count)
            interval = self.spec["report_interval"]
            idle = self.frozen or not self._wants_examples()
            if self.frozen:
                interval = min(interval, ROUND_POLL)
            elif idle:  # examples it will not add to are reported at once: they may be what closes the step
                interval = 0.0 if self.fresh.examples else min(interval, 0.25)
            if time.monotonic() - last_poll < interval and self.fresh.examples < self.share:
                if idle:
                    time.sleep(ROUND_POLL / 2)
                continue
            if not self.frozen:
                self.reported.add(self.fresh)
            last_poll = time.monotonic()
            reply = self.api.progress(
                self.step,
                self.reported.examples,
                self.reduced[1] if self.reduced else None,
                self.params_digest() if self.step >= 0 else None,
                wait=ROUND_WAIT if idle else 0.0,
            )
            if not self.handle(reply):
                return 0
        return 0

    def handle(self, reply: ProgressReply) -> bool:
        """Act on the scheduler's answer; False when the job has finished."""
        if reply.action == "stop":
            log.info("peer %s: the job has finished (%s)", self.api.peer_id, reply.message)
            return False
        if reply.action == "apply":
            self.apply()
        elif reply.action == "resync":
            self.frozen = False
            self.reduced = None
            self.sync_state()
        elif reply.action == "accumulate":
            self.frozen, self.reduced = False, None
            self.others = max(0, reply.accumulated - self.reported.examples)
            self.share = max(1, self.spec["target_batch_size"] // reply.peers)
        elif reply.action == "matchmaking":
            self.frozen, self.reduced = True, None
        elif reply.action == "reduce":
            if reply.round is None:  # the scheduler always sends the round's plan with `reduce`
                raise ValueError(f"peer {self.api.peer_id}: told to reduce step {reply.step} without the round's plan")
            self.frozen = True
            self.reduce(reply.round)
        if self._uploads_now(reply):
            self.upload_state()
        return True

    def _uploads_now(self, reply: ProgressReply) -> bool:
        """The scheduler asks for this peer's state of its step (never with `apply`: the peer reports
        its new parameters first); a poisoning peer uploads unasked while the state is awaited."""
        if self.step != reply.step:
            return False
        if self.o.poison_state:
            return reply.state_step < self.step and self.poisoned < self.step
        return reply.upload_state and reply.action != "apply"

    def upload_state(self) -> None:
        """Upload the state this peer holds (of `self.step`), as the scheduler asked. A refusal is
        logged: the scheduler asks another member that holds the agreed parameters."""
        self.compute.give_buffers()
        blob = encode_state(self.model, self.opt)
        if self.o.poison_state:
            blob = encode({k: v * 0 if not k.startswith("__") else v for k, v in decode(blob).items()})
        try:
            status = self.api.put_state(self.step, blob)
        except Refused as exc:
            if self.o.poison_state and exc.status == 422:
                self.poisoned = self.step
            log.warning("peer %s: the state of step %d was not taken (%s)", self.api.peer_id, self.step, exc)
            return
        log.info("peer %s: uploaded the state of step %d (%s)", self.api.peer_id, self.step, status)

    def reduce(self, plan: RoundPlanOut) -> None:
        if self.o.kill_at == (plan.step, plan.attempt) and not plan.relayed:
            self._die_mid_allreduce(plan)
        try:
            # A job stored before `compression` existed has none in its recipe: float32, as it ran then.
            compression = self.spec.get("compression", "none")
            # On a GPU, `.cpu()` is the copy the all-reduce works on; on the CPU, the tensor itself (never modified).
            average = reduce_round(self.api, plan, self.reported.grads.cpu(), self.groups, compression)
        except Exception as exc:  # any failure of the collective: the round is aborted for everyone
            log.warning(
                "peer %s: step %d attempt %d failed (%s); reporting it", self.api.peer_id, plan.step, plan.attempt, exc
            )
            self.reduced = None
            try:
                self.api.report(plan.step, plan.attempt, False, message=str(exc))
            except Refused as refused:
                log.info("peer %s: the attempt had already ended (%s)", self.api.peer_id, refused)
            return
        self.reduced = (plan.step, plan.attempt, average)
        try:
            self.api.report(plan.step, plan.attempt, True, result_digest(average))
        except Refused as exc:
            log.info(
                "peer %s: step %d attempt %d ended before this peer finished (%s)",
                self.api.peer_id,
                plan.step,
                plan.attempt,
                exc,
            )
            self.reduced = None

    def _die_mid_allreduce(self, plan: RoundPlanOut) -> None:
        """Fault injection for tests: join the collective, then vanish while the others reduce."""
        # Connect to the group like any member, so the others enter the all-reduce and wait on this
        # peer, then die without a word: SIGKILL, no clean-up, no report.
        pg = self.groups.for_round(plan)
        log.warning(
            "peer %s: SIGKILLing itself in the middle of step %d attempt %d", self.api.peer_id, plan.step, plan.attempt
        )
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
        del pg

    def apply(self) -> None:
        if self.reduced is None or self.reduced[0] != self.step:
            self.sync_state()
            return
        step, attempt, average = self.reduced
        offset = 0
        for p in self.params:
            # empty_like keeps the parameter's memory format (a channels-last convolution's): the
            # gradients of the next backward pass accumulate into this tensor.
            p.grad = torch.empty_like(p).copy_(average[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        lr = math.learning_rate(
            step, self.spec["lr"], self.spec["lr_schedule"], self.spec["warmup_steps"], self.recipe["max_steps"]
        )
        for group in self.opt.param_groups:
            group["lr"] = lr
        before = self.params_digest()
        self.opt.step()
        self.compute.take_parameters(buffers=False)
        contributed = self.reported.indices
        self.reported.clear()
        self.step, self.reduced, self.frozen, self.others = step + 1, None, False, 0
        self._digest = None
        after = self.params_digest()
        log.info(
            "peer %s: applied step %d (attempt %d, %d own examples, lr %.5f)",
            self.api.peer_id,
            step,
            attempt,
            len(contributed),
            lr,
        )
        if self.o.trace is not None:
            with self.o.trace.open("a") as f:
                f.write(
                    json.dumps(
                        {
                            "peer": self.api.peer_id,
                            "step": step,
                            "attempt": attempt,
                            "lr": lr,
                            "indices": contributed,
                            "result_digest": result_digest(average),
                            "before": before,
                            "after": after,
                        }
                    )
                    + "\n"
                )
