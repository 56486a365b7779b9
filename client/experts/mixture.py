"""A trainer's side of expert-parallel training: mixture-of-experts layers whose experts live on
expert hosts (crowdtrain.client.experts.host).

The routing (grid gating, each input's k best experts among those the routing table lists) and the
renormalised combination are crowdtrain.core.zoo_experts', shared with the parameter servers'
evaluation. One call per expert per batch carries all the rows routed to it; the calls run
concurrently, and the trainer waits until every row has `k_min` answers and then a `grace` period
more, or until the timeout. Experts that fail or answer late are dropped and the
weights of the rest renormalised (a softmax over the answered experts' scores): this acts like
dropout, and training goes on while hosts come and go. A row with fewer than `k_min` answers gets
no output from the layer (its residual passes it on). Backward is sent only to the experts that
answered forward; one that fails then contributes no input gradient.

An expert with replicas (the layout's `replicas`) is called at one of them in turn; backward goes to
the replica that answered forward. Every `compare_every`-th forward call to such an expert also goes
to another replica, and the two answers are compared (crowdtrain.core.experts.disagree). A
disagreement is blamed on one of its two hosts only when that host is a suspect (`suspects`: it agreed
with fewer than half the answers of hosts that are not suspects themselves) and the other is not; two
honest replicas that drifted apart between their averagings blame nobody. The blamed count goes into
the trainer's reports, which charge the host.
"""

import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import urllib3

from crowdtrain.core.experts import ExpertLayout, disagree, encode_call, parse_uid, read_call
from crowdtrain.core.schemas_experts import ExpertCalls, RoutingTable
from crowdtrain.core.zoo_experts import GridGate, combine, route

_ANSWER = {"forward": ("y",), "backward": ("grad_x",)}
MAX_DISPUTES = 1024  # disagreements a trainer keeps waiting for blame; the oldest go first


class ExpertCallFailed(RuntimeError):
    pass


class AnswerRefused(ExpertCallFailed):
    """The host answered, but not with something a trainer can use (too large, not the call's tensors,
    NaN): the host's fault, reported as refused (crowdtrain.core.schemas_experts.ExpertCalls)."""


def suspects(record: Mapping[tuple[str, str], Counter[str]]) -> set[str]:
    """The hosts whose answers are not trusted, from compared answers (`record`: (host, partner) -> counts
    of `agreed` and `disagreed`, kept both ways). The hosts that agreed least often with hosts not yet
    suspected are suspected when that is less than half the time, and the shares are counted again
    without them, until no host is below half. A host that makes its answers up disagrees with everyone;
    an honest host it was compared with is judged by its other partners alone. Two hosts that only ever
    disagreed with each other are both suspected, so neither is blamed for it (_blame)."""
    suspected: set[str] = set()
    while True:
        agreed: Counter[str] = Counter()
        compared: Counter[str] = Counter()
        for (host, partner), counts in record.items():
            if host not in suspected and partner not in suspected:
                agreed[host] += counts["agreed"]
                compared[host] += counts["agreed"] + counts["disagreed"]
        share = {host: agreed[host] / n for host, n in compared.items() if n}
        lowest = min(share.values(), default=1.0)
        if lowest >= 0.5:
            return suspected
        suspected |= {host for host, s in share.items() if s == lowest}


class ExpertClient:
    """Calls to the experts of a routing table (expert id -> its replicas' hosts' base URLs; `routes`
    gives the hosts of replica 0), run concurrently. It counts what they came to per expert and host
    (`take_calls`), for the trainer's reports: a call dropped late may still be answered, and then
    counts as both."""

    def __init__(self, layout: ExpertLayout, routes: Mapping[str, str], max_concurrency: int = 64):
        self.layout = layout
        self.replicas: dict[str, dict[int, str]] = {uid: {0: url} for uid, url in routes.items()}
        self._turns: Counter[str] = Counter()  # forward calls to each expert so far
        # Each pair of hosts' compared answers that agreed and disagreed, over this trainer's life, kept
        # under (host, partner) both ways, and the disagreements not yet blamed: (expert, host, host).
        self._record: defaultdict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        self._disputes: deque[tuple[str, str, str]] = deque(maxlen=MAX_DISPUTES)
        self.figures: Counter[str] = Counter()
        self._calls: dict[tuple[str, str], Counter[str]] = {}
        self._lock = threading.Lock()
        timeout = max(layout.forward_timeout, layout.backward_timeout)
        # urllib3's pools, one per host, keep a connection for every call that may run at once: a step's
        # calls cost a third of the CPU they cost through httpx's one shared pool (0.48 against 1.25 ms a
        # call, 32 at once, with twice the calls a second), which bounded a trainer's throughput.
        self._http = urllib3.PoolManager(
            maxsize=max_concurrency, retries=False, timeout=urllib3.Timeout(connect=timeout, read=timeout)
        )
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="expert-call")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.clear()

    @property
    def routes(self) -> dict[str, str]:
        """Each served expert's host: that of its lowest replica served."""
        with self._lock:
            return {uid: urls[min(urls)] for uid, urls in self.replicas.items()}

    def available(self, layer: int) -> list[str]:
        """The experts of `layer` the routing table lists, in a stable order."""
        with self._lock:
            return sorted(uid for uid in self.replicas if parse_uid(uid)[0] == layer)

    def set_routes(self, changes: Mapping[tuple[str, int], str | None]) -> None:
        """Apply changes of the routing table: the new host of an expert's replica, or None for none."""
        with self._lock:
            for (uid, replica), url in changes.items():
                urls = self.replicas.setdefault(uid, {})
                if url is None:
                    urls.pop(replica, None)
                else:
                    urls[replica] = url
                if not urls:
                    del self.replicas[uid]

    def pick(self, uid: str) -> str | None:
        """The host to call the expert at: its replicas in turn; None while none is served."""
        with self._lock:
            urls = [url for _, url in sorted(self.replicas.get(uid, {}).items())]
            return urls[self._turns[uid] % len(urls)] if urls else None

    def submit(self, uid: str, kind: str, url: str | None = None, **tensors: np.ndarray) -> "Future[np.ndarray]":
        """Call the expert at `url` (by default `pick`'s); a forward call due for comparison also goes
        to another replica, and the answers are compared once both are in."""
        url = self.pick(uid) if url is None else url
        future = self._pool.submit(self._call, uid, url, kind, tensors)
        if kind == "forward":
            other = self._compare_with(uid, url)
            if other is not None and url is not None:
                first, second = url, self._pool.submit(self._call, uid, other, kind, tensors)
                _when_both(future, second, lambda a, b: self._compared(uid, first, other, a, b))
        return future

    def _compare_with(self, uid: str, url: str | None) -> str | None:
        """Another replica's host when this forward call to `uid` is due for comparison, else None."""
        with self._lock:
            self._turns[uid] += 1
            every = self.layout.compare_every
            others = [u for u in self.replicas.get(uid, {}).values() if u != url]
            if url is None or not others or every == 0 or self._turns[uid] % every:
                return None
            return others[(self._turns[uid] // every) % len(others)]

    def _compared(self, uid: str, url: str, other: str, a: np.ndarray, b: np.ndarray) -> None:
        verdict = "disagreed" if disagree(a, b, self.layout.compare_tolerance) else "agreed"
        with self._lock:
            self.figures[f"compared_{verdict}"] += 1
            for host, partner in ((url, other), (other, url)):
                self._calls.setdefault((uid, host), Counter())["compared"] += 1
                self._record[(host, partner)][verdict] += 1
            if verdict == "disagreed":
                self._disputes.append((uid, url, other))

    def _blame(self) -> None:
        """Settle the disputes that can be: a disagreement between a suspect and a host that is not one is
        the suspect's (`disagreed` in its report). One between two hosts that are not suspects (replicas
        that drifted apart, or two hosts nobody else has compared yet) stays open until one of them is."""
        suspected = suspects(self._record)
        still: deque[tuple[str, str, str]] = deque(maxlen=MAX_DISPUTES)
        for uid, a, b in self._disputes:
            if (a in suspected) == (b in suspected):
                still.append((uid, a, b))
            else:
                blamed = a if a in suspected else b
                self._calls.setdefault((uid, blamed), Counter())["disagreed"] += 1
        self._disputes = still

    def _count(self, what: str, uid: str | None = None, url: str | None = None, rows: int = 0) -> None:
        with self._lock:
            self.figures[what] += 1
            if uid is None or url is None:
                return
            counts = self._calls.setdefault((uid, url), Counter())
            counts[what.rsplit("_", 1)[-1]] += 1
            counts["rows"] += rows

    def take_calls(self) -> list[ExpertCalls]:
        """What the calls to each expert at each host came to since the last time this was asked."""
        with self._lock:
            self._blame()
            taken, self._calls = self._calls, {}
        return [
            ExpertCalls(
                uid=uid,
                url=url,
                answered=c["answered"],
                rows=c["rows"],
                failed=c["failed"],
                late=c["late"],
                refused=c["refused"],
                compared=c["compared"],
                disagreed=c["disagreed"],
            )
            for (uid, url), c in sorted(taken.items())
        ]

    def _call(self, uid: str, url: str | None, kind: str, tensors: dict[str, np.ndarray]) -> np.ndarray:
        rows = int(next(iter(tensors.values())).shape[0])
        (name,) = _ANSWER[kind]
        limit = self.layout.call_limit((name,))
        try:
            if url is None:
                raise ExpertCallFailed(f"expert {uid}: no host serves it now")
            status, body = self._post(f"{url}/v1/experts/{uid}/{kind}", encode_call(**tensors), limit)
            if body is None:
                raise AnswerRefused(f"expert {uid}: an answer of more than {limit} bytes")
            if status != 200:
                raise ExpertCallFailed(f"expert {uid}: {kind} answered {status}: {body[:200]!r}")
            try:
                out = read_call(body, (name,), self.layout.dim, self.layout.max_rows)[name]
            except ValueError as exc:
                raise AnswerRefused(f"expert {uid}: {exc}") from None
            if out.shape[0] != rows:
                raise AnswerRefused(f"expert {uid}: {out.shape[0]} rows answered for {rows} sent")
        except AnswerRefused as exc:
            self._count(f"{kind}_refused", uid, url)
            raise ExpertCallFailed(str(exc)) from exc
        except (urllib3.exceptions.HTTPError, OSError, ExpertCallFailed) as exc:
            self._count(f"{kind}_failed", uid, url)
            raise ExpertCallFailed(str(exc)) from exc
        self._count(f"{kind}_answered", uid, url, rows)
        return np.array(out)

    def _post(self, url: str, body: bytes, limit: int) -> tuple[int, bytes | None]:
        """POST `body`; the status and the answer's body, read up to `limit` bytes (None beyond: the
        connection is closed, not kept with the rest of that answer unread)."""
        response = self._http.request(
            "POST", url, body=body, headers={"Content-Type": "application/octet-stream"}, preload_content=False
        )
        answer = bytearray()
        try:
            for chunk in response.stream(1 << 16):
                answer += chunk
                if len(answer) > limit:
                    response.close()
                    return response.status, None
        finally:
            response.release_conn()
        return response.status, bytes(answer)


def _when_both(
    a: "Future[np.ndarray]", b: "Future[np.ndarray]", then: Callable[[np.ndarray, np.ndarray], None]
) -> None:
    """Call `then` with both results once both futures are done, if both succeeded."""
    lock, pending = threading.Lock(), [2]

    def done(_: "Future[np.ndarray]") -> None:
        with lock:
            pending[0] -= 1
            if pending[0]:
                return
        if not (a.cancelled() or b.cancelled()) and a.exception() is None and b.exception() is None:
            then(a.result(), b.result())

    a.add_done_callback(done)
    b.add_done_callback(done)


@dataclass
class _Routed:
    """The rows of a batch routed to one expert, at which of their k places, and the host called."""

    uid: str
    rows: torch.Tensor  # [n] row indices of the batch
    places: torch.Tensor  # [n] indices into the k chosen experts of each row
    url: str | None = None


def _gather(
    client: ExpertClient,
    futures: dict["Future[np.ndarray]", _Routed],
    need: torch.Tensor,
    timeout: float,
    quorum: float = 1.0,
) -> dict[str, np.ndarray]:
    """The answers of the calls that came back in time: every one, or, once each row has its `need`
    [rows] answers or a share `quorum` of the calls has answered, those within a grace period after
    that (as long again as those answers took, at most the layout's `grace`: on a fast network a lost
    call holds the batch for little); by `timeout` at the latest."""
    started = time.monotonic()
    deadline = started + timeout
    answered = torch.zeros_like(need)
    out: dict[str, np.ndarray] = {}
    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED)
        if not done:
            break
        for f in done:
            if f.exception() is None:
                routed = futures[f]
                out[routed.uid] = f.result()
                answered[routed.rows] += 1
        if pending and (bool((answered >= need).all()) or len(out) >= quorum * len(futures)):
            now = time.monotonic()
            deadline = min(deadline, now + min(client.layout.grace, now - started))
    for f in pending:
        f.cancel()
        client._count("late", futures[f].uid, futures[f].url)
    return out


class _RemoteExperts(torch.autograd.Function):
    """Calls the routed experts: forward returns their outputs [rows, k, dim] (zeros where none came)
    and which came [rows, k]; backward sends the outputs' gradient to the experts that answered and
    sums the input gradients they return."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, client: ExpertClient, routed: list[_Routed], k: int) -> Any:
        layout = client.layout
        x_np = x.detach().numpy()
        for r in routed:
            r.url = client.pick(r.uid)
        futures = {client.submit(r.uid, "forward", r.url, x=x_np[r.rows.numpy()]): r for r in routed}
        need = torch.full((x.shape[0],), layout.k_min, dtype=torch.long)
        answers = _gather(client, futures, need, layout.forward_timeout)
        y = torch.zeros(x.shape[0], k, layout.dim)
        came = torch.zeros(x.shape[0], k, dtype=torch.bool)
        for r in routed:
            if r.uid in answers:
                y[r.rows, r.places] = torch.from_numpy(answers[r.uid])
                came[r.rows, r.places] = True
        ctx.client, ctx.x_np = client, x_np
        ctx.answered = [r for r in routed if r.uid in answers]
        # Backward waits for as many answers per row as forward got, up to k_min.
        ctx.need = came.sum(dim=1).clamp(max=layout.k_min)
        ctx.mark_non_differentiable(came)
        return y, came

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor, _grad_came: torch.Tensor) -> Any:
        client: ExpertClient = ctx.client
        g = grad_y.contiguous().numpy()
        futures = {
            client.submit(
                r.uid, "backward", r.url, x=ctx.x_np[r.rows.numpy()], grad_y=g[r.rows.numpy(), r.places.numpy()]
            ): r
            for r in ctx.answered
        }
        answers = _gather(client, futures, ctx.need, client.layout.backward_timeout, client.layout.backward_quorum)
        grad_x = torch.zeros(ctx.x_np.shape)
        for r in ctx.answered:
            if r.uid in answers:
                grad_x.index_add_(0, r.rows, torch.from_numpy(answers[r.uid]))
        return grad_x, None, None, None


class RemoteExperts:
    """A trunk's mixture-of-experts layers (crowdtrain.core.zoo_experts.MixtureLayers) whose experts are
    remote: each row's k best among the experts the routing table lists, called over `client`."""

    def __init__(self, client: ExpertClient):
        self.client, self.layout = client, client.layout
        self.dropped_rows = 0  # rows that got fewer than k_min answers, so far

    def __call__(self, layer: int, gate: GridGate, x: torch.Tensor) -> torch.Tensor:
        uids = self.client.available(layer)
        if not uids:
            self.dropped_rows += x.shape[0]
            return torch.zeros_like(x)
        top_scores, top = route(gate, x, uids, self.layout.k)
        routed = []
        for e in torch.unique(top).tolist():
            rows, places = (top == e).nonzero(as_tuple=True)
            routed.append(_Routed(uids[e], rows, places))
        y, came = _RemoteExperts.apply(x, self.client, routed, top.shape[1])
        out, enough = combine(top_scores, y, came, self.layout.k_min)
        self.dropped_rows += int((~enough).sum())
        return out


@dataclass
class RoutingFollower:
    """A trainer's copy of a mixture's routing table in `client`, brought up to date by its changes:
    `fetch(since)` answers what changed since a version (MixtureAPI.routing or SchedulerAPI.routing of
    one mixture)."""

    fetch: Callable[[int], RoutingTable]
    client: ExpertClient
    version: int = 0

    def refresh(self) -> int:
        """Apply what changed since the version held; how many routes changed."""
        table = self.fetch(self.version)
        self.client.set_routes({(r.uid, r.replica): r.url for r in table.routes})
        self.version = table.version
        return len(table.routes)
