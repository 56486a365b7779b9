"""Jobs of either framework trained by real clients of either framework (real scheduler, Redis,
Celery parameter servers, transitioner and client processes).

Each test keeps to a few minutes on 2 cores: one parameter-server process and clients with one
task slot each, since every TensorFlow process pays a slow import. The Keras JSON job, which only
TensorFlow clients can train, shows a job trained to its target by TensorFlow alone.
"""

import subprocess

import pytest
import yaml
from sqlalchemy import func, select

from crowdtrain.core.jobspec import load_job_spec
from crowdtrain.core.states import AssignmentStatus
from crowdtrain.launch.cluster import Cluster, crowdtrain_argv
from crowdtrain.server.ledger.db import session_factory
from crowdtrain.server.ledger.models import Assignment, Host
from tests.conftest import ROOT
from tests.test_training_end_to_end import assert_exact_accounting, wait_finished

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.integration

EXAMPLES = ROOT / "examples"
# How long a job may take: the two jobs side by side took 6.5 minutes in a clean-clone run at a load of
# 10 on 2 slow cores, where a TensorFlow job on its own was at epoch 4 of about 10 after 240 s.
JOB_TIMEOUT = 600


def submit(cluster: Cluster, example: str) -> int:
    return cluster.submit(load_job_spec(EXAMPLES / example).model_dump(mode="json"))["job_id"]


def assignments_by_host(cluster: Cluster, job_id: int) -> dict[str, dict[str, int]]:
    """{host name: {assignment status: count}} for one job."""
    db = session_factory(f"sqlite:///{cluster.var_dir / 'crowdtrain.db'}")
    with db.begin() as s:
        rows = s.execute(
            select(Host.name, Assignment.status, func.count())
            .join(Host)
            .where(Assignment.job_id == job_id)
            .group_by(Host.name, Assignment.status)
        ).all()
    out: dict[str, dict[str, int]] = {}
    for name, status, n in rows:
        out.setdefault(name, {})[status] = n
    return out


def assert_reached(st: dict, target: float) -> None:
    assert st["status"] == "succeeded", st["status_message"]
    assert max(e["mean_accuracy"] or 0 for e in st["epochs"]) >= target


def test_pytorch_and_tensorflow_clients_share_a_tensorflow_job_and_a_keras_json_job_goes_to_tensorflow_only(
    make_cluster,
) -> None:
    """One cluster runs both jobs side by side on a PyTorch-only and a TensorFlow-only client: the
    TensorFlow job is trained by both (a PyTorch client reads it through the shared layout), and the
    Keras JSON job, which only Keras can build, is never handed to the PyTorch-only client."""
    cluster = make_cluster(assimilator_concurrency=1)
    tf_job = submit(cluster, "mnist1d-cnn-tensorflow.yaml")
    keras_job = submit(cluster, "mnist1d-keras.yaml")
    cluster.start_client("torch-only", 1, "--frameworks", "pytorch")
    cluster.start_client("tf-only", 1, "--frameworks", "tensorflow")

    # Both jobs end before the accounting is checked: checking it stops the clients.
    tf_status = wait_finished(cluster, tf_job, JOB_TIMEOUT)
    keras_status = wait_finished(cluster, keras_job, JOB_TIMEOUT)
    assert_reached(tf_status, 0.90)
    assert_reached(keras_status, load_job_spec(EXAMPLES / "mnist1d-keras.yaml").stop.target_accuracy)
    assert_exact_accounting(cluster, tf_job)
    assert_exact_accounting(cluster, keras_job)

    merged = {
        host: counts.get(AssignmentStatus.merged.value, 0)
        for host, counts in assignments_by_host(cluster, tf_job).items()
    }
    assert merged.get("torch-only", 0) >= 1 and merged.get("tf-only", 0) >= 1, merged
    assert "pytorch, loss" in cluster.service("torch-only").log_path.read_text()
    assert "tensorflow, loss" in cluster.service("tf-only").log_path.read_text()
    by_host = assignments_by_host(cluster, keras_job)
    assert "torch-only" not in by_host, f"a Keras JSON job went to a PyTorch-only client: {by_host}"
    assert by_host["tf-only"].get(AssignmentStatus.merged.value, 0) >= 1


def submit_with_cli(cluster: Cluster, spec_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        crowdtrain_argv("job", "submit", str(spec_path), "--server", cluster.url, "--admin-token", cluster.admin_token),
        capture_output=True,
        text=True,
        env=cluster.env,
        timeout=120,
    )


def test_a_keras_json_model_with_a_lambda_layer_is_refused_and_nothing_is_stored(make_cluster, tmp_path) -> None:
    from crowdtrain.core.zoo_keras import keras_module

    keras = keras_module()
    model = keras.Sequential(
        [
            keras.Input((40,)),
            keras.layers.Lambda(lambda t: t * 2.0, name="double"),
            keras.layers.Dense(10, name="logits"),
        ]
    )
    (tmp_path / "lambda.json").write_text(model.to_json())
    spec = yaml.safe_load((EXAMPLES / "mnist1d-keras.yaml").read_text())
    spec["model"]["keras_file"] = "lambda.json"
    (tmp_path / "lambda.yaml").write_text(yaml.safe_dump(spec))

    cluster = make_cluster(assimilator_concurrency=1)
    result = submit_with_cli(cluster, tmp_path / "lambda.yaml")
    assert result.returncode == 2, result.stderr
    assert "error 422" in result.stderr and "Lambda" in result.stderr and "safe mode" in result.stderr
    with cluster.admin() as http:
        assert http.get("/v1/jobs").json() == []
    assert [p for p in (cluster.var_dir / "storage").rglob("*") if p.is_file()] == []
