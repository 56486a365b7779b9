"""Both storage backends behind one interface: a local directory, and S3 (moto's standalone server)."""

import os
import sys
from pathlib import Path

import boto3
import pytest

from crowdtrain.core.storage import ObjectNotFound, download_origin, open_storage
from crowdtrain.launch.cluster import Service, free_port, wait_for

MOTO_START = 120  # seconds


@pytest.fixture(scope="module")
def moto_endpoint(tmp_path_factory):
    """moto's standalone S3 server. Its imports take tens of seconds on 2 busy cores: it is given
    MOTO_START seconds, and stopped (killed if it does not stop) however the tests end."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    svc = Service(
        "moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], dict(os.environ), log
    ).start()
    endpoint = f"http://127.0.0.1:{port}"

    def up() -> bool:
        import httpx

        try:
            return httpx.get(endpoint, timeout=1).status_code < 500
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, MOTO_START, "moto server did not start", svc)
        yield endpoint
    finally:
        svc.stop()


@pytest.fixture
def aws_env(monkeypatch):
    for k, v in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(params=["file", "s3"])
def storage(request, tmp_path: Path):
    if request.param == "file":
        return open_storage(tmp_path.as_uri())
    request.getfixturevalue("aws_env")
    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = f"b{os.getpid()}{free_port()}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return open_storage(f"s3://{bucket}/prefix", endpoint)


def test_put_get_exists_delete(storage) -> None:
    key = "jobs/1/shards/00000.npz"
    assert not storage.exists(key)
    storage.put(key, b"abc" * 1000)
    assert storage.exists(key)
    assert storage.get(key) == b"abc" * 1000
    storage.put(key, b"replaced")
    assert storage.get(key) == b"replaced"
    storage.delete(key)
    assert not storage.exists(key)
    with pytest.raises(ObjectNotFound):
        storage.get(key)


def test_files_go_in_and_out_without_a_bytes_object(storage, tmp_path: Path) -> None:
    """put_file/get_file: what dataset uploads use, so that a large one is never held in memory."""
    source, copy = tmp_path / "dataset.csv", tmp_path / "copy.csv"
    source.write_bytes(b"a,label\n" + b"1,x\n" * 10_000)
    storage.put_file("datasets/" + "a" * 64, source)
    assert storage.get("datasets/" + "a" * 64) == source.read_bytes()
    storage.get_file("datasets/" + "a" * 64, copy)
    assert copy.read_bytes() == source.read_bytes()
    with pytest.raises(ObjectNotFound):
        storage.get_file("datasets/" + "b" * 64, tmp_path / "missing")


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a"])
def test_keys_cannot_escape_the_root(storage, key: str) -> None:
    with pytest.raises(ValueError):
        storage.put(key, b"x")


def test_unknown_schemes_are_refused() -> None:
    with pytest.raises(ValueError, match="file:///DIR or s3://"):
        open_storage("ftp://host/dir")


def test_presigned_urls_serve_the_object_without_credentials(storage) -> None:
    import httpx

    storage.put("jobs/1/snapshots/v00000001.safetensors", b"weights")
    url = storage.presigned_url("jobs/1/snapshots/v00000001.safetensors", 120)
    if url is None:  # local storage: the scheduler serves the file itself
        assert storage.local_path("jobs/1/snapshots/v00000001.safetensors").read_bytes() == b"weights"
        return
    assert "Signature" in url or "X-Amz-Signature" in url
    assert httpx.get(url).content == b"weights"


def test_the_download_origin_is_that_of_every_presigned_url(storage) -> None:
    storage.put("jobs/1/shards/0000.npz", b"shard")
    url = storage.presigned_url("jobs/1/shards/0000.npz", 60)
    if url is None:  # local storage: clients download from the scheduler alone
        assert download_origin(storage) is None
        return
    assert url.startswith(f"{download_origin(storage)}/"), (url, download_origin(storage))


def test_the_download_origin_names_the_public_endpoint_clients_reach(aws_env) -> None:
    storage = open_storage("s3://crowdtrain/data", "http://minio:9000", "https://s3.example.org:9443")
    assert download_origin(storage) == "https://s3.example.org:9443"
