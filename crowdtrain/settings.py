"""The one settings object: every `CROWDTRAIN_*` environment variable is read here and nowhere else."""

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Server-side settings (scheduler, work generator, parameter servers, transitioner)."""

    model_config = SettingsConfigDict(env_prefix="CROWDTRAIN_", extra="ignore")

    log_format: Literal["text", "json"] = Field("text", description="Log lines as text or as JSON objects")
    var_dir: Path = Field(Path("var"), description="Runtime files of the embedded default")
    database_url: str = Field("", description="SQLAlchemy URL; empty means SQLite under var_dir")
    db_pool_size: int = Field(5, ge=1, description="Database connections kept open per process")
    db_max_overflow: int = Field(5, ge=0, description="Extra connections a process may open under load")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Parameter store and Celery broker")
    storage_url: str = Field("", description="file:///dir or s3://bucket/prefix; empty means var_dir/storage")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto)")
    s3_public_endpoint_url: str | None = Field(None, description="Endpoint in presigned URLs, if clients reach S3 "
                                                                 "by another address than the servers")
    presign_seconds: int = Field(900, ge=60, description="Lifetime of presigned download URLs")
    ec2_endpoint_url: str | None = Field(None, description="EC2 endpoint for `crowdtrain fleet`; None = AWS")
    public_url: str = Field("http://127.0.0.1:8000", description="Base URL clients use to reach the scheduler")

    admin_token: str = Field("change-me-admin", description="Bearer token for /v1/jobs admin routes")
    join_token: str = Field("change-me-join", description="Bootstrap join token clients may register with; "
                                                        "empty disables it (use `crowdtrain admin join-token`)")

    upload_max_bytes: int = Field(64 * 1024 * 1024, description="Largest accepted result upload")
    work_retry_after: float = Field(2.0, description="Seconds a client waits when no work is ready")
    heartbeat_interval: float = Field(5.0, description="Seconds between client heartbeats")
    transitioner_interval: float = Field(1.0, description="Seconds between transitioner sweeps")
    stuck_upload_seconds: float = Field(60.0, description="Re-queue a merge not done this long after upload")
    snapshots_kept: int = Field(10, ge=2, description="Published W_s snapshots kept in storage per job")
    broker_visibility_timeout: int = Field(300, description="Seconds before Redis redelivers an unacked task")

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.var_dir / 'crowdtrain.db').resolve()}"

    @property
    def resolved_storage_url(self) -> str:
        return self.storage_url or (self.var_dir / "storage").resolve().as_uri()


@lru_cache
def get_settings() -> Settings:
    return Settings()
