"""Showing jobs: the list of jobs, a job's progress as a rich table, a live view that follows a job to
its end, and what keeps a job from going on."""

import time
from datetime import UTC, datetime

import httpx
from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from crowdtrain.core.schemas_jobs import (
    BEST_LABEL,
    InFlightFigures,
    JobProblems,
    JobStatusOut,
    JobSummary,
    best_closed_epoch,
)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def status_table(st: JobStatusOut, last_epochs: int | None = 8) -> Group:
    head = Text.assemble(
        (f"job {st.job_id} ", "bold"),
        f"{st.name}  ",
        (st.status, "green" if st.status == "succeeded" else "yellow"),
        f"  epoch {st.current_epoch}/{st.max_epochs}  merges {st.merges}  W_s v{st.param_version}"
        f"  active hosts {st.active_hosts}  target {st.target_accuracy}"
        f"  elapsed {st.elapsed_seconds or 0:.0f}s",
    )
    best = best_closed_epoch(st.epochs)
    best_line = Text(
        f"{BEST_LABEL} {_pct(best.mean_accuracy)} (epoch {best.epoch})"
        if best
        else f"{BEST_LABEL} -  (none closed yet)"
    )
    table = Table(show_edge=False)
    for col in ("epoch", "workunits", "done", "failed", "merges", "mean acc", "min", "max"):
        table.add_column(col, justify="right")
    epochs = st.epochs if last_epochs is None else st.epochs[-last_epochs:]
    for e in epochs:
        table.add_row(
            str(e.epoch),
            str(e.workunits),
            str(e.done),
            str(e.failed),
            str(e.merges),
            _pct(e.mean_accuracy),
            _pct(e.min_accuracy),
            _pct(e.max_accuracy),
        )
    parts: list[RenderableType] = [head, best_line]
    if st.in_flight is not None:
        parts.append(in_flight_line(st.in_flight))
    parts.append(table)
    if st.status_message:
        parts.append(Text(st.status_message))
    return Group(*parts)


def in_flight_line(f: InFlightFigures) -> Text:
    """Backpressure: the job's unmerged assignments against its budget, and where the budget comes from."""
    if not f.derived:
        source = "scheduling.max_in_flight"
    elif f.merge_rate is None or f.turnaround_seconds is None:
        source = "no budget until two merges measure the merge pace"
    else:
        source = f"{f.merge_rate:.2f} merges/s x {f.turnaround_seconds:.1f}s turnaround + hosts"
    return Text.assemble(
        f"in flight {f.count}/{'-' if f.budget is None else f.budget} ({source})",
        ("  held back: waiting for merges" if f.held_back else "", "yellow"),
    )


def now_utc() -> datetime:
    return datetime.now(UTC)


def age(since: datetime | None, now: datetime) -> str:
    """How long ago `since` was, in its largest whole unit: 45s, 12m, 3h, 2d."""
    if since is None:
        return "-"
    seconds = max((now - since).total_seconds(), 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.0f}s"


def jobs_table(jobs: list[JobSummary], now: datetime) -> Table:
    table = Table(show_edge=False)
    columns: list[tuple[str, JustifyMethod]] = [
        ("id", "right"),
        ("name", "left"),
        ("mode", "left"),
        ("status", "left"),
        ("epoch", "right"),
        ("accuracy", "right"),
        ("age", "right"),
    ]
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for j in jobs:
        epoch = f"{j.current_epoch}/{j.max_epochs}" if j.max_epochs is not None else str(j.current_epoch)
        table.add_row(str(j.job_id), j.name, j.mode, j.status, epoch, _pct(j.accuracy), age(j.created_at, now))
    return table


def problems_view(p: JobProblems) -> Group:
    """Why the job is stuck or failed: its status message, what the figures suggest, the problem
    assignments by reason and the latest of them, and the hosts that can run it."""
    parts: list[RenderableType] = [
        Text.assemble(
            ("hosts ", "bold"),
            f"{p.hosts_able} of {p.hosts_registered} registered can run this job, "
            f"{p.hosts_able_active} of them seen in the last minute",
        )
    ]
    for finding in p.findings:
        parts.append(Text(f"! {finding}", style="yellow"))
    if p.late:
        parts.append(
            Text(f"{p.late} results came after the job had ended, too late to merge (not counted as problems)")
        )
    if not p.reasons:
        parts.append(Text("no assignment ended in a client error, a refusal or a timeout"))
        return Group(*parts)
    reasons = Table(title="assignments that ended without a merge, by reason", show_edge=False, title_justify="left")
    reasons.add_column("count", justify="right")
    reasons.add_column("status")
    reasons.add_column("reason", overflow="fold")
    for r in p.reasons:
        reasons.add_row(str(r.count), r.status, r.reason)
    recent = Table(title=f"the latest {len(p.recent)}", show_edge=False, title_justify="left")
    for col in ("assignment", "host", "epoch", "status", "ended", "message"):
        recent.add_column(col, overflow="fold")
    for a in p.recent:
        ended = a.finished_at.strftime("%Y-%m-%d %H:%M:%S") if a.finished_at else "-"
        recent.add_row(str(a.assignment_id), f"{a.host_id} {a.host_name}", str(a.epoch), a.status, ended, a.message)
    parts += [reasons, recent]
    return Group(*parts)


def watch(
    http: httpx.Client, job_id: int, interval: float = 1.0, timeout: float | None = None, alive=lambda: True
) -> JobStatusOut:
    """Redraw the job's table until it finishes (or `timeout` passes, or `alive()` turns false); the last
    table stays, its last line ended."""
    start = time.monotonic()
    console = Console()
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        while True:
            resp = http.get(f"/v1/jobs/{job_id}")
            resp.raise_for_status()
            st = JobStatusOut.model_validate(resp.json())
            live.update(status_table(st))
            if st.status in ("succeeded", "failed", "cancelled"):
                break
            if timeout is not None and time.monotonic() - start > timeout:
                break
            if not alive():
                break
            time.sleep(interval)
    # Live ends its last frame with a newline only on a terminal; a pipe or a log file gets it here.
    if not console.is_terminal:
        console.line()
    return st
