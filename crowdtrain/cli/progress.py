"""Showing a job's progress: a rich table, and a live view that follows a job to its end."""

import time

import httpx
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from crowdtrain.core.schemas import JobStatusOut


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
    parts: list[RenderableType] = [head, table]
    if st.status_message:
        parts.append(Text(st.status_message))
    return Group(*parts)


def watch(
    http: httpx.Client, job_id: int, interval: float = 1.0, timeout: float | None = None, alive=lambda: True
) -> JobStatusOut:
    """Redraw the job's table until it finishes (or `timeout` passes, or `alive()` turns false)."""
    start = time.monotonic()
    with Live(refresh_per_second=4, transient=False) as live:
        while True:
            resp = http.get(f"/v1/jobs/{job_id}")
            resp.raise_for_status()
            st = JobStatusOut.model_validate(resp.json())
            live.update(status_table(st))
            if st.status in ("succeeded", "failed", "cancelled"):
                return st
            if timeout is not None and time.monotonic() - start > timeout:
                return st
            if not alive():
                return st
            time.sleep(interval)
