"""Uploading the operator's local dataset to the scheduler's object storage, for `crowdtrain job`.

A file is sent as it is; a folder (hf, images) as an uncompressed tar archive written
deterministically (sorted names, no times or owners), so the same folder always has the same hash.
The upload is idempotent by content: the scheduler is asked first whether it has the bytes' sha256,
and skipped if so. The body is streamed in chunks with a progress bar; a connection broken
mid-upload is retried, and the scheduler stores nothing it did not receive whole.
"""

import hashlib
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn

from crowdtrain.cli.adminapi import checked
from crowdtrain.core.datasetspec import FOLDER_FORMATS, UPLOADED

CHUNK_BYTES = 1024 * 1024
ATTEMPTS = 3


def pack_folder(folder: Path, archive: Path) -> None:
    """Write `folder`'s files to an uncompressed tar archive, the same bytes for the same files."""

    def plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        info.mode = 0o755 if info.isdir() else 0o644
        return info

    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file() or path.is_dir():  # links and devices stay behind
                tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False, filter=plain)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _chunks(path: Path, progress: Progress, task: TaskID) -> Iterator[bytes]:
    with path.open("rb") as f:
        while block := f.read(CHUNK_BYTES):
            progress.update(task, advance=len(block))
            yield block


def _send(http: httpx.Client, path: Path, sha: str, label: str) -> None:
    """PUT the file in chunks, with a progress bar; retried when the connection breaks."""
    size = path.stat().st_size
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    for attempt in range(1, ATTEMPTS + 1):
        with Progress(*columns, console=Console(stderr=True)) as progress:
            task = progress.add_task(f"uploading {label}", total=size)
            try:
                resp = http.put(
                    f"/v1/datasets/{sha}",
                    content=_chunks(path, progress, task),
                    headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
                )
            except httpx.TransportError as exc:
                if attempt == ATTEMPTS:
                    typer.echo(f"error: the upload of {label} failed {ATTEMPTS} times: {exc}", err=True)
                    raise typer.Exit(1) from None
                typer.echo(f"the upload of {label} broke off ({exc}); sending it again", err=True)
                continue
        checked(resp)
        return


def upload_dataset(http: httpx.Client, fmt: str, path: Path) -> str:
    """Upload the dataset at `path` (unless the scheduler has its bytes already) and return the
    source that names it, `FORMAT:sha256:HEX`."""
    if path.is_dir() != (fmt in FOLDER_FORMATS):
        kind = "a folder" if fmt in FOLDER_FORMATS else "a file"
        typer.echo(f"error: dataset.source: a {fmt} dataset is {kind}, and {path} is not", err=True)
        raise typer.Exit(2)
    with tempfile.TemporaryDirectory(prefix="crowdtrain-upload-") as scratch:
        blob = path
        if path.is_dir():
            blob = Path(scratch) / "folder.tar"
            pack_folder(path, blob)
        sha = file_sha256(blob)
        known = http.get(f"/v1/datasets/{sha}")
        if known.status_code == httpx.codes.NOT_FOUND:
            _send(http, blob, sha, path.name)
            typer.echo(f"uploaded {path} ({blob.stat().st_size:,} bytes) as sha256 {sha}", err=True)
        else:
            checked(known)
            typer.echo(f"{path}: the scheduler already has these bytes (sha256 {sha}); not sent again", err=True)
    return f"{fmt}:{UPLOADED}{sha}"
