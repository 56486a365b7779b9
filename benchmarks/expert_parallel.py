"""Expert-parallel training (crowdtrain.client.experts): a trainer's throughput against network latency and
lost calls, its accuracy against a dense model of equal FLOPs, how fast a killed host's experts are
restored elsewhere, and the scheduler's CPU per expert-host heartbeat and routing-table request.
After Learning@home's section 4 (Ryabinin & Gusev, NeurIPS 2020), with the table it lacks (lost calls).

What it measures
    The model: a linear trunk, two mixture-of-experts layers of 4x4 experts (dim 32 -> 64 -> 32, top-4,
    k_min 1) as residual branches, a linear head; the task: 40 Gaussian clusters in 8 dimensions, four
    per class (benchmarks/efficiency_data.py `cluster_arrays`; a linear model reaches about 0.63).
    Three expert hosts (`crowdtrain expert-host` processes) serve a third of the experts each.

    `samples_per_s`: examples the trainer trains per second (forward, backward, both layers' expert
    calls and the trunk's step), keeping `--in-flight` micro-batches of 64 going at once (12, the
    layout's default `in_flight`: more hides more latency, and each micro-batch's trunk step is stale
    by up to that many steps less one, which costs accuracy at equal examples)
    (PipelinedTrainer), measured over `--seconds` after a warm-up. Latency is injected at the hosts
    (each answer waits an exponential delay of the given mean: a wide-area link); a lost call holds
    its caller 2 s and answers an error. This machine's speed drifts by more than the effects measured
    (the same clean run gave 185 and 338 samples/s on two days), so the clean figure (no latency,
    nothing lost) is measured before, between and after the two series (`clean_runs`), and each
    condition's ratio divides by the mean of the two clean runs that bracket it, not by one figure for
    all. `throughput_200ms_over_clean`: at 200 ms mean latency over no latency (goal >= 0.8);
    `speedup_over_sequential_200ms`: at 200 ms, the pipelined trainer over
    the same trainer with one micro-batch at a time (each layer waits for the one before it: a
    sequential layer-by-layer model-parallel step); `throughput_at_10pct_drop_over_clean` (goal >= 0.85).

    `accuracy_gap_vs_dense`: validation accuracy, in points, of a dense model with the same FLOPs per
    example (each layer a residual feed-forward block of width 4 x 64: the four experts an input
    visits) minus the mixture's trained with 10% of calls lost, after the same `--examples`, each of
    them the mean over `--accuracy-seeds` runs (initial weights, the experts' too, and batch order
    drawn from seeds 0, 1, ...: one run's gap varied by more than a point between days);
    `accuracy_gap_by_seed` lists each run's (goal: the mean <= 1).

    `restore_s`: a real scheduler (Cluster: SQLite, private Redis) leases the experts to three hosts
    (heartbeat 1 s, a lease lasts 3), a trainer trains through them, one host is SIGKILLed: seconds
    until the routing table names a living host for every expert; `restore_after_lease_heartbeats`:
    the same, after the lease ran out, in heartbeats (goal <= 2). `lost_steps_max`: the most steps an
    expert lost (its steps on the killed host at the kill minus its restored checkpoint's), against
    `checkpoint_every` (goal: no more).

    `heartbeat_cpu_ms`, `routing_cpu_ms`: the scheduler process's CPU milliseconds per lease renewal
    of `--simulated-hosts` expert hosts (each serving one expert of a mixture of as many) and per
    routing-table request (`routing_full_cpu_ms`: the whole table; `routing_cpu_ms`: the changes since
    the version held, what trainers ask for).

Run
    .venv/bin/python benchmarks/expert_parallel.py [--quick] [--seconds 20] [--examples 40000]
        [--accuracy-seeds 3] [--in-flight 8] [--simulated-hosts 1000]

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import torch
from torch import nn

from crowdtrain.client.experts.leasing import MixtureAPI
from crowdtrain.client.experts.mixture import ExpertClient, RoutingFollower
from crowdtrain.client.experts.trainer import MixtureClassifier, PipelinedTrainer, accuracy
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.zoo_experts import MixtureTrunk
from crowdtrain.launch.cluster import Cluster, Service, crowdtrain_argv, free_port, wait_for
from efficiency_data import cluster_arrays
from process_cpu import cpu_seconds

LAYOUT = ExpertLayout(
    layers=2,
    grid=[4, 4],
    dim=32,
    hidden=64,
    k=4,
    k_min=1,
    lr=3e-3,
    forward_timeout=2.0,
    backward_timeout=2.0,
    heartbeat_seconds=1.0,
    lease_heartbeats=3,
    checkpoint_every=20,
)
BATCH = 64


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def batches(x: np.ndarray, y: np.ndarray, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    while True:
        i = rng.integers(0, len(x), BATCH)
        yield x[i], y[i]


class Hosts:
    """Three expert hosts with the experts named on their command line, the injected network given."""

    def __init__(self, directory: Path, latency: float = 0.0, drop_rate: float = 0.0, layout: ExpertLayout = LAYOUT):
        directory.mkdir(parents=True, exist_ok=True)
        layout_file = directory / "layout.json"
        layout_file.write_text(json.dumps(layout.model_dump(mode="json")))
        uids = [uid for layer in range(LAYOUT.layers) for uid in LAYOUT.uids(layer)]
        self.routes: dict[str, str] = {}
        self.services: list[Service] = []
        for i in range(3):
            port, share = free_port(), uids[i::3]
            argv = crowdtrain_argv(
                "expert-host", "--port", str(port), "--layout", str(layout_file), "--experts", ",".join(share)
            )
            argv += ["--inject-latency", str(latency), "--inject-drop-rate", str(drop_rate)]
            env = dict(os.environ) | {"OMP_NUM_THREADS": "1"}
            svc = Service(f"host{i}", argv, env, directory / f"host{i}.log").start()
            self.services.append(svc)
            url = f"http://127.0.0.1:{port}"
            self.routes |= dict.fromkeys(share, url)
            wait_for(lambda url=url: _healthy(url), 120, "an expert host did not start", svc)

    def stop(self) -> None:
        for svc in self.services:
            svc.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def throughput(directory: Path, seconds: float, in_flight: int, latency: float = 0.0, drop_rate: float = 0.0) -> float:
    """Examples per second the trainer trains with `in_flight` micro-batches, over `seconds` after a warm-up."""
    data = cluster_arrays(1)
    hosts = Hosts(directory, latency, drop_rate)
    client = ExpertClient(LAYOUT, hosts.routes, max_concurrency=256)
    try:
        torch.manual_seed(0)
        model = MixtureClassifier(MixtureTrunk([8], 10, LAYOUT.model_dump()), client)
        trainer = PipelinedTrainer(model, torch.optim.Adam(model.parameters(), lr=3e-3), in_flight)
        stream = batches(data["x"], data["y"], 0)
        warm_until = time.monotonic() + min(5.0, seconds / 2)
        trainer.train(stream, lambda: time.monotonic() >= warm_until)
        start, examples = time.monotonic(), trainer.examples
        trainer.train(stream, lambda: time.monotonic() - start >= seconds)
        rate = (trainer.examples - examples) / (time.monotonic() - start)
    finally:
        client.close()
        hosts.stop()
    say(f"throughput: latency {latency * 1000:.0f} ms, drops {drop_rate:.0%}, in flight {in_flight}: {rate:.0f}/s")
    return rate


class Dense(nn.Module):
    """The mixture's model with each mixture layer replaced by one feed-forward block of the FLOPs of the
    k experts an input visits (width k x hidden)."""

    def __init__(self) -> None:
        super().__init__()
        width = LAYOUT.k * LAYOUT.hidden
        self.embed = nn.Linear(8, LAYOUT.dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(LAYOUT.dim), nn.Linear(LAYOUT.dim, width), nn.GELU(), nn.Linear(width, LAYOUT.dim)
            )
            for _ in range(LAYOUT.layers)
        )
        self.head = nn.Sequential(nn.LayerNorm(LAYOUT.dim), nn.Linear(LAYOUT.dim, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        out: torch.Tensor = self.head(h)
        return out


def accuracies(directory: Path, examples: int, in_flight: int, drop_rate: float, seed: int) -> tuple[float, float]:
    """(mixture with `drop_rate` of calls lost, dense of equal FLOPs): validation accuracy after `examples`,
    both from the initial weights and the batch order of `seed` (the experts' too: the layout's seed)."""
    data = cluster_arrays(1)
    hosts = Hosts(directory, drop_rate=drop_rate, layout=LAYOUT.model_copy(update={"seed": seed}))
    client = ExpertClient(LAYOUT, hosts.routes, max_concurrency=256)
    try:
        torch.manual_seed(seed)
        model = MixtureClassifier(MixtureTrunk([8], 10, LAYOUT.model_dump()), client)
        trainer = PipelinedTrainer(model, torch.optim.Adam(model.parameters(), lr=3e-3), in_flight)
        trainer.train(batches(data["x"], data["y"], seed), lambda: trainer.examples >= examples)
        moe = accuracy(model, data["x_val"], data["y_val"])
    finally:
        client.close()
        hosts.stop()
    torch.manual_seed(seed)
    dense = Dense()
    optimizer = torch.optim.Adam(dense.parameters(), lr=3e-3)
    stream = batches(data["x"], data["y"], seed)
    for _ in range(-(-examples // BATCH)):
        x, y = next(stream)
        optimizer.zero_grad()
        nn.functional.cross_entropy(dense(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        optimizer.step()
    with torch.no_grad():
        dense_accuracy = float((dense(torch.from_numpy(data["x_val"])).argmax(1).numpy() == data["y_val"]).mean())
    say(
        f"accuracy after {examples} examples, seed {seed}: mixture at {drop_rate:.0%} lost {moe:.3f}, "
        f"dense {dense_accuracy:.3f}"
    )
    return moe, dense_accuracy


def restore(cluster: Cluster, in_flight: int) -> dict:
    """Kill one of three leasing hosts while a trainer trains; how long until its experts are served again."""
    with cluster.admin() as admin:
        mixture = admin.post("/v1/mixtures", json={"name": "restore", "layout": LAYOUT.model_dump(mode="json")})
        mixture_id = mixture.json()["mixture_id"]
    hosts = [cluster.start_expert_host(f"restore{i}", mixture_id, 16) for i in range(3)]
    api = MixtureAPI(cluster.url)
    api.register(cluster.join_token, "trainer")
    client = ExpertClient(LAYOUT, {}, max_concurrency=256)
    follower = RoutingFollower(partial(api.routing, mixture_id), client)
    total = LAYOUT.layers * LAYOUT.experts_per_layer

    def routed() -> dict[str, str]:
        follower.refresh()
        return dict(client.routes)

    wait_for(lambda: len(routed()) == total, 120, "the experts were not all leased", hosts[0][0])
    data = cluster_arrays(1)
    torch.manual_seed(0)
    model = MixtureClassifier(MixtureTrunk([8], 10, LAYOUT.model_dump()), client)
    trainer = PipelinedTrainer(model, torch.optim.Adam(model.parameters(), lr=3e-3), in_flight)
    stop = threading.Event()
    training = threading.Thread(target=trainer.train, args=(batches(data["x"], data["y"], 0), stop.is_set))
    training.start()
    try:
        while trainer.steps < 3 * LAYOUT.checkpoint_every:
            time.sleep(0.2)
        victim, victim_url = hosts[2]
        at_kill = httpx.get(f"{victim_url}/v1/experts", timeout=10).json()["experts"]
        victim.signal(signal.SIGKILL)
        killed = time.monotonic()
        while victim_url in routed().values() or len(client.routes) < total:
            follower.refresh()
            time.sleep(0.05)
        restore_s = time.monotonic() - killed
    finally:
        stop.set()
        training.join()
        client.close()
        api.close()
    with cluster.admin() as admin:
        view = {e["uid"]: e for e in admin.get(f"/v1/mixtures/{mixture_id}").json()["experts"]}
    lost = [at_kill[uid]["steps"] - view[uid]["checkpoint_step"] for uid in at_kill]
    lease = LAYOUT.heartbeat_seconds * LAYOUT.lease_heartbeats
    say(f"restore: {restore_s:.2f} s after the kill; lost at most {max(lost)} steps of {len(lost)} experts")
    return {
        "restore_s": round(restore_s, 2),
        "restore_after_lease_heartbeats": round(max(0.0, restore_s - lease) / LAYOUT.heartbeat_seconds, 2),
        "lost_steps_max": max(lost),
        "checkpoint_every": LAYOUT.checkpoint_every,
    }


def scheduler_cpu(cluster: Cluster, hosts: int, health_url: str) -> dict:
    """The scheduler's CPU per lease renewal of `hosts` one-expert hosts and per routing request."""
    grid = [hosts // 16 + (hosts % 16 > 0), 16]
    # Leases of a minute: the measured calls renew leases (what a host does at each heartbeat), none ends
    # while hundreds of hosts register and take theirs.
    layout = LAYOUT.model_copy(update={"layers": 1, "grid": grid, "k": 4, "heartbeat_seconds": 60.0})
    with cluster.admin() as admin:
        mixture_id = admin.post("/v1/mixtures", json={"name": "load", "layout": layout.model_dump(mode="json")}).json()[
            "mixture_id"
        ]
    server = next(s for s in cluster.services if s.name == "server")
    assert server.proc is not None
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        tokens = []
        for i in range(hosts):
            reply = http.post("/v1/hosts", json={"join_token": cluster.join_token, "name": f"sim{i}"})
            tokens.append({"Authorization": f"Bearer {reply.json()['host_token']}"})
        lease = {"url": health_url, "capacity": 1}
        for headers in tokens:  # each leases its expert (and is probed once)
            http.post(f"/v1/mixtures/{mixture_id}/leases", json=lease, headers=headers)

        def cpu_per_call(call) -> float:
            before = cpu_seconds(server.proc.pid)[0]
            for headers in tokens:
                call(headers)
            return (cpu_seconds(server.proc.pid)[0] - before) / len(tokens) * 1000

        heartbeat = cpu_per_call(lambda h: http.post(f"/v1/mixtures/{mixture_id}/leases", json=lease, headers=h))
        version = http.get(f"/v1/mixtures/{mixture_id}/routing", headers=tokens[0]).json()["version"]
        full = cpu_per_call(lambda h: http.get(f"/v1/mixtures/{mixture_id}/routing", headers=h))
        changes = cpu_per_call(
            lambda h: http.get(f"/v1/mixtures/{mixture_id}/routing", params={"since": version}, headers=h)
        )
    say(f"scheduler CPU at {hosts} hosts: {heartbeat:.2f} ms a heartbeat, {changes:.2f} ms a routing request")
    return {
        "heartbeat_cpu_ms": round(heartbeat, 2),
        "routing_cpu_ms": round(changes, 2),
        "routing_full_cpu_ms": round(full, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs: about 8 minutes on 2 cores")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds measured per throughput figure")
    parser.add_argument("--examples", type=int, default=40_000, help="examples trained for the accuracy figures")
    parser.add_argument(
        "--accuracy-seeds", type=int, default=3, help="accuracy runs (seeds 0..N-1), their mean compared"
    )
    parser.add_argument(
        "--in-flight", type=int, default=ExpertLayout().in_flight, help="micro-batches the trainer keeps going"
    )
    parser.add_argument(
        "--simulated-hosts",
        type=int,
        default=None,
        help="expert hosts of the scheduler's CPU figures (1000; quick 200)",
    )
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.examples = 8.0, 20_000
    if args.simulated_hosts is None:
        args.simulated_hosts = 200 if args.quick else 1000
    torch.set_num_threads(1)
    out: dict = {"in_flight": args.in_flight, "seconds": args.seconds}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cleans = [throughput(work / "clean0", args.seconds, args.in_flight)]
        by_latency: dict[int, float] = {}
        for ms in (50, 100, 200):
            by_latency[ms] = throughput(work / f"latency{ms}", args.seconds, args.in_flight, latency=ms / 1000)
        sequential = throughput(work / "sequential", args.seconds, 1, latency=0.2)
        cleans.append(throughput(work / "clean1", args.seconds, args.in_flight))
        by_drop: dict[int, float] = {}
        for pct in (5, 10, 20):
            by_drop[pct] = throughput(work / f"drop{pct}", args.seconds, args.in_flight, drop_rate=pct / 100)
        cleans.append(throughput(work / "clean2", args.seconds, args.in_flight))
        latency_clean, drop_clean = (cleans[0] + cleans[1]) / 2, (cleans[1] + cleans[2]) / 2
        by_latency[0], by_drop[0] = latency_clean, drop_clean
        pairs = [
            accuracies(work / f"accuracy{seed}", args.examples, args.in_flight, 0.1, seed)
            for seed in range(args.accuracy_seeds)
        ]
        moe, dense = (float(np.mean(side)) for side in zip(*pairs, strict=True))
        cluster = Cluster(var_dir=work / "cluster", database_url=f"sqlite:///{work / 'cluster.db'}").start()
        try:
            out |= restore(cluster, args.in_flight)
            health = Hosts(work / "health")  # any live host: the simulated hosts all give its URL
            try:
                out |= scheduler_cpu(cluster, args.simulated_hosts, next(iter(health.routes.values())))
            finally:
                health.stop()
        finally:
            cluster.stop()
    out |= {
        "samples_per_s_by_latency_ms": {k: round(v, 1) for k, v in by_latency.items()},
        "samples_per_s_by_drop_pct": {k: round(v, 1) for k, v in by_drop.items()},
        "sequential_samples_per_s_200ms": round(sequential, 1),
        "throughput_200ms_over_clean": round(by_latency[200] / latency_clean, 3),
        "speedup_over_sequential_200ms": round(by_latency[200] / sequential, 2),
        "throughput_at_10pct_drop_over_clean": round(by_drop[10] / drop_clean, 3),
        "accuracy_moe_10pct_drop": round(moe, 4),
        "accuracy_dense": round(dense, 4),
        "accuracy_gap_vs_dense": round(100 * (dense - moe), 2),
        "accuracy_gap_by_seed": [round(100 * (d - m), 2) for m, d in pairs],
        "clean_runs": [round(c, 1) for c in cleans],
        "examples": args.examples,
        "simulated_hosts": args.simulated_hosts,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
