"""`crowdtrain health --local-process KIND`: this host's process of a kind, by its health record in
Redis (crowdtrain.server.services.health), for compose's health checks. Loaded by crowdtrain.cli.health
only with that option: it needs the server's packages."""

import socket
import time

import redis
import typer

from crowdtrain.core.settings import get_settings
from crowdtrain.server.services.health import KINDS, TTL_SECONDS, host_report_age


def check_local_process(kind: str) -> int:
    """0 if a `kind` process on this host renewed its health record within its time-to-live, 1 otherwise
    (also when Redis cannot be reached), saying which."""
    if kind not in KINDS:
        raise typer.BadParameter(f"must be one of {', '.join(KINDS)}, not {kind!r}", param_hint="--local-process")
    host = socket.gethostname()
    try:
        r = redis.Redis.from_url(get_settings().redis_url, socket_timeout=5, socket_connect_timeout=5)
        age = host_report_age(r, kind, host, time.time())
    except redis.RedisError as exc:
        typer.echo(f"Redis cannot be reached: {exc}", err=True)
        return 1
    if age is None:
        typer.echo(f"no {kind} on {host} has a health record", err=True)
        return 1
    if age > TTL_SECONDS:
        typer.echo(f"the {kind} on {host} last reported {age:.1f} s ago (more than {TTL_SECONDS:g} s)", err=True)
        return 1
    typer.echo(f"{kind} on {host}: reported {age:.1f} s ago")
    return 0
