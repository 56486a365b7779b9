"""Time of one DeDLOC round for 5M and 25M float32 parameters with 2, 3 and 4 peers, against the
time of sending the same bytes once over a raw loopback TCP socket, the first round of a group
against its later rounds (the kept process group), and the relayed path against the direct one.

What it measures
    `round_s`: from the moment a peer is told to reduce until it holds the group's average, as the
    peer does it (`ProcessGroups.for_round`, then `reduce_round`): in a group's first round the
    rendezvous (rank 0 hosts a TCPStore and publishes its address with one request to the
    scheduler; the others fetch it with one request) that builds the group's `ProcessGroupGloo`,
    then the bucketed Gloo all-reduce; in later rounds of the same members the kept process group
    and the all-reduce alone. Per round, the slowest member's time (a round ends for everyone when
    its slowest member is done). `first_round_s` is round 1; `later_round_s` the median of the
    others; `round_s` the median of all (as before kept groups, when every round was a first one).
    `rendezvous_s` and `allreduce_s` split the median round (`first_rendezvous_s`: round 1's); `later_over_tcp` is
    `later_round_s / tcp_once_s`. `later_start_skew_s`: how much later than the first member the last
    one heard of the round, time the first spends waiting for the last. A peer that waits (ready for the
    round, or reduced and waiting for the commit) asks as the real peer does: its report may be held by
    the scheduler until the round moves, up to `--round-wait` seconds; with `--round-wait 0` it is
    answered at once and the peer asks again every 10 ms.
    The rows with `relayed: 1` are rounds of the same number of members where one is relayed: the
    others all-reduce in one group, its rank 0 streams the group's sum to the scheduler while the
    buckets complete, the relayed peer streams its weighted gradient, the scheduler sums the parts
    chunk by chunk, the relayed peer and rank 0 stream the total back as it is summed, and rank 0
    broadcasts it to its group. `relayed_over_direct` is its `later_round_s` over the direct row's.

    The bounds, measured in the same run: `tcp_once_s`, the time to send the vector's bytes once
    from one process to another over a loopback TCP socket (sender in a child process, receiver
    here, timed from the first byte requested to the last byte received). A ring all-reduce moves
    about 2(k-1)/k of the vector per member, so it cannot beat this by much on one machine; with
    k peers sharing few cores it moves k times that through the same cores: 2(k-1) vectors, 6 for
    4 peers, through the cores that moved one in `tcp_once_s`. `gloo_bare_s`: one plain
    `ProcessGroupGloo.allreduce` of the same vector among k fresh processes outside crowdtrain (no
    scheduler, no buckets, no scaling; median of the rounds after the first), so `later_over_gloo`
    is what crowdtrain adds to Gloo's own cost on this machine.
    Rows with `compression` other than "none" run the job with that `dedloc.compression` (16-bit
    floats on the all-reduce's wire) next to a bare Gloo all-reduce in that format.

How
    A real `Cluster` (SQLite, private redis-server, local storage, one uvicorn scheduler) runs in
    a temporary directory. For each configuration a small dedloc job is submitted and k peer
    processes join it; each reports one example so the step closes with all k as members, runs
    the round on a synthetic vector of the configured size, reports its result and waits for the
    commit; repeated `--repeats` times (the same members each time). Peers on this machine share
    its cores, and so does the scheduler: figures on a shared machine are noisy.

Run
    .venv/bin/python benchmarks/allreduce.py [--repeats 4] [--sizes 5000000,25000000] [--peers 2,3,4]
        [--compressions none,float16,bfloat16] [--round-wait SECONDS]

Progress goes to stderr; the last line on stdout is one JSON object with the figures, and its
`headline` the largest size with the most peers: `later_over_tcp` (goal <= 2), `later_over_gloo`,
the compressed rows' figures and `relayed_over_direct` (goal <= 4).
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


def peer_process(url: str, join_token: str, job_id: int, relayed: bool, n: int, repeats: int, wait: float, out) -> None:
    import torch

    from crowdtrain.client.dedloc.allreduce import ProcessGroups, reduce_round, result_digest
    from crowdtrain.client.dedloc.api import PeerAPI

    torch.set_num_threads(1)
    api = PeerAPI(url)
    api.register(join_token, f"bench-{os.getpid()}")
    compression = api.join(job_id, relayed).recipe["dedloc"]["compression"]
    groups = ProcessGroups(api)
    vec = torch.full((n,), 1.0 + os.getpid() % 7)
    rows = []
    for step in range(repeats):
        while (reply := api.progress(step, 1, None, None, wait=wait)).action != "reduce":
            time.sleep(0.01)
        plan = reply.round
        t0, started = time.perf_counter(), time.time()
        if not plan.relayed and len(plan.group_members) > 1:
            groups.for_round(plan)
        t1 = time.perf_counter()
        average = reduce_round(api, plan, vec, groups, compression)
        t2 = time.perf_counter()
        api.report(plan.step, plan.attempt, True, result_digest(average))
        rows.append(
            {
                "round_s": t2 - t0,
                "rendezvous_s": t1 - t0,
                "allreduce_s": t2 - t1,
                "kept": None if plan.relayed else not plan.new_session,
                "started": started,
            }
        )
        while api.progress(step, 0, plan.attempt, None, wait=wait).action != "apply":
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


def _gloo_member(rank: int, k: int, port: int, n: int, dtype: str, repeats: int, out) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    pg = dist.ProcessGroupGloo(store, rank, k, timeout)
    vec = torch.full((n,), 1.0 + rank, dtype=getattr(torch, dtype))
    times = []
    for _ in range(repeats):
        pg.barrier().wait()
        t0 = time.perf_counter()
        pg.allreduce([vec]).wait()
        times.append(time.perf_counter() - t0)
    out.put(times)


def gloo_bare(n: int, k: int, repeats: int, dtype: str = "float32") -> float:
    """Seconds of one plain `ProcessGroupGloo.allreduce` of `n` values among `k` processes, outside
    crowdtrain (one tensor, no buckets, no scaling): the median of the rounds after the first, each
    round's slowest member."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=_gloo_member, args=(r, k, host.port, n, dtype, repeats, out)) for r in range(k)]
    for p in procs:
        p.start()
    results = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    per_round = [max(r[i] for r in results) for i in range(repeats)]
    return statistics.median(per_round[1:] or per_round)


def run_config(cluster, n: int, peers: int, relayed: int, repeats: int, wait: float, compression: str = "none") -> dict:
    spec = SPEC | {
        "name": f"bench-{n}-{peers}-{relayed}-{compression}",
        "dedloc": {
            "target_batch_size": peers,
            "micro_batch_size": 1,
            "matchmaking_timeout": 60,
            "averaging_timeout": 300,
            "max_group_size": 16,
            "report_interval": 0.1,
            "compression": compression,
        },
    }
    job_id = cluster.submit(spec)["job_id"]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=peer_process, args=(cluster.url, cluster.join_token, job_id, i < relayed, n, repeats, wait, out)
        )
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
    # How much later than the first member the last one heard of the round (the first waits for it).
    skew = [max(r[i]["started"] for r in results) - min(r[i]["started"] for r in results) for i in range(repeats)]
    later = per_round[1:] or per_round
    return {
        "round_s": statistics.median(per_round),
        "rendezvous_s": statistics.median(rendezvous),
        "allreduce_s": statistics.median(allreduce),
        "first_round_s": per_round[0],
        "first_rendezvous_s": rendezvous[0],
        "later_round_s": statistics.median(later),
        "later_rendezvous_s": statistics.median(rendezvous[1:] or rendezvous),
        "later_start_skew_s": statistics.median(skew[1:] or skew),
        # rounds whose group met in the process group it kept from the round before (no rendezvous)
        "kept_group_rounds": sum(all(r[i]["kept"] is not False for r in results) for i in range(repeats)),
        "rounds": per_round,
    }


def main() -> None:
    from crowdtrain.client.dedloc.peer import ROUND_WAIT
    from crowdtrain.launch.cluster import Cluster

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--sizes", default="5000000,25000000")
    ap.add_argument("--peers", default="2,3,4")
    ap.add_argument("--compressions", default="none,float16,bfloat16", help="dedloc.compression values")
    ap.add_argument(
        "--round-wait",
        type=float,
        default=ROUND_WAIT,
        help="seconds a waiting peer's report may be held until the round moves, as the peer asks (0: answered "
        "at once, the peer polling every 10 ms)",
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    peer_counts = [int(x) for x in args.peers.split(",")]
    figures: dict = {
        "machine_cpus": os.cpu_count(),
        "repeats": args.repeats,
        "round_wait_s": args.round_wait,
        "configs": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(
            var_dir=Path(tmp), assimilator_concurrency=1, extra_env={"CROWDTRAIN_UPLOAD_MAX_BYTES": str(1 << 30)}
        ).start()
        try:
            for n in sizes:
                compressions = args.compressions.split(",")
                figures["configs"] += measure_size(cluster, n, peer_counts, args.repeats, args.round_wait, compressions)
        finally:
            cluster.stop()
    direct = [c for c in figures["configs"] if not c["relayed"] and c["compression"] == "none"]
    top = max(direct, key=lambda c: (c["parameters"], c["peers"]))
    same = (top["parameters"], top["peers"])
    relayed = next(c for c in figures["configs"] if c["relayed"] and (c["parameters"], c["peers"]) == same)
    figures["headline"] = {
        "parameters": top["parameters"],
        "peers": top["peers"],
        "tcp_once_s": top["tcp_once_s"],
        "first_round_s": top["first_round_s"],
        "first_rendezvous_s": top["first_rendezvous_s"],
        "later_round_s": top["later_round_s"],
        "later_over_tcp": top["later_over_tcp"],
        "later_start_skew_s": top["later_start_skew_s"],
        "gloo_bare_s": top["gloo_bare_s"],
        "later_over_gloo": top["later_over_gloo"],
        **{
            f"{c['compression']}_{name}": c[name]
            for c in figures["configs"]
            if c["compression"] != "none" and (c["parameters"], c["peers"]) == same
            for name in ("later_round_s", "later_over_tcp", "gloo_bare_s")
        },
        "relayed_later_round_s": relayed["later_round_s"],
        "relayed_over_direct": relayed["relayed_over_direct"],
    }
    print(json.dumps(figures))


def direct_row(cluster, n: int, k: int, repeats: int, wait: float, bound: float, compression: str) -> dict:
    """The rounds of k direct peers with `compression` on the wire, beside a bare Gloo all-reduce of
    the same vector in the same format and the raw send `bound`."""
    bare = gloo_bare(n, k, repeats, "float32" if compression == "none" else compression)
    row = run_config(cluster, n, k, 0, repeats, wait, compression)
    later = row["later_round_s"]
    return row | {"gloo_bare_s": bare, "later_over_tcp": later / bound, "later_over_gloo": later / bare}


def measure_size(
    cluster, n: int, peer_counts: list[int], repeats: int, wait: float, compressions: list[str]
) -> list[dict]:
    """The rows of one vector size: each peer count direct, the largest in each other wire format,
    and the largest with one peer relayed; each with the bounds measured just before it."""
    nbytes = 4 * n
    bound = statistics.median(tcp_once(nbytes) for _ in range(repeats))
    _log(f"{n} floats ({nbytes / 1e6:.0f} MB): raw loopback TCP once {bound:.3f}s")
    rows = []
    for k in peer_counts:
        row = direct_row(cluster, n, k, repeats, wait, bound, "none")
        bare = row["gloo_bare_s"]
        _log(
            f"  {k} peers: first round {row['first_round_s']:.3f}s (rendezvous {row['first_rendezvous_s']:.3f}s), "
            f"later rounds {row['later_round_s']:.3f}s = {row['later_over_tcp']:.1f}x the raw send, "
            f"{row['later_over_gloo']:.2f}x a bare Gloo all-reduce ({bare:.3f}s)"
        )
        rows.append({"parameters": n, "peers": k, "relayed": 0, "compression": "none", "tcp_once_s": bound, **row})
    k = max(peer_counts)
    for compression in [c for c in compressions if c != "none"]:
        row = direct_row(cluster, n, k, repeats, wait, bound, compression)
        bare = row["gloo_bare_s"]
        _log(
            f"  {k} peers, {compression} on the wire: later rounds {row['later_round_s']:.3f}s = "
            f"{row['later_over_tcp']:.1f}x the raw send, {row['later_over_gloo']:.2f}x a bare {compression} Gloo "
            f"all-reduce ({bare:.3f}s)"
        )
        rows.append({"parameters": n, "peers": k, "relayed": 0, "compression": compression, "tcp_once_s": bound, **row})
    relayed = run_config(cluster, n, k, 1, repeats, wait)
    direct = next(r for r in rows if r["peers"] == k and r["compression"] == "none")
    relayed["relayed_over_direct"] = relayed["later_round_s"] / direct["later_round_s"]
    _log(
        f"  {k} peers, 1 relayed: first round {relayed['first_round_s']:.3f}s, later rounds "
        f"{relayed['later_round_s']:.3f}s = {relayed['relayed_over_direct']:.1f}x direct"
    )
    rows.append({"parameters": n, "peers": k, "relayed": 1, "compression": "none", "tcp_once_s": bound, **relayed})
    return rows


if __name__ == "__main__":
    main()
