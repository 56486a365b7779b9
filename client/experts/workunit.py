"""A moe job's workunit on a volunteer client: the dense trunk (W_s of the job, merged by the parameter
servers like any model) trained on the shard through the mixture's experts, which their hosts step
with every backward call. The trunk's result is what the client uploads; the experts' progress stays
on their hosts and in their checkpoints.

It keeps the trainers' contract (crowdtrain.client.trainers) but for checkpoints: a workunit
interrupted mid-way starts again, since the experts it trained with have moved on anyway. The
routing table is read at the start and again every heartbeat interval of the layout, as changes.
What the calls came to, per expert and host, is reported to the scheduler every REPORT_SECONDS and
when the workunit ends, however it ends: the hosts' credit and charges (a failed report is logged
and its counts dropped, never the workunit).
"""

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from crowdtrain.client.experts.mixture import ExpertClient, RoutingFollower
from crowdtrain.client.experts.trainer import MixtureClassifier, PipelinedTrainer
from crowdtrain.client.server_http import BadReply, Refused, Stopping
from crowdtrain.client.trainers import ExpertRegistry, TrainControl, TrainResult, examples_in, local_steps
from crowdtrain.client.trainers.pytorch import load_optimizer, make_optimizer, optimizer_tensors
from crowdtrain.core.schemas_experts import CallReport
from crowdtrain.core.tensors import Params
from crowdtrain.core.zoo import build_model, load_numpy_state, state_to_numpy
from crowdtrain.core.zoo_experts import MixtureTrunk

log = logging.getLogger(__name__)
REPORT_SECONDS = 30.0  # how often a long workunit reports its calls


@dataclass
class _CallReports:
    """Reports `client`'s calls to the mixture's experts through `registry`."""

    registry: ExpertRegistry
    mixture_id: int
    client: ExpertClient
    since: float = field(default_factory=time.monotonic)

    def due(self) -> bool:
        return time.monotonic() - self.since >= REPORT_SECONDS

    def send(self) -> None:
        now, calls = time.monotonic(), self.client.take_calls()
        seconds, self.since = min(max(now - self.since, 1e-3), 86_400.0), now
        if not calls:
            return
        try:
            self.registry.report_calls(self.mixture_id, CallReport(seconds=seconds, experts=calls))
        except (Refused, Stopping, BadReply) as exc:
            log.warning(
                "mixture %s: the report of %d experts' calls was not taken: %s", self.mixture_id, len(calls), exc
            )


def train(
    recipe: dict,
    params: Params,
    x: np.ndarray,
    y: np.ndarray,
    registry: ExpertRegistry,
    control: TrainControl | None = None,
    local_fraction: float = 1.0,
    optimizer_state: Params | None = None,
) -> TrainResult:
    """Train the trunk `params` for `local_fraction` of the recipe's local epochs' steps on (x, y), the
    layout's `in_flight` micro-batches at a time, calling the experts the mixture's routing table lists."""
    start = time.monotonic()
    control = control or TrainControl()
    m, t = recipe["model"], recipe["training"]
    trunk = build_model(m["name"], m["input_shape"], m["num_classes"], **m["options"])
    assert isinstance(trunk, MixtureTrunk)
    load_numpy_state(trunk, params)
    layout, mixture_id = trunk.layout, int(m["mixture"])
    client = ExpertClient(layout, {})
    reports = _CallReports(registry, mixture_id, client)
    try:
        follower = RoutingFollower(partial(registry.routing, mixture_id), client)
        follower.refresh()
        model = MixtureClassifier(trunk, client).train()
        opt = make_optimizer(model, t)
        if optimizer_state is not None:
            load_optimizer(opt, optimizer_state)
        steps = local_steps(len(x), t["batch_size"], t["local_epochs"], local_fraction)
        pipeline = PipelinedTrainer(model, opt, layout.in_flight)
        batches = _batches(x, y, t["batch_size"], steps, int(recipe["seed"]), control)
        pipeline.train(_refreshing(batches, follower, reports, layout.heartbeat_seconds))
    finally:
        reports.send()
        client.close()
    return TrainResult(
        state_to_numpy(trunk),
        pipeline.loss_sum / max(pipeline.examples, 1),
        examples_in(steps, len(x), t["batch_size"]),
        time.monotonic() - start,
        optimizer_tensors(opt),
    )


def _batches(
    x: np.ndarray, y: np.ndarray, batch_size: int, steps: int, seed: int, control: TrainControl
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`steps` batches of (x, y), a new permutation for each pass; before each the control is asked (it
    raises Cancelled, or waits while the client is paused)."""
    gen = torch.Generator().manual_seed(seed)
    xs, ys = np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(y, dtype=np.int64)
    given = 0
    while given < steps:
        order = torch.randperm(len(xs), generator=gen).numpy()
        for i in range(0, len(order), batch_size):
            if given == steps:
                return
            control.between_batches()
            given += 1
            yield xs[order[i : i + batch_size]], ys[order[i : i + batch_size]]


def _refreshing(
    batches: Iterator[tuple[np.ndarray, np.ndarray]],
    follower: RoutingFollower,
    reports: _CallReports,
    refresh_seconds: float,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`batches`, with the routing table refreshed between them when due, and the calls reported."""
    refreshed = time.monotonic()
    for batch in batches:
        if time.monotonic() - refreshed >= refresh_seconds:
            follower.refresh()
            refreshed = time.monotonic()
        if reports.due():
            reports.send()
        yield batch
