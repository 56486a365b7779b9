"""Time of one DeDLOC round for 5M and 25M float32 parameters with 2, 3 and 4 peers, against the
time of sending the same bytes once over a raw loopback TCP socket, and the relayed path's time.

What it measures
    `round_s`: from the moment a peer is told to reduce until it holds the group's average: the
    rendezvous through the scheduler (a `torch.distributed` Store whose set/get go over HTTP to
    Redis) that builds this round's `ProcessGroupGloo`, plus the Gloo all-reduce itself. The figure
    per configuration is the median over repetitions of the slowest member's time (a round ends
    for everyone when its slowest member is done). `rendezvous_s` and `allreduce_s` split it.
    The row with `relayed: 1` is the same for a round of 3 members where one is relayed: the two direct peers
    all-reduce, their group's rank 0 uploads the group's sum, the relayed peer uploads its weighted
    gradient, the scheduler adds the parts and each member downloads the total (HTTP + Redis). Its
    `round_s` is all of that; its `rendezvous_s`/`allreduce_s` split is not measured (0 / round_s).

    The bound, measured in the same run: `tcp_once_s`, the time to send the vector's bytes once
    from one process to another over a loopback TCP socket (sender in a child process, receiver
    here, timed from the first byte requested to the last byte received). A ring all-reduce moves
    about 2(k-1)/k of the vector per member, so it cannot beat this by much on one machine.

How
    A real `Cluster` (SQLite, private redis-server, local storage, one uvicorn scheduler) runs in
    a temporary directory. For each configuration a small dedloc job is submitted and k peer
    processes join it; each reports one example so the step closes with all k as members, runs
    the round on a synthetic vector of the configured size, reports its result and waits for the
    commit; repeated `--repeats` times. Peers on this machine share its cores.

Run
    .venv/bin/python benchmarks/allreduce.py [--repeats 3] [--sizes 5000000,25000000] [--peers 2,3,4]

Progress goes to stderr; the last line on stdout is one JSON object with the figures.
"""

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPEC = {
    "name": "allreduce-bench",
    "mode": "dedloc",
    "seed": 0,
    "model": {"name": "mlp", "options": {"hidden": [8]}},
    "dataset": {"source": "builtin:mnist1d", "subsets": 1},
    "stop": {"target_accuracy": 1.0, "max_steps": 1000},
}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def peer_process(url: str, join_token: str, job_id: int, relayed: bool, n: int, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    from crowdtrain.client.dedloc.allreduce import reduce_round, result_digest
    from crowdtrain.client.dedloc.api import PeerAPI
    from crowdtrain.client.dedloc.store import RoundStore

    torch.set_num_threads(1)
    api = PeerAPI(url)
    api.register(join_token, f"bench-{os.getpid()}")
    api.join(job_id, relayed)
    vec = torch.full((n,), 1.0 + os.getpid() % 7)
    rows = []
    for step in range(repeats):
        while (reply := api.progress(step, 1, None, None)).action != "reduce":
            time.sleep(0.01)
        plan = reply.round
        t0 = time.perf_counter()
        if plan.needs_combining:
            average = reduce_round(api, plan, vec)
            t1 = t0
        else:
            store = RoundStore(api, plan.step, plan.attempt, plan.averaging_timeout)
            pg = dist.ProcessGroupGloo(
                store, plan.rank, len(plan.group_members), timedelta(seconds=plan.averaging_timeout)
            )
            t1 = time.perf_counter()
            average = vec.clone().mul_(1.0 / plan.total)
            pg.allreduce([average]).wait()
            del pg
        t2 = time.perf_counter()
        api.report(plan.step, plan.attempt, True, result_digest(average))
        rows.append({"round_s": t2 - t0, "rendezvous_s": t1 - t0, "allreduce_s": t2 - t1})
        while api.progress(step, 0, plan.attempt, None).action != "apply":
            time.sleep(0.01)
    out.put(rows)


def _sender(port: int, nbytes: int) -> None:
    payload = bytes(nbytes)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.recv(1)
        s.sendall(payload)


def tcp_once(nbytes: int) -> float:
    """Seconds to move `nbytes` once between two processes over loopback TCP."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        child = mp.get_context("spawn").Process(target=_sender, args=(srv.getsockname()[1], nbytes))
        child.start()
        conn, _ = srv.accept()
        buf = bytearray(4 * 1024 * 1024)
        view = memoryview(buf)
        with conn:
            got = 0
            t0 = time.perf_counter()
            conn.sendall(b"g")
            while got < nbytes:
                k = conn.recv_into(view)
                if not k:
                    break
                got += k
            elapsed = time.perf_counter() - t0
        child.join()
    return elapsed


def run_config(cluster, n: int, peers: int, relayed: int, repeats: int) -> dict:
    spec = SPEC | {
        "name": f"bench-{n}-{peers}-{relayed}",
        "dedloc": {
            "target_batch_size": peers,
            "micro_batch_size": 1,
            "matchmaking_timeout": 60,
            "averaging_timeout": 300,
            "max_group_size": 16,
            "report_interval": 0.1,
        },
    }
    job_id = cluster.submit(spec)["job_id"]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=peer_process, args=(cluster.url, cluster.join_token, job_id, i < relayed, n, repeats, out))
        for i in range(peers)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    per_round = [max(r[i]["round_s"] for r in results) for i in range(repeats)]
    rendezvous = [max(r[i]["rendezvous_s"] for r in results) for i in range(repeats)]
    allreduce = [max(r[i]["allreduce_s"] for r in results) for i in range(repeats)]
    return {
        "round_s": statistics.median(per_round),
        "rendezvous_s": statistics.median(rendezvous),
        "allreduce_s": statistics.median(allreduce),
        "rounds": per_round,
    }


def main() -> None:
    from crowdtrain.launch.cluster import Cluster

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="5000000,25000000")
    ap.add_argument("--peers", default="2,3,4")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    peer_counts = [int(x) for x in args.peers.split(",")]
    figures: dict = {"machine_cpus": os.cpu_count(), "repeats": args.repeats, "configs": []}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(
            var_dir=Path(tmp), assimilator_concurrency=1, extra_env={"CROWDTRAIN_UPLOAD_MAX_BYTES": str(1 << 30)}
        ).start()
        try:
            for n in sizes:
                nbytes = 4 * n
                bound = statistics.median(tcp_once(nbytes) for _ in range(args.repeats))
                _log(f"{n} floats ({nbytes / 1e6:.0f} MB): raw loopback TCP once {bound:.3f}s")
                for k in peer_counts:
                    row = run_config(cluster, n, k, 0, args.repeats)
                    _log(
                        f"  {k} peers: round {row['round_s']:.3f}s (rendezvous {row['rendezvous_s']:.3f}s, "
                        f"all-reduce {row['allreduce_s']:.3f}s)"
                    )
                    figures["configs"].append({"parameters": n, "peers": k, "relayed": 0, "tcp_once_s": bound, **row})
                relayed = run_config(cluster, n, 3, 1, args.repeats)
                _log(f"  3 peers, 1 relayed: round {relayed['round_s']:.3f}s")
                figures["configs"].append({"parameters": n, "peers": 3, "relayed": 1, "tcp_once_s": bound, **relayed})
        finally:
            cluster.stop()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
