"""`crowdtrain expert-host`: serve experts of a mixture-of-experts model (crowdtrain.client.experts.host)."""

from pathlib import Path
from typing import Annotated

import typer
import uvicorn
from pydantic import ValidationError

from crowdtrain.cli.options import HELP_LAYOUT, configure_logging
from crowdtrain.client.experts.host import ExpertHost
from crowdtrain.core.experts import ExpertLayout
from crowdtrain.core.specfile import load_yaml

app = typer.Typer(add_completion=False, **HELP_LAYOUT)


def read_layout(path: Path | None) -> ExpertLayout:
    """The layout in `path` (YAML or JSON), or the default one; a clear error for a bad file."""
    if path is None:
        return ExpertLayout()
    try:
        return ExpertLayout.model_validate(load_yaml(path) or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the layout"
        raise typer.BadParameter(f"{path}: {where}: {first['msg']}", param_hint="--layout") from None


@app.command()
def expert_host(
    experts: Annotated[
        str, typer.Option(help="The experts to serve: ids (layer.coordinate...) separated by commas, or 'all'")
    ] = "all",
    layout: Annotated[
        Path | None, typer.Option(help="The model's expert layout (YAML or JSON); default: the built-in one")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on")] = 8800,
    seed: Annotated[int, typer.Option(help="Seed of the experts' initial weights")] = 0,
    batch_window: Annotated[
        float, typer.Option(min=0, max=1, help="Seconds an expert waits for more calls to batch with the first")
    ] = 0.005,
) -> None:
    """Serve experts of a mixture-of-experts model (expert-parallel training) over HTTP.

    Each expert answers forward and backward calls; its calls are batched, and a bad call gets a 4xx.
    Runs until stopped."""
    configure_logging()
    shape = read_layout(layout)
    uids = (
        [uid for layer in range(shape.layers) for uid in shape.uids(layer)]
        if experts == "all"
        else [u.strip() for u in experts.split(",") if u.strip()]
    )
    try:
        served = ExpertHost(shape, uids, seed, batch_window)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--experts") from None
    uvicorn.run(served.app(), host=host, port=port, log_level="warning")
