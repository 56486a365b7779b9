"""The local launcher: random tokens per cluster, a join token that `ps` does not show, and how a cluster stops."""

import socket
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from crowdtrain.cli import app
from crowdtrain.cli.options import resolve_join_token
from crowdtrain.core.settings import Settings, secrets_problems
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.launch import cluster as cluster_module
from crowdtrain.launch.cluster import Cluster, Service, free_port, wait_for
from tests.client.test_worker import host_assignments, submit_slow_job


def test_each_cluster_makes_its_own_random_tokens(tmp_path: Path) -> None:
    a, b = Cluster(var_dir=tmp_path / "a"), Cluster(var_dir=tmp_path / "b")
    assert len({a.admin_token, a.join_token, b.admin_token, b.join_token}) == 4
    assert min(len(t) for t in (a.admin_token, a.join_token)) >= 32
    assert secrets_problems(Settings(admin_token=a.admin_token, join_token=a.join_token)) == []


def _proc_file(pid: int, name: str) -> list[str]:
    return Path(f"/proc/{pid}/{name}").read_bytes().decode(errors="replace").split("\0")


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_clients_and_peers_get_the_join_token_in_their_environment_not_on_their_command_line(tmp_path) -> None:
    # The cluster is not started: only the processes' arguments matter. Its port is a socket that
    # takes connections and never answers, so each process waits on its first request while /proc is
    # read (against a closed port a peer gives up within seconds, and an exited process shows nothing).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        cluster = Cluster(var_dir=tmp_path, port=silent.getsockname()[1])
        try:
            for svc in (cluster.start_client("volunteer"), cluster.start_peer("peer", 1)):
                # Under load /proc can show an empty command line for a moment after the start: read it
                # again until it names the program (a process that exits fails the wait).
                pid = svc.proc.pid
                wait_for(lambda pid=pid: "crowdtrain" in _proc_file(pid, "cmdline"), 30, "no command line", svc)
                argv, environ = _proc_file(pid, "cmdline"), _proc_file(pid, "environ")
                assert not any(cluster.join_token in arg for arg in argv), argv
                assert f"CROWDTRAIN_CLIENT_JOIN_TOKEN={cluster.join_token}" in environ
                assert not any(e.startswith("CROWDTRAIN_ADMIN_TOKEN=") for e in environ), "clients get no admin token"
            # That they register with it is shown by every test that trains through Cluster.start_client.
        finally:
            cluster.stop()


def test_the_join_token_file_is_read_and_stripped(tmp_path: Path) -> None:
    path = tmp_path / "join-token"
    path.write_text("s3cret-token\n")
    assert resolve_join_token(None, path) == "s3cret-token"
    assert resolve_join_token("from-env", None) == "from-env"


@pytest.mark.parametrize(
    ("args", "file_text", "message"),
    [
        (["client", "--server", "http://127.0.0.1:9"], None, "CROWDTRAIN_CLIENT_JOIN_TOKEN"),
        (["peer", "--server", "http://127.0.0.1:9", "--job", "1"], None, "CROWDTRAIN_CLIENT_JOIN_TOKEN"),
        (["client", "--server", "http://127.0.0.1:9", "--join-token-file", "{file}"], "\n", "is empty"),
        (
            ["peer", "--server", "http://127.0.0.1:9", "--job", "1", "--join-token-file", "{file}/missing"],
            None,
            "cannot read",
        ),
        (
            ["client", "--server", "http://127.0.0.1:9", "--join-token", "t", "--join-token-file", "{file}"],
            "t",
            "give the join token once",
        ),
    ],
)
def test_a_missing_or_doubly_given_join_token_exits_2_naming_the_option(tmp_path, args, file_text, message) -> None:
    file = tmp_path / "token"
    if file_text is not None:
        file.write_text(file_text)
    result = CliRunner().invoke(
        app, [a.replace("{file}", str(file)) for a in args], env={"CROWDTRAIN_CLIENT_JOIN_TOKEN": None}
    )
    assert result.exit_code == 2, result.output
    # The error panel wraps at the terminal's width, wherever the temporary path puts the line ends.
    text = " ".join(word for word in result.output.split() if word != "│")
    assert message in text and "--join-token" in text


def exit_time(svc: Service, since: float) -> dict[str, float]:
    """Seconds after `since` at which `svc` exits, filled in by a watching thread."""
    seen: dict[str, float] = {}

    def watch() -> None:
        svc.proc.wait()
        seen["exited"] = time.monotonic() - since

    threading.Thread(target=watch, daemon=True).start()
    return seen


@pytest.mark.integration
def test_a_cluster_stops_its_clients_first_and_within_seconds(make_cluster, sqlite_url: str) -> None:
    """Clients stopped while the scheduler still runs hand their work back and exit at once. Stopped
    after it, they retried against a dead server until killed (`make demo` took 26 s to exit)."""
    cluster = make_cluster(sqlite_url)
    submit_slow_job(cluster)
    client = cluster.start_client("volunteer", tasks=1)
    wait_for(
        lambda: any(st == AssignmentStatus.in_progress.value for _, st, _ in host_assignments(sqlite_url, "volunteer")),
        60,
        "no work for the client",
        client,
    )
    t0 = time.monotonic()
    client_exit = exit_time(client, t0)
    cluster.stop()
    took = time.monotonic() - t0
    assert not any(s.alive for s in cluster.services + cluster.clients)
    statuses = {st for _, st, _ in host_assignments(sqlite_url, "volunteer")}
    assert statuses == {AssignmentStatus.abandoned.value}, "the scheduler was gone before the client gave back"
    # Exited by itself: a client still running when its stop's grace period ends is killed (-9).
    assert client.proc.returncode == 0, f"the client was killed ({client.proc.returncode}):\n{client.tail()}"
    print(f"the client exited {client_exit['exited']:.1f}s after the stop began; the cluster took {took:.1f}s")


@pytest.mark.skipif(not cluster_module.EPHEMERAL_PORTS.exists(), reason="reads the kernel's ephemeral range")
def test_a_free_port_is_drawn_below_the_ephemeral_range_and_is_not_one_bound_now(monkeypatch) -> None:
    """The local ports of outgoing connections come from the ephemeral range: a port drawn below it
    cannot be taken by one of them before its server binds it."""
    low = int(cluster_module.EPHEMERAL_PORTS.read_text().split()[0])
    assert all(cluster_module.LOWEST_PORT <= free_port() < low for _ in range(50))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        other = free_port()
        draws = iter([taken.getsockname()[1] - cluster_module.LOWEST_PORT, other - cluster_module.LOWEST_PORT])
        monkeypatch.setattr(cluster_module.secrets, "randbelow", lambda _n: next(draws))
        assert free_port() == other, "the bound port was drawn and passed over"
