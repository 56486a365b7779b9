"""The operator's side of a dataset upload (crowdtrain.cli.datasets), against an in-process scheduler:
a folder goes up as one tar archive, the same bytes are not sent twice, and a connection that breaks
mid-upload is retried without leaving a half dataset behind."""

from collections.abc import Iterator

import httpx
import pytest
import typer

from crowdtrain.cli.datasets import file_sha256, pack_folder, upload_dataset
from crowdtrain.core import keys
from tests.server.inprocess import Scheduler, private_scheduler


@pytest.fixture(scope="module")
def sched(tmp_path_factory) -> Iterator[Scheduler]:
    with private_scheduler(tmp_path_factory.mktemp("uploads")) as app:
        yield app


def test_a_folder_is_uploaded_once_as_its_tar_archive(sched: Scheduler, tmp_path, capsys) -> None:
    (tmp_path / "pets" / "cat").mkdir(parents=True)
    (tmp_path / "pets" / "cat" / "1.png").write_bytes(b"not really a png")
    pack_folder(tmp_path / "pets", tmp_path / "expected.tar")
    sha = file_sha256(tmp_path / "expected.tar")
    assert upload_dataset(sched.admin(), "images", tmp_path / "pets") == f"images:sha256:{sha}"
    assert (sched.storage_dir / keys.dataset_key(sha)).read_bytes() == (tmp_path / "expected.tar").read_bytes()
    assert upload_dataset(sched.admin(), "images", tmp_path / "pets") == f"images:sha256:{sha}"
    assert "already has these bytes" in capsys.readouterr().err


def test_a_file_where_a_folder_is_needed_is_refused_before_anything_is_sent(sched: Scheduler, tmp_path) -> None:
    (tmp_path / "t.csv").write_text("a,label\n1,x\n")
    before = sched.stored_files()
    with pytest.raises(typer.Exit):
        upload_dataset(sched.admin(), "hf", tmp_path / "t.csv")
    assert sched.stored_files() == before


class BreaksOnce(httpx.BaseTransport):
    """The scheduler's transport, but the first PUT breaks off after its first chunk is sent."""

    def __init__(self, inner: httpx.BaseTransport):
        self.inner, self.broken = inner, False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "PUT" and not self.broken:
            self.broken = True
            next(iter(request.stream))
            raise httpx.WriteError("connection reset")
        return self.inner.handle_request(request)


def test_a_broken_upload_is_sent_again_and_stored_whole(sched: Scheduler, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("crowdtrain.cli.datasets.CHUNK_BYTES", 1024)
    data = b"a,label\n" + b"1,x\n" * 5000
    (tmp_path / "t.csv").write_bytes(data)
    http = sched.admin()
    http._transport = BreaksOnce(http._transport)
    source = upload_dataset(http, "csv", tmp_path / "t.csv")
    assert "broke off" in capsys.readouterr().err
    assert (sched.storage_dir / keys.dataset_key(source.split(":")[-1])).read_bytes() == data
