"""`crowdtrain peer`: a peer of a synchronous DeDLOC job (it trains with PyTorch)."""

from pathlib import Path
from typing import Annotated

import torch
import typer

from crowdtrain.cli.options import (
    HELP_LAYOUT,
    JoinTokenFileOpt,
    JoinTokenOpt,
    ProjectKeyOpt,
    ServerOpt,
    configure_logging,
    resolve_join_token,
    resolve_project_key,
)
from crowdtrain.client.dedloc.api import PeerAPI
from crowdtrain.client.dedloc.peer import DedlocPeer, PeerOptions, attach
from crowdtrain.client.devices import DEVICE_CHOICES, DeviceUnavailable, detect_accelerators, resolve_device
from crowdtrain.client.identity import Identities
from crowdtrain.client.trust import ProjectTrust

app = typer.Typer(add_completion=False, **HELP_LAYOUT)


def _step_attempt(text: str) -> tuple[int, int]:
    """`STEP:ATTEMPT` -> (step, attempt)."""
    step, _, attempt = text.partition(":")
    try:
        return int(step), int(attempt)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not STEP:ATTEMPT (two integers)", param_hint="--kill-at") from None


@app.command()
def peer(
    server: ServerOpt,
    job: Annotated[int, typer.Option(help="The dedloc job to train")],
    join_token: JoinTokenOpt = None,
    join_token_file: JoinTokenFileOpt = None,
    name: Annotated[str, typer.Option(help="Host name shown to the operator")] = "dedloc-peer",
    relayed: Annotated[
        bool, typer.Option(help="This peer cannot accept connections (NAT): the server reduces for it")
    ] = False,
    data_rank: Annotated[int, typer.Option(min=0, help="Train on examples i with i % data_world == data_rank")] = 0,
    data_world: Annotated[int, typer.Option(min=1, help="Peers sharing the training data by --data-rank")] = 1,
    examples_per_step: Annotated[
        int | None,
        typer.Option(
            min=1, help="Contribute at most this many examples per step (default: no limit)", show_default=False
        ),
    ] = None,
    trace: Annotated[
        Path | None, typer.Option(help="Append one JSON line per applied step to this file", show_default=False)
    ] = None,
    threads: Annotated[
        int | None, typer.Option(min=1, help="CPU threads for training (default: the framework's)")
    ] = None,
    device: Annotated[str, typer.Option(help=f"The device that computes the gradients: {DEVICE_CHOICES}")] = "auto",
    kill_at: Annotated[
        str | None,
        typer.Option(help="Testing: SIGKILL itself mid all-reduce of STEP:ATTEMPT", show_default=False),
    ] = None,
    poison_state: Annotated[
        bool,
        typer.Option(
            help="Testing: play a hostile peer that reports its real parameter digest but uploads its states x0",
            hidden=True,
        ),
    ] = False,
    project_key: ProjectKeyOpt = None,
    cache: Annotated[
        Path | None,
        typer.Option(
            help="Folder keeping this peer's registration, the project key it trusts and the jobs it refused, "
            "across runs (default: none kept; each run registers anew)",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run a peer of a synchronous DeDLOC job until the job finishes.

    A job whose recipe is unsigned (when the peer trusts a project key) or signed by another key is
    refused: reported to the scheduler, never joined again, exit code 3."""
    join_token = resolve_join_token(join_token, join_token_file)
    pinned = resolve_project_key(project_key) if project_key else None
    configure_logging()
    if data_rank >= data_world:
        raise typer.BadParameter(f"must be below --data-world ({data_world})", param_hint="--data-rank")
    at = _step_attempt(kill_at) if kill_at else None
    try:
        resolved = resolve_device(device, detect_accelerators())
    except DeviceUnavailable as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from None
    if threads:
        torch.set_num_threads(threads)
    api = PeerAPI(server)
    identities = Identities(cache.expanduser() / "identity.json") if cache is not None else None
    trust = ProjectTrust(identities, server, pinned)
    attach(api, trust, join_token, name)
    options = PeerOptions(
        job_id=job,
        relayed=relayed,
        data_rank=data_rank,
        data_world=data_world,
        examples_per_step=examples_per_step,
        trace=trace,
        kill_at=at,
        poison_state=poison_state,
        device=resolved,
    )
    code = DedlocPeer(api, options, trust).run()
    raise typer.Exit(code)
