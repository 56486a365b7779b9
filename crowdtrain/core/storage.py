"""Object storage behind one interface: a local directory (embedded default) or S3 via boto3.

Keys are '/'-separated relative paths such as `jobs/3/shards/0007.npz`.
"""

import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse, urlsplit


class ObjectNotFound(KeyError):
    pass


class Storage(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    def put_file(self, key: str, path: Path) -> None: ...
    def get_file(self, key: str, path: Path) -> None: ...
    def get(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def local_path(self, key: str) -> Path | None: ...
    def __hash__(self) -> int: ...  # storages are cache keys (crowdtrain.assimilator.merge)
    def presigned_url(self, key: str, expires_seconds: int) -> str | None: ...


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"bad storage key {key!r}")
    return key


class LocalStorage:
    """Files under one root; writes are atomic (temporary file + rename)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_file(self, key: str, path: Path) -> None:
        """Store the file at `path` under `key` without holding it in memory; atomic like put."""
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        os.close(fd)
        try:
            shutil.copyfile(path, tmp)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get_file(self, key: str, path: Path) -> None:
        """Copy the object under `key` to `path` without holding it in memory."""
        try:
            shutil.copyfile(self._path(key), path)
        except FileNotFoundError:
            raise ObjectNotFound(key) from None

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def local_path(self, key: str) -> Path | None:
        path = self._path(key)
        return path if path.is_file() else None

    def presigned_url(self, key: str, expires_seconds: int) -> str | None:
        """Local files have no URL of their own: the scheduler serves them."""
        return None


class S3Storage:
    """Objects in `s3://bucket/prefix`; `endpoint_url` points at MinIO or another S3 implementation."""

    def __init__(
        self, bucket: str, prefix: str, endpoint_url: str | None = None, public_endpoint_url: str | None = None
    ):
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        config = Config(signature_version="s3v4")
        self.client = boto3.client("s3", endpoint_url=endpoint_url, config=config)
        # Presigned URLs must name the endpoint as clients reach it (e.g. not a compose-internal host).
        self.public = (
            boto3.client("s3", endpoint_url=public_endpoint_url, config=config)
            if public_endpoint_url and public_endpoint_url != endpoint_url
            else self.client
        )

    def _key(self, key: str) -> str:
        key = _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def put_file(self, key: str, path: Path) -> None:
        """Upload in parts (boto3's managed transfer); the object appears only once it is complete."""
        self.client.upload_file(str(path), self.bucket, self._key(key))

    def get_file(self, key: str, path: Path) -> None:
        try:
            self.client.download_file(self.bucket, self._key(key), str(path))
        except self.client.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                raise ObjectNotFound(key) from None
            raise

    def get(self, key: str) -> bytes:
        try:
            body: bytes = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
            return body
        except self.client.exceptions.NoSuchKey:
            raise ObjectNotFound(key) from None

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except self.client.exceptions.ClientError:
            return False

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def local_path(self, key: str) -> Path | None:
        return None

    def presigned_url(self, key: str, expires_seconds: int) -> str | None:
        """A short-lived GET URL: clients download from S3 directly, not through the scheduler."""
        url: str = self.public.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=expires_seconds
        )
        return url


def download_origin(storage: Storage) -> str | None:
    """`scheme://host[:port]` of the presigned URLs `storage` hands out (None: it hands out none).

    Clients learn it at registration and download only from it and the scheduler. Presigning is
    local (no request), and one URL tells the origin of all: the bucket is part of it, not the key.
    """
    url = storage.presigned_url("origin", 60)
    if url is None:
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def open_storage(url: str, endpoint_url: str | None = None, public_endpoint_url: str | None = None) -> Storage:
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return LocalStorage(Path(parsed.path))
    if parsed.scheme == "s3":
        return S3Storage(parsed.netloc, parsed.path, endpoint_url, public_endpoint_url)
    raise ValueError(f"storage URL must be file:///DIR or s3://BUCKET/PREFIX, got {url!r}")
