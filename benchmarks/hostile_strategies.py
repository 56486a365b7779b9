"""The hostile strategies of benchmarks/adversarial.py: what each uploads in place of an honest
result (pure functions of W_base and the honest result), and the scripted hosts that play one over
HTTP (crowdtrain/launch/scripted_host.py)."""

import threading
from collections.abc import Callable

import httpx
import numpy as np

from crowdtrain.client.trainers import train
from crowdtrain.core.tensors import Params
from crowdtrain.launch.cluster import Cluster
from crowdtrain.launch.scripted_host import ScriptedHost


def _along(base: Params, honest: Params, scale: float) -> Params:
    """W_base + scale·Δ, with Δ = honest − W_base, for every float tensor."""
    return {k: (v + scale * (honest[k] - v)).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in base.items()}


def sign_flipped(base: Params, honest: Params, rng: np.random.Generator) -> Params:
    return _along(base, honest, -1.0)


def scaled(base: Params, honest: Params, rng: np.random.Generator) -> Params:
    return _along(base, honest, 10.0)


def noise(base: Params, honest: Params, rng: np.random.Generator) -> Params:
    """W_base + Gaussian noise whose norm is the honest update's (over all float tensors)."""
    floats = [k for k, v in base.items() if v.dtype.kind == "f"]
    draw = {k: rng.standard_normal(base[k].shape) for k in floats}
    delta_norm = np.sqrt(sum(float(np.sum((honest[k] - base[k]).astype(np.float64) ** 2)) for k in floats))
    draw_norm = np.sqrt(sum(float(np.sum(d**2)) for d in draw.values()))
    return {k: (v + delta_norm / draw_norm * draw[k]).astype(v.dtype) if k in draw else v for k, v in base.items()}


FORGED: dict[str, Callable[[Params, Params, np.random.Generator], Params]] = {
    "sign-flip": sign_flipped,
    "scaled": scaled,
    "noise": noise,
}


def class_derangement(num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of the classes that moves every one of them (label i becomes perm[i] != i)."""
    while True:
        perm = rng.permutation(num_classes)
        if not np.any(perm == np.arange(num_classes)):
            return perm


class HostileHost(threading.Thread):
    """One hostile host with one slot, playing `strategy` until stopped: ask for work, fetch what a
    client fetches, upload the forged result. Records (assignment id, attack?, HTTP status) per upload."""

    def __init__(
        self, cluster: Cluster, name: str, strategy: str, seed: int, account: str = "", local_address: str = ""
    ):
        super().__init__(name=f"hostile-{strategy}", daemon=True)
        # An account of its own per job (its name unless given): quarantine follows the account, and each
        # job's hostile host starts afresh.
        self.host = ScriptedHost(
            cluster.url, cluster.join_token, name, account=account or name, local_address=local_address
        )
        self.strategy = strategy
        self.rng = np.random.default_rng(seed)
        self.stopping = threading.Event()
        self.uploads: list[tuple[int, bool, int]] = []
        self.first: Params | None = None  # replay: the result it replays
        self.perm: np.ndarray | None = None
        self.error = ""

    def stop(self) -> None:
        self.stopping.set()
        self.join(120)

    @property
    def host_ids(self) -> list[int]:
        """The hosts it registered."""
        return [self.host.host_id]

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                given = self.host.ask()
                if not given:  # nothing ready, or quarantined
                    self.stopping.wait(1.0)
                    continue
                a = given[0]
                params, metrics, attack = self.forge(a, self.host.snapshot(a), *self.host.shard(a))
                resp = self.host.upload(a, params, metrics)
                self.uploads.append((a["assignment_id"], attack, resp.status_code))
            except (httpx.HTTPError, AssertionError) as exc:  # the cluster going away at the end of a job
                self.error = f"{type(exc).__name__}: {exc}"[:300]
                self.stopping.wait(1.0)

    def forge(self, a: dict, base: Params, x: np.ndarray, y: np.ndarray) -> tuple[Params, dict, bool]:
        """The params to upload, the metrics to report, and whether the upload is an attack."""
        recipe, fraction = a["recipe"], a["local_fraction"]
        claimed = {"examples": round(len(x) * recipe["training"]["local_epochs"] * fraction), "seconds": 5.0}
        if self.strategy in ("lazy", "lazy-unvalidated"):
            return base, claimed | {"train_loss": 0.5}, True
        if self.strategy == "replay" and self.first is not None:
            return self.first, claimed | {"train_loss": 0.5}, True
        if self.strategy == "permuted":
            if self.perm is None:
                self.perm = class_derangement(recipe["model"]["num_classes"], self.rng)
            y = self.perm[y]
        result = train("pytorch", recipe, base, x, y, local_fraction=fraction)
        metrics = {"train_loss": result.train_loss, "examples": result.examples, "seconds": result.seconds}
        if self.strategy == "replay":
            self.first = result.params
            return result.params, metrics, False
        if self.strategy == "permuted":
            return result.params, metrics, True
        return FORGED[self.strategy](base, result.params, self.rng), metrics, True


def garbage(base: Params, rng: np.random.Generator) -> Params:
    """W_base + Gaussian noise of each float tensor's own scale (its standard deviation, at least 0.1): no
    training at all."""
    return {
        k: (v + max(float(np.std(v)), 0.1) * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
        for k, v in base.items()
    }


class ReRegisteringHost(HostileHost):
    """`re-register`: uploads garbage, and whenever it is given no work twice in a row (quarantined, as far
    as it can tell) registers again with the same join token, name and account, and tries again. Its
    `host_ids` are every host it registered; a registration refused (429) is counted and retried later."""

    def __init__(self, cluster: Cluster, name: str, strategy: str, seed: int):
        super().__init__(cluster, name, strategy, seed)
        self.url, self.join_token, self.name_given = cluster.url, cluster.join_token, name
        self.registered = [self.host.host_id]
        self.registrations_refused = 0

    @property
    def host_ids(self) -> list[int]:
        return self.registered

    def register_again(self) -> None:
        try:
            self.host = ScriptedHost(self.url, self.join_token, self.name_given, account=self.name_given)
        except AssertionError:  # refused (429): no host registered
            self.registrations_refused += 1
            return
        self.registered.append(self.host.host_id)

    def run(self) -> None:
        idle = 0
        while not self.stopping.is_set():
            try:
                given = self.host.ask()
                if given:
                    idle, a = 0, given[0]
                    x, _ = self.host.shard(a)
                    claimed = {"examples": len(x), "seconds": 5.0, "train_loss": 0.5}
                    resp = self.host.upload(a, garbage(self.host.snapshot(a), self.rng), claimed)
                    self.uploads.append((a["assignment_id"], True, resp.status_code))
                    continue
                idle += 1
                if idle >= 2:
                    idle = 0
                    self.register_again()
                self.stopping.wait(1.0)
            except (httpx.HTTPError, AssertionError) as exc:
                self.error = f"{type(exc).__name__}: {exc}"[:300]
                self.stopping.wait(1.0)


# ---------------------------------------------------------------- colluding-pair

COLLUDING_PAIR = "colluding-pair"
PAIR_ADDRESSES = ("127.0.1.1", "127.0.2.1")  # two networks: replicas never go to two hosts of one
PAIR_STEP = 0.1  # ||d|| as a fraction of ||W_base||: small enough that W_s merged with it loses little


def shared_direction(base: Params, seed: int, workunit_id: int) -> dict[str, np.ndarray]:
    """The pair's direction d for a workunit, of norm PAIR_STEP·||W_base||: drawn from (seed, workunit id),
    so that both hosts of the pair upload the same d without talking to each other."""
    rng = np.random.default_rng([seed, workunit_id])
    draw = {k: rng.standard_normal(v.shape) for k, v in base.items() if v.dtype.kind == "f"}
    base_norm = np.sqrt(sum(float(np.sum(base[k].astype(np.float64) ** 2)) for k in draw))
    draw_norm = np.sqrt(sum(float(np.sum(d**2)) for d in draw.values()))
    return {k: PAIR_STEP * base_norm / draw_norm * d for k, d in draw.items()}


class Colluder(HostileHost):
    """One host of a colluding pair: uploads W_base + d + ε, d shared with its partner
    (`shared_direction`), ε a private noise of 2% of ||d||, trained by neither."""

    def __init__(self, cluster: Cluster, name: str, seed: int, member: int):
        suffix = f"-{member + 1}" if member else ""
        super().__init__(
            cluster,
            f"{name}{suffix}",
            COLLUDING_PAIR,
            2 * seed + member + 1,
            local_address=PAIR_ADDRESSES[member],
        )
        self.pair_seed = seed

    def forge(self, a: dict, base: Params, x: np.ndarray, y: np.ndarray) -> tuple[Params, dict, bool]:
        recipe, fraction = a["recipe"], a["local_fraction"]
        claimed = {"examples": round(len(x) * recipe["training"]["local_epochs"] * fraction), "seconds": 5.0}
        d = shared_direction(base, self.pair_seed, a["workunit_id"])
        noise = {k: self.rng.standard_normal(v.shape) for k, v in d.items()}
        scale = 0.02 * np.sqrt(sum(float(np.sum(v**2)) for v in d.values()))
        scale /= np.sqrt(sum(float(np.sum(v**2)) for v in noise.values()))
        forged = {k: (v + d[k] + scale * noise[k]).astype(v.dtype) if k in d else v for k, v in base.items()}
        return forged, claimed | {"train_loss": 0.5}, True


class ColludingPair:
    """Two hostile hosts of two accounts on two networks (loopback addresses PAIR_ADDRESSES), each with
    one slot, uploading W_base + d + ε with a shared d: they agree with each other whenever both hold
    replicas of one workunit. `host_ids` and `uploads` as for a HostileHost."""

    def __init__(self, cluster: Cluster, name: str, seed: int):
        self.members = [Colluder(cluster, name, seed, member) for member in range(len(PAIR_ADDRESSES))]

    @property
    def host_ids(self) -> list[int]:
        return [m.host.host_id for m in self.members]

    @property
    def uploads(self) -> list[tuple[int, bool, int]]:
        return [u for m in self.members for u in m.uploads]

    @property
    def error(self) -> str:
        return "; ".join(m.error for m in self.members if m.error)

    def start(self) -> None:
        for m in self.members:
            m.start()

    def stop(self) -> None:
        for m in self.members:
            m.stop()


def hostile_host(cluster: Cluster, name: str, strategy: str, seed: int) -> HostileHost | ColludingPair:
    """The scripted host (or pair of hosts) that plays `strategy`."""
    if strategy == COLLUDING_PAIR:
        return ColludingPair(cluster, name, seed)
    return (ReRegisteringHost if strategy == "re-register" else HostileHost)(cluster, name, strategy, seed)
