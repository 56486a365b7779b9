"""`crowdtrain mixture`: expert-parallel training's mixtures through the scheduler's admin API: create
one from a layout file, and see where each expert is served and how fresh its checkpoint is."""

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from crowdtrain.cli.adminapi import TokenOpt, admin_client, checked, print_rows
from crowdtrain.cli.options import DEFAULT_SERVER, HELP_LAYOUT, ArgumentsCommand, ServerOpt
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.specfile import SpecFileError, load_yaml

app = typer.Typer(
    name="mixture",
    help="Expert-parallel training's mixtures: create one, see its experts (needs the admin token).",
    no_args_is_help=True,
    add_completion=False,
    **HELP_LAYOUT,
)


def read_layout(path: Path | None, option: str = "LAYOUT") -> ExpertLayout:
    """The layout in `path` (YAML or JSON), or the default one; a clear error for a bad file."""
    if path is None:
        return ExpertLayout()
    try:
        return ExpertLayout.model_validate(load_yaml(path) or {})
    except SpecFileError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the layout"
        raise typer.BadParameter(f"{path}: {where}: {first['msg']}", param_hint=option) from None


@app.command(cls=ArgumentsCommand)
def create(
    layout: Annotated[
        Path,
        typer.Argument(
            metavar="LAYOUT", help="The layout (YAML or JSON): layers, grid, dim, hidden, k, ...", show_default=False
        ),
    ],
    name: Annotated[str, typer.Option(help="The mixture's name, shown to the operator")] = "mixture",
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
) -> None:
    """Create a mixture: every expert of the layout, leased to expert hosts as they ask. Prints its id."""
    body = {"name": name, "layout": read_layout(layout).model_dump(mode="json")}
    with admin_client(server, admin_token) as http:
        created = checked(http.post("/v1/mixtures", json=body))
    typer.echo(created["mixture_id"])


@app.command(cls=ArgumentsCommand)
def status(
    mixture_id: Annotated[int, typer.Argument(metavar="MIXTURE_ID", help="The mixture's id", show_default=False)],
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
) -> None:
    """Each expert's host, lease and last checkpoint."""
    with admin_client(server, admin_token) as http:
        print_mixture(checked(http.get(f"/v1/mixtures/{mixture_id}")))


def print_mixture(mixture: dict) -> None:
    """A mixture as `GET /v1/mixtures/{id}` answers it: a line of figures, then each expert's host,
    lease left and last checkpoint, and what trainers reported of their calls (answers per second, the
    share of calls failed or dropped late, answers refused); also `crowdtrain job status` of a moe job."""
    now = datetime.now(UTC)
    rows = []
    for e in mixture["experts"]:
        ends = e["lease_expires_at"]
        left = (datetime.fromisoformat(ends) - now).total_seconds() if ends else None
        at = e["checkpoint_at"]
        rows.append(
            e
            | {
                "lease_s": None if left is None or e["url"] is None else round(max(0.0, left), 1),
                "checkpoint_age_s": None if at is None else round((now - datetime.fromisoformat(at)).total_seconds()),
                "answers_per_s": None if e["answers_per_s"] is None else round(e["answers_per_s"], 1),
                "unanswered": _share(e["failed"] + e["late"], e["answered"] + e["failed"] + e["late"]),
            }
        )
    layout = mixture["layout"]
    typer.echo(
        f"mixture {mixture['mixture_id']} {mixture['name']!r} ({mixture['status']}): {layout['layers']} layers of "
        f"{'x'.join(map(str, layout['grid']))} experts, {mixture['served']} of {len(rows)} served, "
        f"routing version {mixture['route_version']}"
    )
    columns = ["uid", "host_id", "url", "lease_s", "leases", "checkpoint_step", "checkpoint_age_s"]
    columns += ["answers_per_s", "unanswered", "refused"]
    if layout.get("replicas", 1) > 1:  # a row per replica, each named uid#replica
        rows = [
            r | {"uid": f"{r['uid']}#{r['replica']}", "disagreed": f"{r['disagreed']}/{r['compared']}"} for r in rows
        ]
        columns += ["disagreed"]
    headers = {
        "host_id": "host",
        "lease_s": "lease left s",
        "checkpoint_step": "ckpt step",
        "checkpoint_age_s": "ckpt age s",
        "answers_per_s": "answers/s",
        "unanswered": "failed+late",
    }
    print_rows(rows, columns, headers)


def _share(part: int, whole: int) -> str | None:
    """`part` of `whole` calls as a percentage; None with no calls."""
    return None if whole == 0 else f"{100 * part / whole:.1f}%"
