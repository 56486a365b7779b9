"""Device resolution over what torch reports, and the device a real client shows the operator."""

import subprocess

import pytest

from crowdtrain.client.devices import Accelerators, DeviceUnavailable, detect_accelerators, resolve_device
from crowdtrain.launch.cluster import crowdtrain_argv, wait_for

NOTHING = Accelerators()
TWO_GPUS = Accelerators(cuda_devices=2)
MAC = Accelerators(mps=True)


@pytest.mark.parametrize(
    ("requested", "found", "expected"),
    [
        ("auto", NOTHING, "cpu"),
        ("auto", MAC, "mps"),
        ("auto", Accelerators(cuda_devices=1, mps=True), "cuda:0"),
        ("cuda", TWO_GPUS, "cuda:0"),
        ("cuda:1", TWO_GPUS, "cuda:1"),
        ("CPU", TWO_GPUS, "cpu"),
        ("mps", MAC, "mps"),
    ],
)
def test_a_present_device_resolves_to_its_full_name(requested: str, found: Accelerators, expected: str) -> None:
    assert resolve_device(requested, found) == expected


@pytest.mark.parametrize(
    ("requested", "found", "says"),
    [
        ("cuda", NOTHING, "no CUDA or MPS device"),
        ("cuda:2", TWO_GPUS, "cuda:0..cuda:1"),
        ("mps", TWO_GPUS, "mps is not available"),
        ("cuda:x", TWO_GPUS, "unknown device"),
        ("tpu", TWO_GPUS, "expected auto, cpu, cuda, cuda:N or mps"),
    ],
)
def test_a_missing_or_unknown_device_is_refused_with_what_the_machine_has(
    requested: str, found: Accelerators, says: str
) -> None:
    with pytest.raises(DeviceUnavailable, match=says.replace(".", r"\.")):
        resolve_device(requested, found)


def test_the_cli_refuses_a_device_this_machine_lacks_with_exit_2(tmp_path) -> None:
    found = detect_accelerators()
    missing = f"cuda:{found.cuda_devices}"
    proc = subprocess.run(
        crowdtrain_argv(
            "client",
            "--server",
            "http://127.0.0.1:9",
            "--join-token",
            "t",
            "--cache",
            str(tmp_path),
            "--device",
            missing,
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"invalid preference `device`: {missing} is not available on this machine" in proc.stderr


@pytest.mark.integration
def test_the_operator_sees_the_device_a_running_client_resolved(make_cluster, sqlite_url: str) -> None:
    cluster = make_cluster(sqlite_url)
    expected = resolve_device("auto", detect_accelerators())
    client = cluster.start_client("gpu-or-not", 1, "--device", "auto")

    def listed() -> list[dict]:
        with cluster.admin() as http:
            return [h for h in http.get("/v1/admin/hosts").json() if h["name"] == "gpu-or-not"]

    wait_for(listed, 60, "the client never registered", client)
    assert listed()[0]["device"] == expected
    out = subprocess.run(
        crowdtrain_argv("admin", "host", "list", "--server", cluster.url),
        capture_output=True,
        text=True,
        env=cluster.env,
        timeout=120,
        check=True,
    ).stdout
    row = next(line for line in out.splitlines() if "gpu-or-not" in line)
    assert expected in row, out
