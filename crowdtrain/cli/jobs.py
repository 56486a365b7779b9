"""`crowdtrain job`: submit training jobs and follow them through the scheduler's admin API."""

import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from crowdtrain.cli.adminapi import TokenOpt, admin_client, checked, checked_rows
from crowdtrain.cli.datasets import upload_dataset
from crowdtrain.cli.mixtures import print_mixture
from crowdtrain.cli.options import DEFAULT_SERVER, HELP_LAYOUT, ArgumentsCommand, ServerOpt
from crowdtrain.cli.plot import Against, NothingToPlot, plot_accuracy
from crowdtrain.cli.progress import jobs_table, now_utc, problems_view, status_table, watch
from crowdtrain.cli.projectkey import KeyOpt, read_private_key, sign_job
from crowdtrain.core.datasetspec import FORMATS
from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.schemas_jobs import JobProblems, JobStatusOut, JobSummary
from crowdtrain.core.settings import get_settings
from crowdtrain.core.specfile import SpecFileError

app = typer.Typer(
    name="job",
    help="Submit and follow training jobs (needs the admin token).",
    no_args_is_help=True,
    add_completion=False,
    **HELP_LAYOUT,
)


JobIdArg = Annotated[
    int, typer.Argument(metavar="JOB_ID", help="The job's id, as `crowdtrain job list` shows it", show_default=False)
]

# Where `job plot` and `job download` write without --output: one folder per job under the runtime folder
# (CROWDTRAIN_VAR_DIR, ./var by default), never loose in whatever directory the command runs from.
JOB_FILES = "$CROWDTRAIN_VAR_DIR/jobs/JOB_ID"


def job_file(job_id: int, name: str) -> Path:
    return (get_settings().var_dir / "jobs" / str(job_id) / name).resolve()


def output_option(name: str, what: str) -> typer.models.OptionInfo:
    return typer.Option(
        "-o",
        "--output",
        help=f"{what} to write; default {JOB_FILES}/{name} (CROWDTRAIN_VAR_DIR: ./var when unset)",
        show_default=False,
    )


UploadOpt = Annotated[
    bool,
    typer.Option(
        "--upload/--no-upload",
        help="Upload a dataset path found on this machine to the scheduler (skipped if it has the "
        "bytes already); --no-upload sends the path for the scheduler to read on its own machine",
    ),
]


@app.command("submit", cls=ArgumentsCommand)
def job_submit(
    spec: Annotated[Path, typer.Argument(metavar="SPEC", help="The job spec file (YAML or JSON)", show_default=False)],
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
    upload: UploadOpt = True,
    key: KeyOpt = None,
) -> None:
    """Submit a job spec (YAML or JSON); prints the new job's id.

    When the project has a key, the job waits for its recipe's signature: with --key it is signed
    here and sent, and the job starts; without, the job waits for `crowdtrain job sign`.
    A dataset path (`FORMAT:PATH`, a relative one resolved against the spec file's folder) that
    exists on this machine is uploaded to the scheduler and the job names it by its sha256; with
    --no-upload, or if it does not exist here, the path is sent for the scheduler to read."""
    notes: list[str] = []
    try:
        parsed = load_job_spec(spec, notes)
    except SpecFileError as exc:  # its one line names the file
        typer.echo(f"invalid job spec: {exc}", err=True)
        raise typer.Exit(2) from None
    except (OSError, ValueError, ValidationError) as exc:
        typer.echo(f"invalid job spec {spec}: {exc}", err=True)
        raise typer.Exit(2) from None
    for note in notes:
        typer.echo(note, err=True)
    private = read_private_key(key) if key is not None else None
    with admin_client(server, admin_token) as http:
        if upload and parsed.dataset.path is not None and Path(parsed.dataset.path).exists():
            source = upload_dataset(http, parsed.dataset.format, Path(parsed.dataset.path))
            parsed.dataset = parsed.dataset.model_copy(update={"source": source})
        elif parsed.dataset.path is not None:
            typer.echo(f"dataset.source: {parsed.dataset.path} is read by the scheduler on its own machine", err=True)
        created = checked(http.post("/v1/jobs", json=parsed.model_dump(mode="json")))
        if created.get("signature_required") and private is not None:
            created["status"] = sign_job(http, created["job_id"], private, created["recipe"], parsed).status.value
    created.pop("recipe", None)
    typer.echo(json.dumps(created))
    if created.get("signature_required") and private is None:
        typer.echo(
            f"job {created['job_id']} waits for its signature: crowdtrain job sign {created['job_id']} --key FILE",
            err=True,
        )
        raise typer.Exit(2)
    if not created.get("signature_required") and private is not None:
        typer.echo(
            "the scheduler has no project key: the job runs unsigned (crowdtrain admin project-key set)", err=True
        )


@app.command("sign", cls=ArgumentsCommand)
def job_sign(
    job_id: JobIdArg, key: KeyOpt = None, server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None
) -> None:
    """Sign a job's recipe with the project key here and send the signature: a job waiting for it
    starts; a running job is signed again (after `crowdtrain admin project-key rotate`)."""
    if key is None:
        raise typer.BadParameter("the project's private key is needed", param_hint="--key")
    private = read_private_key(key)
    with admin_client(server, admin_token) as http:
        signed = sign_job(http, job_id, private)
    typer.echo(json.dumps({"job_id": job_id, "status": signed.status.value, "public_key": signed.public_key}))


@app.command("upload", cls=ArgumentsCommand)
def job_upload(
    path: Annotated[
        Path,
        typer.Argument(metavar="PATH", help="The dataset: a file, or a folder for hf and images", show_default=False),
    ],
    fmt: Annotated[str, typer.Option("--format", help=f"The dataset's format: {', '.join(FORMATS)}")],
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
) -> None:
    """Upload a local dataset (a file, or a folder for hf and images) to the scheduler; prints the
    `dataset.source` that names it (FORMAT:sha256:HEX) for a job spec."""
    if fmt not in FORMATS:
        typer.echo(f"error: --format must be one of {', '.join(FORMATS)}, got {fmt!r}", err=True)
        raise typer.Exit(2)
    with admin_client(server, admin_token) as http:
        typer.echo(upload_dataset(http, fmt, path.expanduser().resolve()))


@app.command("list")
def job_list(server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    """List every job: id, name, mode, status, epoch, accuracy and age."""
    with admin_client(server, admin_token) as http:
        rows = [JobSummary.model_validate(row) for row in checked_rows(http.get("/v1/jobs"))]
    Console().print(jobs_table(rows, now_utc()))


@app.command("status", cls=ArgumentsCommand)
def job_status(
    job_id: JobIdArg,
    problems: Annotated[int, typer.Option(min=0, help="Problem assignments to list in full")] = 10,
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
) -> None:
    """Print a job's status with per-epoch figures, and why it is stuck or failed: the assignments that
    ended in a client error, a refused upload or a timeout (by reason, and the latest in full), and
    whether any host can run it."""
    with admin_client(server, admin_token) as http:
        st = JobStatusOut.model_validate(checked(http.get(f"/v1/jobs/{job_id}")))
        found = JobProblems.model_validate(checked(http.get(f"/v1/jobs/{job_id}/problems", params={"limit": problems})))
        mixture = None if st.mixture_id is None else checked(http.get(f"/v1/mixtures/{st.mixture_id}"))
    console = Console()
    console.print(status_table(st, last_epochs=None))
    console.print(problems_view(found))
    if mixture is not None:  # mode moe: where its experts are served
        print_mixture(mixture)


@app.command("plot", cls=ArgumentsCommand)
def job_plot(
    job_id: JobIdArg,
    output: Annotated[Path | None, output_option("accuracy.png", "The PNG")] = None,
    against: Annotated[Against, typer.Option(help="The x axis: seconds since the start, or examples merged")] = (
        Against.time
    ),
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
) -> None:
    """Plot a job's validation accuracy after each merge, with each epoch's min-max band (PNG)."""
    with admin_client(server, admin_token) as http:
        st = JobStatusOut.model_validate(checked(http.get(f"/v1/jobs/{job_id}", params={"metrics": True})))
    if not st.metrics:
        typer.echo(f"job {job_id} has no validation point yet", err=True)
        raise typer.Exit(1)
    output = output or job_file(job_id, "accuracy.png")
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        path = plot_accuracy(st, output, against)
    except NothingToPlot as exc:
        typer.echo(f"job {job_id}: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path} ({len(st.metrics)} points, against {against.value})")


@app.command("watch", cls=ArgumentsCommand)
def job_watch(job_id: JobIdArg, server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    """Follow a job until it finishes; exits 0 if it succeeded."""
    with admin_client(server, admin_token) as http:
        st = watch(http, job_id)
    raise typer.Exit(0 if st.status == "succeeded" else 1)


@app.command("cancel", cls=ArgumentsCommand)
def job_cancel(job_id: JobIdArg, server: ServerOpt = DEFAULT_SERVER, admin_token: TokenOpt = None) -> None:
    """Cancel a pending or running job; prints its new status. Its open workunits are cancelled, hosts
    drop its tasks at their next heartbeat, and results uploaded but not yet merged are rejected, not
    charged to anyone. A job that has ended is refused."""
    with admin_client(server, admin_token) as http:
        typer.echo(json.dumps(checked(http.post(f"/v1/jobs/{job_id}/cancel"))))


@app.command("download", cls=ArgumentsCommand)
def job_download(
    job_id: JobIdArg,
    output: Annotated[Path | None, output_option("model.safetensors", "The safetensors file")] = None,
    server: ServerOpt = DEFAULT_SERVER,
    admin_token: TokenOpt = None,
) -> None:
    """Save the final model (safetensors) of a finished job."""
    output = output or job_file(job_id, "model.safetensors")
    with admin_client(server, admin_token) as http:
        resp = http.get(f"/v1/jobs/{job_id}/model")
        if resp.status_code >= 400:
            checked(resp)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(resp.content)
    typer.echo(f"wrote {output} ({len(resp.content)} bytes)")
