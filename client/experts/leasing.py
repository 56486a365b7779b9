"""Expert hosts and trainers as the scheduler's registry sees them (`/v1/mixtures`,
crowdtrain.server.services.experts).

A leasing host (`LeaseKeeper`) calls the scheduler every heartbeat with its URL and capacity; the
answer lists every expert it serves from then on. An expert newly leased is restored from its last
checkpoint (a host that died took nothing with it but the steps since) or, with none, built from the
layout's seed; one no longer listed is dropped (its lease ended and it went elsewhere). Every half
`checkpoint_every` steps an expert snapshots its weights and optimizer state inside its step and the
keeper uploads the snapshot at once; the expert never runs more than `checkpoint_every` steps past its
last stored checkpoint (crowdtrain.client.experts.expert). Once a checkpoint is stored, a replica of
an expert that has others averages its weights with the newest checkpoint they uploaded since it last
did (replicas re-synchronised by averaging, as the layout's `replicas` say). A trainer
(`RoutingFollower`) follows the routing table by its changes, with no lookup per batch.
"""

import logging
import threading
import time
from dataclasses import dataclass, field

from crowdtrain.client.experts.expert import Expert
from crowdtrain.client.experts.host import ExpertHost
from crowdtrain.client.server_http import Refused, ServerHTTP, parse_reply
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.schemas import HostRegister, HostRegistered
from crowdtrain.core.schemas_experts import (
    CallReport,
    CallsRecorded,
    CheckpointStored,
    LeaseRequest,
    Leases,
    RoutingTable,
)

log = logging.getLogger(__name__)
STOP_CHECK_SECONDS = 0.5  # how often, between heartbeats and snapshots, the keeper looks at its stop event
RETRY_SECONDS = 0.1  # the pause before a failed checkpoint upload is tried again


class MixtureAPI:
    """The registry's calls, as one host (by its host token)."""

    def __init__(self, server_url: str, timeout: float = 30.0, stop: threading.Event | None = None):
        self.server = ServerHTTP(server_url, timeout, stop, attempts=5)
        self.token = ""

    def close(self) -> None:
        self.server.close()

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def register(self, join_token: str, name: str) -> None:
        body = HostRegister(join_token=join_token, name=name).model_dump()
        self.token = parse_reply(HostRegistered, self.server.request("POST", "/v1/hosts", json=body)).host_token

    def lease(self, mixture_id: int, url: str, capacity: int) -> Leases:
        body = LeaseRequest(url=url, capacity=capacity).model_dump()
        reply = self.server.request("POST", f"/v1/mixtures/{mixture_id}/leases", json=body, headers=self._auth())
        return parse_reply(Leases, reply)

    def routing(self, mixture_id: int, since: int) -> RoutingTable:
        reply = self.server.request("GET", f"/v1/mixtures/{mixture_id}/routing?since={since}", headers=self._auth())
        return parse_reply(RoutingTable, reply)

    def report_calls(self, mixture_id: int, report: CallReport) -> CallsRecorded:
        """A trainer's report of its calls to the mixture's experts (their hosts' credit and charges)."""
        reply = self.server.request(
            "POST", f"/v1/mixtures/{mixture_id}/calls", json=report.model_dump(mode="json"), headers=self._auth()
        )
        return parse_reply(CallsRecorded, reply)

    def put_checkpoint(self, mixture_id: int, uid: str, step: int, blob: bytes) -> CheckpointStored:
        url = f"/v1/mixtures/{mixture_id}/experts/{uid}/checkpoint?step={step}"
        headers = {**self._auth(), "Content-Type": "application/octet-stream"}
        return parse_reply(CheckpointStored, self.server.request("PUT", url, content=blob, headers=headers))

    def checkpoint(self, mixture_id: int, uid: str, limit: int, of: str = "newest") -> bytes:
        """The newest checkpoint of any of the expert's replicas, or with `of="peer"` of its other replicas."""
        url = f"/v1/mixtures/{mixture_id}/experts/{uid}/checkpoint?of={of}"
        return self.server.exchange("GET", url, limit=limit, headers=self._auth())[1]


@dataclass
class LeaseKeeper:
    """Keeps `host` serving the experts the scheduler leases it (see the module docstring)."""

    api: MixtureAPI
    host: ExpertHost
    mixture_id: int
    url: str
    capacity: int
    unstored: dict[str, tuple[int, bytes]] = field(default_factory=dict)  # expert -> a snapshot to upload again
    due: threading.Event = field(default_factory=threading.Event)  # set by an expert's new snapshot
    peers: dict[str, int] = field(default_factory=dict)  # expert -> its other replicas' newest checkpoint step
    averaged: dict[str, int] = field(default_factory=dict)  # expert -> the peer step it last averaged with

    def beat(self) -> Leases:
        """One heartbeat: leases renewed and taken, experts restored or dropped, due checkpoints uploaded."""
        leases = self.api.lease(self.mixture_id, self.url, self.capacity)
        listed = {lease.uid: lease for lease in leases.leases}
        for uid in set(self.host.served) - set(listed):
            log.warning("expert %s: its lease ended (it is served elsewhere now); dropped", uid)
            self.host.remove(uid)
            for seen in (self.peers, self.averaged, self.unstored):
                seen.pop(uid, None)
        for uid, lease in listed.items():
            self.peers[uid] = lease.peer_step
            if uid not in self.host.served:
                self.host.add(self._start(uid, lease.has_checkpoint))
                # What it restored is at least as new as any other replica's checkpoint.
                self.averaged[uid] = lease.checkpoint_step
        self._upload_due()
        return leases

    def _start(self, uid: str, has_checkpoint: bool) -> Expert:
        expert = Expert(self.host.layout, uid)
        if has_checkpoint:
            try:
                expert.restore(self.api.checkpoint(self.mixture_id, uid, self.host.layout.checkpoint_limit()))
                log.info("expert %s: restored from its checkpoint of step %d", uid, expert.steps)
            except (Refused, ValueError) as exc:
                log.warning("expert %s: its checkpoint cannot be restored (%s); starting it afresh", uid, exc)
                expert = Expert(self.host.layout, uid)
        layout = self.host.layout
        expert.keep_checkpoints(layout.checkpoint_every, layout.backward_timeout, self.due.set)
        return expert

    def _upload_due(self) -> None:
        """Upload each expert's newest snapshot (or one whose upload failed and is not yet replaced);
        a refused one is dropped (the expert's next snapshot comes within half an interval)."""
        for uid, served in list(self.host.served.items()):
            snapshot = served.expert.take_snapshot() or self.unstored.pop(uid, None)
            if snapshot is None:
                continue
            self.unstored[uid] = snapshot  # until stored: a failed upload is tried again
            step, blob = snapshot
            try:
                self.api.put_checkpoint(self.mixture_id, uid, step, blob)
            except Refused as exc:
                log.warning("expert %s: checkpoint of step %d refused: %s", uid, step, exc.message)
                del self.unstored[uid]
                continue
            del self.unstored[uid]
            served.expert.stored(step)
            if self.peers.get(uid, 0) > self.averaged.get(uid, 0):
                self._average(uid, served.expert)

    def _average(self, uid: str, expert: Expert) -> None:
        """Average the expert with its other replicas' newest checkpoint; a failure is logged, and the
        replica goes on alone until its next checkpoint."""
        peer_step = self.peers[uid]
        try:
            expert.average_with(self.api.checkpoint(self.mixture_id, uid, self.host.layout.checkpoint_limit(), "peer"))
            log.info("expert %s: averaged with another replica's checkpoint of step %d", uid, peer_step)
        except (Refused, ValueError) as exc:
            log.warning("expert %s: another replica's checkpoint cannot be averaged with (%s)", uid, exc)
        self.averaged[uid] = peer_step

    def run(self, stop: threading.Event, interval: float) -> None:
        """Beat every `interval` seconds (then the scheduler's heartbeat) until `stop` is set, and between
        beats upload each snapshot as soon as an expert takes it. A failed beat or upload is logged and
        tried again."""
        next_beat = 0.0
        while not stop.is_set():
            try:
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + interval
                    interval = self.beat().heartbeat_seconds
                else:
                    self._upload_due()
            except Exception as exc:
                log.warning("expert host: %s failed (%s); trying again", type(exc).__name__, exc)
            if self.unstored:
                stop.wait(RETRY_SECONDS)  # an upload failed: try again soon, not at once
            if self.due.wait(max(0.0, min(STOP_CHECK_SECONDS, next_beat - time.monotonic()))):
                self.due.clear()


def layout_of(api: MixtureAPI, mixture_id: int, url: str) -> ExpertLayout:
    """The mixture's layout, asked for without taking any expert (capacity 0)."""
    return api.lease(mixture_id, url, 0).layout
