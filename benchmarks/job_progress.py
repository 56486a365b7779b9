"""Following a benchmark's job on its cluster until it ends, with its progress on stderr; the
adversarial and learning-efficiency benchmarks run their jobs through it."""

import time

from crowdtrain.launch.cluster import Cluster
from efficiency_report import say

TERMINAL = ("succeeded", "failed", "cancelled")


def wait_for_job(
    cluster: Cluster, job_id: int, clients: list, timeout: float, label: str, *, every_client: bool = True
) -> str:
    """Poll the job until it ends (its status) or `timeout` passes ('timeout'); progress at once and
    every 15 s. RuntimeError, with the clients' last lines, once a process of the cluster has exited,
    or a client (`every_client`), or every client (not `every_client`: the others may finish the job)."""
    deadline, shown = time.monotonic() + timeout, 0.0
    with cluster.admin() as http:
        while True:
            st = http.get(f"/v1/jobs/{job_id}").json()
            if st["status"] in TERMINAL:
                return st["status"]
            if time.monotonic() > deadline:
                return "timeout"
            clients_alive = all(c.alive for c in clients) if every_client else any(c.alive for c in clients)
            if not all(s.alive for s in cluster.services) or not clients_alive:
                dead = [s.name for s in cluster.services + clients if not s.alive]
                raise RuntimeError(f"processes exited: {dead}\n" + "\n".join(s.tail(10) for s in clients))
            if time.monotonic() - shown > 15:
                shown = time.monotonic()
                best = st["best_epoch_accuracy"]
                say(
                    f"  {label}: epoch {st['current_epoch']}, {st['merges']} merges, best epoch accuracy "
                    + ("-" if best is None else f"{best:.4f}")
                )
            time.sleep(1.0)
