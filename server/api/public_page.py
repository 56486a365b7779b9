"""The public project page rendered by the scheduler with its figures (`/project`): the first paint
shows them, and the page's script (static/dashboard.js, projectPage) only refreshes them. The
formatting here writes what the script's writes, so that the refresh changes nothing but new figures.

Every value is escaped (html.escape); the template's markers are comments (`<!--fig-jobs-->`,
`<!--rows:volunteers-->`) that the page's own text cannot contain.
"""

import html
from collections.abc import Iterable, Sequence

from crowdtrain.core.schemas_dashboard import ProjectPublic

DASH = "–"  # what the script shows for a figure it does not have
Cell = str | tuple[str, str]  # text; (markup already escaped, "html"); or (text, a CSS class)


def pct(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.1f}%"


def num(x: int | None) -> str:
    return DASH if x is None else f"{x:,}"


def credit(x: float | None) -> str:
    """Cobblestones: three significant digits below 1,000 (the script's toPrecision(3)), whole above."""
    if x is None:
        return DASH
    if x == 0:
        return "0"
    if x >= 1000:
        return f"{round(x):,}"
    return f"{x:#.3g}".rstrip(".")


def status_badge(status: str) -> tuple[str, str]:
    return f'<span class="status {html.escape(status)}">{html.escape(status)}</span>', "html"


def rows(cells: Iterable[Sequence[Cell]]) -> str:
    """Table rows of `cells`, as the script's fillTable writes them."""
    out = []
    for row in cells:
        tds = []
        for c in row:
            if isinstance(c, str):
                tds.append(f"<td>{html.escape(c)}</td>")
            elif c[1] == "html":
                tds.append(f"<td>{c[0]}</td>")
            else:
                tds.append(f'<td class="{html.escape(c[1])}">{html.escape(c[0])}</td>')
        out.append("<tr>" + "".join(tds) + "</tr>")
    return "".join(out)


def render(template: str, p: ProjectPublic) -> str:
    """`template` (static/project.html) with `p`'s figures and tables filled in."""
    figures = {
        "fig-jobs": num(len(p.jobs)),
        "fig-results": num(p.results_merged),
        "fig-examples": num(p.examples),
        "fig-active": num(p.hosts_active),
        "fig-credit": credit(p.credit),
    }
    tables = {
        "project-jobs": rows(
            [
                j.name,
                status_badge(j.status.value),
                f"{j.current_epoch}" + (f" / {j.max_epochs}" if j.max_epochs else ""),
                (pct(j.best_accuracy), "num"),
                (num(j.results_merged), "num"),
                (num(j.examples), "num"),
            ]
            for j in p.jobs
        ),
        "volunteers": rows(
            [
                str(rank),
                v.name,
                (num(v.hosts), "num"),
                (num(v.results_merged), "num"),
                (num(v.results_valid), "num"),
                (num(v.examples), "num"),
                (credit(v.credit), "num"),
            ]
            for rank, v in enumerate(p.volunteers, start=1)
        ),
        "host-credit": rows(
            [f"host {h.host_id}", h.account or "anonymous", (num(h.results), "num"), (credit(h.credit), "num")]
            for h in p.hosts
        ),
    }
    for marker, text in figures.items():
        template = template.replace(f"<!--{marker}-->", html.escape(text))
    for marker, markup in tables.items():
        template = template.replace(f"<!--rows:{marker}-->", markup)
    return template
