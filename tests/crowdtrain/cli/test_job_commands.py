"""`crowdtrain job list|status|watch|plot|download` against a real cluster, the scheduler named only by
CROWDTRAIN_SERVER: a job trained by a client (the example cut to one quick epoch: the commands read
any ended job alike), and one that no host can run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from crowdtrain.core.modelfile import read_metadata
from crowdtrain.core.tensors import decode
from tests.conftest import quick_spec
from tests.test_training_end_to_end import submit, wait_finished

pytestmark = pytest.mark.integration
PNG = b"\x89PNG\r\n\x1a\n"


def job_cli(cluster, *args: str, cwd: Path, **settings: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CROWDTRAIN_")} | settings
    env |= {"CROWDTRAIN_SERVER": cluster.url, "CROWDTRAIN_ADMIN_TOKEN": cluster.admin_token}
    env["COLUMNS"] = "160"
    return subprocess.run(
        [sys.executable, "-m", "crowdtrain", "job", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_operator_lists_explains_plots_and_downloads_jobs(make_cluster, sqlite_url: str, tmp_path: Path) -> None:
    cluster = make_cluster(sqlite_url)
    stalled = submit(cluster)
    assert "no host has registered" in job_cli(cluster, "status", str(stalled), cwd=tmp_path).stdout
    job_cli(cluster, "cancel", str(stalled), cwd=tmp_path)
    # Its output piped, as into a log file: the last table's last line is ended.
    watched = job_cli(cluster, "watch", str(stalled), cwd=tmp_path)
    assert watched.returncode == 1 and "cancelled" in watched.stdout, watched.stderr
    assert watched.stdout.endswith("\n"), repr(watched.stdout[-200:])
    job_id = cluster.submit(quick_spec())["job_id"]
    cluster.start_client("alice", tasks=2)
    st = wait_finished(cluster, job_id)
    assert st["status"] == "succeeded", st["status_message"]

    listed = job_cli(cluster, "list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines() if line.split()[:1] != []}
    assert [c for c in rows[str(job_id)] if c not in "│┃"][:4] == [str(job_id), "mnist1d-cnn", "vc-asgd", "succeeded"]
    assert f"{st['final_accuracy']:.3f}" in rows[str(job_id)] and "cancelled" in rows[str(stalled)]

    status = job_cli(cluster, "status", str(job_id), cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert st["status_message"] in status.stdout and "registered can run this job" in status.stdout

    for against in ("time", "examples"):
        plotted = job_cli(cluster, "plot", str(job_id), "--against", against, "-o", f"{against}.png", cwd=tmp_path)
        assert plotted.returncode == 0, plotted.stderr
        assert (tmp_path / f"{against}.png").read_bytes().startswith(PNG)
    downloaded = job_cli(cluster, "download", str(job_id), "-o", "model.safetensors", cwd=tmp_path)
    assert downloaded.returncode == 0, downloaded.stderr
    blob = (tmp_path / "model.safetensors").read_bytes()
    meta = read_metadata(blob)
    assert (meta["job_id"], meta["param_version"]) == (str(job_id), str(st["param_version"]))
    assert float(meta["val_accuracy"]) == st["final_accuracy"] and decode(blob)

    # Without -o: under CROWDTRAIN_VAR_DIR/jobs/JOB_ID/ (./var when unset), not where the command runs.
    here = tmp_path / "here"
    here.mkdir()
    var = tmp_path / "operator-var"
    for command, name in (("plot", "accuracy.png"), ("download", "model.safetensors")):
        done = job_cli(cluster, command, str(job_id), cwd=here, CROWDTRAIN_VAR_DIR=str(var))
        assert done.returncode == 0, done.stderr
        written = var / "jobs" / str(job_id) / name
        assert f"wrote {written}" in done.stdout and written.stat().st_size > 0, done.stdout
    assert (var / "jobs" / str(job_id) / "accuracy.png").read_bytes().startswith(PNG)
    assert list(here.iterdir()) == []
    done = job_cli(cluster, "plot", str(job_id), cwd=here)
    assert done.returncode == 0, done.stderr
    assert [p.relative_to(here).as_posix() for p in here.rglob("*.png")] == [f"var/jobs/{job_id}/accuracy.png"]
