"""CPU time of processes read from /proc (Linux): a process tree's, and PostgreSQL's, counting the
processes that exited in between through their parent's reaped-children time. What
benchmarks/dispatch_throughput.py divides by the requests answered in a window, and
benchmarks/capacity.py by the workunits, heartbeats and polls served."""

import os

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int, int, str]:
    """(parent pid, utime + stime, and the same of its exited children that it waited for, in clock
    ticks; command name) of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]), name


def _processes() -> dict[int, tuple[int, int, int, str]]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out[int(entry)] = _stat(int(entry))
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
    return out


def cpu_seconds(root: int) -> tuple[float, float]:
    """CPU seconds so far of the process tree under `root` (the scheduler) and of PostgreSQL's
    processes, counting processes that have exited (a backend, a worker) through their parent's
    waited-for children's time."""
    figures = cpu_by_tree({"tree": root})
    return figures["tree"], figures["postgres"]


def cpu_by_tree(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process tree (its root's pid), and of PostgreSQL's processes
    under "postgres", counting exited processes as cpu_seconds does."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for name, root in roots.items():
        tree, stack = 0, [root]
        while stack:
            pid = stack.pop()
            if pid in procs:
                tree += procs[pid][1] + (procs[pid][2] if pid == root else 0)
            stack += children.get(pid, [])
        out[name] = tree / CLOCK_TICKS
    postgres = 0
    for ppid, own, reaped, name in procs.values():
        if name.startswith("postgres"):
            is_postmaster = not procs.get(ppid, (0, 0, 0, ""))[3].startswith("postgres")
            postgres += own + (reaped if is_postmaster else 0)
    out["postgres"] = postgres / CLOCK_TICKS
    return out
