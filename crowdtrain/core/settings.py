"""The one settings object: every `CROWDTRAIN_*` environment variable is read here and nowhere else."""

import ipaddress
import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The variable a client or peer reads its join token from (`crowdtrain client`, spot-fleet instances).
CLIENT_JOIN_TOKEN_ENV = "CROWDTRAIN_CLIENT_JOIN_TOKEN"


def user_cache_dir() -> Path:
    """The user's cache directory for crowdtrain's files kept between processes (generated datasets, the
    client's CPU self-test verdicts): $XDG_CACHE_HOME/crowdtrain, by default ~/.cache/crowdtrain."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "crowdtrain"


class Settings(BaseSettings):
    """Server-side settings (scheduler, work generator, parameter servers, transitioner)."""

    model_config = SettingsConfigDict(env_prefix="CROWDTRAIN_", extra="ignore")

    log_format: Literal["text", "json"] = Field("text", description="Log lines as text or as JSON objects")
    var_dir: Path = Field(Path("var"), description="Runtime files of the embedded default")
    data_cache: Path | None = Field(
        None, description="Where generated datasets are kept between processes (default $XDG_CACHE_HOME/crowdtrain)"
    )
    database_url: str = Field("", description="SQLAlchemy URL; empty means SQLite under var_dir")
    db_pool_size: int = Field(5, ge=1, description="Database connections kept open per process")
    db_max_overflow: int = Field(5, ge=0, description="Extra connections a process may open under load")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Parameter store and Celery broker")
    storage_url: str = Field("", description="file:///dir or s3://bucket/prefix; empty means var_dir/storage")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto)")
    s3_public_endpoint_url: str | None = Field(
        None, description="Endpoint in presigned URLs, if clients reach S3 by another address than the servers"
    )
    presign_seconds: int = Field(900, ge=60, description="Lifetime of presigned download URLs")
    ec2_endpoint_url: str | None = Field(None, description="EC2 endpoint for `crowdtrain fleet`; None = AWS")

    admin_token: str = Field(
        "",
        description="Bearer token of the admin routes; the scheduler refuses to start without one (see check_secrets)",
    )
    join_token: str = Field(
        "",
        description="Bootstrap join token clients may register with; "
        "empty disables it (use `crowdtrain admin join-token`)",
    )
    dashboard_session_seconds: int = Field(
        8 * 3600, ge=60, le=30 * 86400, description="How long a dashboard login lasts (its cookie's lifetime)"
    )
    trusted_proxies: str = Field(
        "",
        description="Comma-separated addresses or networks of the reverse proxies in front of the scheduler, "
        "whose X-Forwarded-For names the client (the address failed authentication is throttled by); "
        "empty trusts no proxy: the connecting peer is the client",
    )
    auth_failures_per_minute: int = Field(
        20,
        ge=1,
        description="Failed authentications (join, admin or host token) "
        "one client address may make per minute before it "
        "is answered 429",
    )

    registrations_per_hour_per_token: int = Field(
        100,
        ge=1,
        description="Hosts one join token may register in any hour, unless the token sets its own limit "
        "(`crowdtrain admin join-token create --registrations-per-hour N`); more are answered 429",
    )
    registrations_per_hour_per_network: int = Field(
        20,
        ge=1,
        description="Hosts one network (an IPv4 /24, an IPv6 /48; crowdtrain.core.addresses) may register in any "
        "hour, whatever join token they bring; more are answered 429",
    )
    quarantine_follows_network: bool = Field(
        True,
        description="A host registered from a network with a quarantined host inherits its quarantine; turn it off "
        "where many volunteers share one address (a campus or carrier NAT). Quarantine always follows the account",
    )

    upload_max_bytes: int = Field(64 * 1024 * 1024, description="Largest accepted result upload")
    dataset_max_bytes: int = Field(
        4 * 1024**3, ge=1024, description="Largest dataset an operator may upload (`crowdtrain job submit`)"
    )
    dataset_max_pixels: int = Field(
        100_000_000,
        ge=1,
        description="Pixels the images of one image-folder dataset may declare in all (read from their headers, "
        "before any is decoded): decoding costs about 1 s of CPU per 35 million, in a child process",
    )
    dataset_decode_max_seconds: float = Field(
        120.0,
        gt=0,
        description="Seconds of wall time the child process that decodes one image-folder dataset may take "
        "(its start included); a slower one is killed and the job refused with 422",
    )
    dataset_decode_max_bytes: int = Field(
        2 * 1024**3,
        ge=0,
        description="Memory (address space) the child process that decodes one image-folder dataset may take "
        "beyond what it holds at start, one image being decoded at a time; where the OS enforces it (Linux). "
        "0: unbounded",
    )
    work_retry_after: float = Field(2.0, description="Seconds a client waits when no work is ready")
    heartbeat_interval: float = Field(
        30.0,
        gt=0,
        description="Seconds between a client's heartbeats for each assignment it holds (a third of the job's "
        "deadline_seconds when that is shorter). They are the scheduler's most frequent call once workunits "
        "take minutes: docs/operator/capacity.md",
    )
    transitioner_interval: float = Field(1.0, description="Seconds between transitioner sweeps")
    stuck_upload_seconds: float = Field(60.0, description="Re-queue a merge not done this long after upload")
    snapshots_kept: int = Field(10, ge=2, description="Published W_s snapshots kept in storage per job")
    broker_visibility_timeout: int = Field(300, description="Seconds before Redis redelivers an unacked task")

    # Bounds on what a request may make the scheduler hold (see crowdtrain.server.api.boundary).
    body_max_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Largest JSON request body")
    upload_slots: int = Field(
        8,
        ge=1,
        description="Upload bodies (results, DeDLOC parts and states) read at "
        "once per scheduler process; more wait with 503",
    )
    upload_retry_after: int = Field(2, ge=1, description="Retry-After seconds of a 503 when upload slots are full")

    @field_validator("trusted_proxies")
    @classmethod
    def _proxy_networks(cls, value: str) -> str:
        entries = [entry.strip() for entry in value.split(",") if entry.strip()]
        for entry in entries:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"not an IP address or network: {entry!r}") from None
        return ",".join(entries)

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.var_dir / 'crowdtrain.db').resolve()}"

    @property
    def resolved_storage_url(self) -> str:
        return self.storage_url or (self.var_dir / "storage").resolve().as_uri()


# Tokens this project has published (old defaults, .env.example, demo strings): never secrets.
KNOWN_DEFAULT_TOKENS = frozenset(
    {"change-me-admin", "change-me-join", "demo-admin", "demo-join", "change-me", "changeme"}
)
MAKE_A_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
MIN_TOKEN_BITS = 128
# A token of fewer different characters is a pattern (`aaaa…`, `abab…`), not a random string.
MIN_DISTINCT_CHARACTERS = 8
_HEX = frozenset("0123456789abcdef")
_DIGITS = frozenset("0123456789")


def token_entropy_bits(token: str) -> float:
    """An estimate of the entropy of a token, in bits: its length times log2 of the smallest usual
    alphabet that holds it (digits 10, hexadecimal 16, one letter case with digits 36, base64's
    two cases, digits, `-_+/` 64, printable ASCII 94), so that `secrets.token_urlsafe(16)` and
    `secrets.token_hex(16)` (128 bits) pass. A token of fewer than MIN_DISTINCT_CHARACTERS different
    characters counts 0: a pattern. An estimate of what a random generator could have given, not a
    proof that one did. No I/O."""
    chars = set(token)
    if len(chars) < MIN_DISTINCT_CHARACTERS:
        return 0.0
    if chars <= _DIGITS:
        alphabet = 10
    elif {c.lower() for c in chars} <= _HEX and (chars <= _HEX or chars.isdisjoint("abcdef")):
        alphabet = 16
    elif all(c.isascii() and c.isalnum() for c in chars) and not (
        any(c.islower() for c in chars) and any(c.isupper() for c in chars)
    ):
        alphabet = 36
    elif all(c.isascii() and (c.isalnum() or c in "-_+/=") for c in chars):
        alphabet = 64
    else:
        alphabet = 94
    return len(token) * math.log2(alphabet)


def _weak_token_problem(name: str, token: str) -> str | None:
    bits = token_entropy_bits(token)
    if bits >= MIN_TOKEN_BITS:
        return None
    return f"{name} is too easy to guess: about {bits:.0f} bits of entropy, at least {MIN_TOKEN_BITS} needed"


class InsecureSettings(ValueError):
    """The scheduler's secrets are missing or published; the message says which and how to set them."""


def secrets_problems(settings: Settings) -> list[str]:
    """What is wrong with the scheduler's tokens, one line each; empty when they may be used."""
    admin, join = settings.admin_token.strip(), settings.join_token.strip()
    problems = []
    if not admin:
        problems.append("CROWDTRAIN_ADMIN_TOKEN is not set (or empty)")
    elif admin in KNOWN_DEFAULT_TOKENS:
        problems.append(f"CROWDTRAIN_ADMIN_TOKEN is the published example value {admin!r}")
    elif problem := _weak_token_problem("CROWDTRAIN_ADMIN_TOKEN", admin):
        problems.append(problem)
    if join in KNOWN_DEFAULT_TOKENS:
        problems.append(
            f"CROWDTRAIN_JOIN_TOKEN is the published example value {join!r} (leave it empty to "
            "disable the bootstrap token)"
        )
    elif join and (problem := _weak_token_problem("CROWDTRAIN_JOIN_TOKEN", join)):
        problems.append(problem)
    if admin and join == admin:
        problems.append("CROWDTRAIN_JOIN_TOKEN equals CROWDTRAIN_ADMIN_TOKEN: every volunteer would be an operator")
    return problems


def check_secrets(settings: Settings) -> None:
    """Raise InsecureSettings unless the admin token is set and no token is a published default.

    Called by every process that checks tokens (the scheduler); the demo launcher makes random ones.
    """
    problems = secrets_problems(settings)
    if problems:
        raise InsecureSettings(
            "refusing to start: " + "; ".join(problems) + ". Set each token to a random secret "
            f"in the environment (or .env), e.g. CROWDTRAIN_ADMIN_TOKEN=$({MAKE_A_TOKEN})"
        )


@lru_cache
def get_settings() -> Settings:
    return Settings()
