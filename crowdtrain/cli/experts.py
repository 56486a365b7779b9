"""`crowdtrain expert-host`: serve experts of a mixture-of-experts model (crowdtrain.client.experts.host),
leased from the scheduler (crowdtrain.client.experts.leasing) or named on the command line."""

import threading
from pathlib import Path
from typing import Annotated

import typer
import uvicorn

from crowdtrain.cli.mixtures import read_layout
from crowdtrain.cli.options import (
    HELP_LAYOUT,
    JoinTokenFileOpt,
    JoinTokenOpt,
    OptionalServerOpt,
    configure_logging,
    resolve_join_token,
)
from crowdtrain.client.experts.host import ExpertHost, InjectedNetwork
from crowdtrain.client.experts.leasing import LeaseKeeper, MixtureAPI, layout_of

app = typer.Typer(add_completion=False, **HELP_LAYOUT)


def _fixed_experts(experts: str, layout: Path | None, batch_window: float, network: InjectedNetwork) -> ExpertHost:
    shape = read_layout(layout, "--layout")
    uids = (
        [uid for layer in range(shape.layers) for uid in shape.uids(layer)]
        if experts == "all"
        else [u.strip() for u in experts.split(",") if u.strip()]
    )
    try:
        return ExpertHost(shape, uids, batch_window, network)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--experts") from None


@app.command()
def expert_host(
    server: OptionalServerOpt = None,
    mixture: Annotated[
        int | None, typer.Option(min=1, help="With --server: the mixture whose experts to lease", show_default=False)
    ] = None,
    capacity: Annotated[int, typer.Option(min=1, max=4096, help="With --server: experts to serve at most")] = 8,
    advertise: Annotated[
        str | None,
        typer.Option(
            help="With --server: the URL the scheduler and trainers reach this host at (default http://HOST:PORT)",
            show_default=False,
        ),
    ] = None,
    name: Annotated[str, typer.Option(help="With --server: the host name shown to the operator")] = "expert-host",
    join_token: JoinTokenOpt = None,
    join_token_file: JoinTokenFileOpt = None,
    experts: Annotated[
        str, typer.Option(help="Without --server: the experts to serve, ids (layer.coordinate...) or 'all'")
    ] = "all",
    layout: Annotated[
        Path | None, typer.Option(help="Without --server: the expert layout (YAML or JSON); default: the built-in")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on")] = 8800,
    batch_window: Annotated[
        float, typer.Option(min=0, max=1, help="Seconds an expert waits for more calls to batch with the first")
    ] = 0.005,
    inject_latency: Annotated[
        float, typer.Option(min=0, max=60, help="Benchmarks: delay each answer by an exponential wait of this mean")
    ] = 0.0,
    inject_drop_rate: Annotated[
        float, typer.Option(min=0, max=1, help="Benchmarks: lose this share of calls (answered late, with an error)")
    ] = 0.0,
    inject_drop_hold: Annotated[
        float, typer.Option(min=0, max=600, help="Benchmarks: seconds a lost call holds its caller")
    ] = 2.0,
) -> None:
    """Serve experts of a mixture-of-experts model (expert-parallel training) over HTTP.

    With --server, the experts are leased from the scheduler (it must reach this host at --advertise),
    restored from their checkpoints and checkpointed back; without, they are those of --experts. Each
    expert answers forward and backward calls, batched; a bad call gets a 4xx. Runs until stopped."""
    configure_logging()
    network = InjectedNetwork(inject_latency, inject_drop_rate, inject_drop_hold)
    if server is None:
        fixed = _fixed_experts(experts, layout, batch_window, network)
        uvicorn.run(fixed.app(), host=host, port=port, log_level="warning")
        return
    if mixture is None:
        raise typer.BadParameter("--server needs --mixture: the mixture whose experts to lease", param_hint="--mixture")
    url = advertise or f"http://{host}:{port}"
    stop = threading.Event()
    api = MixtureAPI(server, stop=stop)
    api.register(resolve_join_token(join_token, join_token_file), name)
    served = ExpertHost(layout_of(api, mixture, url), batch_window=batch_window, network=network)
    keeper = LeaseKeeper(api, served, mixture, url, capacity)
    beats = threading.Thread(target=keeper.run, args=(stop, 1.0), name="lease-keeper", daemon=True)
    beats.start()
    try:
        uvicorn.run(served.app(), host=host, port=port, log_level="warning")
    finally:
        stop.set()
        api.close()
